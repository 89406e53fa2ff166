"""The daemon's file descriptors: raise the soft limit, size the connection caps below it.

Every connection holds a descriptor. Under `ulimit -n 1024` (a common
default) the planes' fixed caps (4,096 data connections, 8,192 gRPC ones)
were far beyond what the process had: one tenant's 1,100 data connections
took every descriptor, accept() failed with EMFILE for gRPC and the data
plane alike, and every other job timed out. So at start the daemon raises
its soft RLIMIT_NOFILE toward the hard limit (as far as the full caps need,
no further), then splits what it has:

- RESERVE_DESCRIPTORS for what is not a client's connection: at rest a
  daemon holds 15-16 (stdio, the two listeners and the bind guard, the event
  loop's epoll and self-pipe, gRPC's own epoll and eventfds, the summing
  threads' wake-up pipe); beside them come the metrics endpoint's
  connections (MAX_REQUESTS at once), the token and --config files read on
  SIGHUP, the gRPC guard's /proc reads, and gRPC's connections past its cap
  (each accepted, then closed);
- the data plane's sockets beyond its cap: the connections in their
  handshake (MAX_HANDSHAKING) and refused ones still sending their status
  (REFUSING_AT_MOST; beyond, a refusal is sent and the socket closed at once);
- of the rest, a third to data connections and two thirds to gRPC, as the
  full caps (4,096 : 8,192): gRPC keeps half of its cap for connections that
  passed the token check (reducerd.daemon.grpc_peers).

A connection past a cap is refused: a data connection with RESOURCE_EXHAUSTED
naming the cap and the descriptor limit (clients then use gRPC for a while),
a gRPC connection closed by gRPC at once (UNAVAILABLE in the client).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RESERVE_DESCRIPTORS", "REFUSING_AT_MOST", "MIN_DESCRIPTORS", "DescriptorPlan",
           "DescriptorError", "plan_descriptors"]

RESERVE_DESCRIPTORS = 64
REFUSING_AT_MOST = 32
# Below this the caps would leave a handful of workers: refuse to start instead.
MIN_DESCRIPTORS = 256
_GRPC_PARTS, _PARTS = 2, 3  # gRPC's share of what is left for the two caps


class DescriptorError(ValueError):
    """Too few descriptors to serve (the message names the limit and the fix)."""


@dataclass(frozen=True)
class DescriptorPlan:
    """The descriptor limit the daemon runs under and the caps sized from it."""

    soft: int  # RLIMIT_NOFILE's soft limit, after raising
    hard: int  # its hard limit (-1: unlimited)
    raised_from: int | None  # the soft limit before, if it was raised
    data_connections: int
    grpc_connections: int
    handshaking: int  # data connections in their handshake, beside data_connections
    data_ceiling: int  # the full caps, where the limit allows them
    grpc_ceiling: int

    @property
    def sized_down(self) -> bool:
        """Whether a cap is below the full one (the descriptor limit decided it)."""
        return (self.data_connections < self.data_ceiling
                or self.grpc_connections < self.grpc_ceiling)

    def describe(self) -> str:
        """The log line: the limit, where it came from, and the caps."""
        hard = "unlimited" if self.hard < 0 else str(self.hard)
        raised = f" (raised from {self.raised_from})" if self.raised_from is not None else ""
        return (f"descriptors: RLIMIT_NOFILE {self.soft}{raised}, hard {hard}: up to "
                f"{self.data_connections} data connections (+{self.handshaking} in their "
                f"handshake, +{REFUSING_AT_MOST} being refused), {self.grpc_connections} gRPC "
                f"connections, {RESERVE_DESCRIPTORS} kept for files, logs and gRPC's own"
                + (" (sized down from the descriptor limit: raise it with ulimit -n or "
                   "LimitNOFILE= for the full caps)" if self.sized_down else ""))

    def cap_note(self) -> str:
        """Where the data plane's cap came from, for its refusal at the cap."""
        return (f"sized below the daemon's {self.soft} file descriptors (RLIMIT_NOFILE)"
                if self.sized_down else "the daemon's cap")


def needed_descriptors(data_ceiling: int, grpc_ceiling: int, handshaking: int) -> int:
    """The soft limit that leaves both caps whole."""
    return data_ceiling + grpc_ceiling + handshaking + REFUSING_AT_MOST + RESERVE_DESCRIPTORS


def plan_descriptors(data_ceiling: int, grpc_ceiling: int, handshaking: int,
                     getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
                     setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
                     ) -> DescriptorPlan:
    """Raise the soft RLIMIT_NOFILE toward the hard one (as far as the full
    caps need) and size the caps below what it then is (module doc)."""
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    infinite = hard == resource.RLIM_INFINITY
    need = needed_descriptors(data_ceiling, grpc_ceiling, handshaking)
    raised_from = None
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if infinite else min(hard, need)
        if target > soft:
            try:
                setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                raised_from, soft = soft, target
            except (OSError, ValueError):  # e.g. above fs.nr_open: keep what we have
                pass
    have = need if soft == resource.RLIM_INFINITY else soft
    hard_shown = -1 if infinite else hard
    if have < MIN_DESCRIPTORS:
        raise DescriptorError(
            f"RLIMIT_NOFILE is {have} (hard {'unlimited' if infinite else hard}): reducerd "
            f"needs at least {MIN_DESCRIPTORS} file descriptors (raise it with ulimit -n or "
            "LimitNOFILE= in the unit)")
    left = have - RESERVE_DESCRIPTORS - handshaking - REFUSING_AT_MOST
    data = min(data_ceiling, max(1, left // _PARTS))
    grpc_connections = min(grpc_ceiling, max(1, left - data))
    return DescriptorPlan(soft=have, hard=hard_shown, raised_from=raised_from,
                          data_connections=data, grpc_connections=grpc_connections,
                          handshaking=handshaking, data_ceiling=data_ceiling,
                          grpc_ceiling=grpc_ceiling)
