"""Fuzzing the daemon's Reduce method and TCP data plane with hypothesis.

Scenario, for each test on a daemon of its own: arbitrary Shard messages
(valid, invalid, conflicting, repeated) or arbitrary raw bytes go to the
daemon on many concurrent streams, through gRPC or as frames on the data
plane, while a good job runs beside them. Each example gets jobs of its own,
so the daemon's answer follows from its shards alone (fuzz_model): every
stream must end with the status the contract gives, carrying exactly the
replies it gives (results rounded once from a float32 sum, in-band failures
with their code), within the round timeout. Then the daemon must still be up,
serve a good job exactly, hold no bytes once the fuzz chunks timed out, and
have logged no fault of its own. The data-plane fuzz runs twice: on a daemon
that sums inline (--threads 1: the inline model, byte for byte) and on one
whose summing threads take every chunk (--threads 2 --pool-chunk-bytes 0,
delayed a little), where when a result lands beside the stream's next
message or its error end is a race the contract leaves open: there the
answer must be one of those fuzz_pooled allows. REDUCER_FUZZ_EXAMPLES sets
the number of examples per test (CI runs a bounded number).
"""

import asyncio
import itertools
import os
import threading
import time

import grpc
import numpy as np
import pytest
from fuzz_model import (
    StreamModel,
    data_plane_events,
    mismatches,
    parse,
    play,
    stream_events,
)
from fuzz_pooled import DELAYED_SUMS, pooled_outcomes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_frames import HELLO_OK, frame, split_frames, status_of
from reducer_client import ReducerClient
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from reducer_wire.codes import status_code_from_value
from reducer_wire.framing import MAGIC, SHARD, STATUS
from support import start_daemon

# Every test on each loop that reads plain-TCP frames (conftest.data_loop).
pytestmark = pytest.mark.usefixtures("data_loop")

EXAMPLES = int(os.environ.get("REDUCER_FUZZ_EXAMPLES", "300"))
ROUND_TIMEOUT_S = 2.0
METHOD = "/reducer.v1.Reducer/Reduce"
FUZZ_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))

# Valid UTF-8 only: a str protobuf cannot encode fails in the client, not the daemon.
_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=4)
shards = st.builds(
    pb.Shard,
    job=st.sampled_from(["", "fuzz", "fuzz2"]) | _text,
    rank=st.integers(0, 5), world_size=st.integers(0, 4), round=st.integers(0, 3),
    key=st.sampled_from(["", "a", "b"]) | _text,
    offset=st.sampled_from([0, 1, 7, (1 << 63) - 1, (1 << 64) - 1]),
    dtype=st.integers(0, 5), op=st.integers(0, 4),
    data=st.binary(max_size=64) | st.sampled_from([b"\0\0", b"\0\0\0\0" * 3, b"\x7c\x00"]),
    # One client instance or an old client (0): never a restart, whose rules
    # tests/unit/test_incarnations.py checks; here the field travels both paths.
    incarnation=st.sampled_from([0, (1 << 64) - 1]))

_ITEMSIZE = {pb.DTYPE_FLOAT16: 2, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT32: 4}


@st.composite
def rounds(draw):
    """Shards that mostly make up whole chunks (so sums, MEAN, retries and
    resends are reached), with the odd rank, dtype, op, world size or length
    of another chunk mixed in."""
    dtype = draw(st.sampled_from(sorted(_ITEMSIZE)))
    base = dict(job=draw(st.sampled_from(["r", "r2"])), key=draw(st.sampled_from(["a", "b"])),
                round=draw(st.integers(0, 1)), offset=draw(st.sampled_from([0, 8])),
                dtype=dtype, op=draw(st.integers(0, 2)), world_size=draw(st.integers(1, 3)),
                incarnation=draw(st.sampled_from([0, (1 << 64) - 1])))
    numel = draw(st.integers(1, 8))
    values = st.floats(-70000, 70000, width=32) | st.sampled_from(
        [np.inf, -np.inf, np.nan, -0.0, 65504.0, 1e-7])
    # Every rank once, in any order, with retries and a rank too many mixed in.
    ranks = draw(st.permutations(range(base["world_size"])))
    for extra in draw(st.lists(st.integers(0, base["world_size"]), max_size=3)):
        ranks.insert(draw(st.integers(0, len(ranks))), extra)
    messages = []
    for rank in ranks:
        fields = dict(base, rank=rank)
        if draw(st.integers(0, 9)) == 0:  # one field of another chunk
            name = draw(st.sampled_from(["dtype", "op", "world_size", "round", "numel"]))
            if name == "numel":
                numel = draw(st.integers(1, 8))
            else:
                fields[name] = draw(st.sampled_from({"dtype": sorted(_ITEMSIZE),
                                                     "op": [0, 1, 2], "world_size": [1, 2, 3],
                                                     "round": [0, 1]}[name]))
        x = np.array(draw(st.lists(values, min_size=numel, max_size=numel)), np.float32)
        messages.append(pb.Shard(data=_wire_bytes(x, fields["dtype"]), **fields))
    return messages


