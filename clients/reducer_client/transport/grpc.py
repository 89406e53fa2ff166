"""The daemon's gRPC service as a Transport (the Reduce stream) and as the Control.

One long-lived channel per daemon carries both. Requests go out as the bytes
that reducer_wire.codec made (gRPC Python wants `bytes`, so each message is
copied once, as it serializes it); replies come back as ShardViews whose data
is a view into gRPC's message, with no protobuf copy. The daemon reports a
failed chunk in band (the call metadata `reducer-errors: inband` asks for
that) so one bad chunk does not end the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardView, decode_shard
from reducer_wire.tls import TLS_REFUSAL

from reducer_client.transport.base import (
    HEADROOM,
    Control,
    DaemonInfo,
    Transport,
    TransportError,
)

__all__ = ["GrpcTransport", "MAX_MESSAGE_BYTES"]

_REDUCE_METHOD = "/reducer.v1.Reducer/Reduce"
_STATUS_METHOD = "/reducer.v1.Reducer/GetStatus"
_STATUS_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 64 << 20
# A restarted daemon is found within ~1 s; gRPC's default backoff grows to 120 s.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _message_bytes(item: memoryview) -> bytes:
    """The Shard after the transport headroom, as the bytes gRPC sends."""
    return bytes(item[HEADROOM:])


class GrpcTransport(Transport, Control):
    """Reduce streams and GetStatus over one channel to `address`."""

    name = "grpc"
    label = "gRPC"

    def __init__(self, address: str, metadata: Sequence[tuple[str, str]] = (),
                 credentials: grpc.ChannelCredentials | None = None,
                 extra_options: Sequence[tuple[str, Any]] = (),
                 tls_probe: Callable[[], str | None] | None = None) -> None:
        self.address = address
        # Under TLS: why a handshake fails, in words (reducer_wire.tls.diagnose_handshake).
        self._tls_probe = tls_probe
        options = [*_CHANNEL_OPTIONS, *extra_options]
        self._channel = (grpc.secure_channel(address, credentials, options) if credentials
                         else grpc.insecure_channel(address, options))
        self._reduce = self._channel.stream_stream(
            _REDUCE_METHOD, request_serializer=_message_bytes,
            response_deserializer=decode_shard)
        self._status = self._channel.unary_unary(
            _STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.StatusReply.FromString)
        self._auth_metadata = tuple(metadata)
        self._stream_metadata = (*metadata, ("reducer-errors", "inband"))

    def brief_status(self) -> DaemonInfo:
        try:
            reply = self._status(pb.StatusRequest(brief=True), metadata=self._auth_metadata,
                                 timeout=_STATUS_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise TransportError(exc.code(), self._reason(exc) or "GetStatus failed") from None
        return DaemonInfo(data_port=reply.data_port,
                          round_timeout_s=reply.round_timeout_s or None)

    def job_status(self, job: str) -> pb.StatusReply:
        try:
            return self._status(pb.StatusRequest(job=job), metadata=self._auth_metadata,
                                timeout=_STATUS_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise TransportError(exc.code(), self._reason(exc) or "GetStatus failed") from None

    def open(self, requests: Iterator[memoryview], daemon: DaemonInfo,
             ) -> Iterable[ShardView]:
        # No wait_for_ready: a daemon that is down or refuses the handshake
        # fails the call at once with gRPC's reason, which the link retries.
        return self._replies(self._reduce(requests, metadata=self._stream_metadata))

    def _reason(self, exc: grpc.RpcError) -> str:
        """gRPC's details, or where TLS refused the connection, why in words
        (gRPC says "Socket closed" for a refused client certificate)."""
        details = exc.details() or ""
        lowered = details.lower()
        if (self._tls_probe is not None and exc.code() == grpc.StatusCode.UNAVAILABLE
                and any(word in lowered for word in ("handshake", "socket closed", "ssl"))):
            reason = self._tls_probe()
            if reason:
                return f"{TLS_REFUSAL}: {reason} (gRPC: {details})"
        return details

    @staticmethod
    def _replies(call: Iterable[ShardView]) -> Iterator[ShardView]:
        try:
            yield from call
        except grpc.RpcError as exc:
            raise TransportError(exc.code(), exc.details() or "stream failed") from None

    def close(self) -> None:
        self._channel.close()
