"""The one exception type of the client, with the gRPC status code."""

from __future__ import annotations

import grpc
from reducer_wire.codes import status_code_from_value

__all__ = ["ReducerError", "RETRYABLE_CODES", "status_code_from_value"]

# Codes worth retrying: the daemon went away (restart, drain) or was busy.
# Everything else (bad input, mismatch between ranks, a missing rank, auth)
# would fail the same way again.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


class ReducerError(RuntimeError):
    """A reduction failed. `code` is the grpc.StatusCode, str(err) the reason.

    The message names the daemon address and, where the daemon said so, the
    job, key, round and ranks involved.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES

    def __reduce__(self):  # picklable across worker processes
        return (type(self), (self.code, str(self)))

    def __repr__(self) -> str:
        return f"ReducerError({self.code.name}, {str(self)!r})"