def _wire_bytes(x, dtype):
    """float32 values as wire bytes (bfloat16 truncated: any pattern will do)."""
    with np.errstate(all="ignore"):
        if dtype == pb.DTYPE_FLOAT16:
            return x.astype("<f2").tobytes()
        if dtype == pb.DTYPE_BFLOAT16:
            return (x.view(np.uint32) >> 16).astype("<u2").tobytes()
        return x.astype("<f4").tobytes()


# grpc.aio's own reports, on the client side, of the race when the daemon ends
# a call (an earlier shard was invalid) while the client still writes: its
# local CANCELLED (aio/_call.py, _consume_request_iterator), or core's INTERNAL
# "Internal error from Core". Allowed only where the daemon ends the stream
# before the client's last message; the daemon's own INTERNAL says "reducerd".
_CORE_INTERNAL = "Internal error from Core"


def _client_race(code: grpc.StatusCode, details: str) -> bool:
    return code == grpc.StatusCode.CANCELLED or (
        code == grpc.StatusCode.INTERNAL and details == _CORE_INTERNAL)


class FuzzLoop:
    """An asyncio loop on its own thread driving aio streams to the daemon."""

    def __init__(self, address):
        with grpc.insecure_channel(address) as channel:
            port = pb_grpc.ReducerStub(channel).GetStatus(
                pb.StatusRequest(brief=True), timeout=5).data_port
        self.data_address = (address.rpartition(":")[0], port)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.channel = self.run(self._channel(address)).result(10)
        self.tcp_slots = self.run(self._semaphore()).result(10)

    async def _channel(self, address):
        return grpc.aio.insecure_channel(address)

    async def _semaphore(self):
        # A few data connections at a time: the daemon may close one left idle
        # past its handshake timeout, as thousands of pending ones would be.
        return asyncio.Semaphore(32)

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def grpc_call(self, payloads, inband):
        """Send raw messages on one Reduce call; (code, details, raw replies)."""
        metadata = (("reducer-errors", "inband"),) if inband else ()
        call = self.channel.stream_stream(METHOD)(iter(payloads), metadata=metadata,
                                                  timeout=ROUND_TIMEOUT_S + 30)
        replies = []
        try:
            async for reply in call:
                replies.append(reply)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or "", replies
        return await call.code(), await call.details() or "", replies

    async def tcp(self, payload):
        """Send `payload` on a data connection, half-close, read every frame."""
        async with self.tcp_slots:
            reader, writer = await asyncio.open_connection(*self.data_address)
            try:
                writer.write(payload)
                await writer.drain()
                writer.write_eof()
                received = await asyncio.wait_for(reader.read(), ROUND_TIMEOUT_S + 20)
            except ConnectionError as exc:
                return f"connection error {exc!r}", "", []
            finally:
                writer.close()
        frames, rest = split_frames(received)
        if rest or not frames or frames[-1][0] != STATUS:
            return f"no STATUS frame at the end: {received[-40:]!r}", "", []
        if not all(kind == SHARD for kind, _ in frames[:-1]):
            return "a frame other than SHARD before STATUS", "", []
        code, details = status_of(frames)
        return status_code_from_value(code), details, [body for _, body in frames[:-1]]

    def close(self):
        self.run(self.channel.close()).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class GoodJob:
    """Two ranks allreducing known data in a loop beside the fuzzing."""

    def __init__(self, address):
        self.errors, self.rounds = [], [0, 0]
        self.last_round = None  # set by stop(): both ranks run up to it
        self.threads = [threading.Thread(target=self._run, args=(address, r), daemon=True)
                        for r in range(2)]
        for t in self.threads:
            t.start()

    def _run(self, address, rank):
        try:
            with ReducerClient([address], job="good", rank=rank, world_size=2,
                               timeout=30) as client:
                for i in range(100_000):
                    if self.last_round is not None and i >= self.last_round:
                        return
                    x = np.full(10_000, rank + i % 7, dtype=np.float32)
                    out = client.allreduce(x, key="w")
                    if not np.all(out == 1 + 2 * (i % 7)):
                        self.errors.append(f"rank {rank} round {i}: {out[:4]}")
                    self.rounds[rank] = i + 1
        except Exception as exc:  # reported by the test
            self.errors.append(f"rank {rank}: {exc!r}")

    def stop(self):
        if self.last_round is None:  # ranks are at most one round apart
            self.last_round = max(self.rounds) + 2
        for t in self.threads:
            t.join(30)
        return not any(t.is_alive() for t in self.threads)


