"""TLS options of the client: server verification and, for mutual TLS, our certificate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

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
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls: give cert_file and key_file together (mutual TLS)")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"tls: {name} {path!r} does not exist")


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(root_certificates=read(tls.ca_file),
                                        private_key=read(tls.key_file),
                                        certificate_chain=read(tls.cert_file))
