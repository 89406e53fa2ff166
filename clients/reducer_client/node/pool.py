"""The node coordinator's shared-memory segments: handed out, reused, given back.

A segment is reused by later operations of up to its capacity (a power of
two, at least 64 KiB) once the one using it is released; one that a failed
operation used is never reused (late writes may land) and is given back
(`drop`) once every local rank released that operation. The pages an
operation writes are reserved when it gets the segment (shm.reserve_pages),
so /dev/shm running full fails that operation instead of a worker's write.
Only the coordinator thread calls this, except `segments`, which the owner
process's worker side reads (Coordinator.segment).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

from reducer_client.node.shm import (
    close_segment,
    create_segment,
    reserve_pages,
    shm_free_bytes,
    shortage,
    unlink_segment,
)

__all__ = ["Segment", "SegmentPool", "unlink_all"]

_MIN_SEGMENT_BYTES = 64 << 10


@dataclass
class Segment:
    shm: SharedMemory
    capacity: int
    unlinked: bool = False
    retired: bool = False  # a failed op used it: never reused (late writes may land)
    reserved: bool = False  # its pages are taken (posix_fallocate): no SIGBUS on write


class SegmentPool:
    """The segments of one coordinator, named `<prefix><seq>`."""

    def __init__(self, prefix: str) -> None:
        self._prefix, self._seq = prefix, 0
        # Entries are added before their name is sent and removed when given back.
        self.segments: dict[str, Segment] = {}

    def take(self, need: int, busy: set[int]) -> Segment | str:
        """The smallest free segment that fits `need` bytes (none whose id is in
        `busy`), or a new one, its first `need` bytes' pages reserved; else why not."""
        free = [s for s in self.segments.values()
                if not s.retired and s.capacity >= need and id(s) not in busy]
        if free:
            segment = min(free, key=lambda s: s.capacity)
            problem = _reserve(segment, need)
            return segment if problem is None else problem
        capacity = max(_MIN_SEGMENT_BYTES, 1 << (need - 1).bit_length())
        # Pages of segments that could not be reserved are taken only when
        # written: count them as taken, or keys in flight together overrun.
        unreserved = sum(s.capacity for s in self.segments.values() if not s.reserved)
        available = shm_free_bytes()
        if available is not None and need + unreserved > available:
            return shortage(need, available - unreserved)
        name = f"{self._prefix}{self._seq}"
        self._seq += 1
        segment = Segment(create_segment(name, capacity), capacity)
        problem = _reserve(segment, need)
        if problem is not None:
            unlink_segment(segment.shm)
            close_segment(segment.shm)
            return problem
        self.segments[name] = segment
        return segment

    def drop(self, segment: Segment) -> str:
        """Unlink and unmap a retired segment nobody uses any more; its name."""
        name = segment.shm.name
        del self.segments[name]
        if not segment.unlinked:
            unlink_segment(segment.shm)
            segment.unlinked = True
        close_segment(segment.shm)
        return name

    def close(self) -> None:
        """Unlink and unmap every segment."""
        unlink_all(self.segments)
        for segment in self.segments.values():
            close_segment(segment.shm)


def _reserve(segment: Segment, need: int) -> str | None:
    """Take the pages an op writes; None, or why /dev/shm cannot hold them."""
    try:
        segment.reserved = reserve_pages(segment.shm, need) or segment.reserved
    except OSError as exc:  # ENOSPC: the free-space check passed, the pages are not there
        return shortage(need, shm_free_bytes(), exc)
    return None


def unlink_all(segments: dict[str, Segment]) -> None:
    """Drop every name (mappings stay): at abort, close, or exit without close."""
    for segment in list(segments.values()):
        if not segment.unlinked:
            unlink_segment(segment.shm)
            segment.unlinked = True
