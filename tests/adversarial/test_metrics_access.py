"""Probe: the metrics endpoint (issue 16, row 9).

Before: /metrics answered anyone, in plaintext even under TLS, with job names
in its labels. Bounds now: --metrics-auth-file makes it ask for HTTP basic
auth (401 without, or with a wrong password); under --tls-cert it is HTTPS
with the daemon's certificate, and with --tls-client-ca it wants a client
certificate, as gRPC and the data plane do. What it reveals is listed in the
README ("What the metrics reveal").
"""

import base64
import re
import ssl
import time
import urllib.error
import urllib.request

import pytest
from probes import assert_alive, good_job, limited_daemon

_URL_RE = re.compile(r"metrics on (https?)://(\S+)/metrics")


def _url(daemon) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        match = _URL_RE.search(daemon.log())
        if match:
            return f"{match.group(1)}://{match.group(2)}/metrics"
        time.sleep(0.05)
    raise AssertionError(f"no metrics address in the log:\n{daemon.log()}")


def _get(url, auth=None, context=None):
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization",
                           "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(request, timeout=5, context=context) as response:
        return response.status, response.read().decode()


def test_metrics_want_basic_auth(tmp_path):
    auth_file = tmp_path / "metrics-auth"
    auth_file.write_text("prometheus:s3cret\n")
    daemon = limited_daemon("--metrics-listen", "127.0.0.1:0", "--metrics-auth-file",
                            str(auth_file), log_dir=tmp_path)
    try:
        url = _url(daemon)
        good_job([daemon.address], job="secret-job-name")
        for auth in (None, "prometheus:wrong", "other:s3cret", "prometheus:s3cret2"):
            with pytest.raises(urllib.error.HTTPError) as info:
                _get(url, auth)
            assert info.value.code == 401
            assert "secret-job-name" not in info.value.read().decode()
        status, body = _get(url, "prometheus:s3cret")
        assert status == 200 and 'reducer_job="secret-job-name"' in body
        assert_alive(daemon)
    finally:
        daemon.stop()


def test_a_bad_metrics_auth_file_stops_the_daemon_with_its_name(tmp_path):
    import subprocess
    import sys

    auth_file = tmp_path / "metrics-auth"
    auth_file.write_text("no colon here\n")
    run = subprocess.run([sys.executable, "-m", "reducerd", "--listen", "127.0.0.1:0",
                          "--metrics-listen", "127.0.0.1:0", "--metrics-auth-file",
                          str(auth_file)], capture_output=True, text=True, timeout=30)
    assert run.returncode != 0 and "USER:PASSWORD" in run.stderr


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_metrics_are_https_under_tls(tmp_path, mutual):
    pytest.importorskip("cryptography")
    from pki import make_pki

    pki = make_pki(tmp_path)
    key, cert = pki["server"]
    extra = ("--tls-client-ca", pki["ca"]) if mutual else ()
    daemon = limited_daemon("--tls-cert", cert, "--tls-key", key, *extra,
                            "--metrics-listen", "127.0.0.1:0", log_dir=tmp_path)
    try:
        url = _url(daemon)
        assert url.startswith("https://")
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _get(url.replace("https://", "http://"))  # plaintext gets nothing
        trusted = ssl.create_default_context(cafile=pki["ca"])
        if mutual:
            with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
                _get(url, context=trusted)  # no client certificate
            trusted.load_cert_chain(pki["client"][1], pki["client"][0])
        status, body = _get(url, context=trusted)
        assert status == 200 and "reducerd_build_info" in body
        assert_alive(daemon)
    finally:
        daemon.stop()
