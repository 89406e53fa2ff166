"""Access control with real daemons: TLS, mutual TLS and tokens.

Certificates are made by the test with the cryptography package
(tests/helpers/pki.py): a CA, a server certificate for 127.0.0.1, a client
certificate signed by the CA and one signed by a stranger CA.
"""

import json
import time

import grpc
import numpy as np
import pytest
from reducer_client import ReducerClient, ReducerError
from reducer_client.tls import TLSConfig
from support import start_daemon

pytest.importorskip("cryptography")
from pki import make_pki  # noqa: E402

# Every test on each loop that reads plain-TCP frames (conftest.data_loop).
pytestmark = pytest.mark.usefixtures("data_loop")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _allreduce(address, **options):
    with ReducerClient([address], job="tls", rank=0, world_size=1, timeout=3,
                       **options) as client:
        return client.allreduce(np.arange(4, dtype=np.float32), key="k").tolist()


def test_tls_serves_clients_that_trust_the_ca(tmp_path, pki):
    key, cert = pki["server"]
    d = start_daemon("--tls-cert", cert, "--tls-key", key, log_dir=tmp_path)
    try:
        assert _allreduce(d.address, tls=TLSConfig(ca_file=pki["ca"])) == [0, 1, 2, 3]
        with pytest.raises(ReducerError) as info:  # a plaintext client is refused
            _allreduce(d.address)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ReducerError) as info:  # and so is one that distrusts the CA
            _allreduce(d.address, tls=TLSConfig(ca_file=pki["stranger"]))
        assert "certificate" in str(info.value).lower() or "ssl" in str(info.value).lower()
    finally:
        d.stop()


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(tmp_path, pki):
    key, cert = pki["server"]
    d = start_daemon("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"],
                     log_dir=tmp_path)
    try:
        client_key, client_cert = pki["client"]
        good = TLSConfig(ca_file=pki["ca"], cert_file=client_cert, key_file=client_key)
        assert _allreduce(d.address, tls=good) == [0, 1, 2, 3]
        impostor_key, impostor_cert = pki["impostor"]
        for tls in (TLSConfig(ca_file=pki["ca"]),
                    TLSConfig(ca_file=pki["ca"], cert_file=impostor_cert,
                              key_file=impostor_key)):
            with pytest.raises(ReducerError) as info:
                _allreduce(d.address, tls=tls)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert d.address in str(info.value)
    finally:
        d.stop()


def test_tls_settings_from_env(pki):
    from reducer_client.env import settings_from_env

    key, cert = pki["client"]
    settings = settings_from_env({"REDUCER_ADDRESSES": "h:1", "REDUCER_RANK": "0",
                                  "REDUCER_WORLD_SIZE": "1", "REDUCER_TLS_CA": pki["ca"],
                                  "REDUCER_TLS_CERT": cert, "REDUCER_TLS_KEY": key})
    assert settings["tls"] == TLSConfig(ca_file=pki["ca"], cert_file=cert, key_file=key)


def test_status_over_tls_and_mutual_tls_uses_the_shared_helper(tmp_path, pki, capsys):
    """`reducerd status` builds its channel with reducer_wire.tls, as the client
    does: it reads a TLS daemon, presents a client certificate under mutual
    TLS, and refuses a certificate without its key before connecting."""
    from reducerd.daemon import status

    key, cert = pki["server"]
    client_key, client_cert = pki["client"]
    d = start_daemon("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"],
                     log_dir=tmp_path)
    try:
        base = ["--address", d.address, "--json", "--sample", "0", "--timeout", "5"]
        assert status.main([*base, "--tls-ca", pki["ca"], "--tls-cert", client_cert,
                            "--tls-key", client_key]) == 0
        assert json.loads(capsys.readouterr().out)["address"] == d.address
        assert status.main([*base, "--tls-ca", pki["ca"]]) == 1  # no client certificate
        assert "UNAVAILABLE" in capsys.readouterr().err
        assert status.main([*base, "--tls-ca", pki["ca"], "--tls-cert", client_cert]) == 2
        err = capsys.readouterr().err
        assert "--tls-cert" in err and "together" in err
    finally:
        d.stop()
    with pytest.raises(ValueError, match="together"):
        TLSConfig(ca_file=pki["ca"], cert_file=client_cert)
    with pytest.raises(ValueError, match="does not exist"):
        TLSConfig(ca_file=str(tmp_path / "missing.pem"))


