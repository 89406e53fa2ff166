"""What a data-plane connection and its readers share, below all of them.

The reading bounds that hold on the loop as on a reader thread, a
connection's limits, the plane-wide payload slots, and the two faces the
parts show each other: the plane as its connections use it (Plane,
reducerd.dataplane.plane.DataPlane is one) and a plain-TCP connection as its
loop reader uses it (Link, reducerd.dataplane.connection.Connection is one).
So the plane, a connection and a loop reader each import this module, not
one another.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from reducerd.core.limits import Credit, MemoryBudget
from reducerd.dataplane.outbox import ThreadOutbox
from reducerd.service.access import Access
from reducerd.service.session import Session, Stream

__all__ = ["BACKLOG_FRAMES", "UNSENT_FRAMES", "UNSENT_BYTES", "RESERVE_WAIT_S", "LINGER_S",
           "SKIP_BYTES", "ConnectionLimits", "PayloadSlots", "SlotWaiter", "Plane", "Link"]

# The bounds on reading, on the loop as on a reader thread (reducerd.dataplane.connection).
BACKLOG_FRAMES = 16
UNSENT_FRAMES = 64
UNSENT_BYTES = 16 << 20
RESERVE_WAIT_S = 5.0
# After the daemon's last frame, how long the client gets to close its side
# (closing with unread input would reset the connection and lose that frame).
LINGER_S = 5.0
# The scratch buffer that input read only to be dropped goes through.
SKIP_BYTES = 1 << 16


@dataclass(frozen=True)
class ConnectionLimits:
    max_message_bytes: int
    send_timeout_s: float
    handshake_timeout_s: float
    frame_timeout_s: float


class SlotWaiter(Protocol):
    """A reader that may wait for a payload slot (reducerd.dataplane.loop_reader.LoopReader)."""

    @property
    def wants_slot(self) -> bool: ...

    def resume_with_slot(self) -> None: ...


class PayloadSlots:
    """How many payloads the loop may be receiving at once, plane-wide
    (reducerd.dataplane.loop_reader; loop thread only): a reader waits its turn, first come
    first served."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        self.limit = limit
        self.loop = loop
        self.taken = 0
        self._waiting: deque[SlotWaiter] = deque()

    def take(self, reader: SlotWaiter) -> bool:
        """A slot for `reader`, or False: it is queued and resumed when one frees."""
        if self.taken < self.limit and not self._waiting:
            self.taken += 1
            return True
        if reader not in self._waiting:
            self._waiting.append(reader)
        return False

    def give(self) -> None:
        self.taken -= 1
        while self._waiting and self.taken < self.limit:
            reader = self._waiting.popleft()
            if reader.wants_slot:
                self.taken += 1
                self.loop.call_soon(reader.resume_with_slot)
                return

    def forget(self, reader: SlotWaiter) -> None:
        if reader in self._waiting:
            self._waiting.remove(reader)


class Plane(Protocol):
    """The data plane as its connections and their readers use it."""

    session: Session
    loop: asyncio.AbstractEventLoop
    access: Access
    tls_context: ssl.SSLContext | None
    budget: MemoryBudget
    limits: ConnectionLimits
    backlog: Credit  # frames read on reader threads, not yet taken by the loop
    payload_slots: PayloadSlots
    refusing: threading.BoundedSemaphore  # refused connections lingering to send why

    def admit(self, conn: Any) -> tuple[grpc.StatusCode, str] | None:
        """Count an authenticated connection, or why it may not be served."""

    def forget(self, conn: Any) -> None:
        """The connection ended: uncount it."""

    def read_plain(self, conn: Any) -> None:
        """Hand a registered plain-TCP connection's frames to the loop that reads them."""

    def call(self, function: Any, *args: Any) -> None:
        """Run function(*args) on the loop thread, in the order called."""


class Link(Protocol):
    """A plain-TCP connection as its loop reader uses it."""

    plane: Plane
    sock: socket.socket
    stream: Stream
    outbox: ThreadOutbox
    reader_done: threading.Event
    writer_done: threading.Event
