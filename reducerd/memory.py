"""Keep the daemon's chunk-sized allocations out of mmap.

glibc's malloc serves every block of 128 KiB or more with a fresh mmap and
returns it with munmap, so each chunk's float32 accumulator (2 MiB for a
1 MiB float16 chunk) and every large NumPy temporary cost page faults on
every round. Raising the mmap threshold to 64 MiB keeps them in the heap,
where freed blocks are reused; the trim threshold keeps up to 256 MiB of free
heap instead of returning it to the kernel after every round. The memory the
daemon holds for open chunks stays bounded by --max-inflight-bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20


def tune_malloc() -> bool:
    """Set glibc's thresholds for this process; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if not ok:
        logging.getLogger("reducerd").debug("mallopt refused the thresholds")
    return ok
