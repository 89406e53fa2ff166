"""Operation is settled exactly once whatever races it; the watchdog survives.

Replies, in-band failures, a link giving up, close() and the watchdog may all
reach one operation from different threads at once: exactly one of
set_result / set_exception runs, the settle callback once, and no thread ever
raises (before ops.py, a reply racing a failure raised InvalidStateError on a
link's reader thread, or killed the watchdog).
"""

import concurrent.futures
import threading
import time

import grpc
import numpy as np
import pytest
from reducer_client.errors import ReducerError
from reducer_client.ops import InFlight, Operation
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import decode_shard, encode_shard
from reducer_wire.layout import Chunk

pytestmark = pytest.mark.timeout(120)
F32 = pb.DTYPE_FLOAT32


def reply_for(chunk, values):
    data = np.asarray(values, dtype="<f4").tobytes()
    return decode_shard(encode_shard(job="j", key="k", offset=chunk.offset, dtype=F32,
                                     data=data))


def operation(chunks, settled=None, deadline_s=float("inf")):
    numel = sum(c.numel for c in chunks)
    result = np.full(numel, np.nan, dtype=np.float32)
    return Operation("k", 0, result, result, F32, chunks, deadline_s, settled), result


class Recorder:
    """A settle callback counting its calls; thread-safe. It takes as long as
    the client's (its lock, then forgetting chunks on every link), which is
    what opened the window between deciding and completing before ops.py."""

    def __init__(self, delay_s=0.0005):
        self.lock = threading.Lock()
        self.calls = []
        self.delay_s = delay_s

    def __call__(self, op, error):
        time.sleep(self.delay_s)
        with self.lock:
            self.calls.append(error)


def race(*actions):
    """Run the actions on their own threads released together; their exceptions."""
    barrier = threading.Barrier(len(actions))
    errors = []

    def run(action):
        barrier.wait()
        try:
            action()
        except BaseException as exc:  # what would kill a reader thread or the watchdog
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a,)) for a in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return errors


@pytest.mark.parametrize("failures", [1, 3])
def test_last_reply_racing_failures_settles_once_and_raises_nowhere(failures):
    """500 times: the last chunk's reply and `failures` failures (a link
    giving up, the watchdog, close()) at once. (The _Operation before ops.py
    raised InvalidStateError in nearly every round of this.)"""
    chunks = [Chunk(0, 2, 0), Chunk(2, 2, 1)]
    outcomes = {"result": 0, "error": 0}
    for _ in range(500):
        recorder = Recorder()
        op, result = operation(chunks, recorder)
        op.handler(0)(reply_for(chunks[0], [1, 2]), None)  # all but the last chunk
        error = ReducerError(grpc.StatusCode.UNAVAILABLE, "link gave up")
        last, reply = op.handler(1), reply_for(chunks[1], [3, 4])
        errors = race(lambda: last(reply, None),  # noqa: B023 (run before the next loop)
                      *[lambda: op.fail(error)] * failures)  # noqa: B023
        assert errors == []
        assert op.future.done() and op.settled and len(recorder.calls) == 1
        if op.future.exception() is None:
            outcomes["result"] += 1
            assert op.future.result() is result and result.tolist() == [1, 2, 3, 4]
            assert recorder.calls == [None]
        else:
            outcomes["error"] += 1
            assert op.future.exception() is error and recorder.calls == [error]
    assert sum(outcomes.values()) == 500


def test_fail_says_whether_it_settled():
    op, _ = operation([Chunk(0, 1, 0)])
    first = ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED, "late")
    assert op.fail(first) is True
    assert op.fail(ReducerError(grpc.StatusCode.CANCELLED, "closed")) is False
    assert op.future.exception() is first
    op.handler(0)(reply_for(Chunk(0, 1, 0), [5]), None)  # a late reply: ignored
    assert op.future.exception() is first


def test_replies_from_many_threads_complete_it_once():
    chunks = [Chunk(i * 3, 3, i % 2) for i in range(64)]
    recorder = Recorder()
    op, result = operation(chunks, recorder)
    expected = np.arange(64 * 3, dtype=np.float32)
    handlers = [(op.handler(i), reply_for(c, expected[c.offset:c.offset + c.numel]))
                for i, c in enumerate(chunks)]
    errors = race(*[lambda h=h, r=r: h(r, None) for h, r in handlers])
    assert errors == [] and recorder.calls == [None]
    assert op.future.result(timeout=1) is result and np.array_equal(result, expected)


