"""The daemon's TCP data plane (protocol: reducer_wire.framing).

Each connection is a Stream of the Session, like a Reduce call: the shards
go through the same checks and table, replies and in-band errors are the same
messages. Only the I/O differs: a reader thread per connection receives each
frame straight into a fresh buffer (recv_into, no copy) and hands the shard
to the event loop thread, which alone touches the table; a writer thread per
connection sends what the loop puts into the stream's outbox: each reply's
frame, one buffer that the result was narrowed into (reducerd.replies), in
one send. Socket calls release the GIL, so receiving and sending run beside
the sums, and no per-byte work happens in Python.

Bounds, so that no client can hold the daemon's memory or threads for ever:
- a reader has at most _QUEUED_FRAMES shards waiting for the loop, and pauses
  while _UNSENT_FRAMES replies wait for its writer (a client that sends but
  does not read is slowed by TCP, not buffered);
- a send that makes no progress for `send_timeout_s` (the round timeout)
  ends the connection, as does a handshake not done in _HANDSHAKE_TIMEOUT_S;
- at most _MAX_CONNECTIONS connections at once; more are refused.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from collections import deque
from typing import Any

import grpc
from reducer_wire.codec import DecodeError, ShardView
from reducer_wire.framing import (
    HELLO,
    MAGIC,
    MAX_HELLO_BYTES,
    SHARD,
    FrameError,
    read_frame,
    recv_exactly,
    shutdown_quietly,
    status_frame,
    tune_socket,
)

from reducerd.access import Access
from reducerd.replies import Reply
from reducerd.session import END, DecodeFault, Session, Stream, daemon_fault_message, decode_request

__all__ = ["DataPlane"]

log = logging.getLogger("reducerd")

_QUEUED_FRAMES = 8
_UNSENT_FRAMES = 64
_HANDSHAKE_TIMEOUT_S = 10.0
_MAX_CONNECTIONS = 4096
# After the daemon's last frame, how long the client gets to close its side
# (closing with unread input would reset the connection and lose that frame).
_LINGER_S = 5.0
_ACCEPT_POLL_S = 0.5
_GONE = object()  # the connection broke: the writer stops without a status


class _Outbox:
    """The writer's queue; any thread may put. Counts what is still unsent so
    that the reader can pause while the client is not reading."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()

    def put_nowait(self, item: Any) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def get(self) -> Any:
        with self._cond:
            while not self._items:
                self._cond.wait()
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def wait_below(self, limit: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self._items) < limit, timeout_s)


class _Connection:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.outbox = _Outbox()
        self.stream = Stream(f"tcp:{peer}", inband_errors=True, outbox=self.outbox,
                             frames=True)
        self.credit = threading.Semaphore(_QUEUED_FRAMES)
        self.reader_done = threading.Event()
        self.writer_done = threading.Event()
        self.registered = False  # a Stream of the session, with a writer thread


