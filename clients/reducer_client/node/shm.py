"""Shared-memory segments and socket names of node-local aggregation.

Names are per host user, job and node, so two jobs (or two simulated nodes
on one host) never meet: segments are `reducer-<uid>-<job>-n<node>-<pid>-<seq>`
in /dev/shm, the coordination socket the same without pid and seq (abstract
on Linux, so it vanishes with its process; a file in the temp folder elsewhere).

Who unlinks what: local rank 0 creates every segment, and unlinks it as soon
as every local worker has it mapped (they have all written their input into
it), so a running job holds nothing in /dev/shm and a crash cannot leak what
is already unlinked. For the short window before that, a worker that sees the
node fail sweeps the node's prefix (`sweep_segments`), local rank 0 sweeps
stale ones of an earlier run when it starts, and its Python resource tracker
unlinks what it created if the process is killed. Workers that only attach
unregister the segment from their own resource tracker (Python < 3.13 registers
attachments too), which would otherwise unlink it, or warn about a "leak",
when that worker exits.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import tempfile
import threading
import zlib
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

__all__ = ["name_prefix", "segment_prefix", "socket_address", "create_segment",
           "attach_segment", "reserve_pages", "unlink_segment", "close_segment", "sweep_segments",
           "shm_free_bytes", "shortage", "SHM_DIR"]

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory


def _job_tag(job: str) -> str:
    """A short, file-name-safe tag that still tells jobs apart (readable part + CRC)."""
    readable = re.sub(r"[^A-Za-z0-9_.]", "_", job)[:24]
    return f"{readable}-{zlib.crc32(job.encode()):08x}"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def name_prefix(job: str, node: int) -> str:
    """`reducer-<uid>-<job tag>-n<node>`: the stem of every name of this node and job."""
    return f"reducer-{_uid()}-{_job_tag(job)}-n{node}"


def segment_prefix(job: str, node: int) -> str:
    """Every segment of this job and node in /dev/shm starts with this."""
    return name_prefix(job, node) + "-"


def socket_address(job: str, node: int) -> str:
    """The node coordinator's Unix socket: abstract on Linux, else a temp file."""
    name = name_prefix(job, node) + ".sock"
    if sys.platform.startswith("linux"):
        return "\0" + name
    return os.path.join(tempfile.gettempdir(), name)


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm (None where it cannot be told)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except (OSError, AttributeError):
        return None
    return stat.f_bavail * stat.f_frsize


def shortage(need: int, available: int | None, exc: OSError | None = None) -> str:
    """Say that /dev/shm cannot hold `need` bytes, and what to do about it."""
    free = "" if available is None else f", {max(0, available) / 2**20:.1f} MiB are free"
    cause = "" if exc is None else f" ({exc.strerror})"
    return (f"needs {need / 2**20:.1f} MiB of /dev/shm for node-local aggregation{free}"
            f"{cause}: enlarge /dev/shm (docker --shm-size) or set REDUCER_NODE_LOCAL=0")


class _Segment(SharedMemory):
    """A SharedMemory whose mapping outlives it while NumPy views use it.

    The node's rows are np.frombuffer views, which keep the buffer exported,
    so closing under them raises BufferError instead of unmapping memory a
    thread still reads; the mapping then goes with the last view. CPython's
    __del__ lets that BufferError out as "Exception ignored" noise.
    """

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, BufferError):
            pass


def create_segment(name: str, nbytes: int) -> SharedMemory:
    """Create a segment of `nbytes` (local rank 0 only; its resource tracker owns it)."""
    return _Segment(name=name, create=True, size=max(1, nbytes))


# What posix_fallocate answers where the file system cannot reserve pages.
_CANNOT_RESERVE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def reserve_pages(shm: SharedMemory, nbytes: int) -> bool:
    """Take the tmpfs pages of the segment's first `nbytes` now; False where
    that cannot be done (again on reuse: pages taken already cost nothing).

    tmpfs allocates a page when it is first written, so a segment created with
    room to spare can still find /dev/shm full when a worker writes into it,
    and that worker dies of SIGBUS. Reserved at creation, the shortage shows up
    here instead, as OSError(ENOSPC), which the caller can report.
    """
    fd = getattr(shm, "_fd", -1)  # CPython's SharedMemory keeps its descriptor here
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or not isinstance(fd, int) or fd < 0:
        return False
    try:
        fallocate(fd, 0, min(max(1, nbytes), shm.size))
    except OSError as exc:
        if exc.errno in _CANNOT_RESERVE:
            return False
        raise
    return True


def attach_segment(name: str) -> SharedMemory:
    """Map an existing segment without making this process its owner.

    Python < 3.13 registers attachments with the resource tracker, which would
    unlink the segment (and warn of a leak) when this worker exits. Registering
    and then unregistering is not enough: workers started by multiprocessing
    share their parent's tracker, whose register/unregister is a set, so two
    workers attaching at once would unbalance it. So the attachment is never
    registered: the call is skipped for the moment of the attach.
    """
    if sys.version_info >= (3, 13):
        return _Segment(name=name, track=False)  # type: ignore[call-arg]
    with _untracked_lock:  # one attach at a time patches the module function
        register = resource_tracker.register
        resource_tracker.register = _register_unless_shm  # type: ignore[assignment]
        try:
            return _Segment(name=name)
        finally:
            resource_tracker.register = register  # type: ignore[assignment]


_untracked_lock = threading.Lock()
_register = resource_tracker.register


def _register_unless_shm(name: str, rtype: str) -> None:
    if rtype != "shared_memory":  # another thread's semaphore, say: still tracked
        _register(name, rtype)


def sweep_segments(prefix: str) -> list[str]:
    """Unlink every segment in /dev/shm whose name starts with `prefix`.

    Mappings stay valid: unlinking only removes the name. Returns what it removed.
    """
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass  # gone already (another worker swept it) or not ours
    return removed


def unlink_segment(shm: SharedMemory) -> None:
    """Unlink a segment this process created; fine if a sweep removed it already."""
    try:
        shm.unlink()
    except FileNotFoundError:
        # Swept by another worker: still tell our resource tracker it is gone.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def close_segment(shm: SharedMemory) -> None:
    """Unmap, unless NumPy views still use it (then the mapping goes with them)."""
    try:
        shm.close()
    except BufferError:
        pass
