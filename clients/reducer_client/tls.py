"""TLS options of the client: server verification and, for mutual TLS, our certificate.

The credentials (gRPC) and the ssl context (the TCP data plane) come from
reducer_wire.tls, the helper `reducerd status` and the daemon use too.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc
from reducer_wire import tls as wire_tls

__all__ = ["TLSConfig", "channel_credentials", "ssl_context"]


@dataclass(frozen=True)
class TLSConfig:
    """Files for a TLS channel; all optional.

    ca_file: PEM roots that signed the daemons' certificates (None: system roots).
    cert_file / key_file: this client's certificate and key, for mutual TLS.
    server_name: the name to check in the daemon's certificate when it differs
    from the host in the address (e.g. connecting by IP).
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        wire_tls.check_tls_files(self.ca_file, self.cert_file, self.key_file)


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    return wire_tls.channel_credentials(tls.ca_file, tls.cert_file, tls.key_file)


def ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """The same trust and certificate for the daemons' TCP data plane."""
    return wire_tls.client_context(tls.ca_file, tls.cert_file, tls.key_file)
