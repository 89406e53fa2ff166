"""A link's TCP data plane on the C loop's connection: one connection per daemon.

Where the client runs its C loop (fastpath.py), a link's data-plane
transport is a LoopTransport. open() dials and greets the data port exactly
as TcpTransport does (the same NotOffered where the daemon offers no data
port, cannot be reached, or refused a stream for capacity lately), then
hands the socket to the loop. That connection then carries both paths: the
loop's keys, and between their frames the link's own requests (its other
keys, its resends), which this stream's sender thread writes through the
loop (Loop.write). Replies that are none of the loop's keys come back here,
and so does the connection's end, raised as a TcpStream raises it. So the
daemon counts one connection per worker against its caps and a job's share,
and a refusal, a break or a token refused takes the link's own path: its
retries and backoff, gRPC after a refusal for capacity, its errors.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from reducer_wire.codec import DecodeError, ShardView, decode_shard
from reducer_wire.framing import SHARD, frame_header

from reducer_client.transport.base import HEADROOM, DaemonInfo, Transport, TransportError
from reducer_client.transport.tcp import TcpTransport

__all__ = ["LoopTransport", "LoopStream"]

_FRAME_HEADER_BYTES = len(frame_header(SHARD, 0))
_FRAME_START = HEADROOM - _FRAME_HEADER_BYTES


class LoopStream:
    """One connection on the loop, as the link's stream: it drains `requests`
    into the loop on a thread of its own; iterating yields the replies that
    are no loop key's until the connection ends (TransportError on a break)."""

    can_send_now = False  # the loop's thread owns the socket

    def __init__(self, loop: Any, index: int, gen: int, where: str,
                 requests: Iterable[memoryview]) -> None:
        self.index, self.gen, self.where = index, gen, where
        self._loop = loop
        self._requests = requests
        # Reply bodies (bytes), then the end: an _End. The loop's thread puts.
        self._inbox: queue.SimpleQueue[bytes | _End] = queue.SimpleQueue()

    def start(self) -> None:
        threading.Thread(target=self._send, daemon=True,
                         name=f"reducer-loop-send-{self.where}").start()

    def replied(self, body: bytes) -> None:
        """A reply that is no loop key's (the loop's thread)."""
        self._inbox.put(body)

    def ended(self, error: TransportError | None) -> None:
        """The connection ended: with `error`, or None for the daemon's OK."""
        self._inbox.put(_End(error))

    def _send(self) -> None:
        for item in self._requests:
            frame = item[_FRAME_START:]
            frame[:_FRAME_HEADER_BYTES] = frame_header(SHARD, len(frame) - _FRAME_HEADER_BYTES)
            if not self._loop.write(self.index, self.gen, frame):
                return  # the connection ended: iteration reports why

    def __iter__(self) -> Iterator[ShardView]:
        try:
            while True:
                item = self._inbox.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                try:
                    reply = decode_shard(item)
                except DecodeError as exc:
                    raise TransportError(grpc.StatusCode.INTERNAL,
                                         f"data port {self.where}: malformed reply: "
                                         f"{exc}") from None
                yield reply
        finally:  # whatever stopped the reading ends the connection (no-op if it did)
            self._loop.shutdown(self.index, self.gen)


class _End:
    __slots__ = ("error",)

    def __init__(self, error: TransportError | None) -> None:
        self.error = error


# (link index, greeted socket, the daemon's brief status, the link's requests)
# -> the started stream; the C loop's (fastpath.FastPath.attach).
Attach = Callable[[int, socket.socket, DaemonInfo, Iterable[memoryview]], LoopStream]


class LoopTransport(Transport):
    """TcpTransport's dialling, with the connection handed to the C loop."""

    name = "tcp"
    label = "the TCP data plane"

    def __init__(self, tcp: TcpTransport, index: int, attach: Attach) -> None:
        self.tcp = tcp
        self._index = index
        self._attach = attach

    def open(self, requests: Iterator[memoryview], daemon: DaemonInfo,
             ) -> Iterable[ShardView]:
        sock = self.tcp.dial_plain(daemon)  # NotOffered as TcpTransport.open raises it
        return self._attach(self._index, sock, daemon, requests)

    def close(self) -> None:
        self.tcp.close()
