"""The TCP data plane's framing, shared by the daemon and the client.

    client -> daemon   MAGIC, then a HELLO frame (payload: the token, UTF-8,
                       may be empty), then SHARD frames; closing its sending
                       side is the half-close ("no more shards").
    daemon -> client   SHARD frames (replies; failed chunks carry error_code),
                       and last a STATUS frame (payload: uint32 gRPC status code,
                       then the message, UTF-8) when the daemon ends the stream.
    frame              uint8 kind, uint32 payload length (little-endian), payload.

docs/reference/wire-protocol.md holds the whole protocol.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol

import grpc
import numpy as np

from reducer_wire.codes import status_code_from_value

__all__ = ["MAGIC", "HELLO", "SHARD", "STATUS", "MAX_HELLO_BYTES", "FRAME_HEADER_BYTES",
           "Receiver", "FrameError", "TruncatedFrame", "FrameTimeout", "frame_header",
           "read_header", "parse_header", "read_payload", "read_frame", "send_frame",
           "status_frame", "parse_status", "recv_exactly", "recv_ready", "send_at_once",
           "set_receive_tick", "set_send_timeout", "shutdown_quietly", "tune_socket"]

MAGIC = b"RDCRDP01"
HELLO, SHARD, STATUS = 1, 2, 3
_HEADER = struct.Struct("<BI")
# A sender may write the header into room it left in front of the message.
FRAME_HEADER_BYTES = _HEADER.size
_STATUS_CODE = struct.Struct("<I")
MAX_HELLO_BYTES = 4096
# Sends the header with the payload in one segment where the OS allows it.
_MSG_MORE = getattr(socket, "MSG_MORE", 0)


class Receiver(Protocol):
    """What the readers below need: a socket, or a reducer_wire.tls.TlsChannel."""

    def recv_into(self, buffer: memoryview, nbytes: int = 0, flags: int = 0) -> int: ...


class FrameError(ValueError):
    """The peer sent something that is not a frame of this protocol."""


class TruncatedFrame(FrameError):
    """The peer closed its side in the middle of a frame."""


class FrameTimeout(FrameError):
    """What was being read did not all arrive by its deadline."""


def frame_header(kind: int, length: int) -> bytes:
    return _HEADER.pack(kind, length)


def status_frame(code: grpc.StatusCode, message: str) -> bytes:
    payload = _STATUS_CODE.pack(code.value[0]) + message.encode("utf-8", "replace")
    return frame_header(STATUS, len(payload)) + payload


def parse_status(payload: memoryview) -> tuple[grpc.StatusCode, str]:
    if len(payload) < _STATUS_CODE.size:
        raise FrameError(f"STATUS frame of {len(payload)} bytes")
    (value,) = _STATUS_CODE.unpack_from(payload)
    message = bytes(payload[_STATUS_CODE.size:]).decode("utf-8", "replace")
    return status_code_from_value(value), message


# Blocking sockets wait in the kernel for the whole request (one call per
# frame part, not one per arriving packet); elsewhere it is a plain recv.
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


def recv_exactly(sock: Receiver, view: memoryview, deadline_s: float | None = None,
                 on_tick: Callable[[], None] | None = None) -> bool:
    """Fill `view` from the socket; False on a clean end of stream before any byte.

    deadline_s (time.monotonic()): raise FrameTimeout if `view` is not full by
    then, however slowly its bytes come. The socket must then have a receive
    tick (set_receive_tick), so that a silent peer returns control to check it.
    on_tick: called each time a receive tick passes with nothing new (a
    reader that keeps its tick between frames clears it there once idle).
    """
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], 0, _WAITALL)
        except BlockingIOError:  # the receive tick passed with nothing new
            n = -1
            if on_tick is not None:
                on_tick()
        if not n:
            if got:
                raise TruncatedFrame(f"connection ended inside a frame ({got} of "
                                     f"{len(view)} bytes)")
            return False
        got += max(n, 0)
        if deadline_s is not None and got < len(view) and time.monotonic() >= deadline_s:
            raise FrameTimeout(f"{got} of {len(view)} bytes arrived by the deadline")
    return True


def recv_ready(sock: socket.socket, view: memoryview) -> int:
    """Bytes of `view` filled from what the socket already holds, without
    waiting: 0 when nothing is there yet (or the peer closed: the next
    blocking receive says which)."""
    try:
        return sock.recv_into(view, 0, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0


def read_header(sock: Receiver, max_bytes: int, deadline_s: float | None = None,
                on_tick: Callable[[], None] | None = None) -> tuple[int, int] | None:
    """The next frame's (kind, length), checked, or None at a clean end of
    stream (deadline_s and on_tick: as for recv_exactly)."""
    header = bytearray(_HEADER.size)
    if not recv_exactly(sock, memoryview(header), deadline_s, on_tick):
        return None
    return parse_header(header, max_bytes)


def parse_header(header: bytes | bytearray, max_bytes: int) -> tuple[int, int]:
    """A frame header's (kind, length), checked (FrameError otherwise)."""
    kind, length = _HEADER.unpack(header)
    if kind not in (HELLO, SHARD, STATUS):
        raise FrameError(f"unknown frame kind {kind}")
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes is larger than the limit of "
                         f"{max_bytes} bytes")
    return kind, length


def read_payload(sock: Receiver, length: int, deadline_s: float | None = None,
                 ) -> memoryview:
    """A frame's payload, in a fresh uninitialised buffer, without copies:
    shard data decoded from it stays a view into it."""
    payload = np.empty(length, np.uint8).data
    if not recv_exactly(sock, payload, deadline_s) and length:
        raise TruncatedFrame(f"connection ended inside a frame (0 of {length} bytes)")
    return payload


def read_frame(sock: Receiver, max_bytes: int, deadline_s: float | None = None,
               ) -> tuple[int, memoryview] | None:
    """The next frame (kind, payload), or None at a clean end of stream."""
    header = read_header(sock, max_bytes, deadline_s)
    if header is None:
        return None
    kind, length = header
    return kind, read_payload(sock, length, deadline_s)


def set_receive_tick(sock: socket.socket, seconds: float | None) -> None:
    """Let a blocking receive return after `seconds` without data (SO_RCVTIMEO;
    None: wait for ever), so that a reader can keep a deadline (recv_exactly)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds or 0))


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """A blocking send that makes no progress for `seconds` fails (SO_SNDTIMEO)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay; a peer that vanishes is noticed within about a minute,
    idle (keepalive) or with data in flight (TCP_USER_TIMEOUT), where the OS
    has these options."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", 60_000)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def send_at_once(sock: socket.socket, data: memoryview) -> int:
    """Bytes of `data` the socket takes without blocking: all, some or none (0
    also for a broken socket, which the next blocking send then reports)."""
    try:
        return sock.send(data, socket.MSG_DONTWAIT)
    except OSError:  # BlockingIOError (no room) among them
        return 0


def send_frame(sock: socket.socket, kind: int, payload: bytes | memoryview) -> None:
    sock.sendall(frame_header(kind, len(payload)), _MSG_MORE)
    sock.sendall(payload)


def shutdown_quietly(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    """shutdown(), ignoring a socket that is already closed or reset."""
    try:
        sock.shutdown(how)
    except OSError:
        pass
