from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_INT8_BLOCK128: _ClassVar[DType]
    DTYPE_FP8_E4M3: _ClassVar[DType]
    DTYPE_FP8_E5M2: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]

class ReduceOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_OP_UNSPECIFIED: _ClassVar[ReduceOp]
    REDUCE_OP_SUM: _ClassVar[ReduceOp]
    REDUCE_OP_MEAN: _ClassVar[ReduceOp]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_INT8_BLOCK128: DType
DTYPE_FP8_E4M3: DType
DTYPE_FP8_E5M2: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_INT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
REDUCE_OP_UNSPECIFIED: ReduceOp
REDUCE_OP_SUM: ReduceOp
REDUCE_OP_MEAN: ReduceOp

class Shard(_message.Message):
    __slots__ = ("job", "rank", "world_size", "round", "key", "offset", "dtype", "op", "data", "error_code", "error_message", "layout", "priority", "incarnation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    round: int
    key: str
    offset: int
    dtype: DType
    op: ReduceOp
    data: bytes
    error_code: int
    error_message: str
    layout: int
    priority: int
    incarnation: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., round: _Optional[int] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., op: _Optional[_Union[ReduceOp, str]] = ..., data: _Optional[bytes] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., layout: _Optional[int] = ..., priority: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job", "brief", "max_jobs")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    MAX_JOBS_FIELD_NUMBER: _ClassVar[int]
    job: str
    brief: bool
    max_jobs: int
    def __init__(self, job: _Optional[str] = ..., brief: _Optional[bool] = ..., max_jobs: _Optional[int] = ...) -> None: ...

class ChunkStatus(_message.Message):
    __slots__ = ("job", "key", "round", "offset", "world_size", "missing_ranks", "age_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    key: str
    round: int
    offset: int
    world_size: int
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    age_s: float
    def __init__(self, job: _Optional[str] = ..., key: _Optional[str] = ..., round: _Optional[int] = ..., offset: _Optional[int] = ..., world_size: _Optional[int] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., age_s: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "chunks_completed", "chunks_failed", "open_chunks", "bytes_in", "bytes_out", "bytes_in_per_s", "bytes_out_per_s", "world_sizes", "first_seen_unix_s", "open_chunk_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    OPEN_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_PER_S_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZES_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    OPEN_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    chunks_completed: int
    chunks_failed: int
    open_chunks: int
    bytes_in: int
    bytes_out: int
    bytes_in_per_s: float
    bytes_out_per_s: float
    world_sizes: _containers.RepeatedScalarFieldContainer[int]
    first_seen_unix_s: float
    open_chunk_bytes: int
    def __init__(self, job: _Optional[str] = ..., chunks_completed: _Optional[int] = ..., chunks_failed: _Optional[int] = ..., open_chunks: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., bytes_in_per_s: _Optional[float] = ..., bytes_out_per_s: _Optional[float] = ..., world_sizes: _Optional[_Iterable[int]] = ..., first_seen_unix_s: _Optional[float] = ..., open_chunk_bytes: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "uptime_s", "bytes_held", "max_inflight_bytes", "open_streams", "jobs", "stalled", "stalled_after_s", "round_timeout_s", "data_port", "jobs_total", "jobs_open", "record_bytes", "max_record_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    STALLED_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    JOBS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    JOBS_OPEN_FIELD_NUMBER: _ClassVar[int]
    RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    bytes_held: int
    max_inflight_bytes: int
    open_streams: int
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    stalled: _containers.RepeatedCompositeFieldContainer[ChunkStatus]
    stalled_after_s: float
    round_timeout_s: float
    data_port: int
    jobs_total: int
    jobs_open: int
    record_bytes: int
    max_record_bytes: int
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., bytes_held: _Optional[int] = ..., max_inflight_bytes: _Optional[int] = ..., open_streams: _Optional[int] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., stalled: _Optional[_Iterable[_Union[ChunkStatus, _Mapping]]] = ..., stalled_after_s: _Optional[float] = ..., round_timeout_s: _Optional[float] = ..., data_port: _Optional[int] = ..., jobs_total: _Optional[int] = ..., jobs_open: _Optional[int] = ..., record_bytes: _Optional[int] = ..., max_record_bytes: _Optional[int] = ...) -> None: ...
