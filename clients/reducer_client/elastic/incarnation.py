"""Incarnations: a restarted or reset job never receives an earlier one's sums.

The daemons keep each chunk's last result for retries (contract section 2),
keyed by job, key, round and offset; a job restarted under the same job id
would start its keys at round 0 again and could be answered with the
previous incarnation's result. Here every incarnation of a job agrees on a
random id first and prefixes all its keys with it, so its rounds never meet
an earlier incarnation's.

The agreement (agree): each rank puts a fresh random nonce in its slot of
a world_size-slot array and the ranks sum it, float32 on the wire (exact:
values below 2^24). A result whose slot for this rank does not hold this
rank's nonce is an earlier incarnation's cached one: the ranks all get the
same cached result, all see that, and all try the next round. The id is a
hash of every rank's nonce, the same on every rank.

If a rank is gone, the round fails with the daemon's DEADLINE_EXCEEDED
naming the missing ranks (contract section 2): missing_ranks reads them, so
the survivors can go on without them (run.py).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from concurrent.futures import Future
from typing import Any

import grpc
import numpy as np

from reducer_client.api import Reducer
from reducer_client.compression import allreduce_async_on_wire
from reducer_client.errors import ReducerError

__all__ = ["agree", "missing_ranks", "IncarnationReducer", "AGREE_ATTEMPTS"]

AGREE_ATTEMPTS = 8
_LIMB = 1 << 23  # nonces are two limbs below 2^23: exact in float32, never 0
_MISSING = re.compile(r"no contribution from rank\(s\) ([0-9, ]+) of (\d+)")


def agree(reducer: Reducer, attempts: int = AGREE_ATTEMPTS) -> str:
    """The id every rank of this incarnation agrees on (a hex string)."""
    key = f"elastic/incarnation/{reducer.world_size}"
    for _ in range(attempts):
        nonce = np.array([1 + secrets.randbelow(_LIMB - 1) for _ in range(2)], np.float32)
        slots = np.zeros((reducer.world_size, 2), np.float32)
        slots[reducer.rank] = nonce
        rows = allreduce_async_on_wire(reducer, slots, key, "sum", "float32").result()
        if np.array_equal(rows[reducer.rank], nonce) and np.all(rows > 0):
            return hashlib.blake2b(rows.tobytes(), digest_size=6).hexdigest()
        # An earlier incarnation's cached result: every rank sees it; the next round.
    raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION,
                       f"no fresh incarnation after {attempts} rounds of {key!r}: an "
                       "earlier incarnation of the job is still running under the same "
                       "job id")


def missing_ranks(error: BaseException, world_size: int) -> list[int] | None:
    """The ranks the daemon's round-timeout error names as missing, or None.

    None when the error is not such a message (a client-side timeout, a
    daemon down) or names a count that is cut short ("... and N more").
    """
    if not isinstance(error, ReducerError) or error.code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return None
    match = _MISSING.search(str(error))
    if match is None or int(match.group(2)) != world_size:
        return None
    return sorted(int(r) for r in match.group(1).split(",") if r.strip())


class IncarnationReducer:
    """A Reducer whose keys all carry one incarnation's id (see the module doc).

    The inner Reducer (and with it rank and world size) is swapped by
    reset(): objects that keep this one (optimizers, hooks) go on across
    incarnations.
    """

    def __init__(self, inner: Reducer, incarnation: str = "") -> None:
        self.inner, self.incarnation = inner, incarnation

    @property
    def prefix(self) -> str:
        return f"i{self.incarnation}/" if self.incarnation else ""

    def reset(self, inner: Reducer, incarnation: str) -> None:
        self.inner, self.incarnation = inner, incarnation

    def __getattr__(self, name: str) -> Any:
        # rank, world_size, local_rank, local_size, timeout, wire_dtype, _node ...
        if name.startswith("__") or name in ("inner", "incarnation"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum", *,
                        out: np.ndarray | None = None, wire_dtype: str | None = None,
                        priority: int = 0) -> Future[np.ndarray]:
        return allreduce_async_on_wire(self.inner, array, self.prefix + key, op, wire_dtype,
                                       out, priority)

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum", *,
                  out: np.ndarray | None = None, wire_dtype: str | None = None,
                  priority: int = 0) -> np.ndarray:
        return self.allreduce_async(array, key, op, out=out, wire_dtype=wire_dtype,
                                    priority=priority).result()

    def broadcast_async(self, array: np.ndarray, key: str, root_rank: int = 0,
                        ) -> Future[np.ndarray]:
        return self.inner.broadcast_async(array, self.prefix + key, root_rank)

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray:
        return self.broadcast_async(array, key, root_rank).result()

    def close(self) -> None:
        self.inner.close()
