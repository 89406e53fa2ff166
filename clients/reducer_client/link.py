"""One daemon: a long-lived channel and a bidirectional Reduce stream.

Shards go out through a queue that gRPC drains on its own thread, replies come
back on a reader thread, so sending and receiving overlap and any number of
chunks can be in flight. Replies are matched to waiting chunks by
(key, round, offset); the daemon reports a failed chunk in-band (we ask for
that with call metadata) so one bad chunk does not end the stream.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from reducer_client._proto.reducer.v1 import reducer_pb2 as pb
from reducer_client._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from reducer_client.errors import ReducerError

__all__ = ["DaemonLink", "ReplyHandler", "status_code_from_value"]

log = logging.getLogger("reducer_client")

# (key, round, offset): how a reply finds the chunk that waits for it.
PendingKey = tuple[str, int, int]
# Called on the reader thread with the reply, or with None and an error.
ReplyHandler = Callable[[pb.Shard | None, ReducerError | None], None]

_CLOSE = object()
_CODES = {code.value[0]: code for code in grpc.StatusCode}
MAX_MESSAGE_BYTES = 64 << 20


def status_code_from_value(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


class DaemonLink:
    """The client's connection to one daemon; thread-safe."""

    def __init__(self, address: str, metadata: Sequence[tuple[str, str]],
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.keepalive_time_ms", 30_000)]
        self._channel = (grpc.secure_channel(address, credentials, options) if credentials
                         else grpc.insecure_channel(address, options))
        self._stub = pb_grpc.ReducerStub(self._channel)
        self._metadata = (*metadata, ("reducer-errors", "inband"))
        self._connectivity = grpc.ChannelConnectivity.IDLE
        self._channel.subscribe(self._on_connectivity, try_to_connect=True)
        # _lock guards _pending, _outbox and _closed; taken by callers of send()
        # and by the reader thread. Handlers are called outside it.
        self._lock = threading.Lock()
        self._pending: dict[PendingKey, ReplyHandler] = {}
        self._outbox: queue.SimpleQueue[Any] | None = None
        self._closed = False

    def _on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        self._connectivity = state

    @property
    def connectivity(self) -> grpc.ChannelConnectivity:
        return self._connectivity

    def send(self, shards: Sequence[pb.Shard], handlers: Sequence[ReplyHandler]) -> None:
        """Queue shards for the daemon; each handler gets its shard's reply."""
        with self._lock:
            if self._closed:
                raise ReducerError(grpc.StatusCode.CANCELLED, "client is closed")
            if self._outbox is None:
                self._open_stream()
            assert self._outbox is not None
            for shard, handler in zip(shards, handlers, strict=True):
                self._pending[(shard.key, shard.round, shard.offset)] = handler
            for shard in shards:
                self._outbox.put(shard)

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
        self._channel.unsubscribe(self._on_connectivity)
        self._channel.close()

    def _open_stream(self) -> None:
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        call = self._stub.Reduce(iter(outbox.get, _CLOSE), metadata=self._metadata,
                                 wait_for_ready=True)
        self._outbox = outbox
        threading.Thread(target=self._read, args=(call, outbox), daemon=True,
                         name=f"reducer-link-{self.address}").start()

    def _read(self, call, outbox: queue.SimpleQueue[Any]) -> None:
        error: ReducerError | None = None
        try:
            for reply in call:
                with self._lock:
                    handler = self._pending.pop((reply.key, reply.round, reply.offset), None)
                if handler is None:
                    continue  # a late reply to an operation that gave up, or a repeat
                if reply.error_code:
                    handler(None, ReducerError(status_code_from_value(reply.error_code),
                                               f"daemon {self.address}: "
                                               f"{reply.error_message}"))
                else:
                    handler(reply, None)
        except grpc.RpcError as exc:
            error = ReducerError(exc.code(), f"daemon {self.address}: {exc.details()}")
        except Exception as exc:  # a bug in a handler must not hang the others
            log.exception("reply handler failed")
            error = ReducerError(grpc.StatusCode.INTERNAL, f"client error: {exc!r}")
        with self._lock:
            if self._outbox is outbox:
                self._outbox = None  # the next send opens a new stream
                outbox.put(_CLOSE)
            failed, self._pending = self._pending, {}
        if failed:
            error = error or ReducerError(grpc.StatusCode.UNAVAILABLE,
                                          f"daemon {self.address} ended the stream with "
                                          f"{len(failed)} chunk(s) unanswered")
            for handler in failed.values():
                handler(None, error)
