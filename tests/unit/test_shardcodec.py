"""The hand-written Shard codec agrees with the generated protobuf code."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reducer_wire import codec, convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import (
    DecodeError,
    ShardEncoder,
    decode_shard,
    encode_shard,
    encode_shard_into,
)

FIELDS = ("job", "rank", "world_size", "round", "key", "offset", "dtype", "op", "data",
          "error_code", "error_message", "layout", "priority", "incarnation")
_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=6)
shards = st.fixed_dictionaries({
    "job": _text, "key": _text, "rank": st.integers(0, (1 << 32) - 1),
    "world_size": st.integers(0, (1 << 32) - 1), "round": st.integers(0, (1 << 64) - 1),
    "offset": st.integers(0, (1 << 64) - 1), "dtype": st.integers(-(1 << 31), (1 << 31) - 1),
    "op": st.integers(-(1 << 31), (1 << 31) - 1), "data": st.binary(max_size=40),
    "error_code": st.integers(0, (1 << 32) - 1), "error_message": _text,
    "layout": st.integers(0, (1 << 64) - 1), "priority": st.integers(0, (1 << 32) - 1),
    "incarnation": st.integers(0, (1 << 64) - 1)})


def _as_dict(message):
    return {name: bytes(getattr(message, name)) if name == "data" else getattr(message, name)
            for name in FIELDS}


@settings(max_examples=500, deadline=None)
@given(fields=shards)
def test_encode_is_byte_identical_and_decode_round_trips(fields):
    reference = pb.Shard(**fields).SerializeToString()
    assert encode_shard(**fields) == reference
    assert _as_dict(decode_shard(reference)) == _as_dict(pb.Shard.FromString(reference))


@settings(max_examples=2000, deadline=None)
@given(raw=st.binary(max_size=60) | shards.map(lambda f: pb.Shard(**f).SerializeToString()
                                                  + b"\x62\x02hi\x0d\x01\x02\x03\x04"))
def test_decode_accepts_only_what_protobuf_accepts_and_agrees(raw):
    try:
        mine = decode_shard(raw)
    except DecodeError:
        return  # stricter than protobuf at most for groups (wire types 3 and 4)
    assert _as_dict(mine) == _as_dict(pb.Shard.FromString(raw))


def test_data_is_a_view_not_a_copy():
    message = encode_shard(job="j", key="k", data=b"\x01\x02" * 1000)
    view = decode_shard(message).data
    assert isinstance(view, memoryview) and view.obj is message and len(view) == 2000


@settings(max_examples=500, deadline=None)
@given(fields=shards, slack=st.integers(0, 8))
def test_encoder_and_encode_into_write_the_generated_bytes(fields, slack):
    """Header, payload region and tail in a caller's buffer: the same bytes as
    SerializeToString, whatever the buffer held before."""
    reference = pb.Shard(**fields).SerializeToString()
    data = fields["data"]
    header_fields = {k: v for k, v in fields.items() if k != "data"}
    encoder = ShardEncoder(**header_fields, data_nbytes=len(data))
    assert encoder.nbytes == len(reference)
    buffer = bytearray(b"\xaa" * encoder.nbytes)  # garbage: every byte must be written
    payload = encoder.write_into(buffer)
    assert len(payload) == len(data)
    payload[:] = data
    assert bytes(buffer) == reference
    assert encoder.join(data) == reference
    out = bytearray(b"\x55" * (len(reference) + slack))
    assert encode_shard_into(out, **fields) == len(reference)
    assert bytes(out[:len(reference)]) == reference


def test_payload_region_takes_to_wire_in_place():
    """The narrowed chunk is the message's payload: to_wire writes into the
    encoder's view of a (recycled, numpy) buffer, no other copy, same bytes."""
    values = np.linspace(-3, 3, 1001, dtype=np.float32)
    fields = dict(job="j", key="grad/0", rank=1, world_size=4, round=130, offset=7,
                  dtype=pb.DTYPE_FLOAT16, op=pb.REDUCE_OP_MEAN, layout=99)
    reference = pb.Shard(**fields, data=values.astype("<f2").tobytes()).SerializeToString()
    encoder = ShardEncoder(**fields, data_nbytes=values.size * 2)
    buffer = np.empty(encoder.nbytes + 5, dtype=np.uint8)  # 5 bytes of headroom in front
    payload = encoder.write_into(buffer[5:])
    wire = convert.to_wire(values, pb.DTYPE_FLOAT16, out=payload)
    assert np.shares_memory(wire, buffer)
    assert buffer[5:].tobytes() == reference
    decoded = decode_shard(buffer[5:])
    assert decoded.round == 130 and bytes(decoded.data) == values.astype("<f2").tobytes()


