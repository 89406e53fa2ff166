"""One daemon: a long-lived channel and one stream of shards at a time.

Shards go out through a queue that a sender thread drains (gRPC's own, or the
data plane's), replies come back on a reader thread, so sending and receiving
overlap and any number of chunks can be in flight. Replies are matched to
waiting chunks by (key, round, offset); the daemon reports a failed chunk
in-band (on gRPC we ask for that with call metadata) so one bad chunk does not
end the stream.

Transport: where the daemon offers a TCP data plane (GetStatus.data_port,
reducer_client.transport.tcp) and TLS is off, the same messages go over a plain
socket, which costs both ends far less CPU than gRPC Python; otherwise over
the Reduce stream. `data_plane` chooses: "auto" (the default: TCP if offered
and reachable, else gRPC), "tcp" or "grpc".

Recovery: when the stream breaks with a retryable status (the daemon restarted
or went away), the link opens a new stream, waits for the daemon, and resends
first its contribution to the last completed round of every chunk it has seen
(the contract keeps it until the next round of that chunk completes), then
every contribution still waiting. The daemon counts each rank once, so ranks
that missed a result get it and the others ignore the repeat. That costs one
wire copy of this daemon's share of the model in client memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardView, decode_shard

from reducer_client.env import DATA_PLANES
from reducer_client.errors import ReducerError, status_code_from_value
from reducer_client.transport.tcp import StreamBroken, TcpStream

__all__ = ["DaemonLink", "ReplyHandler", "status_code_from_value", "DATA_PLANES"]

log = logging.getLogger("reducer_client")

# (key, round, offset): how a reply finds the chunk that waits for it.
PendingKey = tuple[str, int, int]
# Called on the reader thread with the reply, or with None and an error.
ReplyHandler = Callable[[ShardView | None, ReducerError | None], None]
_REDUCE_METHOD = "/reducer.v1.Reducer/Reduce"
_STATUS_METHOD = "/reducer.v1.Reducer/GetStatus"
_DISCOVERY_TIMEOUT_S = 5.0

_CLOSE = object()
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
# Backoff between stream attempts: 0, 50 ms, 100 ms, ... up to 1 s. Retries go
# on while chunks wait; each operation's deadline (the client's timeout) bounds them.
_FIRST_RETRY_DELAY_S, _MAX_RETRY_DELAY_S = 0.05, 1.0


class DaemonLink:
    """The client's connection to one daemon; thread-safe."""

    def __init__(self, address: str, metadata: Sequence[tuple[str, str]],
                 credentials: grpc.ChannelCredentials | None = None,
                 extra_options: Sequence[tuple[str, Any]] = (), *, token: str = "",
                 data_plane: str = "auto") -> None:
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {data_plane!r}")
        if credentials is not None and data_plane == "tcp":
            raise ValueError("data_plane='tcp' has no TLS: use 'auto' or 'grpc' with tls")
        self.address = address
        self._host = address.rpartition(":")[0].strip("[]")
        self._token = token
        # gRPC only with TLS: the TCP data plane is not encrypted.
        self._data_plane = "grpc" if credentials is not None else data_plane
        # What the current (or last) stream uses: "tcp" or "grpc"; None before the first.
        self.transport: str | None = None
        self._warned_fallback = False
        options = [*_CHANNEL_OPTIONS, *extra_options]
        self._channel = (grpc.secure_channel(address, credentials, options) if credentials
                         else grpc.insecure_channel(address, options))
        # Requests go out as bytes made by reducer_wire.codec.encode_shard and replies
        # come back as ShardViews whose data is a view into the message:
        # no protobuf copies of the data on either way.
        self._reduce = self._channel.stream_stream(_REDUCE_METHOD,
                                                   response_deserializer=decode_shard)
        self._status = self._channel.unary_unary(
            _STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.StatusReply.FromString)
        self._auth_metadata = tuple(metadata)
        self._metadata = (*metadata, ("reducer-errors", "inband"))
        # Why the last stream failed, or None once a reply came back since.
        self.last_error: ReducerError | None = None
        # _lock guards _pending, _completed, _outbox, _retries and _closed; taken
        # by callers of send() and by the reader thread. Handlers run outside it.
        self._lock = threading.Lock()
        self._pending: dict[PendingKey, tuple[ReplyHandler, bytes]] = {}
        # (key, offset) -> our contribution to the last completed round.
        self._completed: dict[tuple[str, int], bytes] = {}
        self._outbox: queue.SimpleQueue[Any] | None = None
        self._retries = 0
        self._streams_opened = 0
        self._closed = False

    @property
    def reconnects(self) -> int:
        """Streams opened after the first (each resent what was open)."""
        return max(0, self._streams_opened - 1)

    def send(self, key: PendingKey, message: bytes, handler: ReplyHandler) -> None:
        """Queue one encoded shard for the daemon; `handler` gets its reply."""
        with self._lock:
            if self._closed:
                raise ReducerError(grpc.StatusCode.CANCELLED, "client is closed")
            if self._outbox is None:
                self._open_stream()
            assert self._outbox is not None
            self._pending[key] = (handler, message)
            self._outbox.put(message)

    def forget(self, keys: Sequence[PendingKey]) -> None:
        """Stop waiting for these chunks (their operation failed or timed out)."""
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)

    def close(self) -> None:
        """Half-close the stream (the daemon answers what is open), close the channel."""
        with self._lock:
            self._closed = True
            outbox, self._outbox = self._outbox, None
        if outbox is not None:
            outbox.put(_CLOSE)
        self._channel.close()

    def _open_stream(self) -> None:
        """Open a new stream (caller holds _lock); after the first, resend history.

        Whether the old stream broke with shards in flight or after its last
        reply, the daemon may have lost the last completed round of some chunk
        before every rank had its result, so that round goes out again first.
        """
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._outbox = outbox
        if self._streams_opened:
            for message in self._completed.values():
                outbox.put(message)
        self._streams_opened += 1
        threading.Thread(target=self._read, args=(outbox,), daemon=True,
                         name=f"reducer-link-{self.address}").start()

    def _open_replies(self, requests: Iterable[bytes]) -> Iterable[ShardView]:
        """Start a stream of `requests` on the data plane or gRPC; its replies.

        Runs on the reader thread: finding the data port and connecting block.
        """
        if self._data_plane != "grpc":
            port = self._status(pb.StatusRequest(brief=True), metadata=self._auth_metadata,
                                timeout=_DISCOVERY_TIMEOUT_S).data_port
            if port:
                stream = TcpStream(self._host, port, self._token, requests, MAX_MESSAGE_BYTES)
                try:
                    stream.connect()
                    self.transport = "tcp"
                    return stream
                except OSError as exc:
                    if self._data_plane == "tcp":
                        raise StreamBroken(grpc.StatusCode.UNAVAILABLE, f"cannot connect to "
                                           f"data port {port}: {exc}") from None
                    # This stream goes through gRPC; the next one tries TCP again.
                    if not self._warned_fallback:
                        self._warned_fallback = True
                        log.warning("daemon %s: data port %d unreachable (%s); sending "
                                    "data through gRPC", self.address, port, exc)
            elif self._data_plane == "tcp":
                raise StreamBroken(grpc.StatusCode.FAILED_PRECONDITION,
                                   "the daemon offers no TCP data plane (reducerd "
                                   "--data-listen)")
        # No wait_for_ready: a daemon that is down or refuses the handshake fails
        # the call at once with gRPC's reason, which we retry and report.
        self.transport = "grpc"
        return self._reduce(requests, metadata=self._metadata)

    def _read(self, outbox: queue.SimpleQueue[Any]) -> None:
        error: ReducerError | None = None
        try:
            for reply in self._open_replies(iter(outbox.get, _CLOSE)):
                with self._lock:
                    entry = self._pending.pop((reply.key, reply.round, reply.offset), None)
                    if entry is not None and not reply.error_code:
                        self._completed[(reply.key, reply.offset)] = entry[1]
                        self._retries = 0
                        self.last_error = None
                if entry is None:
                    continue  # a late reply to an operation that gave up, or a repeat
                if reply.error_code:
                    entry[0](None, ReducerError(status_code_from_value(reply.error_code),
                                                f"daemon {self.address}: "
                                                f"{reply.error_message}"))
                else:
                    entry[0](reply, None)
        except grpc.RpcError as exc:
            error = ReducerError(exc.code(), f"daemon {self.address}: {exc.details()}")
        except StreamBroken as exc:
            error = ReducerError(exc.code, f"daemon {self.address}: {exc.details}")
        except Exception as exc:  # a bug in a handler must not hang the others
            log.exception("reply handler failed")
            error = ReducerError(grpc.StatusCode.INTERNAL, f"client error: {exc!r}")
        self._stream_ended(outbox, error)

    def _stream_ended(self, outbox: queue.SimpleQueue[Any], error: ReducerError | None,
                      ) -> None:
        """Resend what is open on a new stream if worth it, else fail it."""
        # A stream the daemon ended with OK while we still waited (it was
        # shutting down or closed an idle stream) is as retryable as a crash.
        retryable = error is None or error.retryable
        with self._lock:
            if self._outbox is outbox:
                self._outbox = None
                outbox.put(_CLOSE)
            if not self._pending:
                return
            if error is not None:
                self.last_error = error
            attempt = self._retries
            self._retries += 1
            retry = retryable and not self._closed
            if not retry:
                failed, self._pending = self._pending, {}
        if retry:
            if attempt:
                time.sleep(min(_MAX_RETRY_DELAY_S, _FIRST_RETRY_DELAY_S * 2 ** (attempt - 1)))
            self._resend(error)
            return
        error = error or ReducerError(grpc.StatusCode.UNAVAILABLE,
                                      f"daemon {self.address} ended the stream with "
                                      f"{len(failed)} chunk(s) unanswered")
        for handler, _ in failed.values():
            handler(None, error)

    def _resend(self, cause: ReducerError | None) -> None:
        with self._lock:
            if self._closed or not self._pending:
                return
            if self._outbox is None:
                self._open_stream()
            assert self._outbox is not None
            if self._retries <= 1:  # once per outage, not per attempt
                log.warning("daemon %s: stream broke (%s); resending %d open and %d "
                            "completed chunk(s)", self.address,
                            cause.code.name if cause else "ended early",
                            len(self._pending), len(self._completed))
            for _, message in self._pending.values():
                self._outbox.put(message)
