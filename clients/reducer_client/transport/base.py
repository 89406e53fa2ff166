"""The seam under DaemonLink: how one stream of shards reaches one daemon.

DaemonLink (link.py) decides what to send, what to resend after a break and
when to give up; a Transport only carries one stream at a time, as httpx's
BaseTransport carries one request. Implementations:

    GrpcTransport   grpc.py   the Reduce stream of the daemon's gRPC service
                              (also the Control: GetStatus brief)
    TcpTransport    tcp.py    the daemon's TCP data plane (its port from Control)
    FakeDaemon      fake.py   an in-process daemon with fault switches, for tests

A link is given a Control and one or more transports, tried in order at each
stream: "auto" is [tcp, grpc], where a transport that cannot reach the daemon
raises NotOffered and the next one is tried.

Messages: every request item is HEADROOM bytes that the transport may
overwrite with its own framing (the data plane's 5-byte frame header), then
one serialized Shard, so a frame goes out with one send and no copy. An item
stays valid until the transport asks for the next one: by then it must have
sent or copied it, for the link recycles the buffer once nobody can resend it.
A reply (its `data` view) is valid until the transport is asked for the next.

Direct sends (optional, the TCP data plane's): a stream (what open() returns)
with `can_send_now` true offers send_now(item), which the link calls from its
caller's thread while the stream's sender waits for work with nothing queued
(order.LinkQueue.idle): the frame goes out with one non-blocking send, and
what the socket did not take comes back (a view, empty if nothing is left),
which the link queues first: the stream knows that item for the rest of its
own frame and sends it as it is. A chunk the socket takes at once thus costs
no hand-off to the sender thread.

Errors: a transport raises only TransportError (with a gRPC status code), from
open() or while its replies are iterated; iteration ends without error when
the daemon ends the stream with OK.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from reducer_wire.codec import ShardView

__all__ = ["HEADROOM", "DaemonInfo", "TransportError", "NotOffered", "Control", "Transport"]

# Bytes in front of each message for the transport's framing: the data plane's
# frame header (uint8 kind, uint32 length; reducer_wire.framing).
HEADROOM = 5


@dataclass(frozen=True)
class DaemonInfo:
    """What a daemon's brief status says (GetStatus brief=True)."""

    data_port: int = 0  # the TCP data plane's port, 0 when it offers none
    # How long the daemon keeps a chunk's last result (and waits for a round);
    # None when it did not say.
    round_timeout_s: float | None = None


class TransportError(Exception):
    """A stream could not start, or broke: its gRPC status code and the reason."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class NotOffered(TransportError):
    """This transport cannot reach the daemon at all (raised by open() before
    it takes any request): the link tries its next transport, if any.

    quiet: the daemon does not offer it (no data port), which is no news;
    otherwise it offers it but cannot be reached, worth a warning.
    """

    def __init__(self, code: grpc.StatusCode, details: str, quiet: bool = False) -> None:
        super().__init__(code, details)
        self.quiet = quiet


class Control(ABC):
    """The daemon's control plane, as far as a link needs it."""

    @abstractmethod
    def brief_status(self) -> DaemonInfo:
        """The daemon's brief status; TransportError when it cannot be had."""

    def job_status(self, job: str) -> Any:
        """The daemon's GetStatus reply (reducer.v1.StatusReply) for `job`: its
        open and stalled chunks; TransportError when it cannot be had."""
        raise TransportError(grpc.StatusCode.UNIMPLEMENTED,
                             f"{type(self).__name__} has no job status")

    def close(self) -> None:  # noqa: B027 (optional: most hold nothing)
        """Release what it holds (a channel); nothing by default."""


class Transport(ABC):
    """One way to carry a stream of shards to one daemon."""

    #: What DaemonLink.transports reports for a stream on it: "tcp", "grpc", ...
    name: str = "transport"
    #: How log messages name it.
    label: str = "transport"

    @abstractmethod
    def open(self, requests: Iterator[memoryview], daemon: DaemonInfo,
             ) -> Iterable[ShardView]:
        """Start one stream: send `requests` in order, return the replies.

        Called on the link's reader thread; may block to connect. The
        transport drains `requests` on a thread of its own (sending and
        receiving overlap); their end is the half-close. The replies come in
        the daemon's order, until it ends the stream. Raises NotOffered (before
        taking any request) when it cannot reach the daemon, TransportError when
        the stream cannot start or breaks.
        """

    def close(self) -> None:  # noqa: B027 (optional: most hold nothing)
        """Release what it holds; a stream still open breaks. Nothing by default."""