def test_a_repeated_reply_counts_once():
    chunks = [Chunk(0, 1, 0), Chunk(1, 1, 0)]
    op, _ = operation(chunks)
    op.handler(0)(reply_for(chunks[0], [1]), None)
    op.handler(0)(reply_for(chunks[0], [1]), None)
    assert not op.future.done() and op.remaining == 1
    op.handler(1)(reply_for(chunks[1], [2]), None)
    assert op.future.result(timeout=1).tolist() == [1, 2]


def test_a_reply_of_the_wrong_size_fails_it_with_internal():
    op, _ = operation([Chunk(0, 2, 0)])
    op.handler(0)(reply_for(Chunk(0, 2, 0), [1, 2, 3]), None)
    error = op.future.exception(timeout=1)
    assert error.code == grpc.StatusCode.INTERNAL and "12 bytes, expected 8" in str(error)


def test_an_error_reply_fails_it_with_the_daemons_code():
    op, _ = operation([Chunk(0, 1, 0)])
    error = ReducerError(grpc.StatusCode.INVALID_ARGUMENT, "rank 1 sent length 2")
    op.handler(0)(None, error)
    assert op.future.exception(timeout=1) is error


def test_a_settle_callback_that_raises_still_completes_the_future():
    def broken(op, error):
        raise RuntimeError("bookkeeping bug")

    op, result = operation([Chunk(0, 1, 0)], broken)
    op.handler(0)(reply_for(Chunk(0, 1, 0), [7]), None)
    assert op.future.result(timeout=1) is result


def test_no_chunks_is_done_at_once():
    op, result = operation([])
    assert op.settled and op.future.result(timeout=0) is result
    assert op.fail(ReducerError(grpc.StatusCode.CANCELLED, "x")) is False


def _late(op):
    return ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{op.key} is late")


def test_watchdog_fails_late_operations_and_survives_what_raises():
    """A bug in describing a timeout or in the tick must not stop the
    watchdog: both are logged, the late operation still fails, and later
    deadlines are still enforced."""
    ticks = []

    def tick(now_s):
        ticks.append(now_s)
        if len(ticks) == 1:
            raise RuntimeError("tick bug")

    def timeout_error(op):
        if op.key == "buggy":
            raise RuntimeError("describe bug")
        return _late(op)

    inflight = InFlight(timeout_error, tick, interval_s=0.02)
    try:
        buggy = Operation("buggy", 0, np.empty(1), np.empty(1), F32, [Chunk(0, 1, 0)],
                          time.monotonic() + 0.1, lambda op, e: inflight.discard(op))
        later = Operation("later", 0, np.empty(1), np.empty(1), F32, [Chunk(0, 1, 0)],
                          time.monotonic() + 0.4, lambda op, e: inflight.discard(op))
        inflight.add(buggy)
        inflight.add(later)
        error = buggy.future.exception(timeout=2)
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and "buggy" in str(error)
        assert later.future.exception(timeout=2).code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() >= later.deadline_s
        assert inflight.watching and len(ticks) > 2 and len(inflight) == 0
    finally:
        inflight.close(ReducerError(grpc.StatusCode.CANCELLED, "closed"))


def test_watchdog_racing_replies_and_close_never_dies():
    """Operations at their deadline get their last reply, the watchdog's
    failure and close() at the same moment, many times: each settles once,
    nothing raises, the watchdog keeps running until close()."""
    inflight = InFlight(_late, interval_s=0.001)
    try:
        for _ in range(300):
            recorder = Recorder()
            chunk = Chunk(0, 1, 0)
            op = Operation("k", 0, np.empty(1, np.float32), np.empty(1, np.float32), F32,
                           [chunk], time.monotonic(), recorder)
            inflight.add(op)
            last, reply = op.handler(0), reply_for(chunk, [1])
            closed = ReducerError(grpc.StatusCode.CANCELLED, "close")
            errors = race(lambda: last(reply, None),  # noqa: B023 (run before the next loop)
                          lambda: inflight.check(time.monotonic()),
                          lambda: op.fail(closed))  # noqa: B023
            concurrent.futures.wait([op.future], timeout=2)  # the watchdog may be settling it
            inflight.discard(op)
            assert errors == [] and len(recorder.calls) == 1 and op.future.done()
        assert inflight.watching
    finally:
        inflight.close(ReducerError(grpc.StatusCode.CANCELLED, "closed"))
    time.sleep(0.05)
    assert not inflight.watching


def test_close_fails_what_is_open_and_refuses_more():
    inflight = InFlight(_late)
    op, _ = operation([Chunk(0, 1, 0)])
    inflight.add(op)
    inflight.close(ReducerError(grpc.StatusCode.CANCELLED, "client closed"))
    assert op.future.exception(timeout=1).code == grpc.StatusCode.CANCELLED
    with pytest.raises(ReducerError, match="closed"):
        inflight.add(operation([Chunk(0, 1, 0)])[0])
