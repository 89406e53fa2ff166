"""The real transports of one daemon: its gRPC service (also the Control) and
its TCP data plane, in the order a DaemonLink tries them (link.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from reducer_wire.tls import diagnose_handshake

from reducer_client.tls import TLSConfig, ssl_context
from reducer_client.transport.base import Control, Transport
from reducer_client.transport.grpc import MAX_MESSAGE_BYTES, GrpcTransport
from reducer_client.transport.tcp import TcpTransport

__all__ = ["real_transports"]


def real_transports(address: str, metadata: Sequence[tuple[str, str]] = (),
                    credentials: grpc.ChannelCredentials | None = None,
                    extra_options: Sequence[tuple[str, Any]] = (), token: str = "",
                    data_plane: str = "auto", tls: TLSConfig | None = None,
                    ) -> tuple[Control, list[Transport]]:
    """The daemon's gRPC service (also the Control) and, unless data_plane is
    "grpc" (or gRPC has credentials but no `tls` came for the data plane), its
    TCP data plane first, over TLS with `tls`."""
    probe = (None if tls is None else
             lambda: diagnose_handshake(address, tls.ca_file, tls.cert_file, tls.key_file,
                                        tls.server_name))
    service = GrpcTransport(address, metadata, credentials, extra_options, tls_probe=probe)
    if credentials is not None and tls is None:
        return service, [service]
    tcp = TcpTransport(address.rpartition(":")[0].strip("[]"), token, MAX_MESSAGE_BYTES,
                       tls_context=ssl_context(tls) if tls is not None else None,
                       server_hostname=tls.server_name if tls is not None else None)
    chains: dict[str, list[Transport]] = {"auto": [tcp, service], "tcp": [tcp],
                                          "grpc": [service]}
    return service, chains[data_plane]
