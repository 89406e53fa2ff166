"""Bind the gRPC server to exactly the address --listen names.

gRPC takes "0.0.0.0:P" for "every address" and binds the dual-stack [::]:P,
which accepts IPv6 connections too: wider than asked. So, for 0.0.0.0, the
daemon first holds [::]:P itself with a socket that is IPv6-only, bound and
never listening (it accepts nothing); gRPC's dual-stack bind then fails and
it falls back to 0.0.0.0:P alone, as it does on hosts without IPv6. The
guard is held for as long as the server serves. Every other address is
bound as given ("[::]:P" stays the dual-stack wildcard it names).
"""

from __future__ import annotations

import socket

import grpc

__all__ = ["add_port"]

_ATTEMPTS = 5  # for port 0: the port free on [::] may be taken on 0.0.0.0


def add_port(server: grpc.aio.Server, address: str,
             credentials: grpc.ServerCredentials | None = None,
             ) -> tuple[int, socket.socket | None]:
    """Add `address` to `server`; the bound port and the guard socket to keep
    open while serving (None when none is needed). RuntimeError if it cannot bind."""
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    for _ in range(_ATTEMPTS):
        guard = _ipv6_guard(port) if host == "0.0.0.0" else None
        wanted = f"{host}:{guard.getsockname()[1]}" if guard is not None else address
        try:
            bound = (server.add_secure_port(wanted, credentials) if credentials is not None
                     else server.add_insecure_port(wanted))
        except RuntimeError:
            bound = 0
        if bound:
            return bound, guard
        if guard is not None:
            guard.close()
        if port or guard is None:
            break  # a fixed port that is taken: say so
    raise RuntimeError(f"cannot listen on {address}")


def _ipv6_guard(port: int) -> socket.socket | None:
    """[::]:port held IPv6-only (port 0: a free one), or None without IPv6."""
    if not socket.has_ipv6:
        return None
    guard = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        guard.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        guard.bind(("::", port))
    except OSError:  # IPv6 is off here, or [::]:port is someone else's: nothing to guard
        guard.close()
        return None
    return guard