def test_job_token_command_prints_the_hmac_of_the_job_under_the_daemon_token(tmp_path):
    """`reducerd token`: rj1.<job, base64url>.<HMAC-SHA256(daemon token, job), hex>."""
    import base64
    import hashlib
    import hmac
    import subprocess
    import sys

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    run = subprocess.run([sys.executable, "-m", "reducerd", "token", "--job", "job/é 1",
                          "--auth-token-file", str(token_file)], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    mac = hmac.new(b"s3cret", "job/é 1".encode(), hashlib.sha256).hexdigest()
    name = base64.urlsafe_b64encode("job/é 1".encode()).rstrip(b"=").decode()
    assert run.stdout == f"rj1.{name}.{mac}\n"
    missing = subprocess.run([sys.executable, "-m", "reducerd", "token", "--job", "j",
                              "--auth-token-file", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "--auth-token-file" in missing.stderr


@pytest.mark.parametrize("data_plane", ["tcp", "grpc"])
def test_clients_and_status_take_a_job_token_like_any_token(tmp_path, capsys, data_plane):
    from reducerd.daemon import status
    from reducerd.service.access import job_token

    token_file = tmp_path / "token"
    token_file.write_text("daemon-token")
    d = start_daemon("--auth-token-file", str(token_file), log_dir=tmp_path)
    try:
        mine = job_token("daemon-token", "tls")
        with ReducerClient([d.address], job="tls", rank=0, world_size=1, timeout=5,
                           token=mine, data_plane=data_plane) as client:
            assert client.allreduce(np.arange(4, dtype=np.float32), key="k").tolist() == [
                0, 1, 2, 3]
            assert client.transports == [data_plane]
        with ReducerClient([d.address], job="other", rank=0, world_size=1, timeout=5,
                           token=mine, data_plane=data_plane) as client:
            with pytest.raises(ReducerError) as info:
                client.allreduce(np.arange(4, dtype=np.float32), key="k")
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "'other'" in str(info.value) and not info.value.retryable
        base = ["--address", d.address, "--json", "--sample", "0", "--token", mine]
        assert status.main(base) == 0  # its own job, without --job
        assert [j["job"] for j in json.loads(capsys.readouterr().out)["jobs"]] == ["tls"]
        assert status.main([*base, "--job", "other"]) == 1
        assert "PERMISSION_DENIED" in capsys.readouterr().err
    finally:
        d.stop()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_the_data_plane_is_offered_over_tls_and_tls_clients_use_it(tmp_path, pki, mutual):
    """Under --tls-cert the data plane is served over TLS (mutual TLS with
    --tls-client-ca, as gRPC): a TLS client keeps the fast path, sums exact."""
    key, cert = pki["server"]
    extra = ("--tls-client-ca", pki["ca"]) if mutual else ()
    d = start_daemon("--tls-cert", cert, "--tls-key", key, *extra, log_dir=tmp_path)
    try:
        client_key, client_cert = pki["client"]
        tls = (TLSConfig(ca_file=pki["ca"], cert_file=client_cert, key_file=client_key)
               if mutual else TLSConfig(ca_file=pki["ca"]))
        values = np.arange(3 << 20, dtype=np.float32) % 251  # 12 MiB: many TLS records
        for data_plane in ("tcp", "auto"):
            with ReducerClient([d.address], job="tls", rank=0, world_size=1, timeout=10,
                               tls=tls, data_plane=data_plane) as client:
                np.testing.assert_array_equal(client.allreduce(values, key="k"), values)
                assert client.transports == ["tcp"]
        if mutual:  # no client certificate: refused on the data plane as on gRPC
            with pytest.raises(ReducerError):
                _allreduce(d.address, tls=TLSConfig(ca_file=pki["ca"]), data_plane="tcp")
    finally:
        d.stop()


@pytest.mark.parametrize("case", ["wrong-ca", "no-client-cert", "stranger-client-cert"])
def test_a_certificate_refusal_is_named_within_two_seconds(tmp_path, pki, case):
    """Not UNAVAILABLE after the whole client timeout (20 s here), and not
    "Socket closed": the client names the TLS reason at its first contact,
    and does not retry what would fail the same way."""
    key, cert = pki["server"]
    d = start_daemon("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"],
                     log_dir=tmp_path)
    client_key, client_cert = pki["client"]
    stranger_key, stranger_cert = pki["impostor"]
    tls, expected = {
        "wrong-ca": (TLSConfig(ca_file=pki["stranger"], cert_file=client_cert,
                               key_file=client_key), "certificate is not trusted"),
        "no-client-cert": (TLSConfig(ca_file=pki["ca"]), "wants a client certificate"),
        "stranger-client-cert": (TLSConfig(ca_file=pki["ca"], cert_file=stranger_cert,
                                           key_file=stranger_key),
                                 "refused this client's certificate"),
    }[case]
    try:
        for data_plane in ("auto", "tcp", "grpc"):
            start = time.monotonic()
            with pytest.raises(ReducerError) as info:
                with ReducerClient([d.address], job="tls", rank=0, world_size=1, timeout=20,
                                   tls=tls, data_plane=data_plane) as client:
                    client.allreduce(np.arange(4, dtype=np.float32), key="k")
            assert time.monotonic() - start < 2.0, (data_plane, str(info.value))
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and not info.value.retryable
            assert "TLS handshake failed" in str(info.value), str(info.value)
            assert expected in str(info.value) and d.address in str(info.value)
    finally:
        d.stop()


def test_status_names_a_missing_client_certificate(tmp_path, pki, capsys):
    from reducerd.daemon import status

    key, cert = pki["server"]
    d = start_daemon("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"],
                     log_dir=tmp_path)
    try:
        start = time.monotonic()
        assert status.main(["--address", d.address, "--json", "--sample", "0",
                            "--tls-ca", pki["ca"]]) == 1
        assert time.monotonic() - start < 3
        err = capsys.readouterr().err
        assert "TLS handshake failed" in err and "wants a client certificate" in err
    finally:
        d.stop()
