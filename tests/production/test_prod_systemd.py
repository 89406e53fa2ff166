"""The systemd units and the daemon's side of Type=notify.

Scenarios: both units pass `systemd-analyze verify` and stay under an exposure
of 2.0; the daemon, started with the unit's own ExecStart arguments, a token
credential and NOTIFY_SOCKET on a datagram socket that the test holds, sends
READY=1 only once health checks answer SERVING, pings WATCHDOG=1 when
WATCHDOG_USEC is set, and sends STOPPING=1 on SIGTERM before exiting 0.
"""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import grpc
import pytest
from conftest import DEPLOY, ROOT, UNIT_BINARY, exec_start_args
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc

from reducerd.config import add_arguments, config_from_args
from reducerd.notify import Notifier

SYSTEMD = DEPLOY / "systemd"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (Debian: apt-get install "
                                    "systemd)")


def units_for_analysis(tmp_path):
    """Copies of the units that systemd-analyze can load here.

    verify insists that ExecStart's binary exists, so it points at this
    environment's reducerd; the template is checked as instance 3.
    """
    binary = shutil.which("reducerd", path=os.path.dirname(sys.executable)) or sys.executable
    out = {}
    for name, as_name in (("reducerd.service", "reducerd.service"),
                          ("reducerd@.service", "reducerd@3.service"),
                          ("reducerd.target", "reducerd.target")):
        path = tmp_path / as_name
        path.write_text((SYSTEMD / name).read_text().replace(UNIT_BINARY, binary))
        out[name] = path
    return out


@needs_systemd_analyze
def test_units_pass_systemd_analyze_verify(tmp_path):
    units = units_for_analysis(tmp_path)
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, units.values())],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    # verify exits 0 on unknown keys and bad values too: any message is a failure.
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), (
        result.stdout + result.stderr)


@needs_systemd_analyze
@pytest.mark.parametrize("name", ["reducerd.service", "reducerd@.service"])
def test_unit_exposure_is_under_2(tmp_path, name):
    unit = units_for_analysis(tmp_path)[name]
    result = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=true", str(unit)],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) < 2.0, result.stdout


def test_template_maps_instance_to_port_offset_and_cpu():
    args = exec_start_args(SYSTEMD / "reducerd@.service")
    assert args[args.index("--port-offset") + 1] == "%i"
    assert "CPUAffinity=%i" in (SYSTEMD / "reducerd@.service").read_text()
    assert "--port-offset" not in exec_start_args(SYSTEMD / "reducerd.service")


@pytest.mark.parametrize("abstract", [False, True])
def test_notifier_sends_datagrams_to_path_and_abstract_sockets(abstract):
    # A short directory: socket paths are limited to 107 bytes.
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, \
            tempfile.TemporaryDirectory(prefix="rd-") as short_dir:
        name = f"reducerd-test-{uuid.uuid4().hex}"
        path = os.path.join(short_dir, name)
        sock.bind("\0" + name if abstract else path)
        sock.settimeout(5)
        notifier = Notifier.from_config(_config(
            {"NOTIFY_SOCKET": "@" + name if abstract else path,
             "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}))
        assert notifier.watchdog_s == 3.0
        assert notifier.ready("serving")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notifier_without_socket_is_a_no_op():
    notifier = Notifier.from_config(_config({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}))
    assert not notifier.enabled and notifier.watchdog_s is None
    assert not notifier.ready()


def test_the_config_reads_systemds_variables_and_nothing_else_does():
    """Config is the daemon's one reader of the environment: the watchdog is
    ours only when $WATCHDOG_PID is unset or our pid."""
    assert _config({"WATCHDOG_USEC": "2000000"}).watchdog_s == 2.0
    assert _config({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert _config({"WATCHDOG_USEC": "soon"}).watchdog_s is None
    assert _config({"NOTIFY_SOCKET": "/run/x"}).notify_socket == "/run/x"
    # local.py starts daemons (it passes an environment on); logs.py reads
    # $JOURNAL_STREAM because config errors are logged before a Config exists.
    readers = [p.name for p in sorted((ROOT / "reducerd").glob("*.py"))
               if re.search(r"os\.environ|getenv", p.read_text())]
    assert set(readers) <= {"config.py", "local.py", "logs.py"}, readers


def _config(environ):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args([]), environ=environ)


def test_notifier_survives_a_missing_socket(tmp_path):
    assert not Notifier(str(tmp_path / "gone")).stopping()


def _unit_command(tmp_path):
    """The unit's ExecStart with this test's config in place of /etc/reducerd/reducerd.toml."""
    config = tmp_path / "reducerd.toml"
    text = (DEPLOY / "reducerd.toml.example").read_text()
    text = re.sub(r'(?m)^listen = .*$', 'listen = "127.0.0.1:0"', text)
    text = re.sub(r'(?m)^metrics_listen = .*$', 'metrics_listen = "127.0.0.1:0"', text)
    config.write_text(text)
    args = exec_start_args(SYSTEMD / "reducerd.service")
    args[args.index("--config") + 1] = str(config)
    return [sys.executable, "-m", "reducerd", *args]


def _recv_until(sock, wanted: bytes, deadline_s: float, seen: list) -> bytes:
    while time.monotonic() < deadline_s:
        sock.settimeout(max(0.01, deadline_s - time.monotonic()))
        try:
            message = sock.recv(4096)
        except TimeoutError:
            break
        seen.append(message)
        if wanted in message.split(b"\n"):
            return message
    raise AssertionError(f"no {wanted!r} from the daemon; got {seen}")


def test_daemon_started_as_the_unit_does_notifies_ready_watchdog_stopping(tmp_path):
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "token").write_text("s3cret\n")
    name = f"reducerd-test-{uuid.uuid4().hex}"
    log_path = tmp_path / "reducerd.log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, \
            open(log_path, "w") as log_file:
        sock.bind("\0" + name)
        env = {**os.environ, "NOTIFY_SOCKET": "@" + name, "CREDENTIALS_DIRECTORY":
               str(credentials), "WATCHDOG_USEC": "300000"}
        process = subprocess.Popen(_unit_command(tmp_path), stdout=log_file,
                                   stderr=subprocess.STDOUT, env=env)
        try:
            seen: list[bytes] = []
            _recv_until(sock, b"READY=1", time.monotonic() + 30, seen)
            assert len(seen) == 1, f"datagrams before READY=1: {seen[:-1]}"
            # READY=1 is out: the port must answer health checks right now.
            port = re.search(r"listening on \S+:(\d+)", log_path.read_text()).group(1)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                stub = pb_grpc.ReducerStub(channel)
                with pytest.raises(grpc.RpcError) as denied:
                    stub.GetStatus(pb.StatusRequest(), timeout=2)
                assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stub.GetStatus(pb.StatusRequest(), timeout=2,
                               metadata=(("authorization", "Bearer s3cret"),))
            for _ in range(2):  # every 0.1 s with WATCHDOG_USEC=300000
                _recv_until(sock, b"WATCHDOG=1", time.monotonic() + 2, seen)
            process.send_signal(signal.SIGTERM)
            _recv_until(sock, b"STOPPING=1", time.monotonic() + 10, seen)
            assert process.wait(timeout=20) == 0, log_path.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
