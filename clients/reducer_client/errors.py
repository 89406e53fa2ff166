"""The one exception type of the client, with the gRPC status code, and which
failures are worth a retry.

Retried by the link itself, within each chunk's deadline (the client's
timeout), with a backoff of 50 ms doubling to 1 s: a stream that broke or
could not start because the daemon went away (UNAVAILABLE: restart, drain,
network), or because the daemon refused the connection for capacity
(RESOURCE_EXHAUSTED at the stream level: too many data-plane connections).
What is still unanswered at the deadline fails with that last reason.

Not retried either: a TLS refusal (UNAVAILABLE, its message starts with
reducer_wire.tls.TLS_REFUSAL: an untrusted daemon certificate, a missing or
refused client certificate), which the next attempt would meet again.

Not retried: a chunk the daemon failed in band, whatever its code (a chunk
over `--max-inflight-bytes` or the open-chunk limit is RESOURCE_EXHAUSTED and
fails its operation at once, naming the limit), a message over the daemon's
size limit, and everything else (bad input, ranks that disagree, a missing
rank, auth): they would fail the same way again.

`ReducerError.retryable` tells a caller whether calling again can help: True
for UNAVAILABLE and for a connection refused for capacity, False otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import grpc
from reducer_wire.codes import status_code_from_value
from reducer_wire.tls import TLS_REFUSAL

__all__ = ["ReducerError", "RETRYABLE_CODES", "cause_behind", "first_cause",
           "status_code_from_value", "stream_error"]

# Codes a retry can help whatever the context: the daemon went away.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
# gRPC's own RESOURCE_EXHAUSTED for a message over a size limit: a
# configuration problem, not a busy daemon.
_MESSAGE_TOO_LARGE = "larger than max"


class ReducerError(RuntimeError):
    """A reduction failed. `code` is the grpc.StatusCode, str(err) the reason.

    The message names the daemon address and, where the daemon said so, the
    job, key, round and ranks involved. retryable: whether a retry can help
    (default: the code is in RETRYABLE_CODES).
    """

    def __init__(self, code: grpc.StatusCode, message: str,
                 retryable: bool | None = None) -> None:
        super().__init__(message)
        self.code = code
        self._retryable = code in RETRYABLE_CODES if retryable is None else retryable

    @property
    def retryable(self) -> bool:
        return self._retryable

    def naming(self, what: str) -> ReducerError:
        """This error with the user's call `what` before it (the keys on the
        wire are the shims' own); itself where it names it already."""
        if str(self).startswith(what):
            return self
        return ReducerError(self.code, f"{what}: {self}", self._retryable)

    def __reduce__(self):  # picklable across worker processes
        return (type(self), (self.code, str(self), self._retryable))

    def __repr__(self) -> str:
        return f"ReducerError({self.code.name}, {str(self)!r})"


def stream_error(code: grpc.StatusCode, message: str) -> ReducerError:
    """The error of a stream that ended or could not start with `code`.

    RESOURCE_EXHAUSTED here is a daemon refusing a connection for capacity:
    worth a retry with backoff (the link's, within the deadline), unless it
    is gRPC's "message larger than max".
    """
    busy = code == grpc.StatusCode.RESOURCE_EXHAUSTED and _MESSAGE_TOO_LARGE not in message
    refused = code == grpc.StatusCode.UNAVAILABLE and TLS_REFUSAL.lower() in message.lower()
    return ReducerError(code, message, retryable=True if busy else False if refused else None)


def first_cause(error: Exception, others: Iterable[Future[Any]]) -> Exception:
    """What to raise when one of several reductions in flight failed with `error`.

    A daemon that went away fails the chunks it held with UNAVAILABLE, and a
    rank that stopped on that error leaves the other daemons' chunks of its
    step waiting, so they end with DEADLINE_EXCEEDED naming that rank: the
    echo, not the cause. If `error` is a ReducerError but not UNAVAILABLE, and one of `others`
    (futures of the same step) already failed with UNAVAILABLE, that one is
    the cause; otherwise `error`. Nothing is waited for.
    """
    if not isinstance(error, ReducerError) or error.code == grpc.StatusCode.UNAVAILABLE:
        return error  # not a reduction's failure (a bug, bad input), or already the cause
    for future in others:
        if future.done() and not future.cancelled():
            exc = future.exception()
            if isinstance(exc, ReducerError) and exc.code == grpc.StatusCode.UNAVAILABLE:
                return exc
    return error


def cause_behind(error: ReducerError, links: Iterable[Any]) -> ReducerError:
    """The error an operation fails with, or its cause where one is known.

    A daemon that went away leaves the ranks that noticed first stopped, so
    the other daemons fail the chunks those ranks no longer send with
    DEADLINE_EXCEEDED (the round timeout, naming the missing ranks): the
    echo, which often comes before the dead daemon's own UNAVAILABLE (its
    link retries until the client's timeout). Whichever operation, bucket or
    shim meets the echo first, a link (of `links`: `.address`, `.last_error`)
    that lost its daemon and has not heard from it since is named as the
    cause (UNAVAILABLE, retryable), the echo kept in the message.
    """
    if error.code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return error
    gone = next((link for link in links if link.last_error is not None
                 and link.last_error.code == grpc.StatusCode.UNAVAILABLE), None)
    if gone is None:
        return error
    return ReducerError(grpc.StatusCode.UNAVAILABLE,
                        f"{gone.last_error} (the cause: daemon {gone.address} went away; "
                        f"meanwhile {error})", retryable=True)
