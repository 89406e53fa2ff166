"""Which failures are worth a retry (errors.py), as its docstring says."""

import pickle

import grpc
from reducer_client.errors import RETRYABLE_CODES, ReducerError, stream_error

BUSY = "too many data connections (4096)"


def test_the_daemon_going_away_is_retryable_and_nothing_else_by_code():
    assert RETRYABLE_CODES == {grpc.StatusCode.UNAVAILABLE}
    assert ReducerError(grpc.StatusCode.UNAVAILABLE, "restarting").retryable
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL,
                 grpc.StatusCode.RESOURCE_EXHAUSTED):
        assert not ReducerError(code, "no").retryable, code


def test_a_connection_refused_for_capacity_is_retryable_a_chunk_over_a_limit_is_not():
    """RESOURCE_EXHAUSTED ending a stream (the daemon's connection cap) is
    worth a retry; in band, for one chunk (memory, open chunks), it is not;
    gRPC's own "larger than max" is a configuration problem."""
    assert stream_error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"daemon h:1: {BUSY}").retryable
    in_band = ReducerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "daemon h:1: chunk needs 4096 more bytes (--max-inflight-bytes)")
    assert not in_band.retryable
    too_large = stream_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "daemon h:1: Received message larger than max (5000 vs. 4096)")
    assert not too_large.retryable
    assert stream_error(grpc.StatusCode.UNAVAILABLE, "gone").retryable
    assert not stream_error(grpc.StatusCode.UNAUTHENTICATED, "no token").retryable


def test_errors_cross_processes_whole():
    error = stream_error(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, str(copy), copy.retryable) == (error.code, BUSY, True)
    assert repr(copy) == f"ReducerError(RESOURCE_EXHAUSTED, {BUSY!r})"


def test_first_cause_prefers_a_daemon_gone_over_its_echo():
    """A bucket that timed out on a surviving daemon (DEADLINE_EXCEEDED: a
    rank never sent) is the echo of one that failed on the daemon that went
    away (UNAVAILABLE): first_cause picks the latter among what already
    failed, and waits for nothing."""
    from concurrent.futures import Future

    from reducer_client.errors import first_cause

    def failed(code: grpc.StatusCode, message: str) -> Future:
        future: Future = Future()
        future.set_exception(ReducerError(code, message))
        return future

    echo = ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED, "daemon b: no contribution from rank 1")
    gone = failed(grpc.StatusCode.UNAVAILABLE, "daemon a: connection refused")
    pending, done, cancelled = Future(), Future(), Future()
    done.set_result(None)
    cancelled.cancel()
    others = [pending, done, cancelled, failed(grpc.StatusCode.INTERNAL, "x"), gone]
    assert first_cause(echo, others) is gone.exception()
    assert first_cause(echo, [pending, done, cancelled]) is echo  # nothing better yet
    own = ReducerError(grpc.StatusCode.UNAVAILABLE, "daemon c: gone too")
    assert first_cause(own, others) is own  # already the cause
    bug = ValueError("bad input")
    assert first_cause(bug, [gone]) is bug  # not a reduction's failure: never hidden
