"""The data plane spoken by hand (the layout of reducer_wire.framing), for the
tests that send raw frames: build frames, split what came back, read the status."""

from __future__ import annotations

import socket
import struct

import grpc
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from reducer_wire.framing import HELLO, MAGIC, STATUS

_HEADER = struct.Struct("<BI")


def frame(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


HELLO_OK = MAGIC + frame(HELLO, b"")  # the handshake of a daemon without a token


def split_frames(received: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """The whole frames in `received`, and the bytes after the last one."""
    frames, view = [], memoryview(received)
    while len(view) >= _HEADER.size:
        kind, length = _HEADER.unpack_from(view)
        if len(view) < _HEADER.size + length:
            break
        frames.append((kind, bytes(view[_HEADER.size:_HEADER.size + length])))
        view = view[_HEADER.size + length:]
    return frames, bytes(view)


def status_of(frames: list[tuple[int, bytes]]) -> tuple[int, str]:
    """The numeric code and message of the STATUS frame that must come last."""
    kind, payload = frames[-1]
    assert kind == STATUS, frames
    (code,) = struct.unpack_from("<I", payload)
    return code, payload[4:].decode()


def data_port(address: str, token: str | None = None) -> int:
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ReducerStub(channel).GetStatus(
            pb.StatusRequest(brief=True), metadata=metadata, timeout=5).data_port


def raw_session(address: str, payload: bytes, timeout: float = 10.0) -> list[tuple[int, bytes]]:
    """Send `payload` on a fresh data connection, half-close, read every frame
    until the daemon closes; the daemon must close within `timeout`."""
    host, _, _ = address.rpartition(":")
    with socket.create_connection((host, data_port(address)), timeout=timeout) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        received = bytearray()
        while chunk := sock.recv(1 << 16):
            received += chunk
    frames, rest = split_frames(bytes(received))
    assert not rest, f"{len(rest)} trailing bytes"
    return frames
