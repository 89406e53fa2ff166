"""TLS from PEM files for whoever connects to a daemon: the client library and `reducerd status`.

    credentials = channel_credentials(ca_file="ca.pem")                  # verify the daemon
    credentials = channel_credentials("ca.pem", "me.pem", "me.key")      # mutual TLS

The files are checked first (a client certificate needs its key, every file
must exist), with a ValueError naming the option, not a TLS handshake that
fails later with a vague message.
"""

from __future__ import annotations

from pathlib import Path

import grpc

__all__ = ["check_tls_files", "channel_credentials", "read_pem"]


def check_tls_files(ca_file: str | None = None, cert_file: str | None = None,
                    key_file: str | None = None, option: str = "tls") -> None:
    """Raise ValueError (naming `option`) unless cert and key come together and all exist."""
    if bool(cert_file) != bool(key_file):
        raise ValueError(f"{option}: give the certificate and its key together (mutual TLS)")
    for name, path in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
        if path and not Path(path).is_file():
            raise ValueError(f"{option}: {name} {path!r} does not exist")


def read_pem(path: str | None) -> bytes | None:
    """The bytes of a PEM file, or None for no file (gRPC's "not given")."""
    return Path(path).read_bytes() if path else None


def channel_credentials(ca_file: str | None = None, cert_file: str | None = None,
                        key_file: str | None = None, option: str = "tls",
                        ) -> grpc.ChannelCredentials:
    """gRPC channel credentials: trust `ca_file` (None: the system's roots) and,
    for mutual TLS, present `cert_file` with `key_file`."""
    check_tls_files(ca_file, cert_file, key_file, option)
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca_file),
                                        private_key=read_pem(key_file),
                                        certificate_chain=read_pem(cert_file))
