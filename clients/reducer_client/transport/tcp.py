"""The daemon's TCP data plane as a Transport (reducer_wire.framing).

gRPC Python costs about a CPU-second per GB on each end (scripts/grpc_ceiling.py),
more than the reduction itself. A daemon started with a data port (reducerd
--data-listen; GetStatus reports it as `data_port`) also takes the very same
Shard messages, in-band errors included, over a plain socket. A connection
that ends without a STATUS frame broke (UNAVAILABLE). gRPC keeps the control
plane: health, GetStatus (which finds the data port) and the token check.

Per chunk: the frame header is written into the message's headroom, so header
and Shard leave with one sendall; a reply is read into one receive buffer that
is reused for the next (a reply is consumed before the next is asked for, see
base.py), so nothing is allocated per reply once it has grown to the largest.
"""

from __future__ import annotations

import socket
import threading
import weakref
from collections.abc import Iterable, Iterator

import grpc
import numpy as np
from reducer_wire.codec import DecodeError, ShardView, decode_shard
from reducer_wire.framing import (
    HELLO,
    MAGIC,
    SHARD,
    STATUS,
    FrameError,
    TruncatedFrame,
    frame_header,
    parse_status,
    recv_exactly,
    shutdown_quietly,
    tune_socket,
)

from reducer_client.transport.base import (
    HEADROOM,
    DaemonInfo,
    NotOffered,
    Transport,
    TransportError,
)

__all__ = ["StreamBroken", "TcpStream", "TcpTransport"]

# The name this module's callers knew; the seam's error now (base.py).
StreamBroken = TransportError
_FRAME_HEADER_BYTES = len(frame_header(SHARD, 0))
assert _FRAME_HEADER_BYTES <= HEADROOM


class TcpTransport(Transport):
    """Streams over the data port that the daemon's brief status names."""

    name = "tcp"
    label = "the TCP data plane"

    def __init__(self, host: str, token: str, max_message_bytes: int,
                 connect_timeout_s: float = 5.0) -> None:
        self.host = host
        self._token = token
        self._max_message_bytes = max_message_bytes
        self._connect_timeout_s = connect_timeout_s
        # Streams still open, for close(); the reader thread adds, close() reads.
        self._streams: weakref.WeakSet[TcpStream] = weakref.WeakSet()

    def open(self, requests: Iterator[memoryview], daemon: DaemonInfo,
             ) -> Iterable[ShardView]:
        port = daemon.data_port
        if not port:
            raise NotOffered(grpc.StatusCode.FAILED_PRECONDITION,
                             "the daemon offers no TCP data plane (reducerd --data-listen)",
                             quiet=True)
        stream = TcpStream(self.host, port, self._token, requests, self._max_message_bytes,
                           self._connect_timeout_s)
        try:
            stream.connect()
        except OSError as exc:
            raise NotOffered(grpc.StatusCode.UNAVAILABLE,
                             f"cannot connect to data port {port}: {exc}") from None
        self._streams.add(stream)
        return stream

    def close(self) -> None:
        """Break the open streams: their readers see the end at once."""
        for stream in list(self._streams):
            stream.shutdown()


class TcpStream:
    """One client connection: shards from `requests`, replies by iteration.

    connect() runs on the caller's thread; a sender thread then drains
    `requests` (its end half-closes the connection), and iterating yields the
    daemon's replies until it ends the stream with OK, or raises TransportError.
    """

    def __init__(self, host: str, port: int, token: str, requests: Iterable[memoryview],
                 max_message_bytes: int, connect_timeout_s: float = 5.0) -> None:
        self.host, self.port = host, port
        self._token = token
        self._requests = requests
        self._max_message_bytes = max_message_bytes
        self._connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None

    def connect(self) -> None:
        """Open the connection and say hello; OSError when the port is unreachable."""
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout_s)
        sock.settimeout(None)
        tune_socket(sock)
        token = self._token.encode()
        sock.sendall(MAGIC + frame_header(HELLO, len(token)) + token)
        self._sock = sock
        threading.Thread(target=self._send, args=(sock,), daemon=True,
                         name=f"reducer-tcp-send-{self.host}:{self.port}").start()

    def shutdown(self) -> None:
        """End the connection both ways (any thread); iteration then stops."""
        if self._sock is not None:
            shutdown_quietly(self._sock)

    def _send(self, sock: socket.socket) -> None:
        start = HEADROOM - _FRAME_HEADER_BYTES
        try:
            for item in self._requests:
                frame = item[start:]
                frame[:_FRAME_HEADER_BYTES] = frame_header(SHARD, len(frame) - _FRAME_HEADER_BYTES)
                sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            shutdown_quietly(sock)  # the reader sees the break and reports it

    def __iter__(self) -> Iterator[ShardView]:
        sock = self._sock
        assert sock is not None, "connect() first"
        where = f"data port {self.host}:{self.port}"
        header = bytearray(_FRAME_HEADER_BYTES)
        payload = np.empty(0, dtype=np.uint8)  # grows to the largest reply, then reused
        try:
            while True:
                try:
                    if not recv_exactly(sock, memoryview(header)):
                        raise TransportError(grpc.StatusCode.UNAVAILABLE,
                                             f"{where}: the daemon closed the connection")
                    kind, length = header[0], int.from_bytes(header[1:], "little")
                    if kind not in (SHARD, STATUS):
                        raise FrameError(f"unexpected frame kind {kind}")
                    if length > self._max_message_bytes:
                        raise FrameError(f"frame of {length} bytes is larger than the "
                                         f"limit of {self._max_message_bytes} bytes")
                    if payload.size < length:
                        payload = np.empty(length, dtype=np.uint8)
                    body = payload.data[:length]
                    if length and not recv_exactly(sock, body):
                        raise TruncatedFrame(f"connection ended inside a frame (0 of "
                                             f"{length} bytes)")
                except (OSError, TruncatedFrame) as exc:  # the daemon went away
                    raise TransportError(grpc.StatusCode.UNAVAILABLE,
                                         f"{where}: connection broke ({exc})") from None
                except FrameError as exc:
                    raise TransportError(grpc.StatusCode.INTERNAL, f"{where}: {exc}") from None
                if kind == STATUS:
                    try:
                        code, message = parse_status(body)
                    except FrameError as exc:
                        raise TransportError(grpc.StatusCode.INTERNAL,
                                             f"{where}: {exc}") from None
                    if code == grpc.StatusCode.OK:
                        return
                    raise TransportError(code, message)
                try:
                    reply = decode_shard(body)
                except DecodeError as exc:
                    raise TransportError(grpc.StatusCode.INTERNAL,
                                         f"{where}: malformed reply: {exc}") from None
                yield reply
        finally:
            shutdown_quietly(sock)
            sock.close()
