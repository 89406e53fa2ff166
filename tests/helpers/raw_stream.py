"""A Reduce call driven by hand, for tests that speak the gRPC protocol themselves.

    stream = RawStream(daemon.address, token)
    stream.send(pb.Shard(...))
    reply = stream.next_reply()   # a Shard, the grpc.RpcError that ended the call, or None
    stream.close()

No client library in between: the tests see exactly what the daemon answers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable

import grpc
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc

__all__ = ["RawStream", "metadata"]


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class RawStream:
    """A Reduce call driven by hand: send() shards, next_reply() to read one.

    token: the bearer token; inband: ask for errors as in-band statuses
    ("reducer-errors: inband"); options: the channel's gRPC options.
    """

    def __init__(self, address: str, token: str | None = None, inband: bool = False,
                 options: Iterable[tuple[str, object]] = ()) -> None:
        self.channel = grpc.insecure_channel(address, options=list(options))
        # The request iterator: gRPC's sender thread takes from it; None ends it.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        extra = (("reducer-errors", "inband"),) if inband else ()
        self.call = pb_grpc.ReducerStub(self.channel).Reduce(
            iter(self.outbox.get, None), metadata=metadata(token) + extra)

    def send(self, message) -> None:
        self.outbox.put(message)

    def next_reply(self, timeout: float = 10.0):
        """The next reply Shard, the grpc.RpcError that ended the call, or None (OK).

        Read on a thread of its own so that the wait is bounded: queue.Empty
        after `timeout` seconds without a reply.
        """
        result: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            try:
                result.put(next(self.call))
            except grpc.RpcError as exc:
                result.put(exc)
            except StopIteration:
                result.put(None)

        threading.Thread(target=read, daemon=True).start()
        return result.get(timeout=timeout)

    def close(self) -> None:
        """End the request stream, cancel the call and close the channel."""
        self.outbox.put(None)
        self.call.cancel()
        self.channel.close()
