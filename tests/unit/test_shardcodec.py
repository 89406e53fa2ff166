"""The hand-written Shard codec agrees with the generated protobuf code."""

from hypothesis import given, settings
from hypothesis import strategies as st
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import DecodeError, decode_shard, encode_shard

FIELDS = ("job", "rank", "world_size", "round", "key", "offset", "dtype", "op", "data",
          "error_code", "error_message", "layout")
_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=6)
shards = st.fixed_dictionaries({
    "job": _text, "key": _text, "rank": st.integers(0, (1 << 32) - 1),
    "world_size": st.integers(0, (1 << 32) - 1), "round": st.integers(0, (1 << 64) - 1),
    "offset": st.integers(0, (1 << 64) - 1), "dtype": st.integers(-(1 << 31), (1 << 31) - 1),
    "op": st.integers(-(1 << 31), (1 << 31) - 1), "data": st.binary(max_size=40),
    "error_code": st.integers(0, (1 << 32) - 1), "error_message": _text,
    "layout": st.integers(0, (1 << 64) - 1)})


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
