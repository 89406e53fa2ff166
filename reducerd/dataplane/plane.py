"""The daemon's TCP data plane (protocol: reducer_wire.framing, docs/reference/wire-protocol.md).

Each connection is a Stream of the Session, like a Reduce call: the shards
go through the same checks and table, replies and in-band errors are the same
messages. Only the I/O differs: each connection's handshake runs on a thread
of its own; then the event loop thread, which alone touches the table, reads
a plain-TCP connection's frames itself (reducerd.dataplane.loop_reader: the loop's
selector, non-blocking receives straight into a fresh buffer per frame, no
copy and no thread hand-off), while a TLS connection's thread goes on
reading its frames (over reducer_wire.tls.TlsChannel) and hands each shard
to the loop. With data_loop "c" (reducerd.dataplane.cloop) a C thread reads
the plain-TCP connections' frames instead and sends their replies, and the
loop thread sees one event per whole frame; TLS connections are served as
above either way. Each reply's frame is one buffer that the result was narrowed
into (reducerd.core.replies); the loop sends it itself where the socket takes it
at once without blocking, else the connection's writer thread sends the rest
(reducerd.dataplane.outbox). Socket calls release the GIL, so sending runs beside the
sums, and no per-byte work happens in Python.

Bounds, so that no client can hold the daemon's memory or threads for ever
(the per-connection ones in reducerd.dataplane.connection):
- the whole handshake (TLS, preface, HELLO) must end within
  HANDSHAKE_TIMEOUT_S of the accept, however slowly its bytes come;
- at most MAX_HANDSHAKING connections are in their handshake, apart from the
  authenticated ones: one more evicts the oldest, so trickled handshakes
  cannot lock workers out (a worker's handshake takes a round trip);
- at most MAX_CONNECTIONS authenticated connections (the daemon sizes the
  cap below its descriptor limit: reducerd.ops.descriptors), and half of
  them per job of a job token; beyond, a new one is refused with
  RESOURCE_EXHAUSTED naming the cap (clients fall back to gRPC for a while);
  at most REFUSING_AT_MOST refused ones linger to send their status, the
  others are told and closed at once;
- each socket's kernel receive buffer is fixed (SO_RCVBUF) so that what
  waits unread in them all keeps to --max-inflight-bytes
  (reducerd.ops.receive_buffers);
- each frame's declared length is reserved from the memory budget
  (--max-inflight-bytes) before it is read, and must arrive within the frame
  timeout; a reader pauses while its replies wait unsent; a send without
  progress for `send_timeout_s` ends the connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import grpc
from reducer_wire.framing import shutdown_quietly

from reducerd.core.limits import Credit, MemoryBudget, StreamCount
from reducerd.dataplane.base import BACKLOG_FRAMES, ConnectionLimits, PayloadSlots
from reducerd.dataplane.cloop import CDataLoop, c_loop_available
from reducerd.dataplane.connection import Connection
from reducerd.dataplane.loop_reader import LoopReader
from reducerd.ops.descriptors import REFUSING_AT_MOST
from reducerd.ops.receive_buffers import ReceiveBuffers
from reducerd.service.access import Access
from reducerd.service.session import Session

__all__ = ["DataPlane", "MAX_HANDSHAKING", "MAX_CONNECTIONS", "HANDSHAKE_TIMEOUT_S"]

log = logging.getLogger("reducerd")

HANDSHAKE_TIMEOUT_S = 10.0
MAX_HANDSHAKING = 64
MAX_CONNECTIONS = 4096
_ACCEPT_POLL_S = 0.5
# Data-plane threads do socket calls and decoding: far less stack than the
# default 8 MiB of address space each (thousands of them under RLIMIT_AS).
_THREAD_STACK_BYTES = 1 << 20


class DataPlane:
    """Serves the data plane for `session` on its own threads."""

    def __init__(self, session: Session, loop: asyncio.AbstractEventLoop,
                 access: Access, max_message_bytes: int,
                 send_timeout_s: float = 60.0, tls_context: ssl.SSLContext | None = None,
                 budget: MemoryBudget | None = None, max_handshaking: int | None = None,
                 max_connections: int | None = None,
                 receive_buffers: ReceiveBuffers | None = None,
                 cap_note: str = "the daemon's cap", data_loop: str = "python") -> None:
        """`receive_buffers`: the kernel buffers' total (default: the budget's
        limit); `cap_note`: where max_connections came from, for the refusal;
        `data_loop`: what reads plain-TCP frames, "c" or "python" (Config.data_loop)."""
        self.session = session
        self.loop = loop
        self.access = access
        self.tls_context = tls_context
        self.budget = budget or session.table.budget
        self.limits = ConnectionLimits(max_message_bytes=max_message_bytes,
                                       send_timeout_s=send_timeout_s,
                                       handshake_timeout_s=HANDSHAKE_TIMEOUT_S,
                                       frame_timeout_s=send_timeout_s)
        # Read when built, not when imported: tests start daemons with smaller caps.
        self.max_handshaking = max_handshaking or MAX_HANDSHAKING
        self.max_connections = max_connections or MAX_CONNECTIONS
        self.cap_note = cap_note
        self.receive_buffers = receive_buffers or ReceiveBuffers(self.budget.limit_bytes)
        # Refused connections still sending their status, each holding a
        # descriptor and a thread for up to the linger (Connection.refuse).
        self.refusing = threading.BoundedSemaphore(REFUSING_AT_MOST)
        self._listener: socket.socket | None = None
        # _lock guards _handshaking, _connections and _stopped; taken by the
        # accept thread, the connections' threads and stop() (loop thread).
        self._lock = threading.Lock()
        self._handshaking: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._connections: set[Connection] = set()
        # Of the authenticated ones: in all, and per job of a job token (limits).
        self._counts = StreamCount(self.max_connections, "data connections")
        self._stopped = False
        # Frames read on all connections and not yet taken by the loop thread.
        self.backlog = Credit(BACKLOG_FRAMES)
        # Payloads the loop itself is receiving (reducerd.dataplane.loop_reader), as many.
        self.payload_slots = PayloadSlots(BACKLOG_FRAMES, loop)
        # What the connections' threads handed the loop (call), in order; one
        # wake-up of the loop (call_soon_threadsafe) runs all queued by then.
        self._calls: deque[tuple[Any, tuple[Any, ...]]] = deque()
        self._calls_scheduled = False
        # Plain-TCP connections' frames: read by the C loop's thread ("c",
        # reducerd.dataplane.cloop) or by this loop's (reducerd.dataplane.loop_reader).
        self.c_loop: CDataLoop | None = None
        if data_loop == "c":
            why_not = c_loop_available(self.budget)
            if why_not is None:
                self.c_loop = CDataLoop(session, loop, self.budget, self.limits)
            else:
                log.warning("data plane: the C data loop is not available (%s); plain-TCP "
                            "frames are read by the Python loop", why_not)

    @property
    def handshaking(self) -> int:
        return len(self._handshaking)

    @property
    def connections(self) -> int:
        return len(self._connections)

    def start(self, host: str, port: int) -> int:
        """Bind and start accepting; return the bound port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise RuntimeError(f"data plane: cannot listen on {host}:{port}: "
                               f"{exc.strerror or exc}") from None
        listener.settimeout(_ACCEPT_POLL_S)  # the accept loop sees stop() within this
        self._listener = listener
        if self.c_loop is not None:
            self.c_loop.start()
        log.info("data plane: plain-TCP frames read by the %s loop",
                 "C" if self.c_loop is not None else "Python")
        threading.stack_size(_THREAD_STACK_BYTES)  # for the threads started from now on
        threading.Thread(target=self._accept_loop, daemon=True,
                         name="reducerd-data-accept").start()
        return int(listener.getsockname()[1])

    def stop(self, message: str = "reducerd is shutting down") -> None:
        """Stop accepting; end every connection, registered ones with UNAVAILABLE
        (loop thread)."""
        with self._lock:
            self._stopped = True
            registered = list(self._connections)
            handshaking = list(self._handshaking)
        for conn in registered:
            conn.stream.end(grpc.StatusCode.UNAVAILABLE, message)
        for conn in handshaking:  # wake its reader
            shutdown_quietly(conn.sock, socket.SHUT_RDWR)

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                sock, address = listener.accept()
            except TimeoutError:
                if self._stopped:
                    break
                continue
            except OSError as exc:  # e.g. out of file descriptors: do not spin
                if self._stopped:
                    break
                log.warning("data plane: accept failed: %s", exc)
                time.sleep(_ACCEPT_POLL_S)
                continue
            self.receive_buffers.at_accept(sock)
            conn = Connection(self, sock, f"{address[0]}:{address[1]}")
            evicted = None
            with self._lock:
                stopped = self._stopped
                if not stopped:
                    if len(self._handshaking) >= self.max_handshaking:
                        evicted, _ = self._handshaking.popitem(last=False)
                    self._handshaking[conn] = None
            if stopped:
                sock.close()
                continue
            if evicted is not None:
                log.info("data plane: %d connections in their handshake; dropping the "
                         "oldest, %s", self.max_handshaking, evicted.stream.peer)
                shutdown_quietly(evicted.sock, socket.SHUT_RDWR)
            try:
                threading.Thread(target=conn.serve, daemon=True,
                                 name=f"reducerd-data-read-{conn.stream.peer}").start()
            except RuntimeError as exc:  # no thread to be had
                log.warning("data plane: dropping %s: %s", conn.stream.peer, exc)
                self.forget(conn)
                sock.close()
        listener.close()

    # -- for the connections' threads ---------------------------------------

    def admit(self, conn: Connection) -> tuple[grpc.StatusCode, str] | None:
        """Move a connection that passed its handshake among the authenticated
        ones; why not, or None. stop() either sees it registered or refuses it."""
        with self._lock:
            if conn not in self._handshaking:
                return grpc.StatusCode.UNAVAILABLE, "dropped during its handshake"
            del self._handshaking[conn]
            if self._stopped or self.session.draining:
                return grpc.StatusCode.UNAVAILABLE, "reducerd is shutting down"
            refusal = self._counts.refusal(conn.stream.job)
            if refusal is not None:
                if self._counts.total >= self.max_connections:
                    refusal = f"{refusal}: {self.cap_note}"
                return grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
            self._connections.add(conn)
            if self.c_loop is not None and conn.io is conn.sock:
                # Before anything can be put into it: stop() may end it from now on.
                conn.outbox = conn.stream.outbox = self.c_loop.outbox_for(conn)
            conn.counted_job = conn.stream.job  # its job may be set later, by a shard
            self._counts.add(conn.counted_job)
            # Under the lock: forget() gives it back after, never before.
            self.receive_buffers.admit(conn, conn.sock, conn.counted_job)
            conn.registered = True
            return None

    def read_plain(self, conn: Connection) -> None:
        """Hand a registered plain-TCP connection's frames to the loop that
        reads them (its reader thread, which ends then)."""
        if self.c_loop is not None:
            self.call(self.c_loop.adopt, conn)
            return
        conn.outbox.direct = conn.sock
        conn.loop_reader = LoopReader(conn, self.payload_slots)
        self.call(conn.loop_reader.start)

    def forget(self, conn: Connection) -> None:
        with self._lock:
            self._handshaking.pop(conn, None)
            if conn in self._connections:
                self._connections.remove(conn)
                self._counts.remove(conn.counted_job)
            self.receive_buffers.release(conn)

    def call(self, function: Any, *args: Any) -> None:
        """Run `function(*args)` on the loop thread, after the calls before it
        (nothing once the loop is closed).

        The loop is woken (a byte through its self-pipe, and a GIL hand-off)
        only when no wake-up is pending: while it is behind, the connections'
        calls queue up and one wake-up runs them all. Appended before the flag
        is read, so a call whose thread saw a wake-up pending is in the queue
        before _run_calls clears the flag, and that run takes it.
        """
        self._calls.append((function, args))
        if self._calls_scheduled:
            return
        self._calls_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._run_calls)
        except RuntimeError:  # the loop is closed: the daemon is gone
            self._calls.clear()
            self._calls_scheduled = False

    def _run_calls(self) -> None:
        """Run the calls queued by now, in order (loop thread); later ones
        scheduled their own run, so other loop work is not starved."""
        self._calls_scheduled = False
        for _ in range(len(self._calls)):
            function, args = self._calls.popleft()
            try:
                function(*args)
            except Exception:  # as the loop's own handler would: log, run the rest
                log.exception("reducerd fault in a data-plane call %r", function)