def test_encoder_refuses_a_buffer_of_the_wrong_size_or_read_only():
    encoder = ShardEncoder(job="j", key="k", data_nbytes=4)
    with pytest.raises(ValueError, match=f"writable buffer of {encoder.nbytes} bytes, got 3"):
        encoder.write_into(bytearray(3))
    with pytest.raises(ValueError, match="read-only"):
        encoder.write_into(bytes(encoder.nbytes))
    with pytest.raises(ValueError, match="needs"):
        encode_shard_into(bytearray(2), job="j", key="k", data=b"1234")
    with pytest.raises(ValueError, match="data_nbytes must be >= 0"):
        ShardEncoder(job="j", key="k", data_nbytes=-1)
    with pytest.raises(ValueError, match="made for 4"):
        encoder.join(b"123")


def _python_decode(raw):
    """What the Python parse alone gives: the view, or the error's text."""
    try:
        return _as_dict(codec._decode_in_python(memoryview(raw).cast("B")))
    except DecodeError as exc:
        return f"DecodeError: {exc}"


def _decode(raw):
    try:
        return _as_dict(decode_shard(raw))
    except DecodeError as exc:
        return f"DecodeError: {exc}"


_edge_bytes = st.sampled_from([b"\x80" * 10 + b"\x01", b"\xff" * 11, b"\x0a\x02\xc3\x28",
                               b"\x12\x05", b"\x4a\x7f\x00", b"\x78\x01", b"\x7a\x00",
                               b"\x10\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
                               b"\x10\xff\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x38\xff\x01"])


@pytest.mark.skipif(codec._c_codec is None, reason="reducer_wire._codec not built")
@settings(max_examples=3000, deadline=None)
@given(raw=st.binary(max_size=60)
       | shards.map(lambda f: pb.Shard(**f).SerializeToString())
       | st.tuples(shards, _edge_bytes, st.booleans()).map(
           lambda t: (pb.Shard(**t[0]).SerializeToString() + t[1]) if t[2]
           else (t[1] + pb.Shard(**t[0]).SerializeToString())))
def test_the_c_parse_gives_the_python_parse_exactly(raw):
    """Results and error messages alike: the C parse takes the plain case and
    hands the rest (overlong varints, unknown fields, other wire types, bad
    UTF-8) back to the Python parse."""
    assert _decode(raw) == _python_decode(raw)


@pytest.mark.skipif(codec._c_codec is None, reason="reducer_wire._codec not built")
def test_the_c_parse_takes_the_plain_case_itself():
    message = encode_shard(job="j", rank=3, world_size=4, round=7, key="k", offset=1 << 40,
                           dtype=pb.DTYPE_FLOAT16, op=pb.REDUCE_OP_MEAN, data=b"\x01\x02" * 8,
                           layout=(1 << 64) - 1, priority=2, incarnation=(1 << 63) + 5)
    fields = codec._c_codec.decode_fields(memoryview(message))
    assert fields is not None and fields[:8] == ("j", 3, 4, 7, "k", 1 << 40, pb.DTYPE_FLOAT16,
                                                 pb.REDUCE_OP_MEAN)
    assert message[fields[8]:fields[8] + fields[9]] == b"\x01\x02" * 8
    assert fields[10:] == (0, "", (1 << 64) - 1, 2, (1 << 63) + 5)
    view = decode_shard(message).data
    assert view.obj is message  # still a view into the frame
