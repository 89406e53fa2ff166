"""The systemd units and the daemon's side of Type=notify.

Scenarios: both units pass `systemd-analyze verify` and stay under an exposure
of 2.0; the daemon, started with the unit's own ExecStart arguments, a token
credential and NOTIFY_SOCKET on a datagram socket that the test holds, sends
READY=1 only once health checks answer SERVING, pings WATCHDOG=1 when
WATCHDOG_USEC is set, and sends STOPPING=1 on SIGTERM before exiting 0. The
template belongs to reducerd.target and asserts its CPU; the daemon's lines
carry sd-daemon priority prefixes exactly when stderr is $JOURNAL_STREAM.
"""

import argparse
import logging
import os
import re
import shlex
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

from reducerd.ops.config import add_arguments, config_from_args
from reducerd.ops.logs import JournalFormatter, stderr_is_journal, syslog_priority
from reducerd.ops.notify import Notifier

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


def unit_settings(path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_the_template_belongs_to_the_target_and_refuses_a_missing_cpu():
    """The tier under a booted systemd shows what these lines do (tests/deploy)."""
    template = unit_settings(SYSTEMD / "reducerd@.service")
    assert template["PartOf"] == ["reducerd.target"]
    # Stop order is start order reversed: the target's stop waits for the instances.
    assert "reducerd.target" in template["After"]
    assert template["WantedBy"] == ["reducerd.target"]
    assert template["AssertCPUs"] == [">%i"]
    assert template["RestartPreventExitStatus"] == ["2 215"]
    for unit in ("reducerd.service", "reducerd@.service"):
        assert unit_settings(SYSTEMD / unit)["ReadOnlyPaths"] == ["/etc/reducerd"], unit
    assert unit_settings(SYSTEMD / "reducerd.target")["WantedBy"] == ["multi-user.target"]


def _journal_stream(path) -> dict[str, str]:
    stat = os.stat(path)
    return {"JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"}


def test_log_lines_carry_their_priority_only_when_stderr_is_the_journal(tmp_path):
    stream_path = tmp_path / "stderr"
    with open(stream_path, "w") as stream, open(tmp_path / "other", "w") as other:
        assert stderr_is_journal(_journal_stream(stream_path), stream)
        assert not stderr_is_journal(_journal_stream(stream_path), other)  # inherited only
        assert not stderr_is_journal({}, stream)
        assert not stderr_is_journal({"JOURNAL_STREAM": "x:y"}, stream)
    assert [syslog_priority(level) for level in (logging.CRITICAL, logging.ERROR,
            logging.WARNING, logging.INFO, logging.DEBUG)] == [2, 3, 4, 6, 7]
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("reducerd", logging.ERROR, __file__, 1, "failed %s",
                                   ("x",), sys.exc_info())
    lines = JournalFormatter().format(record).split("\n")
    assert lines[0] == "<3>ERROR reducerd: failed x"
    assert len(lines) > 2 and all(line.startswith("<3>") for line in lines), lines


def test_the_daemon_writes_journal_prefixes_under_systemd(tmp_path):
    """As the unit runs it: a config error at priority 3, a bad flag too, and
    the serving daemon's lines at 6, without a timestamp of their own."""
    bad = tmp_path / "bad.toml"
    bad.write_text('listen = "127.0.0.1:0"\nround-timout = 5\n')
    stderr_path = tmp_path / "stderr"
    for args, wanted in ((["--config", str(bad)], "<3>reducerd: config: unknown key"),
                         (["--no-such-flag"], "<3>reducerd: error: unrecognized")):
        with open(stderr_path, "w") as stderr:
            code = subprocess.run([sys.executable, "-m", "reducerd", *args], stderr=stderr,
                                  env={**os.environ, **_journal_stream(stderr_path)},
                                  timeout=30).returncode
        assert code == 2 and wanted in stderr_path.read_text(), stderr_path.read_text()
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "reducerd", "--listen", "127.0.0.1:0"],
                                   stderr=stderr, env={**os.environ,
                                                       **_journal_stream(stderr_path)})
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in stderr_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = stderr_path.read_text().splitlines()
    assert lines and all(re.match(r"<[3-7]>[A-Z]+ reducerd", line) for line in lines), lines
    assert any(line.startswith("<6>INFO reducerd: listening on") for line in lines), lines


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
    daemon = ROOT / "reducerd"
    readers = [p.name for p in sorted(daemon.rglob("*.py"))
               if not p.is_relative_to(daemon / "bench") and not p.is_relative_to(daemon / "plan")
               and re.search(r"os\.environ|getenv", p.read_text())]
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


def _exec_reload(unit) -> list[str]:
    return next(shlex.split(line.removeprefix("ExecReload="))
                for line in unit.read_text().splitlines() if line.startswith("ExecReload="))


def test_reload_sends_sighup_and_the_daemon_started_as_the_unit_rotates_its_token(tmp_path):
    """`systemctl reload` runs ExecReload= with $MAINPID: both units send
    SIGHUP with the shell's kill (a minimal system has no /bin/kill). Run here as systemd
    would, against the daemon started with the unit's ExecStart and a token
    credential that changed: the new token is served at once, the old one
    for token_grace, and the daemon keeps serving."""
    for unit in ("reducerd.service", "reducerd@.service"):
        assert _exec_reload(SYSTEMD / unit) == ["/bin/sh", "-c", 'kill -HUP "$MAINPID"'], unit
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "token").write_text("s3cret\n")
    log_path = tmp_path / "reducerd.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(_unit_command(tmp_path), stdout=log_file,
                                   stderr=subprocess.STDOUT,
                                   env={**os.environ, "CREDENTIALS_DIRECTORY": str(credentials)})
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in log_path.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()
            time.sleep(0.05)
        port = re.search(r"listening on \S+:(\d+)", log_path.read_text()).group(1)
        (credentials / "token").write_text("n3w-token\n")
        # As systemd runs it: $MAINPID in the environment (and expanded in the line).
        command = [arg.replace("$MAINPID", str(process.pid))
                   for arg in _exec_reload(SYSTEMD / "reducerd.service")]
        subprocess.run(command, check=True, timeout=10,
                       env={**os.environ, "MAINPID": str(process.pid)})
        deadline = time.monotonic() + 10
        while "SIGHUP: token rotated" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ReducerStub(channel)
            for token in ("n3w-token", "s3cret"):  # the old one within its grace
                stub.GetStatus(pb.StatusRequest(), timeout=5,
                               metadata=(("authorization", f"Bearer {token}"),))
        assert process.poll() is None, log_path.read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
