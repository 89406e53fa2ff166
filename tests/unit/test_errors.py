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