class DataPlane:
    """Serves the data plane for `session` on its own threads."""

    def __init__(self, session: Session, loop: asyncio.AbstractEventLoop,
                 access: Access, max_message_bytes: int,
                 send_timeout_s: float = 60.0) -> None:
        self.session = session
        self.loop = loop
        self._access = access
        self.max_message_bytes = max_message_bytes
        self._send_timeout_s = send_timeout_s
        self._listener: socket.socket | None = None
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()  # guards _connections, registration and _stopped
        self._stopped = False

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
        threading.Thread(target=self._accept_loop, daemon=True,
                         name="reducerd-data-accept").start()
        return int(listener.getsockname()[1])

    def stop(self, message: str = "reducerd is shutting down") -> None:
        """Stop accepting; end every connection, registered ones with UNAVAILABLE
        (loop thread)."""
        with self._lock:
            self._stopped = True
            connections = list(self._connections)
        for conn in connections:
            if conn.registered:
                conn.stream.end(grpc.StatusCode.UNAVAILABLE, message)
            else:  # still in its handshake: wake its reader
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
            conn = _Connection(sock, f"{address[0]}:{address[1]}")
            with self._lock:
                full = len(self._connections) >= _MAX_CONNECTIONS
                if not full and not self._stopped:
                    self._connections.add(conn)
            if full or self._stopped:
                threading.Thread(target=self._refuse, daemon=True, args=(
                    sock, grpc.StatusCode.RESOURCE_EXHAUSTED if full
                    else grpc.StatusCode.UNAVAILABLE,
                    f"too many data connections ({_MAX_CONNECTIONS})" if full
                    else "reducerd is shutting down")).start()
                continue
            try:
                threading.Thread(target=self._read, args=(conn,), daemon=True,
                                 name=f"reducerd-data-read-{conn.stream.peer}").start()
            except RuntimeError as exc:  # no thread to be had
                log.warning("data plane: dropping %s: %s", conn.stream.peer, exc)
                self._forget(conn)
                sock.close()
        listener.close()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)

    # -- the reader thread ---------------------------------------------------

    def _read(self, conn: _Connection) -> None:
        try:
            tune_socket(conn.sock)
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                 _timeval(self._send_timeout_s))
            conn.sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            refusal = self._handshake(conn)
            if refusal is None:
                with self._lock:  # stop() either sees the registration or refuses us
                    conn.registered = not self._stopped
                if not conn.registered:
                    refusal = grpc.StatusCode.UNAVAILABLE, "reducerd is shutting down"
            if refusal is not None:
                self._forget(conn)
                self._refuse(conn.sock, *refusal)
                return
            conn.sock.settimeout(None)  # reads wait for the client; sends have SO_SNDTIMEO
            self._call(self.session.open_stream, conn.stream)
            threading.Thread(target=self._write, args=(conn,), daemon=True,
                             name=f"reducerd-data-write-{conn.stream.peer}").start()
            self._read_shards(conn)
        except OSError as exc:
            log.debug("data connection %s broke: %r", conn.stream.peer, exc)
            if conn.registered:
                conn.outbox.put_nowait(_GONE)
            else:
                self._forget(conn)
                conn.sock.close()
        except Exception as exc:  # e.g. MemoryError: our fault; end the stream and say so
            log.exception("data connection %s: reader failed", conn.stream.peer)
            if conn.registered:
                self._call(conn.stream.end, grpc.StatusCode.INTERNAL,
                           daemon_fault_message(exc))
                _drop_input(conn.sock)
            else:
                self._forget(conn)
                conn.sock.close()
        finally:
            conn.reader_done.set()

    def _handshake(self, conn: _Connection) -> tuple[grpc.StatusCode, str] | None:
        """Read the preface and HELLO; why the client is refused, or None. The
        HELLO's token binds the connection to its job (a job token)."""
        sock = conn.sock
        preface = bytearray(len(MAGIC))
        try:
            complete = recv_exactly(sock, memoryview(preface))
        except FrameError:
            complete = False
        if not complete or preface != MAGIC:
            return (grpc.StatusCode.INVALID_ARGUMENT,
                    f"not a reducer data-plane client: expected the preface {MAGIC!r}")
        try:
            frame = read_frame(sock, MAX_HELLO_BYTES)
        except FrameError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, f"bad HELLO frame: {exc}"
        if frame is None or frame[0] != HELLO:
            return grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be HELLO"
        grant = self._access.grant(bytes(frame[1]))
        if grant is None:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong token in the data-plane HELLO")
        conn.stream.job = grant.job
        if self.session.draining:
            return grpc.StatusCode.UNAVAILABLE, "reducerd is shutting down"
        return None

    def _read_shards(self, conn: _Connection) -> None:
        ending = False  # we asked the loop to end the stream: read and drop the rest
        while True:
            try:
                frame = read_frame(conn.sock, self.max_message_bytes)
            except FrameError as exc:
                # The byte stream cannot be followed any further: end with why.
                self._call(conn.stream.end, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                _drop_input(conn.sock)
                return
            if frame is None:  # the client half-closed: answer what is open, then OK
                self._call(conn.stream.half_close)
                return
            kind, payload = frame
            if ending or conn.stream.ended or conn.writer_done.is_set():
                continue  # read and drop, so the client sees our status, not a reset
            if kind != SHARD:
                ending = True
                self._call(conn.stream.end, grpc.StatusCode.INVALID_ARGUMENT,
                           f"unexpected frame kind {kind} after HELLO")
                continue
            shard = decode_request(payload)
            # Pause while the loop is behind or the client does not read its replies.
            while not (conn.outbox.wait_below(_UNSENT_FRAMES, 1.0)
                       and conn.credit.acquire(timeout=1.0)):
                if conn.writer_done.is_set():
                    break
            else:
                self._call(self._accept, conn, shard)

    def _refuse(self, sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
        log.info("data plane: refused %s: %s", _peer(sock), message)
        try:
            sock.settimeout(_LINGER_S)
            sock.sendall(status_frame(code, message))
            sock.shutdown(socket.SHUT_WR)
            _drop_input(sock, _LINGER_S)
        except OSError:
            pass
        finally:
            sock.close()

    # -- on the loop thread --------------------------------------------------

    def _call(self, function: Any, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop is closed: the daemon is gone
            pass

    def _accept(self, conn: _Connection, shard: ShardView | DecodeError | DecodeFault,
                ) -> None:
        try:
            self.session.accept(shard, conn.stream)  # it answers its own faults
        except Exception as exc:  # still a bug must end this stream, not hang its client
            log.exception("data connection %s: shard not taken", conn.stream.peer)
            conn.stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
        finally:
            conn.credit.release()

    # -- the writer thread ---------------------------------------------------

    def _write(self, conn: _Connection) -> None:
        try:
            while True:
                item = conn.outbox.get()
                if item is _GONE:
                    break
                if item is END:
                    conn.sock.sendall(status_frame(grpc.StatusCode.OK, ""))
                    break
                if isinstance(item, tuple):
                    conn.sock.sendall(status_frame(*item))
                    break
                reply: Reply = item
                conn.sock.sendall(reply.frame)  # frame header and message: one buffer
        except OSError as exc:  # broken, or no progress for send_timeout_s
            log.debug("data connection %s broke while sending: %r", conn.stream.peer, exc)
        finally:
            conn.writer_done.set()
            # Half-close, give the client time to read our last frame and close
            # its side (the reader drains meanwhile), then close.
            shutdown_quietly(conn.sock, socket.SHUT_WR)
            if not conn.reader_done.wait(_LINGER_S):
                shutdown_quietly(conn.sock, socket.SHUT_RDWR)
                conn.reader_done.wait(_LINGER_S)
            conn.sock.close()
            self._forget(conn)
            self._call(self.session.close_stream, conn.stream)


def _drop_input(sock: socket.socket, timeout_s: float | None = None) -> None:
    """Read and drop until the client closes (or `timeout_s`, or the writer's
    linger shuts the socket down)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while sock.recv(1 << 16):
            if deadline is not None and time.monotonic() > deadline:
                return
    except OSError:
        pass


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
