"""Limits that hold whatever a client declares: world sizes, missing ranks, held bytes.

A shard's world_size is only a number the client wrote: the daemon's cost
must follow what arrived (the ranks that contributed, the bytes received),
never what was declared. So missing ranks are computed lazily and at most
MISSING_LISTED_AT_MOST of them are named, in messages and in GetStatus.

MemoryBudget is the one count of the bytes the daemon holds against
--max-inflight-bytes: float32 accumulators (the table, on the loop thread),
and the transports' receive buffers and replies not yet sent (any thread).
"""

from __future__ import annotations

import threading
from collections.abc import Collection

__all__ = ["MISSING_LISTED_AT_MOST", "WORLD_SIZES_KEPT", "TRANSPORT_RESERVE_SHARE",
           "FAILURES_KEPT", "missing_ranks", "describe_missing", "MemoryBudget"]

# Ranks named per chunk in a failure message and in GetStatus.
MISSING_LISTED_AT_MOST = 64
# Distinct world sizes remembered per job (GetStatus lists them).
WORLD_SIZES_KEPT = 16
# The daemon's accumulators leave 1/8 of --max-inflight-bytes to its connections.
TRANSPORT_RESERVE_SHARE = 8
# Failed chunks remembered (a late contributor hears the failure, for a round
# timeout), the oldest forgotten first beyond this: a tenant whose every shard
# is refused (limits, mismatches) cannot grow the table without bound (each
# record holds its message, a few KiB with the longest names: 24 MiB at most).
FAILURES_KEPT = 8192


def missing_ranks(world_size: int, present: Collection[int],
                  at_most: int = MISSING_LISTED_AT_MOST) -> tuple[list[int], int]:
    """The lowest `at_most` ranks below `world_size` not in `present`, and how
    many are missing in all. At most at_most + len(present) steps, whatever
    world_size says."""
    total = world_size - len(present)
    wanted = min(at_most, total)
    listed: list[int] = []
    rank = 0
    while len(listed) < wanted:
        if rank not in present:
            listed.append(rank)
        rank += 1
    return listed, total


def describe_missing(world_size: int, present: Collection[int]) -> str:
    """'1, 3 of 4', or '0, 1, ... 63 and 4294967231 more of 4294967295'."""
    listed, total = missing_ranks(world_size, present)
    more = f" and {total - len(listed)} more" if total > len(listed) else ""
    return f"{', '.join(map(str, listed))}{more} of {world_size}"


class MemoryBudget:
    """Bytes held against one limit (--max-inflight-bytes); thread-safe.

    accumulators: the table's float32 accumulators (taken on the loop thread
    when a chunk opens, refused beyond the limit). transport: receive buffers
    (a data-plane frame is reserved at its declared size before it is read)
    and replies queued but not yet sent. Accumulators always leave
    `transport_reserve` bytes to the transports, so that contributions to
    chunks already open can still be received when accumulators are at their
    most (else chunks would wait for frames that wait for memory).
    """

    def __init__(self, limit_bytes: int, transport_reserve_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes
        self.transport_reserve_bytes = min(transport_reserve_bytes, limit_bytes)
        # _lock guards the two counts and _waiting; taken by the loop thread,
        # the summing threads and the data plane's threads (several times a
        # frame: held without the Condition's Python wrapper). Waiters are
        # woken whenever bytes are given back while one waits.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0
        self._accumulators = 0
        self._transport = 0

    @property
    def accumulator_bytes(self) -> int:
        return self._accumulators

    @property
    def transport_bytes(self) -> int:
        return self._transport

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._accumulators + self._transport

    def take_accumulator(self, nbytes: int) -> bool:
        """Take room for an accumulator; False when that would pass the limit."""
        with self._lock:
            used = self._accumulators + max(self._transport, self.transport_reserve_bytes)
            if used + nbytes > self.limit_bytes:
                return False
            self._accumulators += nbytes
            return True

    def give_accumulator(self, nbytes: int) -> None:
        with self._lock:
            self._accumulators -= nbytes
            if self._waiting:
                self._cond.notify_all()

    def fits_transport(self, nbytes: int) -> bool:
        """Whether `nbytes` more for a transport would stay within the limit."""
        with self._lock:
            return self._accumulators + self._transport + nbytes <= self.limit_bytes

    def reserve(self, nbytes: int, timeout_s: float) -> bool:
        """Reserve `nbytes` of receive buffer, waiting up to `timeout_s` for
        room; False if none came (or it can never fit)."""
        if nbytes > self.limit_bytes:
            return False
        with self._lock:
            if self._accumulators + self._transport + nbytes > self.limit_bytes:
                self._waiting += 1
                try:
                    if not self._cond.wait_for(
                            lambda: self._accumulators + self._transport + nbytes
                            <= self.limit_bytes, timeout_s):
                        return False
                finally:
                    self._waiting -= 1
            self._transport += nbytes
            return True

    def take_transport(self, nbytes: int) -> None:
        """Count `nbytes` a transport holds anyway (a reply queued for sending)."""
        with self._lock:
            self._transport += nbytes

    def give_transport(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self._transport -= nbytes
                if self._waiting:
                    self._cond.notify_all()
