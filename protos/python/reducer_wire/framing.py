"""The TCP data plane's framing, shared by the daemon and the client.

    client -> daemon   MAGIC, then a HELLO frame (payload: the token, UTF-8,
                       may be empty), then SHARD frames; closing its sending
                       side is the half-close ("no more shards").
    daemon -> client   SHARD frames (replies; failed chunks carry error_code),
                       and last a STATUS frame (payload: uint32 gRPC status code,
                       then the message, UTF-8) when the daemon ends the stream.
    frame              uint8 kind, uint32 payload length (little-endian), payload.

docs/data-plane.md holds the whole protocol.
"""

from __future__ import annotations

import socket
import struct

import grpc
import numpy as np

from reducer_wire.codes import status_code_from_value

__all__ = ["MAGIC", "HELLO", "SHARD", "STATUS", "MAX_HELLO_BYTES", "FRAME_HEADER_BYTES",
           "FrameError", "TruncatedFrame", "frame_header", "read_frame", "send_frame",
           "status_frame", "parse_status", "recv_exactly", "shutdown_quietly", "tune_socket"]

MAGIC = b"RDCRDP01"
HELLO, SHARD, STATUS = 1, 2, 3
_HEADER = struct.Struct("<BI")
# A sender may write the header into room it left in front of the message.
FRAME_HEADER_BYTES = _HEADER.size
_STATUS_CODE = struct.Struct("<I")
MAX_HELLO_BYTES = 4096
# Sends the header with the payload in one segment where the OS allows it.
_MSG_MORE = getattr(socket, "MSG_MORE", 0)


class FrameError(ValueError):
    """The peer sent something that is not a frame of this protocol."""


class TruncatedFrame(FrameError):
    """The peer closed its side in the middle of a frame."""


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


def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False on a clean end of stream before any byte."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, _WAITALL)
        if not n:
            if got:
                raise TruncatedFrame(f"connection ended inside a frame ({got} of "
                                     f"{len(view)} bytes)")
            return False
        got += n
    return True


def read_frame(sock: socket.socket, max_bytes: int) -> tuple[int, memoryview] | None:
    """The next frame (kind, payload), or None at a clean end of stream.

    The payload lands in a fresh uninitialised buffer, without copies: shard
    data decoded from it stays a view into it.
    """
    header = bytearray(_HEADER.size)
    if not recv_exactly(sock, memoryview(header)):
        return None
    kind, length = _HEADER.unpack(header)
    if kind not in (HELLO, SHARD, STATUS):
        raise FrameError(f"unknown frame kind {kind}")
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes is larger than the limit of "
                         f"{max_bytes} bytes")
    payload = np.empty(length, np.uint8).data
    if not recv_exactly(sock, payload) and length:
        raise TruncatedFrame(f"connection ended inside a frame (0 of {length} bytes)")
    return kind, payload


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


def send_frame(sock: socket.socket, kind: int, payload: bytes | memoryview) -> None:
    sock.sendall(frame_header(kind, len(payload)), _MSG_MORE)
    sock.sendall(payload)


def shutdown_quietly(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    """shutdown(), ignoring a socket that is already closed or reset."""
    try:
        sock.shutdown(how)
    except OSError:
        pass
