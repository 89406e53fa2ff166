"""The daemon's TCP data plane (protocol: reducer_client.dataplane).

Each connection is a Stream of the ReducerService, like a Reduce call: the
shards go through the same checks and table, replies and in-band errors are
the same messages. Only the I/O differs: a reader thread per connection
receives each frame straight into a fresh buffer (recv_into, no copy) and
hands the shard to the event loop thread, which alone touches the table; a
writer thread per connection sends what the loop puts into the stream's
outbox. Socket calls release the GIL, so receiving and sending run beside the
sums, and no per-byte work happens in Python.

A reader has at most _QUEUED_FRAMES shards waiting for the loop, so a client
that sends faster than the daemon sums is slowed by TCP, not held in memory.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import queue
import socket
import threading
import time
from typing import Any

import grpc
from reducer_client.dataplane import (
    HELLO,
    MAGIC,
    MAX_HELLO_BYTES,
    SHARD,
    FrameError,
    read_frame,
    recv_exactly,
    send_frame,
    status_frame,
)
from reducer_client.shardcodec import DecodeError, ShardView, decode_shard

from reducerd.service import END, ReducerService, Stream

__all__ = ["DataPlane"]

log = logging.getLogger("reducerd")

_QUEUED_FRAMES = 8
# After the daemon's last frame, how long the client gets to close its side
# (closing with unread input would reset the connection and lose that frame).
_LINGER_S = 5.0
_ACCEPT_POLL_S = 0.5
_GONE = object()  # the connection broke: the writer stops without a status


class _Connection:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.stream = Stream(f"tcp:{peer}", inband_errors=True, outbox=queue.SimpleQueue())
        self.credit = threading.Semaphore(_QUEUED_FRAMES)
        self.reader_done = threading.Event()
        self.refused = False  # the stream is ending with an error: ignore later shards


class DataPlane:
    """Serves the data plane for `service` on its own threads."""

    def __init__(self, service: ReducerService, loop: asyncio.AbstractEventLoop,
                 token: str | None, max_message_bytes: int) -> None:
        self.service = service
        self.loop = loop
        self._token = token.encode() if token else None
        self.max_message_bytes = max_message_bytes
        self._listener: socket.socket | None = None
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()  # guards _connections
        self._stopped = threading.Event()

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
        listener.settimeout(_ACCEPT_POLL_S)  # so stop() is seen without closing under accept
        self._listener = listener
        threading.Thread(target=self._accept_loop, daemon=True,
                         name="reducerd-data-accept").start()
        return int(listener.getsockname()[1])

    def stop(self, message: str = "reducerd is shutting down") -> None:
        """Stop accepting and end every connection with UNAVAILABLE (loop thread)."""
        self._stopped.set()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.stream.outbox.put_nowait((grpc.StatusCode.UNAVAILABLE, message))
        if self._listener is not None:
            self._listener.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                sock, address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                log.exception("data plane: accept failed")
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn = _Connection(sock, f"{address[0]}:{address[1]}")
            threading.Thread(target=self._read, args=(conn,), daemon=True,
                             name=f"reducerd-data-read-{conn.stream.peer}").start()

    # -- the reader thread ---------------------------------------------------

    def _read(self, conn: _Connection) -> None:
        try:
            refusal = self._handshake(conn.sock)
            if refusal is not None:
                self._refuse(conn.sock, *refusal)
                return
            with self._lock:
                self._connections.add(conn)
            self._call(self.service.streams.add, conn.stream)
            threading.Thread(target=self._write, args=(conn,), daemon=True,
                             name=f"reducerd-data-write-{conn.stream.peer}").start()
            self._read_shards(conn)
        except OSError as exc:
            log.debug("data connection %s broke: %r", conn.stream.peer, exc)
            conn.stream.outbox.put_nowait(_GONE)
        finally:
            conn.reader_done.set()

    def _handshake(self, sock: socket.socket) -> tuple[grpc.StatusCode, str] | None:
        """Read the preface and HELLO; why the client is refused, or None."""
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
        if self._token is not None and not hmac.compare_digest(bytes(frame[1]), self._token):
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong token in the data-plane HELLO")
        if self.service.draining or self._stopped.is_set():
            return grpc.StatusCode.UNAVAILABLE, "reducerd is shutting down"
        return None

    def _read_shards(self, conn: _Connection) -> None:
        while True:
            try:
                frame = read_frame(conn.sock, self.max_message_bytes)
            except FrameError as exc:
                # The byte stream cannot be followed any further: end with why.
                self._call(self._end, conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
            if frame is None:  # the client half-closed: answer what is open, then OK
                self._call(self._half_close, conn)
                return
            kind, payload = frame
            if conn.refused:
                continue  # read and drop, so the client sees our status, not a reset
            if kind != SHARD:
                conn.refused = True
                self._call(self._end, conn, grpc.StatusCode.INVALID_ARGUMENT,
                           f"unexpected frame kind {kind} after HELLO")
                continue
            shard: ShardView | DecodeError
            try:
                shard = decode_shard(payload)
            except DecodeError as exc:
                shard = exc
            while not conn.credit.acquire(timeout=1.0):
                if self._stopped.is_set():
                    return
            self._call(self._accept, conn, shard)

    def _refuse(self, sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
        log.info("data plane: refused %s: %s", _peer(sock), message)
        try:
            sock.sendall(status_frame(code, message))
        finally:
            self._linger_close(sock, None)

    # -- on the loop thread --------------------------------------------------

    def _call(self, function: Any, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop is closed: the daemon is gone
            pass

    def _accept(self, conn: _Connection, shard: ShardView | DecodeError) -> None:
        try:
            if not conn.refused and not self.service.accept(shard, conn.stream):
                conn.refused = True
        finally:
            conn.credit.release()

    def _end(self, conn: _Connection, code: grpc.StatusCode, message: str) -> None:
        conn.refused = True
        conn.stream.outbox.put_nowait((code, message))

    @staticmethod
    def _half_close(conn: _Connection) -> None:
        conn.stream.half_closed = True
        conn.stream.maybe_finish()

    # -- the writer thread ---------------------------------------------------

    def _write(self, conn: _Connection) -> None:
        outbox: Any = conn.stream.outbox
        try:
            while True:
                item = outbox.get()
                if item is _GONE:
                    break
                if item is END:
                    conn.sock.sendall(status_frame(grpc.StatusCode.OK, ""))
                    break
                if isinstance(item, tuple):
                    conn.sock.sendall(status_frame(*item))
                    break
                send_frame(conn.sock, SHARD, item)
        except OSError as exc:
            log.debug("data connection %s broke while sending: %r", conn.stream.peer, exc)
        finally:
            conn.refused = True
            self._linger_close(conn.sock, conn.reader_done)
            with self._lock:
                self._connections.discard(conn)
            self._call(self.service.close_stream, conn.stream)

    @staticmethod
    def _linger_close(sock: socket.socket, reader_done: threading.Event | None) -> None:
        """Close after our last frame: half-close, give the client time to read it
        and close its side (a reader, if any, drains meanwhile), then close."""
        try:
            sock.shutdown(socket.SHUT_WR)
            if reader_done is None:
                deadline = time.monotonic() + _LINGER_S
                sock.settimeout(_LINGER_S)
                while time.monotonic() < deadline and sock.recv(1 << 16):
                    pass
            elif not reader_done.wait(_LINGER_S):
                sock.shutdown(socket.SHUT_RDWR)
                reader_done.wait(_LINGER_S)
        except OSError:
            pass
        finally:
            sock.close()


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