class Fuzz:
    """One daemon, its fuzzing loop, the good job beside it, and the cases sent.

    pooled: the daemon sums every chunk on summing threads, so each case's
    answer must be one of those fuzz_pooled allows (the landing of a result
    is a race); else the inline model's, byte for byte.
    """

    def __init__(self, daemon, pooled: bool):
        self.daemon = daemon
        self.pooled = pooled
        self.loop = FuzzLoop(daemon.address)
        self.good = GoodJob(daemon.address)
        # (what was sent, the daemon's events, in-band?, future of (code, details, replies))
        self.cases = []
        self._ids = itertools.count()

    def own_jobs(self, messages):
        """The messages with jobs of this example alone (empty jobs stay empty)."""
        case = next(self._ids)
        out = []
        for m in messages:
            m = pb.Shard.FromString(m.SerializeToString())
            if m.job:
                m.job = f"{m.job}#{case}"
            out.append(m)
        return out

    def send(self, sent, events, inband, coroutine):
        self.cases.append((sent, events, inband, self.loop.run(coroutine)))

    def _problems(self, events, inband, code, replies, race):
        """[] if the answer is allowed, else how it differs from the inline model's
        (and, pooled, from each allowed one)."""
        inline = play(StreamModel(inband), events)
        if not self.pooled:
            return mismatches(inline, code, replies, race)
        allowed = pooled_outcomes(events, inband)
        found = [mismatches(o, code, replies, race, per_chunk_prefix=True) for o in allowed]
        if any(f == [] for f in found):
            return []
        return [f"none of the {len(allowed)} answers allowed on summing threads: {found}"]

    def check(self, grpc_race_allowed, min_results=0):
        """Every case's answer is the model's; then the daemon is whole.

        min_results: the share of cases whose replies must include a result
        (so that the sums are checked, not only the refusals)."""
        start = time.monotonic()
        problems, codes = [], set()
        with_results = sum(any(not r.shard.error_code for r in play(StreamModel(i), e).replies)
                           for _, e, i, _ in self.cases)
        assert with_results >= min_results * len(self.cases), (with_results, len(self.cases))
        for sent, events, inband, future in self.cases:
            code, details, replies = future.result(timeout=ROUND_TIMEOUT_S + 60)
            race = grpc_race_allowed and _client_race(code, details)
            codes.add(code)
            found = self._problems(events, inband, code, replies, race)
            if isinstance(code, str):  # the data connection broke or was garbled
                found.append(code)
            if found:
                got = [pb.Shard.FromString(r) for r in replies]
                problems.append(f"{sent!r}\n  answered {code} {details!r} {got}: {found}")
        assert problems == [], f"{len(problems)} of {len(self.cases)} cases:\n" + "\n".join(
            problems[:5])
        assert grpc.StatusCode.INVALID_ARGUMENT in codes  # the fuzzing reached the checks
        assert time.monotonic() - start < ROUND_TIMEOUT_S + 60
        assert self.good.stop(), "the good job did not stop"
        assert self.good.errors == [] and min(self.good.rounds) > 0
        _reduce_exactly(self.daemon.address)
        time.sleep(ROUND_TIMEOUT_S + 0.5)  # chunks of streams that ended early time out
        with grpc.insecure_channel(self.daemon.address) as channel:
            status = pb_grpc.ReducerStub(channel).GetStatus(pb.StatusRequest(), timeout=5)
        assert status.bytes_held == 0
        assert all(job.open_chunks == 0 for job in status.jobs)
        assert self.daemon.process.poll() is None
        log = self.daemon.log()
        assert "Traceback" not in log and "reducerd fault" not in log, log[-3000:]
        if self.pooled:  # every chunk went through the summing threads
            assert "summing on 2 threads (chunks of 0 wire bytes or more" in log, log[-3000:]

    def close(self):
        self.good.stop()
        self.loop.close()


