"""The data plane's I/O threads: a few selector loops instead of two threads per connection.

With a reader and a writer thread per connection, 256 contributors were 512
threads (their stacks, and the GIL handed between hundreds of runnable
threads: CPU per contributor grew with their number). Here a small pool of
threads each runs a selectors.DefaultSelector over its share of the
connections (non-blocking sockets, assigned at accept to the least loaded
thread); each connection is a state machine (reducerd.dataconn) driven by
readiness events, its timers and tasks posted from other threads.

Other threads reach an I/O thread with post(): a task queue and a byte on a
socketpair, written only when the thread is not already woken, so the loop
thread's puts into idle connections' outboxes cost one send per wake, not
one per reply.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["IoThread", "IoPool", "default_io_threads", "RESERVE_POLL_S", "MAX_IO_THREADS"]

log = logging.getLogger("reducerd")

MAX_IO_THREADS = 8
# While connections wait for --max-inflight-bytes, how often they look again
# (room given back by the transports wakes them at once; the table's
# accumulators are given back without telling us).
RESERVE_POLL_S = 0.02
_SCRATCH_BYTES = 1 << 16


def default_io_threads() -> int:
    """The CPUs this process may run on, within 1..MAX_IO_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_IO_THREADS, cpus))


class IoThread:
    """One selector loop and the connections it serves.

    A connection (reducerd.dataconn.Connection) is touched by its thread
    alone, apart from what post() hands over. It offers: start(), on_ready(mask),
    on_timer(now), resume(), retry_reserve(), abandon(), `peer` and `timer_at`.
    """

    def __init__(self, name: str, load_lock: threading.Lock) -> None:
        self.name = name
        self.selector: selectors.BaseSelector | None = None  # start() makes it and:
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._tasks: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._woken = False  # a wake byte is on its way: posting needs no other
        self._timers: list[tuple[float, int, Any]] = []  # (when, n, connection): a heap
        self._order = itertools.count()
        self._again: deque[Any] = deque()  # connections to pump again (fairness)
        self.connections: set[Any] = set()
        # Connections waiting for room under --max-inflight-bytes (oldest first).
        self.reserving: dict[Any, None] = {}
        self._retry_posted = False
        self._next_poll_s = 0.0
        # Shared by this thread's connections for bytes they drop: one read at a time.
        self.scratch = memoryview(bytearray(_SCRATCH_BYTES))
        # _load_lock (the pool's) guards `load`: the accept thread adds, this thread takes.
        self._load_lock = load_lock
        self.load = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- any thread ----------------------------------------------------------

    def post(self, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on this thread, soon (any thread)."""
        self._tasks.append((function, args))
        # The thread clears _woken after reading the wake bytes and before it
        # runs the tasks: a task appended while it is True is run by that turn.
        if not self._woken and self._wake_w is not None:
            self._woken = True
            try:
                self._wake_w.send(b"\0")
            except OSError:  # full (a wake is pending anyway) or closed (thread gone)
                pass

    def stop_when_idle(self) -> None:
        if self._thread.is_alive():
            self.post(self._set_stopping)

    # -- this thread ---------------------------------------------------------

    def add(self, conn: Any) -> None:
        if conn.closed:  # evicted before it got here
            return
        self.connections.add(conn)
        self._guard(conn, conn.start)

    def remove(self, conn: Any) -> None:
        self.connections.discard(conn)
        self.reserving.pop(conn, None)
        self.uncount(conn)

    def uncount(self, conn: Any) -> None:
        """`conn` no longer counts in `load` (pick() counted it); any thread."""
        with self._load_lock:
            if conn.counted:
                conn.counted = False
                self.load -= 1

    def watch(self, sock: socket.socket, conn: Any, old: int, new: int) -> None:
        """Change what `sock` is selected for from `old` to `new` (0: nothing)."""
        assert self.selector is not None
        if old == new:
            return
        if not old:
            self.selector.register(sock, new, conn)
        elif not new:
            self.selector.unregister(sock)
        else:
            self.selector.modify(sock, new, conn)

    def schedule(self, conn: Any, when_s: float) -> None:
        """Call conn.on_timer at `when_s` (time.monotonic()), unless an earlier call is due."""
        if conn.timer_at is None or when_s < conn.timer_at:
            conn.timer_at = when_s
            heapq.heappush(self._timers, (when_s, next(self._order), conn))

    def again(self, conn: Any) -> None:
        """Pump `conn` again on the next turn, after the others had theirs."""
        self._again.append(conn)

    def retry_reserves_soon(self) -> None:
        """Room came back under --max-inflight-bytes (any thread)."""
        if self.reserving and not self._retry_posted:
            self._retry_posted = True
            self.post(self._retry_reserves)

    def _set_stopping(self) -> None:
        self._stopping = True

    def _run(self) -> None:
        assert self.selector is not None and self._wake_r is not None
        assert self._wake_w is not None
        try:
            while not (self._stopping and not self.connections and not self._tasks):
                for key, mask in self.selector.select(self._timeout()):
                    if key.data is None:
                        self._drain_wake()
                    elif key.data in self.connections:
                        self._guard(key.data, key.data.on_ready, mask)
                self._run_tasks()
                self._run_again()
                self._run_timers()
                if self.reserving and time.monotonic() >= self._next_poll_s:
                    self._retry_reserves()
        except Exception:  # a bug of ours: say so rather than leave its connections hanging
            log.exception("data plane: I/O thread %s failed", self.name)
            for conn in list(self.connections):
                self._guard(conn, conn.abandon)
        finally:
            self.selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _timeout(self) -> float | None:
        if self._tasks or self._again:
            return 0.0
        now = time.monotonic()
        timeout = None
        if self._timers:
            timeout = max(0.0, self._timers[0][0] - now)
        if self.reserving:
            poll = max(0.0, self._next_poll_s - now)
            timeout = poll if timeout is None else min(timeout, poll)
        return timeout

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        # Only now (a byte sent during the drain may have been read with the
        # others), and before the tasks run: one posted from here on sends anew.
        self._woken = False

    def _run_tasks(self) -> None:
        for _ in range(len(self._tasks)):  # those posted meanwhile wait for the next turn
            function, args = self._tasks.popleft()
            self._guard(getattr(function, "__self__", None), function, *args)

    def _run_again(self) -> None:
        for _ in range(len(self._again)):
            conn = self._again.popleft()
            if conn in self.connections:
                self._guard(conn, conn.resume)

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            when_s, _, conn = heapq.heappop(self._timers)
            if conn.timer_at == when_s and conn in self.connections:
                conn.timer_at = None
                self._guard(conn, conn.on_timer, now)

    def _retry_reserves(self) -> None:
        self._retry_posted = False
        self._next_poll_s = time.monotonic() + RESERVE_POLL_S
        for conn in list(self.reserving):
            if conn in self.reserving:
                self._guard(conn, conn.retry_reserve)

    def _guard(self, conn: Any, function: Callable[..., Any], *args: Any) -> None:
        """Run a connection's handler; a fault it let through drops that
        connection, never the thread (the others go on)."""
        try:
            function(*args)
        except Exception:
            log.exception("data plane: I/O fault on %s; dropping it",
                          getattr(conn, "peer", "a connection"))
            if conn is not None and hasattr(conn, "abandon"):
                try:
                    conn.abandon()
                except Exception:
                    log.exception("data plane: cannot drop %s", getattr(conn, "peer", "?"))


class IoPool:
    """The I/O threads of one data plane."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {threads}")
        self._load_lock = threading.Lock()
        self.threads = [IoThread(f"reducerd-data-io-{i}", self._load_lock)
                        for i in range(threads)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def pick(self) -> IoThread:
        """The least loaded thread, counting the connection about to be added (accept thread)."""
        with self._load_lock:
            thread = min(self.threads, key=lambda t: t.load)
            thread.load += 1
        return thread

    def room_given(self) -> None:
        """Bytes came back under --max-inflight-bytes: waiting connections look again."""
        for thread in self.threads:
            if thread.reserving:
                thread.retry_reserves_soon()

    def stop(self) -> None:
        """Each thread ends once its connections have (they are being ended)."""
        for thread in self.threads:
            thread.stop_when_idle()
