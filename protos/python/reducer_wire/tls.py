"""TLS from PEM files for both sides: gRPC credentials, and TLS on the data plane.

    credentials = channel_credentials(ca_file="ca.pem")                  # verify the daemon
    credentials = channel_credentials("ca.pem", "me.pem", "me.key")      # mutual TLS
    context = client_context("ca.pem", "me.pem", "me.key")               # data plane, client
    context = server_context("server.pem", "server.key", "clients-ca.pem")   # daemon
    channel = TlsChannel(sock, context, server_side=False, server_hostname=host)

The files are checked first (a client certificate needs its key, every file
must exist), with a ValueError naming the option, not a TLS handshake that
fails later with a vague message.

TlsChannel: the data plane reads a connection on one thread and writes it on
another, which one ssl.SSLSocket does not allow (one OpenSSL object must not
be used by two threads at once, and in TLS 1.3 a read may have to write). So
the TLS state is an ssl.SSLObject over memory buffers, used under a lock for
short CPU-only steps, while the socket calls happen outside it (a second lock
keeps the encrypted records in order on the socket). It offers what the
framing code uses of a socket: recv_into and sendall.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from pathlib import Path

import grpc

__all__ = ["check_tls_files", "channel_credentials", "read_pem", "client_context",
           "server_context", "TlsChannel", "diagnose_handshake", "TLS_REFUSAL"]

# Starts every message of a TLS refusal (a client's errors say so; not worth a retry).
TLS_REFUSAL = "TLS handshake failed"

# Encrypted bytes taken from the socket per call, and plaintext per TLS write.
_RAW_RECV_BYTES = 256 << 10
_WRITE_PIECE_BYTES = 256 << 10


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


def client_context(ca_file: str | None = None, cert_file: str | None = None,
                   key_file: str | None = None, option: str = "tls") -> ssl.SSLContext:
    """An ssl context that verifies the daemon against `ca_file` (None: the
    system's roots) and, for mutual TLS, presents `cert_file` with `key_file`."""
    check_tls_files(ca_file, cert_file, key_file, option)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


def server_context(cert_file: str, key_file: str, client_ca_file: str | None = None,
                   ) -> ssl.SSLContext:
    """The daemon's ssl context; with `client_ca_file`, clients must present a
    certificate it signed (mutual TLS), as on gRPC."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.load_verify_locations(cafile=client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def diagnose_handshake(address: str, ca_file: str | None = None, cert_file: str | None = None,
                       key_file: str | None = None, server_name: str | None = None,
                       timeout_s: float = 2.0) -> str | None:
    """Why a TLS connection to the gRPC daemon at HOST:PORT fails, in words
    (what to fix), or None when it does not fail for a TLS reason.

    gRPC reports a refused client certificate as "Socket closed"; this one
    handshake, made the way gRPC makes it (ALPN h2), tells the cases apart:
    the daemon's certificate not trusted, the daemon closing right after the
    handshake (it wants a client certificate signed by its client CA), or the
    daemon answering (not TLS, then).
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        context = client_context(ca_file, cert_file, key_file)
        context.set_alpn_protocols(["h2"])
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return None  # unreachable or unreadable files: not the handshake's doing
    with sock:
        try:
            with context.wrap_socket(sock, server_hostname=server_name or host) as tls:
                tls.settimeout(timeout_s)
                answer = tls.recv(1)  # an HTTP/2 server speaks first (SETTINGS)
        except ssl.SSLCertVerificationError as exc:
            return (f"the daemon's certificate is not trusted ({exc.verify_message}): "
                    f"is {ca_file or 'the system CA bundle'} the CA that signed it, and does "
                    f"it name {server_name or host}?")
        except ssl.SSLError as exc:
            return _refused_certificate(cert_file, exc.reason or str(exc))
        except OSError:
            return None
    if answer:
        return None
    return _refused_certificate(cert_file, "it closed the connection after the handshake")


def _refused_certificate(cert_file: str | None, detail: str) -> str:
    if cert_file is None:
        return (f"the daemon wants a client certificate (mutual TLS) and this client gave "
                f"none ({detail}): give cert_file and key_file signed by its client CA")
    return (f"the daemon refused this client's certificate {cert_file} ({detail}): it "
            f"must be signed by the daemon's client CA (--tls-client-ca)")


class TlsChannel:
    """TLS over a blocking socket, for one reading and one writing thread at once."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self.sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=server_hostname)
        # _lock guards _tls and both BIOs (the reader and the writer thread take
        # it for CPU-only steps); _send_lock keeps the records in order on the
        # socket: it is held from taking bytes out of _outgoing until they are sent.
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()

    def handshake(self, deadline_s: float | None = None) -> None:
        """Run the TLS handshake: ssl.SSLError if it fails, TimeoutError if it is
        not done by `deadline_s` (time.monotonic(); the socket needs a receive
        tick then, see reducer_wire.framing.set_receive_tick)."""
        while True:
            with self._lock:
                try:
                    self._tls.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
            self._flush()
            if done:
                return
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise TimeoutError("TLS handshake not finished by its deadline")
            if not self._pull(deadline_s):
                raise ConnectionResetError("the peer closed the connection during the "
                                           "TLS handshake")

    @property
    def peer_certificate(self) -> dict | None:
        return self._tls.getpeercert()

    def recv_into(self, view: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        """Up to `nbytes` (default len(view)) plaintext bytes into `view`; 0 at
        the end of the stream. BlockingIOError when the socket's receive tick
        passes with nothing (as a plain socket's recv_into)."""
        wanted = nbytes or len(view)
        while True:
            got, ended = 0, False
            with self._lock:
                # As many records as are in: one read() returns one record at most.
                while got < wanted:
                    try:
                        # With a buffer, read() returns a count (typeshed says bytes).
                        n: int = self._tls.read(wanted - got, view[got:])  # type: ignore
                    except ssl.SSLWantReadError:
                        break
                    except ssl.SSLZeroReturnError:  # the peer's close_notify
                        ended = True
                        break
                    if not n:
                        break
                    got += n
                pending = self._outgoing.pending
            if pending:  # e.g. a TLS 1.3 key update to answer
                self._flush()
            if got or ended:
                return got
            if not self._pull(None):
                return 0

    def sendall(self, data: bytes | memoryview, flags: int = 0) -> None:
        view = memoryview(data).cast("B")
        with self._send_lock:
            for start in range(0, len(view), _WRITE_PIECE_BYTES):
                with self._lock:
                    self._tls.write(view[start:start + _WRITE_PIECE_BYTES])
                    records = self._outgoing.read()
                self.sock.sendall(records)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()

    def _flush(self) -> None:
        with self._send_lock:
            with self._lock:
                records = self._outgoing.read()
            if records:
                self.sock.sendall(records)

    def _pull(self, deadline_s: float | None) -> bool:
        """Move encrypted bytes from the socket into the TLS state; False at EOF."""
        while True:
            try:
                raw = self.sock.recv(_RAW_RECV_BYTES)
                break
            except BlockingIOError:  # the receive tick
                if deadline_s is None:
                    raise
                if time.monotonic() >= deadline_s:
                    raise TimeoutError("TLS handshake not finished by its deadline") from None
        if not raw:
            return False
        with self._lock:
            self._incoming.write(raw)
        return True