def _reduce_exactly(address):
    """After the fuzzing, a fresh job of 3 ranks sums exactly (small integers on a
    float16 wire and float32 sums, exact in both)."""
    results = [None] * 3

    def rank(r):
        try:
            with ReducerClient([address], job="after", rank=r, world_size=3,
                               wire_dtype="float16", timeout=20) as client:
                x = (np.arange(100_000) % 300 * (r + 1)).astype(np.float32)
                results[r] = client.allreduce(x, key="x")
        except Exception as exc:  # reported below
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = (np.arange(100_000) % 300 * 6).astype(np.float32)
    for r in results:
        assert isinstance(r, np.ndarray) and np.array_equal(r, expected), r


@pytest.fixture(params=["inline"])
def fuzz(request, tmp_path):
    """A daemon to fuzz. "inline": one summing thread (every sum on the loop
    thread), answers byte for byte as fuzz_model says, order included.
    "pooled": two summing threads that take every chunk (--pool-chunk-bytes
    0), delayed (DELAYED_SUMS), answers within fuzz_pooled's set."""
    pooled = request.param == "pooled"
    if pooled:
        daemon = start_daemon("--round-timeout", str(ROUND_TIMEOUT_S), "--threads", "2",
                              "--pool-chunk-bytes", "0", "--pool-busy-cores", "0",
                              log_dir=tmp_path,
                              entry=("-c", DELAYED_SUMS))
    else:
        daemon = start_daemon("--round-timeout", str(ROUND_TIMEOUT_S), "--threads", "1",
                              log_dir=tmp_path)
    fuzz = Fuzz(daemon, pooled)
    try:
        yield fuzz
    finally:
        fuzz.close()
        daemon.stop()


BOTH = pytest.mark.parametrize("fuzz", ["inline", "pooled"], indirect=True)


@BOTH
def test_fuzz_shards(fuzz):
    @settings(max_examples=EXAMPLES, **FUZZ_SETTINGS)
    @given(messages=st.lists(shards, min_size=1, max_size=6) | rounds(), inband=st.booleans())
    def send(messages, inband):
        messages = fuzz.own_jobs(messages)
        payloads = [m.SerializeToString() for m in messages]
        fuzz.send(messages, stream_events(messages), inband,
                  fuzz.loop.grpc_call(payloads, inband))

    send()
    fuzz.check(grpc_race_allowed=True, min_results=0.1)


def test_fuzz_raw_bytes(fuzz):
    @settings(max_examples=EXAMPLES // 3, **FUZZ_SETTINGS)
    @given(payloads=st.lists(st.binary(max_size=80), min_size=1, max_size=4))
    def send(payloads):
        events = stream_events([parse(p) for p in payloads])
        fuzz.send(payloads, events, False, fuzz.loop.grpc_call(payloads, inband=False))

    send()
    fuzz.check(grpc_race_allowed=True)


@BOTH
def test_fuzz_shards_on_the_data_plane(fuzz):
    @settings(max_examples=EXAMPLES, **FUZZ_SETTINGS)
    @given(messages=st.lists(shards, min_size=1, max_size=6) | rounds())
    def send(messages):
        messages = fuzz.own_jobs(messages)
        payload = HELLO_OK + b"".join(frame(SHARD, m.SerializeToString()) for m in messages)
        fuzz.send(messages, data_plane_events(payload), True, fuzz.loop.tcp(payload))

    send()
    fuzz.check(grpc_race_allowed=False, min_results=0.1)


@BOTH
def test_fuzz_raw_bytes_on_the_data_plane(fuzz):
    @settings(max_examples=EXAMPLES // 3, **FUZZ_SETTINGS)
    @given(prefix=st.sampled_from([b"", MAGIC, HELLO_OK]),
           frames=st.lists(st.tuples(st.integers(0, 4), st.binary(max_size=48)), max_size=3),
           tail=st.binary(max_size=24))
    def send(prefix, frames, tail):
        payload = prefix + b"".join(frame(kind, data) for kind, data in frames) + tail
        fuzz.send(payload, data_plane_events(payload), True, fuzz.loop.tcp(payload))

    send()
    fuzz.check(grpc_race_allowed=False)
