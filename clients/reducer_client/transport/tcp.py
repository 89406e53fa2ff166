"""The client's side of one TCP data-plane connection (reducer_wire.framing).

gRPC Python costs about a CPU-second per GB on each end (scripts/grpc_ceiling.py),
more than the reduction itself. A daemon started with a data port (reducerd
--data-listen; GetStatus reports it as `data_port`) also takes the very same
Shard messages, in-band errors included, over a plain socket. A connection
that ends without a STATUS frame broke (UNAVAILABLE). gRPC keeps the control
plane: health, GetStatus (which finds the data port) and the token check.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable, Iterator

import grpc
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
    read_frame,
    send_frame,
    shutdown_quietly,
    tune_socket,
)

__all__ = ["StreamBroken", "TcpStream"]


class StreamBroken(Exception):
    """A data-plane connection ended with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class TcpStream:
    """One client connection: shards from `requests`, replies by iteration.

    connect() runs on the caller's thread; a sender thread then drains
    `requests` (its end half-closes the connection), and iterating yields the
    daemon's replies until it ends the stream with OK, or raises StreamBroken.
    """

    def __init__(self, host: str, port: int, token: str, requests: Iterable[bytes],
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

    def _send(self, sock: socket.socket) -> None:
        try:
            for message in self._requests:
                send_frame(sock, SHARD, message)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            shutdown_quietly(sock)  # the reader sees the break and reports it

    def __iter__(self) -> Iterator[ShardView]:
        sock = self._sock
        assert sock is not None, "connect() first"
        where = f"data port {self.host}:{self.port}"
        try:
            while True:
                try:
                    frame = read_frame(sock, self._max_message_bytes)
                except (OSError, TruncatedFrame) as exc:  # the daemon went away
                    raise StreamBroken(grpc.StatusCode.UNAVAILABLE,
                                       f"{where}: connection broke ({exc})") from None
                except FrameError as exc:
                    raise StreamBroken(grpc.StatusCode.INTERNAL, f"{where}: {exc}") from None
                if frame is None:
                    raise StreamBroken(grpc.StatusCode.UNAVAILABLE,
                                       f"{where}: the daemon closed the connection")
                kind, payload = frame
                if kind == STATUS:
                    try:
                        code, message = parse_status(payload)
                    except FrameError as exc:
                        raise StreamBroken(grpc.StatusCode.INTERNAL, f"{where}: {exc}") from None
                    if code == grpc.StatusCode.OK:
                        return
                    raise StreamBroken(code, message)
                if kind != SHARD:
                    raise StreamBroken(grpc.StatusCode.INTERNAL,
                                       f"{where}: unexpected frame kind {kind}")
                try:
                    reply = decode_shard(payload)
                except DecodeError as exc:
                    raise StreamBroken(grpc.StatusCode.INTERNAL,
                                       f"{where}: malformed reply: {exc}") from None
                yield reply
        finally:
            shutdown_quietly(sock)
            sock.close()
