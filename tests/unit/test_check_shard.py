"""check_shard: every rule of contract section 2, "A shard is INVALID_ARGUMENT on its own when ..."

Each case breaks one rule of a valid shard and names the reason it must give;
the boundaries (rank = world_size - 1, offset + elements = 2^63 exactly) pass.
"""

import pytest
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardView, decode_shard

from reducerd.service.session import MAX_OFFSET, check_shard

F16, BF16, F32 = pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32


def shard(**fields) -> ShardView:
    """A valid shard (two float16 elements), `fields` changed, through the real decoder."""
    values = dict(job="j", key="k", rank=1, world_size=2, round=0, offset=0, dtype=F16,
                  op=pb.REDUCE_OP_SUM, data=b"\0\0\0\0") | fields
    return decode_shard(pb.Shard(**values).SerializeToString())


def test_a_valid_shard_passes():
    assert check_shard(shard()) == ""


@pytest.mark.parametrize("fields,reason", [
    (dict(job=""), "job is empty"),
    (dict(key=""), "key is empty"),
    (dict(job="j" * 1025), "job has 1025 characters, above the limit of 1024"),
    (dict(key="é" * 1025), "key has 1025 characters, above the limit of 1024"),
    (dict(dtype=pb.DTYPE_UNSPECIFIED), "dtype 0 is unspecified or unknown"),
    (dict(dtype=99), "dtype 99 is unspecified or unknown"),
    (dict(dtype=-1), "dtype -1 is unspecified or unknown"),
    (dict(op=7), "op 7 is unknown"),
    (dict(world_size=0, rank=0), "world_size is 0"),
    (dict(rank=2), "rank 2 is not below world_size 2"),
    (dict(rank=1 << 31), "is not below world_size 2"),
    (dict(data=b""), "data is empty"),
    (dict(data=b"\0\0\0"), "data has 3 bytes, not a whole number of float16 elements"),
    (dict(dtype=F32, data=b"\0" * 6), "data has 6 bytes, not a whole number of float32"),
    (dict(offset=MAX_OFFSET - 1), "offset + elements passes 2^63"),
    (dict(offset=(1 << 64) - 1), "offset + elements passes 2^63"),
])
def test_each_rule_names_its_reason(fields, reason):
    assert reason in check_shard(shard(**fields))


@pytest.mark.parametrize("fields", [
    dict(rank=0, world_size=1),
    dict(rank=65535, world_size=65536),
    dict(offset=MAX_OFFSET - 2),  # offset + 2 elements = 2^63: the last one allowed
    dict(op=pb.REDUCE_OP_UNSPECIFIED),  # means sum
    dict(op=pb.REDUCE_OP_MEAN),
    dict(dtype=BF16),
    dict(dtype=F32, data=b"\0" * 8),
    dict(job="j" * 1024, key="k" * 1024),  # MAX_NAME_CHARS exactly
])
def test_boundaries_and_every_known_dtype_and_op_pass(fields):
    assert check_shard(shard(**fields)) == ""


def test_the_dtypes_and_ops_accepted_are_those_of_the_wire_package():
    """The daemon's checks take the dtypes both sides route and the ops from
    reducer_wire.dtypes, the one list (a dtype defined but not routed yet is
    refused as unknown, not taken and failed later)."""
    from reducer_wire import dtypes

    routed = set(dtypes.WIRE_DTYPES.values()) | dtypes.INTEGER_WIRES
    for dtype in range(-1, 16):
        data = b"\0" * dtypes.wire_nbytes(dtype, 1) if dtype in routed else b"\0\0"
        assert (check_shard(shard(dtype=dtype, data=data)) == "") == (dtype in routed), dtype
    for op in range(-1, 8):
        assert (check_shard(shard(op=op)) == "") == (op in dtypes.OP_NAMES), op
