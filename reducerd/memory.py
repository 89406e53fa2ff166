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
45 MiB with glibc's default). Two arenas: the payloads freed on the loop
thread are reused by every reader; one malloc per frame contends little.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
ARENA_MAX = 2


def tune_malloc() -> bool:
    """Set glibc's thresholds and arena count for this process (before its
    threads start); False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
              and libc.mallopt(_M_ARENA_MAX, ARENA_MAX) == 1)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if not ok:
        logging.getLogger("reducerd").debug("mallopt refused the thresholds")
    return ok
