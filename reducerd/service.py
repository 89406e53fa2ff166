"""The gRPC servicer: parse and check shards, route them to the table, reply.

Each Reduce stream gets an outbox queue. A reader task feeds the stream's
shards to the ReductionTable; whatever the table says to deliver is put into
the outboxes of the streams waiting for it, and the handler writes them out.
All of this runs on the one event loop thread, as the table requires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Protocol

import grpc
from reducer_wire import dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import DecodeError, ShardView, decode_shard, encode_shard

from reducerd import __version__
from reducerd.reduction import ChunkId, Contribution, Delivery, ReductionTable

log = logging.getLogger("reducerd")

MAX_OFFSET = 1 << 63
INBAND_METADATA = ("reducer-errors", "inband")
STALLED_AFTER_S = 5.0
END = object()


class Observer(Protocol):
    """Sees every valid shard and every delivery (reducerd.metrics.Metrics); loop thread."""

    def shard_in(self, job: str, dtype: int, nbytes: int) -> None: ...

    def delivered(self, d: Delivery) -> None: ...


class Stream:
    """One Reduce call or data-plane connection: its outbox and the chunks it
    still waits for. The outbox takes reply bytes, then END (end with OK) or
    a (code, message) tuple (end with that status), put by the loop thread
    (the data plane's reader also puts its own "connection broke" marker)."""

    def __init__(self, peer: str, inband_errors: bool, outbox: Any = None) -> None:
        self.peer = peer
        self.inband_errors = inband_errors
        self.outbox = asyncio.Queue() if outbox is None else outbox
        self.waiting: set[ChunkId] = set()
        self.half_closed = False
        self.last_message_s = time.monotonic()

    def half_close(self) -> None:
        """The client sent its last shard: end with OK once all it waits for is answered."""
        self.half_closed = True
        self.maybe_finish()

    def maybe_finish(self) -> None:
        if self.half_closed and not self.waiting:
            self.outbox.put_nowait(END)


class _Throughput:
    """Bytes per second over a sliding window, from cumulative counters."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()

    def rate(self, now: float, bytes_in: int, bytes_out: int) -> tuple[float, float]:
        self.samples.append((now, bytes_in, bytes_out))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, in0, out0 = self.samples[0]
        span = now - t0
        if span <= 0:
            return 0.0, 0.0
        return (bytes_in - in0) / span, (bytes_out - out0) / span


def decode_request(message: bytes | memoryview) -> ShardView | DecodeError:
    # Never raise here: gRPC would end the call with a bare INTERNAL.
    try:
        return decode_shard(message)
    except DecodeError as exc:
        return exc


def _bytes(message: bytes) -> bytes:
    return message  # replies are serialized once by deliver(), for every stream


def check_shard(shard: ShardView) -> str:
    """Why this shard is invalid on its own, or '' if it is fine."""
    if not shard.job:
        return "job is empty"
    if not shard.key:
        return "key is empty"
    if shard.dtype not in dtypes.WIRE_DTYPES.values():
        return f"dtype {shard.dtype} is unspecified or unknown"
    if shard.op not in (pb.REDUCE_OP_UNSPECIFIED, pb.REDUCE_OP_SUM, pb.REDUCE_OP_MEAN):
        return f"op {shard.op} is unknown"
    if shard.world_size == 0:
        return "world_size is 0"
    if shard.rank >= shard.world_size:
        return f"rank {shard.rank} is not below world_size {shard.world_size}"
    itemsize = dtypes.wire_itemsize(shard.dtype)
    if not shard.data:
        return "data is empty"
    if len(shard.data) % itemsize:
        return (f"data has {len(shard.data)} bytes, not a whole number of "
                f"{itemsize}-byte elements")
    if shard.offset + len(shard.data) // itemsize > MAX_OFFSET:
        return "offset + elements passes 2^63"
    return ""


class ReducerService:
    """Reduce and GetStatus over one ReductionTable.

    Shards are decoded and encoded by reducer_wire.codec rather than the
    generated classes, so shard data is never copied on its way in (a view
    into the received message) and each reply is serialized once for all the
    streams it goes to.
    """

    def __init__(self, table: ReductionTable, stalled_after_s: float = STALLED_AFTER_S,
                 observer: Observer | None = None) -> None:
        self.table = table
        self.stalled_after_s = stalled_after_s
        self.observer = observer
        self.streams: set[Stream] = set()
        # The TCP data plane's port, set by the daemon when it serves one.
        self.data_port = 0
        self.draining = False
        self.started_s = time.monotonic()
        self._throughput: dict[str, _Throughput] = {}
        # (job, key, round, code) of failures logged lately: one line per failed
        # round, not one per chunk (a 64 MiB key has dozens of chunks).
        self._logged_failures: deque[tuple[str, str, int, str]] = deque(maxlen=256)

    async def Reduce(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "reducerd is shutting down")
        inband = INBAND_METADATA in tuple(context.invocation_metadata() or ())
        stream = Stream(context.peer(), inband)
        self.streams.add(stream)
        reader = asyncio.create_task(self._read(request_iterator, stream))
        try:
            while True:
                item = await stream.outbox.get()
                if item is END:
                    return
                if isinstance(item, tuple):  # (code, message): end the stream
                    await context.abort(*item)
                yield item
        finally:
            reader.cancel()
            self.close_stream(stream)

    async def _read(self, request_iterator, stream: Stream) -> None:
        try:
            async for shard in request_iterator:
                if not self.accept(shard, stream):
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # e.g. bytes that are no Shard: end the call with why
            log.debug("stream from %s broke: %r", stream.peer, exc)
            stream.outbox.put_nowait((grpc.StatusCode.INVALID_ARGUMENT,
                                      f"cannot read the stream: {exc}"))
            return
        stream.half_close()

    def accept(self, shard: ShardView | DecodeError, stream: Stream) -> bool:
        """Take one received message of `stream` (loop thread); False when it
        ended the stream (a message that is no valid Shard)."""
        if isinstance(shard, DecodeError):
            stream.outbox.put_nowait((grpc.StatusCode.INVALID_ARGUMENT,
                                      f"malformed Shard message: {shard}"))
            return False
        problem = check_shard(shard)
        if problem:
            stream.outbox.put_nowait((grpc.StatusCode.INVALID_ARGUMENT,
                                      f"invalid shard (job {shard.job!r} key "
                                      f"{shard.key!r} round {shard.round} rank "
                                      f"{shard.rank}): {problem}"))
            return False
        self._note_job(shard)
        if self.observer is not None:
            self.observer.shard_in(shard.job, shard.dtype, len(shard.data))
        cid = ChunkId(shard.job, shard.key, shard.round, shard.offset)
        part = Contribution(shard.rank, shard.world_size, shard.dtype, shard.op,
                            shard.data, shard.layout)
        stream.waiting.add(cid)
        stream.last_message_s = time.monotonic()
        self.deliver(self.table.contribute(cid, part, stream))
        return True

    def close_stream(self, stream: Stream) -> None:
        """Forget a stream that ended (loop thread)."""
        self.streams.discard(stream)
        self.table.drop_sink(stream)

    def handler(self) -> grpc.GenericRpcHandler:
        """The reducer.v1.Reducer service with our own Shard codec."""
        return grpc.method_handlers_generic_handler("reducer.v1.Reducer", {
            "Reduce": grpc.stream_stream_rpc_method_handler(
                self.Reduce, request_deserializer=decode_request,
                response_serializer=_bytes),
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                self.GetStatus, request_deserializer=pb.StatusRequest.FromString,
                response_serializer=pb.StatusReply.SerializeToString),
        })

    def _note_job(self, shard: ShardView) -> None:
        if shard.job not in self.table.jobs:
            log.info("job %r first seen (world size %d)", shard.job, shard.world_size)

    def _log_failure(self, d: Delivery) -> None:
        failure = (d.chunk.job, d.chunk.key, d.chunk.round, d.error_code)
        if failure not in self._logged_failures:
            self._logged_failures.append(failure)
            log.warning("chunk failed (%s): %s", d.error_code, d.error_message)

    def end_idle_streams(self, idle_timeout_s: float) -> None:
        """End (OK) streams that wait for nothing and sent nothing for a while,
        so a client that opens streams and goes quiet holds nothing for ever."""
        now = time.monotonic()
        for stream in list(self.streams):
            if not stream.waiting and now - stream.last_message_s >= idle_timeout_s:
                stream.last_message_s = float("inf")  # end it once
                stream.outbox.put_nowait(END)

    def deliver(self, deliveries: list[Delivery]) -> None:
        """Put each delivery's reply into its streams' outboxes."""
        for d in deliveries:
            if self.observer is not None:
                self.observer.delivered(d)
            code = getattr(grpc.StatusCode, d.error_code) if d.error_code else None
            if code is not None and not d.repeat:
                self._log_failure(d)
            reply = encode_shard(job=d.chunk.job, key=d.chunk.key, round=d.chunk.round,
                                 offset=d.chunk.offset, dtype=d.dtype, op=d.op,
                                 world_size=d.world_size, data=d.data,
                                 error_code=code.value[0] if code else 0,
                                 error_message=d.error_message)
            for sink in d.sinks:
                stream: Stream = sink  # type: ignore[assignment]
                if code is not None and not stream.inband_errors:
                    stream.outbox.put_nowait((code, d.error_message))
                else:
                    stream.outbox.put_nowait(reply)
                stream.waiting.discard(d.chunk)
                stream.maybe_finish()

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.StatusReply:
        now = time.monotonic()
        reply = pb.StatusReply(
            version=__version__, uptime_s=now - self.started_s,
            bytes_held=self.table.bytes_held,
            max_inflight_bytes=self.table.max_inflight_bytes,
            open_streams=len(self.streams), stalled_after_s=self.stalled_after_s,
            round_timeout_s=self.table.round_timeout_s, data_port=self.data_port)
        if request.brief:
            return reply
        for name, stats in sorted(self.table.jobs.items()):
            if request.job and name != request.job:
                continue
            rate_in, rate_out = self._throughput.setdefault(name, _Throughput()).rate(
                now, stats.bytes_in, stats.bytes_out)
            reply.jobs.add(job=name, chunks_completed=stats.chunks_completed,
                           chunks_failed=stats.chunks_failed,
                           open_chunks=stats.open_chunks, bytes_in=stats.bytes_in,
                           bytes_out=stats.bytes_out, bytes_in_per_s=rate_in,
                           bytes_out_per_s=rate_out, world_sizes=sorted(stats.world_sizes),
                           first_seen_unix_s=stats.first_seen_s)
        for cid, world_size, missing, age_s in self.table.open_chunks():
            if age_s < self.stalled_after_s or len(reply.stalled) >= 100:
                break
            if request.job and cid.job != request.job:
                continue
            reply.stalled.add(job=cid.job, key=cid.key, round=cid.round, offset=cid.offset,
                              world_size=world_size, missing_ranks=missing, age_s=age_s)
        return reply
