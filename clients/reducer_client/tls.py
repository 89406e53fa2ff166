"""TLS options of the client: server verification and, for mutual TLS, our certificate.

The credentials come from reducer_wire.tls, the helper `reducerd status` uses too.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from reducer_wire import tls as wire_tls

__all__ = ["TLSConfig", "channel_credentials"]


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
