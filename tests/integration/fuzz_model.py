"""What the daemon must answer to one fuzzed stream: contract section 2 as a model.

The fuzz tests give each example jobs of its own, so nothing but the
example's own shards reaches its chunks; then the daemon's answer follows
from the shards alone. StreamModel plays them as the daemon takes them, in
order: a message that is no Shard, or a Shard invalid on its own, ends the
stream with INVALID_ARGUMENT; contributions that disagree fail their chunk;
a chunk's result is the float32 sum (the first contribution widened, the
others added in arrival order; MEAN divides once) rounded once to the wire
dtype; a retry is not counted again but answered again; a chunk still open
after the client's last shard fails with DEADLINE_EXCEEDED at the round
timeout. Failures come in band (error_code in a reply) on in-band streams,
else they end the stream. The sums here are NumPy's own float16 cast and
integer bfloat16 rounding, not the daemon's kernels.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from reducer_wire import dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.framing import HELLO, MAGIC, MAX_HELLO_BYTES, SHARD, STATUS

F16, BF16, F32 = pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32
ROUTED = frozenset(dtypes.WIRE_DTYPES.values())
MAX_MESSAGE_BYTES = 64 << 20  # the daemon's default --max-message-bytes
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def parse(payload: bytes) -> pb.Shard | None:
    """The message as the generated code reads it, None if it is no Shard."""
    try:
        return pb.Shard.FromString(payload)
    except DecodeError:
        return None


def numel_of(shard: pb.Shard) -> int | None:
    return dtypes.wire_numel(shard.dtype, len(shard.data))


def invalid_on_its_own(s: pb.Shard) -> bool:
    if not s.job or not s.key or s.dtype not in ROUTED or s.op not in dtypes.OP_NAMES:
        return True
    if s.world_size == 0 or s.rank >= s.world_size or not s.data:
        return True
    numel = numel_of(s)
    return numel is None or s.offset + numel > 1 << 63


def widen(data: bytes, dtype: int) -> np.ndarray:
    if dtype == F16:
        return np.frombuffer(data, "<f2").astype(np.float32)
    if dtype == BF16:
        return (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, "<f4").astype(np.float32)


def narrow(values: np.ndarray, dtype: int) -> bytes:
    """Round once to the wire dtype: nearest even; NaN stays NaN."""
    if dtype == F16:
        with np.errstate(all="ignore"):
            return values.astype("<f2").tobytes()
    if dtype == BF16:
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(values)
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        return rounded.astype("<u2").tobytes()
    return values.astype("<f4").tobytes()


def chunk_result(first: pb.Shard, acc: np.ndarray | None) -> bytes | None:
    """A complete chunk's result bytes: MEAN divided in float32, rounded once
    (None: a dtype whose sums we do not model)."""
    if acc is None:
        return None
    if first.op == pb.REDUCE_OP_MEAN:
        with np.errstate(all="ignore"):
            acc = (acc / np.float32(first.world_size)).astype(np.float32)
    return narrow(acc, first.dtype)


def result_reply(cid: tuple, first: pb.Shard, numel: int, data: bytes | None) -> Expected:
    job, key, round_, offset = cid
    reply = pb.Shard(job=job, key=key, round=round_, offset=offset, dtype=first.dtype,
                     op=first.op, world_size=first.world_size)
    return Expected(reply, data, dtypes.wire_nbytes(first.dtype, numel))


def error_reply(cid: tuple, ref: pb.Shard, code: grpc.StatusCode) -> Expected:
    job, key, round_, offset = cid
    return Expected(pb.Shard(job=job, key=key, round=round_, offset=offset, dtype=ref.dtype,
                             op=ref.op, world_size=ref.world_size, error_code=code.value[0]))


def cache_result(results: dict[tuple, tuple], latest: dict[tuple, int], cid: tuple,
                 value: tuple) -> None:
    """Cache a chunk's result as the daemon does (ReductionTable._cache_result):
    one result per (job, key, offset), the latest round's; a newer round's
    result drops the older one, so a later resend to that older round opens
    it anew. (The cache's byte limit and expiry are not reached here.)"""
    job, key, round_, offset = cid
    slot = (job, key, offset)
    previous = latest.get(slot)
    if previous is not None and previous < round_:
        results.pop((job, key, previous, offset), None)
    results[cid] = value
    latest[slot] = round_


@dataclass
class Expected:
    """One reply the daemon must send: a result (data to compare) or an in-band failure."""

    shard: pb.Shard  # every field but error_message (and data: see same_data)
    data: bytes | None = None  # the result's bytes; None: a dtype whose sums we do not model
    nbytes: int = 0  # the result's length


@dataclass
class _Chunk:
    first: pb.Shard
    numel: int
    acc: np.ndarray | None
    ranks: set[int] = field(default_factory=set)


class StreamModel:
    """One stream's shards, played as the daemon takes them; see the module docstring."""

    def __init__(self, inband: bool) -> None:
        self.inband = inband
        self.replies: list[Expected] = []
        self.code: grpc.StatusCode | None = None  # how the stream ended, once it has
        self.early = False  # ended before the client's half-close was read
        self._open: dict[tuple, _Chunk] = {}
        self._results: dict[tuple, tuple[pb.Shard, int, bytes | None]] = {}  # first, numel, data
        self._latest: dict[tuple, int] = {}  # (job, key, offset) -> round of its cached result
        self._failed: dict[tuple, grpc.StatusCode] = {}
        self._waiting: set[tuple] = set()
        self._half_closed = False

    def accept(self, shard: pb.Shard | None) -> bool:
        """Take one message; False once the stream has ended (the daemon reads no more)."""
        if self.code is not None:
            return False
        if shard is None or invalid_on_its_own(shard):
            self._end(INVALID)
            return False
        cid = (shard.job, shard.key, shard.round, shard.offset)
        self._waiting.add(cid)
        self._contribute(cid, shard)
        return self.code is None

    def end(self, code: grpc.StatusCode) -> None:
        """The daemon ends the stream itself (a frame it cannot follow)."""
        self._end(code)

    def half_close(self) -> None:
        """The client's last message was read; then the round timeout passes."""
        if self.code is not None:
            return
        self._half_closed = True
        self._maybe_finish()
        for cid, chunk in list(self._open.items()):  # oldest first, as the daemon expires
            del self._open[cid]
            self._failed[cid] = grpc.StatusCode.DEADLINE_EXCEEDED
            self._deliver_error(cid, chunk.first, grpc.StatusCode.DEADLINE_EXCEEDED)

    def _contribute(self, cid: tuple, s: pb.Shard) -> None:
        numel = numel_of(s)
        assert numel is not None
        if cid in self._failed:
            return self._deliver_error(cid, s, self._failed[cid])
        if cid in self._results:
            first, result_numel, data = self._results[cid]
            if (s.dtype, numel, s.world_size) != (first.dtype, result_numel, first.world_size):
                return self._deliver_error(cid, s, INVALID)
            return self._deliver_result(cid, first, result_numel, data)
        chunk = self._open.get(cid)
        if chunk is None:
            known = s.dtype in (F16, BF16, F32)
            chunk = self._open[cid] = _Chunk(s, numel, widen(s.data, s.dtype) if known else None,
                                             {s.rank})
            if s.world_size == 1:
                self._complete(cid, chunk)
            return None
        f = chunk.first
        if (f.dtype, dtypes.OP_NAMES[f.op], f.world_size, chunk.numel) != (
                s.dtype, dtypes.OP_NAMES[s.op], s.world_size, numel):
            del self._open[cid]
            self._failed[cid] = INVALID
            return self._deliver_error(cid, f, INVALID)
        if s.rank in chunk.ranks:
            return None
        chunk.ranks.add(s.rank)
        if chunk.acc is not None:
            with np.errstate(all="ignore"):
                chunk.acc = chunk.acc + widen(s.data, s.dtype)
        if len(chunk.ranks) == f.world_size:
            self._complete(cid, chunk)
        return None

    def _complete(self, cid: tuple, chunk: _Chunk) -> None:
        del self._open[cid]
        f, data = chunk.first, chunk_result(chunk.first, chunk.acc)
        cache_result(self._results, self._latest, cid, (f, chunk.numel, data))
        self._deliver_result(cid, f, chunk.numel, data)

    def _deliver_result(self, cid: tuple, first: pb.Shard, numel: int,
                        data: bytes | None) -> None:
        self._deliver(cid, result_reply(cid, first, numel, data))

    def _deliver_error(self, cid: tuple, ref: pb.Shard, code: grpc.StatusCode) -> None:
        if not self.inband:
            self._waiting.discard(cid)
            return self._end(code)
        self._deliver(cid, error_reply(cid, ref, code))
        return None

    def _deliver(self, cid: tuple, reply: Expected) -> None:
        """One reply however often this stream sent to the chunk (a retry waits once)."""
        self._waiting.discard(cid)
        if self.code is None:
            self.replies.append(reply)
            self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self._half_closed and not self._waiting and self.code is None:
            self.code = grpc.StatusCode.OK

    def _end(self, code: grpc.StatusCode) -> None:
        if self.code is None:
            self.code, self.early = code, not self._half_closed


# What a stream's daemon reads, in order: ("shard", Shard or None: no Shard),
# ("end", code: a frame it cannot follow), ("half_close",). Both models play them.
Event = tuple


def play(model, events: list[Event]):
    """Feed `events` to a model (StreamModel, or one with its accept/end/half_close)
    until the daemon would stop reading; return the model."""
    for event in events:
        if event[0] == "shard":
            if not model.accept(event[1]):
                break
        elif event[0] == "end":
            model.end(event[1])
            break
        else:
            model.half_close()
    return model


def stream_events(messages: list[pb.Shard | None]) -> list[Event]:
    """A Reduce call's events: every message, then the client's half-close."""
    return [("shard", m) for m in messages] + [("half_close",)]


def data_plane_events(payload: bytes) -> list[Event]:
    """The events of a data connection that sends `payload`, then half-closes."""
    events: list[Event] = []
    view = memoryview(payload)
    if bytes(view[:len(MAGIC)]) != MAGIC:
        return [("end", INVALID)]  # not a reducer data-plane client
    view = view[len(MAGIC):]
    first = True
    while True:
        if not len(view):
            # The first frame must be HELLO; else the client's half-close.
            return events + [("end", INVALID) if first else ("half_close",)]
        if len(view) < 5:
            return events + [("end", INVALID)]  # truncated frame header
        kind, length = struct.unpack_from("<BI", view)
        limit = MAX_HELLO_BYTES if first else MAX_MESSAGE_BYTES
        if kind not in (HELLO, SHARD, STATUS) or length > limit or len(view) < 5 + length:
            return events + [("end", INVALID)]  # unknown kind, too large, or truncated
        body, view = bytes(view[5:5 + length]), view[5 + length:]
        if first:
            if kind != HELLO:
                return events + [("end", INVALID)]
            first = False
            continue
        if kind != SHARD:
            return events + [("end", INVALID)]  # unexpected frame kind after HELLO
        events.append(("shard", parse(body)))


def expected_data_plane(payload: bytes) -> StreamModel:
    """The model of a data connection that sends `payload`, then half-closes."""
    return play(StreamModel(inband=True), data_plane_events(payload))


def _chunk_of(shard: pb.Shard) -> tuple[str, str, int, int]:
    return shard.job, shard.key, shard.round, shard.offset


def _by_chunk(replies: list, shard_of) -> dict[tuple, list]:
    grouped: dict[tuple, list] = {}
    for reply in replies:
        grouped.setdefault(_chunk_of(shard_of(reply)), []).append(reply)
    return grouped


def mismatches(model, code: grpc.StatusCode, replies: list[bytes],
               client_race: bool, per_chunk_prefix: bool = False) -> list[str]:
    """How the daemon's answer differs from the model's ([] if it does not).

    `model`: a StreamModel, or anything with its code, early and replies.
    `client_race`: the call ended with gRPC's own client-side report of a race
    (the daemon ended the call while the client still wrote); allowed only
    where the model ends the stream early, and then any prefix of the replies
    (with `per_chunk_prefix`, a prefix of each chunk's: the order across
    chunks is open, as on summing threads).
    """
    problems = []
    if client_race:
        if not model.early:
            problems.append(f"client-side race reported, but the daemon ends the stream "
                            f"with {model.code} after reading everything")
    elif code != model.code:
        problems.append(f"status {code}, expected {model.code}")
    if client_race and per_chunk_prefix:
        wanted = _by_chunk(model.replies, lambda want: want.shard)
        got_by_chunk = _by_chunk(replies, pb.Shard.FromString)
        replies = [raw for got in got_by_chunk.values() for raw in got]
        expected = [want for chunk, got in got_by_chunk.items()
                    for want in wanted.get(chunk, [])[:len(got)]]
    elif client_race:
        expected = model.replies[:len(replies)]
    else:
        # Replies of different chunks may come in any order (contract section 2;
        # with summing threads two rounds of one key finish on two threads);
        # those of one chunk keep theirs. A stable sort by chunk pairs them up.
        replies = sorted(replies, key=lambda raw: _chunk_of(pb.Shard.FromString(raw)))
        expected = sorted(model.replies, key=lambda want: _chunk_of(want.shard))
    if len(replies) != len(expected):
        problems.append(f"{len(replies)} replies, expected {len(expected)}")
    for got_bytes, want in zip(replies, expected, strict=False):
        got = pb.Shard.FromString(got_bytes)
        shape = pb.Shard()
        shape.CopyFrom(want.shard)
        shape.data = got.data
        if want.shard.error_code:
            shape.error_message = got.error_message
            if not got.error_message:
                problems.append("an in-band failure without a message")
        if shape.SerializeToString() != got_bytes:
            problems.append(f"reply {got} is not the expected {shape} (byte for byte)")
        elif not want.shard.error_code and not same_data(got.data, want):
            problems.append(f"reply data {got.data!r}, expected {want.data!r}")
    return problems


def same_data(got: bytes, want: Expected) -> bool:
    """Bit-equal, except that a NaN only has to be a NaN (payloads follow the hardware)."""
    if len(got) != want.nbytes:
        return False
    if want.data is None:
        return True
    a, b = widen(got, want.shard.dtype), widen(want.data, want.shard.dtype)
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))
