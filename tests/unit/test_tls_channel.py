"""reducer_wire.tls.TlsChannel: one TLS connection read and written by two threads
at once (what ssl.SSLSocket does not allow), frames intact both ways; the
handshake keeps its deadline however slowly bytes come."""

import datetime
import socket
import threading
import time

import numpy as np
import pytest
from reducer_wire.framing import read_frame, send_frame, set_receive_tick
from reducer_wire.tls import TlsChannel, client_context, server_context

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .sign(key, hashes.SHA256()))
    (d / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    (d / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(d / "c.pem"), str(d / "k.pem")


def test_two_threads_stream_frames_both_ways_at_once(certs):
    cert, key = certs
    a, b = socket.socketpair()
    server = TlsChannel(a, server_context(cert, key), server_side=True)
    client = TlsChannel(b, client_context(cert), server_side=False, server_hostname="localhost")
    handshakes = [threading.Thread(target=server.handshake), threading.Thread(
        target=client.handshake)]
    for t in handshakes:
        t.start()
    for t in handshakes:
        t.join(10)
    payloads = [np.random.default_rng(i).integers(0, 255, size=(1 << 20) + i,
                                                   dtype=np.uint8).tobytes() for i in range(8)]
    received = {"server": [], "client": []}

    def pump(channel, who):
        for p in payloads:
            send_frame(channel, 2, p)

    def drain(channel, who):
        for _ in payloads:
            kind, payload = read_frame(channel, 1 << 24)
            received[who].append(bytes(payload))

    threads = [threading.Thread(target=f, args=args) for f, args in (
        (pump, (client, "client")), (drain, (server, "server")),
        (pump, (server, "server")), (drain, (client, "client")))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert received["server"] == payloads and received["client"] == payloads
    a.close()
    b.close()


def test_the_handshake_keeps_its_deadline_against_a_trickle(certs):
    cert, key = certs
    a, b = socket.socketpair()
    server = TlsChannel(a, server_context(cert, key), server_side=True)
    set_receive_tick(a, 0.1)
    stop = threading.Event()

    def trickle():  # a record header, then a byte every 0.2 s: a per-read
        b.send(b"\x16\x03\x01\x40\x00")  # timeout of 1 s would never fire
        while not stop.is_set():
            try:
                b.send(b"\x00")
            except OSError:
                return
            time.sleep(0.2)

    threading.Thread(target=trickle, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        server.handshake(time.monotonic() + 1.0)
    assert time.monotonic() - start < 2.5
    stop.set()
    a.close()
    b.close()
