"""Keep the daemon's chunk-sized allocations out of mmap.

glibc's malloc serves every block of 128 KiB or more with a fresh mmap and
returns it with munmap, so each chunk's float32 accumulator (2 MiB for a
1 MiB float16 chunk) and every large NumPy temporary cost page faults on
every round. Raising the mmap threshold to 64 MiB keeps them in the heap,
where freed blocks are reused; the trim threshold keeps up to 256 MiB of free
heap instead of returning it to the kernel after every round. The memory the
daemon holds for open chunks stays bounded by --max-inflight-bytes.

Arenas: glibc gives each thread that allocates its own arena, up to 8 per
core, and with the trim threshold above each keeps what it freed. Every
data-plane reader allocates its frames' payloads, so with hundreds of
connections a dozen arenas each held several MiB of freed payloads (issue
19: 256 contributors, peak RSS 22 MiB above idle with 2 arenas against
45 MiB with glibc's default). One arena: the payloads freed on the loop
thread are reused by every reader, and no second heap keeps its own peak
(256 contributors: 4.9-5.0x the open chunks' need against 6.1-6.5x with
two). Python threads allocate under the GIL anyway, so they hardly contend
for it; only the C summing threads free outside it.

What the heaps keep free is given back (malloc_trim) when the daemon has
held nothing for a few seconds or is at a memory limit (a stream waiting for
room), not while it serves within its limits: its RSS after a burst, or
beside a job that never reads, comes back towards what it holds, and steady
traffic (training steps, with gaps between them) keeps reusing its freed
blocks (HeapTrimmer).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc", "HeapTrimmer", "KEEP_FREE_BYTES", "IDLE_CALLS"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
ARENA_MAX = 1
# Free heap kept when trimming is due: below it a trim is not worth its page faults.
KEEP_FREE_BYTES = 8 << 20
# Calls of HeapTrimmer.trim_if_due (one a second) holding nothing before it is idle.
IDLE_CALLS = 5


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def tune_malloc() -> bool:
    """Set glibc's thresholds and arena count for this process (before its
    threads start); False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
              and libc.mallopt(_M_ARENA_MAX, ARENA_MAX) == 1)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if not ok:
        logging.getLogger("reducerd").debug("mallopt refused the thresholds")
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


class HeapTrimmer:
    """Gives the heaps' free memory back to the kernel when it is due.

    due(): the daemon has held nothing for IDLE_CALLS calls (once, until it
    holds something again), or some stream waited for memory since the last
    call. trim_if_due() then trims once the heaps hold more than
    `keep_bytes` free (glibc's mallinfo2; where that is missing, always). A
    no-op without glibc. Called from one thread at a time (the server's
    trim loop, in an executor: a trim walks every arena under its lock).
    """

    def __init__(self, keep_bytes: int = KEEP_FREE_BYTES) -> None:
        self.keep_bytes = keep_bytes
        libc = _libc()
        self._trim = getattr(libc, "malloc_trim", None)
        self._info = getattr(libc, "mallinfo2", None)
        if self._info is not None:
            self._info.restype = _MallInfo2
        self._pressure_seen = 0
        self._idle_calls = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def free_bytes(self) -> int | None:
        """Bytes the heaps hold free (None where glibc cannot say)."""
        return int(self._info().fordblks) if self._info is not None else None

    def due(self, held_bytes: int, pressure: int) -> bool:
        """Whether to trim: idle at last, or the budget's pressure count moved."""
        moved, self._pressure_seen = pressure != self._pressure_seen, pressure
        self._idle_calls = self._idle_calls + 1 if held_bytes == 0 else 0
        return self.available and (moved or self._idle_calls == IDLE_CALLS)

    def trim_if_due(self, held_bytes: int, pressure: int) -> bool:
        """Trim when due and worth it; whether it trimmed."""
        if not self.due(held_bytes, pressure):
            return False
        free = self.free_bytes()
        if free is not None and free <= self.keep_bytes:
            return False
        assert self._trim is not None
        self._trim(0)
        return True
