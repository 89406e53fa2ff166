"""systemd's notify protocol (sd_notify), written out: no libsystemd, no dependency.

A unit with Type=notify sets $NOTIFY_SOCKET to a Unix datagram socket; the
daemon sends newline-separated KEY=VALUE assignments to it: READY=1 once it
serves, STOPPING=1 when it starts to drain, WATCHDOG=1 at least every half of
$WATCHDOG_USEC when the unit has WatchdogSec=. A socket path starting with '@'
is in the abstract namespace (the '@' stands for a leading NUL byte).

The daemon's Config reads those variables (reducerd.ops.config, the one reader
of the environment). Without $NOTIFY_SOCKET every call does nothing, so the daemon runs the same
outside systemd. A failed send is logged, never raised: the service manager's
socket going away must not take the daemon down.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reducerd.ops.config import Config

__all__ = ["Notifier"]

log = logging.getLogger("reducerd")


class Notifier:
    """Sends state changes to the service manager; a no-op without a socket."""

    def __init__(self, socket_path: str | None = None, watchdog_s: float | None = None) -> None:
        self.socket_path = socket_path or None
        self.watchdog_s = watchdog_s if watchdog_s and watchdog_s > 0 else None

    @classmethod
    def from_config(cls, config: Config) -> Notifier:
        """The notifier of the socket and watchdog period the Config read from systemd."""
        return cls(config.notify_socket, config.watchdog_s)

    @property
    def enabled(self) -> bool:
        return self.socket_path is not None

    def notify(self, **state: object) -> bool:
        """Send KEY=VALUE lines (ready=1 -> READY=1); True if the datagram went out."""
        if self.socket_path is None:
            return False
        message = "\n".join(f"{key.upper()}={value}" for key, value in state.items())
        address = self.socket_path
        if address.startswith("@"):
            address = "\0" + address[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(address)
                sock.sendall(message.encode())
        except OSError as exc:
            log.warning("cannot notify the service manager at %s: %s", self.socket_path, exc)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify(ready=1, status=status) if status else self.notify(ready=1)

    def stopping(self, status: str = "") -> bool:
        return self.notify(stopping=1, status=status) if status else self.notify(stopping=1)

    async def watchdog_loop(self) -> None:
        """Ping WATCHDOG=1 every third of the watchdog period until cancelled.

        The pings run on the daemon's event loop, so a loop that hangs stops
        them and systemd restarts the daemon. A third, not the documented
        half, leaves room for one late tick.
        """
        if self.watchdog_s is None or not self.enabled:
            return
        while True:
            self.notify(watchdog=1)
            await asyncio.sleep(self.watchdog_s / 3)
