"""Keep unauthenticated gRPC connections to a share, so workers always get in.

gRPC takes at most MAX_GRPC_CONNECTIONS connections at once and closes the
ones beyond as they come (reducerd.server). Health and reflection need no
token, so anyone who reaches the port can hold connections: a flood of idle
HTTP/2 connections (the preface and SETTINGS, no call) filled the cap and
every later connection was closed, workers with a valid token included.
gRPC Python has no per-peer limit and tells the application nothing of a
connection until it carries a call, so the guard looks at the process's own
sockets: every SCAN_PERIOD_S it lists the established connections to the
gRPC port (/proc/self/net/tcp{,6}, their inodes matched with /proc/self/fd)
and shuts down (shutdown(2) on a duplicate of gRPC's descriptor: gRPC sees
the peer go and frees the slot) those that are unauthenticated, meaning no
call on them has passed the token check (`note_authenticated`, called by the
daemon's interceptor with the call's peer):

- older than UNAUTHENTICATED_DEADLINE_S;
- beyond UNAUTHENTICATED_SHARE of the cap in all, or PEER_SHARE of it from
  one peer address, the oldest first (a worker's new connection is the
  youngest, and its first call makes it authenticated).

So the flood holds half the cap at most and the other half is always there
for workers. Authenticated connections are never shut down here; like every
other they are closed by gRPC after --grpc-idle-timeout without a call.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator

__all__ = ["UnauthenticatedGuard", "parse_peer", "SCAN_PERIOD_S"]

log = logging.getLogger("reducerd")

SCAN_PERIOD_S = 0.25
# Reading /proc/net/tcp walks the kernel's whole established-connection hash
# table (about 3.5 ms per table on a host with 262,144 buckets, whatever the
# number of sockets): every SCAN_PERIOD_S that was several per cent of a core.
# While the process holds fewer descriptors than PEER_SHARE of the cap, no
# share can be exceeded, only the deadline, so the tables are read every
# QUIET_SCAN_PERIOD_S then (a deadline is kept within that much).
QUIET_SCAN_PERIOD_S = 2.0
UNAUTHENTICATED_DEADLINE_S = 10.0
UNAUTHENTICATED_SHARE = 2  # 1/2 of the cap for connections without an authenticated call
PEER_SHARE = 4  # 1/4 of the cap for one peer address's unauthenticated connections
_ESTABLISHED = "01"
# One established connection to local port %04X in /proc/net/tcp{,6}: its
# remote address and its inode. Matched over the whole table at once (C
# speed): the table lists every socket of the network namespace, and a
# line-by-line parse of it in Python every SCAN_PERIOD_S cost a daemon on a
# busy host several per cent of its CPU.
_CONNECTION_LINE = (r"^ *\d+: [0-9A-F]+:%04X ([0-9A-F]+:[0-9A-F]+) " + _ESTABLISHED
                    + r" \S+ \S+ \S+ +\d+ +\d+ +(\d+)")

Peer = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def parse_peer(peer: str) -> Peer | None:
    """gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000") as
    (address, port), or None for another kind (unix:...)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    try:
        address = ipaddress.ip_address(host.strip("[]"))
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address, int(port)
    except ValueError:
        return None


class UnauthenticatedGuard:
    """Shuts down unauthenticated connections to `port` past their deadline or share.

    `note_authenticated` runs on the event loop's thread, `scan` on an
    executor thread; the one dict they share is only added to (loop) and
    pruned by replacement (scan), each a single atomic step under the GIL.
    """

    def __init__(self, port: int, cap: int, deadline_s: float = UNAUTHENTICATED_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.port, self.cap, self.deadline_s, self._clock = port, cap, deadline_s, clock
        self.total_share = max(1, cap // UNAUTHENTICATED_SHARE)
        self.peer_share = max(1, cap // PEER_SHARE)
        self._authenticated: dict[Peer, None] = {}
        self._first_seen: dict[int, float] = {}  # socket inode -> when a scan first saw it
        self.shut_down = 0  # connections shut down so far (for the log and tests)
        self._pattern: re.Pattern[str] | None = None
        self._next_quiet_scan = 0.0

    @property
    def available(self) -> bool:
        return os.path.exists("/proc/self/net/tcp")

    def note_authenticated(self, peer: str) -> None:
        parsed = parse_peer(peer)
        if parsed is not None:
            self._authenticated[parsed] = None

    def scan(self) -> int:
        """One pass; how many connections it shut down."""
        now = self._clock()
        if now < self._next_quiet_scan and _descriptors() < self.peer_share:
            return 0
        self._next_quiet_scan = now + QUIET_SCAN_PERIOD_S
        connections = dict(self._connections())  # inode -> peer
        if not connections:
            self._first_seen, self._authenticated = {}, {}
            return 0
        first_seen = {inode: self._first_seen.get(inode, now) for inode in connections}
        self._first_seen = first_seen
        peers = set(connections.values())
        self._authenticated = {p: None for p in list(self._authenticated) if p in peers}
        unauthenticated = sorted((first_seen[inode], inode) for inode, peer
                                 in connections.items() if peer not in self._authenticated)
        doomed: set[int] = set()
        kept_by_address: dict[object, int] = {}
        kept = 0
        # Youngest first: the newest connections are the ones that may be
        # workers about to call; the oldest beyond a share go.
        for seen_s, inode in reversed(unauthenticated):
            address = connections[inode][0]
            if (now - seen_s >= self.deadline_s or kept >= self.total_share
                    or kept_by_address.get(address, 0) >= self.peer_share):
                doomed.add(inode)
                continue
            kept += 1
            kept_by_address[address] = kept_by_address.get(address, 0) + 1
        if not doomed:
            return 0
        done = self._shut_down(doomed, connections)
        self.shut_down += done
        if done:
            log.info("gRPC: shut down %d unauthenticated connection(s) past their %g s or "
                     "their share (%d in all, %d from one address); %d unauthenticated "
                     "and %d authenticated kept", done, self.deadline_s, self.total_share,
                     self.peer_share, kept, len(connections) - len(unauthenticated))
        return done

    def _connections(self) -> Iterator[tuple[int, Peer]]:
        """(inode, peer) of the established connections to our port, any process's."""
        pattern = self._pattern
        if pattern is None:
            pattern = self._pattern = re.compile(_CONNECTION_LINE % self.port, re.M)
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            try:
                with open(table) as f:
                    text = f.read()
            except OSError:
                continue
            for remote, inode in pattern.findall(text):
                yield int(inode), _proc_address(remote)

    def _shut_down(self, inodes: set[int], connections: dict[int, Peer]) -> int:
        """shutdown(2) the connections of `inodes` that are this process's."""
        done = 0
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return 0
        for name in names:
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if not target.startswith("socket:["):
                continue
            inode = int(target[8:-1])
            if inode not in inodes:
                continue
            try:
                duplicate = os.dup(int(name))
            except OSError:
                continue
            sock = socket.socket(fileno=duplicate)
            try:
                # The descriptor may have been closed and reused since it was
                # listed: shut down only the very socket the scan saw.
                if os.fstat(duplicate).st_ino == inode and sock.getsockname()[1] == self.port:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
            except OSError:
                pass
            finally:
                sock.close()  # the duplicate alone; gRPC closes its own
        return done


def _descriptors() -> int:
    """How many descriptors this process holds (cheap: no socket tables read)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _proc_address(field: str) -> Peer:
    """/proc/net/tcp's "0100007F:D431" (host byte order words) as (address, port)."""
    host, _, port = field.partition(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":  # each 32-bit word is in the host's order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(port, 16)
