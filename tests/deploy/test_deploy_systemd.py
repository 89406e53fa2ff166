"""The systemd units under a booted systemd (one boot for the whole module).

Scenarios, in order, on a debootstrapped bookworm booted with systemd-nspawn,
reducerd installed into /opt/reducerd from wheels by deploy/systemd/README.md's
steps (drain_grace shortened to 4 s):
reducerd.service: `systemctl enable --now` returns only once health checks
answer SERVING (none fails after READY=1); the daemon runs as a dynamic user
with no capabilities, no new privileges, a seccomp filter, a read-only root and
a private /tmp, with LimitNOFILE as far as the manager allows and its own
session keyring, at exposure under 2.0; the credential carries the token;
`systemctl reload` sends SIGHUP and the same process serves on;
`systemctl stop` drains (a round completes during the drain, one fails at its
end, exit 0) and the drain's warning is in `journalctl -p warning`; a bad key
stops the start with status 2, once, its line at error priority; a frozen
daemon is killed by the watchdog about WatchdogSec after its last ping and
restarted. reducerd@.service and reducerd.target: enabled together, @0 and @1
listen on ports +0 and +1, pinned to CPUs 0 and 1, and reduce a job from host
workers; an instance that is not a CPU fails once (assertion, or 215 where a
cpuset hides the CPU); `systemctl stop reducerd.target` returns only once the
instances have drained and exited.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from deploy_host import ROOT, require
from deploy_machine import PROBE, Machine, text

pytestmark = pytest.mark.timeout(300)

STAGE = "/var/tmp/reducerd-install"  # the checkout and wheels, as an operator copies them
DRAIN_GRACE_S = 4.0
DYNAMIC_UIDS = range(61184, 65520)  # systemd's DynamicUser= range
# The session keyring of a process inside the machine: "keyring;UID;GID;PERM;NAME".
KEYRING_SCRIPT = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
SYS_keyctl, GET_KEYRING_ID, DESCRIBE, SESSION = 250, 0, 6, -3
key = libc.syscall(SYS_keyctl, GET_KEYRING_ID, SESSION, 0)
text = ctypes.create_string_buffer(256)
libc.syscall(SYS_keyctl, DESCRIBE, key, text, 256)
print(os.getuid(), text.value.decode())
"""

# deploy/systemd/README.md, "Install", in the machine (the wheels instead of PyPI).
INSTALL_STEPS = f"""
cd {STAGE}
python3 -m venv /opt/reducerd
/opt/reducerd/bin/pip install --quiet --no-index --find-links {STAGE}/wheels reducerd
install -d -m 0755 /etc/reducerd
install -m 0644 deploy/reducerd.toml.example /etc/reducerd/reducerd.toml
install -m 0600 /dev/null /etc/reducerd/token
python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > /etc/reducerd/token
"""
SERVICE_STEPS = f"""
cd {STAGE}
install -m 0644 deploy/systemd/reducerd.service /etc/systemd/system/
systemctl daemon-reload
systemctl enable --now reducerd.service
"""


def instance_steps(count: int) -> str:
    return f"""
cd {STAGE}
install -m 0644 deploy/systemd/reducerd@.service deploy/systemd/reducerd.target \\
    /etc/systemd/system/
systemctl daemon-reload
systemctl enable --now reducerd.target reducerd@{{0..{count - 1}}}.service
"""


@pytest.fixture(scope="module")
def machine(request, tmp_path_factory):
    require("systemd")
    rootfs, wheels = request.getfixturevalue("rootfs"), request.getfixturevalue("wheels")
    booted = Machine(rootfs, tmp_path_factory.mktemp("machine"))
    try:
        stage = booted.path(STAGE)
        shutil.copytree(ROOT / "deploy", stage / "deploy")
        shutil.copytree(wheels, stage / "wheels")
        booted.boot()
        booted.sh(INSTALL_STEPS, timeout=300)
        config = booted.path("/etc/reducerd/reducerd.toml")
        config.write_text(re.sub(r"(?m)^drain_grace = .*$", f"drain_grace = {DRAIN_GRACE_S}",
                                 config.read_text()))
        yield booted
    finally:
        booted.stop()


def token(machine) -> str:
    return machine.path("/etc/reducerd/token").read_text().strip()


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


# -- reducerd.service ------------------------------------------------------------------


@pytest.mark.timeout(1200)  # set-up on a bare machine: packages, debootstrap, wheels
def test_enable_now_returns_only_once_health_answers_serving(machine):
    watcher = machine.in_netns([sys.executable, str(PROBE), "watch-health", "127.0.0.1:7000"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        machine.sh(SERVICE_STEPS)
        time.sleep(1.0)  # health checks after READY=1
        out, _ = watcher.communicate("", timeout=30)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    attempts = json.loads(out.splitlines()[-1])
    state = machine.show("reducerd", "ActiveState", "StatusText", "ActiveEnterTimestampMonotonic")
    assert state["ActiveState"] == "active", machine.journal("reducerd")
    ready_s = int(state["ActiveEnterTimestampMonotonic"]) / 1e6
    before = [a for a in attempts if a[1] < ready_s]
    after = [a for a in attempts if a[0] > ready_s]
    assert any(a[2] != "SERVING" for a in before), f"the probe saw no start-up: {attempts[:5]}"
    assert len(after) >= 5 and all(a[2] == "SERVING" for a in after), after[:10]
    assert "serving" in state["StatusText"], state
    assert machine.run(["systemctl", "is-enabled", "reducerd"]).stdout.strip() == "enabled"


def test_the_daemon_runs_sandboxed(machine):
    pid = machine.main_pid("reducerd")
    status = machine.proc_status(pid)
    assert int(status["Uid"].split()[0]) in DYNAMIC_UIDS, status["Uid"]
    for capabilities in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[capabilities], 16) == 0, (capabilities, status[capabilities])
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2", status
    mounts = {fields[4]: fields for fields in (
        line.split() for line in machine.run(["cat", f"/proc/{pid}/mountinfo"]).stdout
        .splitlines())}
    assert "ro" in mounts["/"][5].split(","), mounts["/"]  # /opt and /etc with it
    assert not any(point.startswith(("/opt", "/etc")) and "rw" in fields[5].split(",")
                   for point, fields in mounts.items()), "a writable mount under /opt or /etc"
    assert "systemd-private" in mounts["/tmp"][3], mounts["/tmp"]  # PrivateTmp
    # LimitNOFILE=65536, capped by the manager's own hard limit (20000 in an nspawn
    # machine whose host limit is lower: it lacks CAP_SYS_RESOURCE to raise it).
    manager_hard = int(machine.sh("grep 'open files' /proc/1/limits").stdout.split()[4])
    limits = machine.sh(f"grep 'open files' /proc/{pid}/limits").stdout.split()
    assert [int(limits[3]), int(limits[4])] == [min(65536, manager_hard)] * 2, limits
    # KeyringMode=private: a session keyring of the service's own (owned by its user).
    assert machine.show("reducerd", "KeyringMode")["KeyringMode"] == "private"
    uid, keyring = machine.run(
        ["systemd-run", "--quiet", "--wait", "--pipe", "-p", "KeyringMode=private",
         "-p", "DynamicUser=yes", "/opt/reducerd/bin/python", "-c", KEYRING_SCRIPT]
    ).stdout.split()
    assert re.fullmatch(rf"keyring;{uid};\d+;[0-9a-f]+;_ses", keyring), (uid, keyring)
    security = machine.run(["systemd-analyze", "security", "reducerd.service"]).stdout
    exposure = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", security).group(1))
    assert exposure < 2.0, security


def test_the_credential_carries_the_token(machine):
    answers = json.loads(machine.probe("status", "127.0.0.1:7000", token(machine)))
    assert answers == {"without": "UNAUTHENTICATED", "with": "OK"}, answers
    assert oct(machine.path("/etc/reducerd/token").stat().st_mode & 0o777) == "0o600"
    # The README's check, as root in the machine.
    machine.run(["/opt/reducerd/bin/reducerd", "status", "--address", "127.0.0.1:7000",
                 "--token-file", "/etc/reducerd/token"])


def test_reload_sends_sighup_and_the_daemon_keeps_serving(machine):
    """`systemctl reload` runs the unit's ExecReload= (SIGHUP): the same
    process goes on serving and logs what it reloaded. The token it reads is
    the credential's copy: whether systemd refreshed it on reload decides
    which token the daemon serves after, and the log says which."""
    pid = machine.main_pid("reducerd")
    start = machine.cursor()
    token_file = machine.path("/etc/reducerd/token")
    old = token(machine)
    new = "rotated-" + old[:16]
    token_file.write_text(new + "\n")
    try:
        reload = machine.run(["systemctl", "reload", "reducerd"], check=False)
        assert reload.returncode == 0, machine.journal("reducerd", "-n", "30")
        logged = wait_for(lambda: [m for m in (e.get("MESSAGE", "") for e in
                                               machine.entries("reducerd", start))
                                   if "SIGHUP:" in m], 10, "the daemon's SIGHUP line")
        assert machine.main_pid("reducerd") == pid
        assert machine.show("reducerd", "ActiveState")["ActiveState"] == "active"
        served = json.loads(machine.probe("status", "127.0.0.1:7000", new))["with"]
        if any("token rotated" in m for m in logged):
            assert served == "OK", logged
        else:  # the credential was not refreshed: the token in use stays
            assert any("nothing changed" in m for m in logged), logged
            assert served == "UNAUTHENTICATED", logged
        print(f"systemctl reload: {logged}; the new token: {served}")
        answers = json.loads(machine.probe("status", "127.0.0.1:7000", old))
        assert answers["with"] == "OK", answers  # the old one: in use, or in its grace
    finally:
        token_file.write_text(old + "\n")


def test_stop_drains_and_the_warning_reaches_the_journal_as_one(machine):
    start = machine.cursor()
    probe = machine.in_netns([sys.executable, str(PROBE), "drain", "127.0.0.1:7000",
                              token(machine), "drain-job"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = None
    try:
        assert json.loads(probe.stdout.readline()) == {"open": [5.0]}
        stop_started = time.monotonic()
        stop = machine.popen(["systemctl", "stop", "reducerd"])
        wait_for(lambda: "draining" in text(machine.entries("reducerd", start)),
                 10, "the daemon to drain")
        out, err = probe.communicate("go\n", timeout=30)
        assert stop.wait(timeout=60) == 0
        stop_s = time.monotonic() - stop_started
    finally:
        for process in (probe, stop):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    replies = json.loads(out.splitlines()[-1])
    assert replies["done0"] == replies["done1"] == [11.0, 22.0], replies
    assert replies["left0"].startswith("UNAVAILABLE"), replies
    assert DRAIN_GRACE_S - 0.5 < stop_s < 60, stop_s
    state = machine.show("reducerd", "ActiveState", "Result", "ExecMainStatus")
    assert state == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
    # The issue's own command (the first drain of this boot).
    warnings = machine.journal("reducerd", "-p", "warning")
    assert "failing 1 open chunk(s)" in warnings, machine.journal("reducerd")
    priorities = {e["MESSAGE"].split(": ", 1)[-1][:30]: e["PRIORITY"]
                  for e in machine.entries("reducerd", start)
                  if e.get("SYSLOG_IDENTIFIER") == "reducerd"}
    assert {p for m, p in priorities.items() if m.startswith("failing")} == {"4"}, priorities
    assert {p for m, p in priorities.items() if m.startswith("draining")} == {"6"}, priorities


def test_a_bad_key_stops_the_start_once_with_status_2_at_error_priority(machine):
    config = machine.path("/etc/reducerd/reducerd.toml")
    good = config.read_text()
    start = machine.cursor()
    try:
        config.write_text(good + "round-timout = 5\n")
        assert machine.run(["systemctl", "start", "reducerd"], check=False).returncode != 0
        time.sleep(3)  # past RestartSec=2s: a restart would have begun
        state = machine.show("reducerd", "ActiveState", "ExecMainStatus", "NRestarts")
        assert state == {"ActiveState": "failed", "ExecMainStatus": "2", "NRestarts": "0"}, (
            state, text(machine.entries("reducerd", start)))
        errors = machine.entries("reducerd", start, max_priority=3)
        config_lines = [e for e in errors if "unknown key 'round-timout'" in e["MESSAGE"]]
        assert [e["PRIORITY"] for e in config_lines] == ["3"], errors
        assert "unknown key 'round-timout'" in machine.journal("reducerd", "-p", "err")
    finally:
        config.write_text(good)
        machine.run(["systemctl", "reset-failed", "reducerd"], check=False)


@pytest.mark.timeout(180)
def test_the_watchdog_restarts_a_frozen_daemon(machine):
    machine.run(["systemctl", "start", "reducerd"])
    watchdog_s = int(machine.show("reducerd", "WatchdogUSec")["WatchdogUSec"].rstrip("s"))
    frozen = machine.main_pid("reducerd")
    start = machine.cursor()
    machine.run(["systemctl", "kill", "--kill-whom=main", "--signal=SIGSTOP", "reducerd"])
    frozen_at_us = time.monotonic() * 1e6

    def restarted():
        state = machine.show("reducerd", "NRestarts", "MainPID", "ActiveState")
        return state["NRestarts"] == "1" and state["MainPID"] not in ("0", frozen) and (
            state["ActiveState"] == "active")

    try:
        wait_for(restarted, watchdog_s + 40, "the watchdog's restart", interval_s=1)
        timeouts = [e for e in machine.entries("reducerd", start)
                    if "Watchdog timeout" in e["MESSAGE"]]
        assert timeouts, text(machine.entries("reducerd", start))
        waited_s = (int(timeouts[0]["__MONOTONIC_TIMESTAMP"]) - frozen_at_us) / 1e6
        # Pings every third of the period: the last one 0 to watchdog_s/3 before the freeze.
        assert watchdog_s * 2 / 3 - 1 < waited_s < watchdog_s + 2, waited_s
    finally:
        machine.run(["systemctl", "disable", "--now", "reducerd"])  # 7000 for the instances


# -- reducerd@.service and reducerd.target ---------------------------------------------


def cpu_count(machine) -> int:
    return int(machine.run(["nproc"]).stdout)


def test_instances_on_their_ports_and_cpus_reduce_a_job(machine):
    count = min(2, cpu_count(machine))
    machine.sh(instance_steps(count))
    assert machine.run(["systemctl", "is-enabled", "reducerd.target"]).stdout.strip() == (
        "enabled")
    for n in range(count):
        unit = f"reducerd@{n}"
        assert machine.show(unit, "ActiveState")["ActiveState"] == "active", (
            machine.journal(unit))
        status = machine.proc_status(machine.main_pid(unit))
        assert status["Cpus_allowed_list"] == str(n), status["Cpus_allowed_list"]
        answers = json.loads(machine.probe("status", f"127.0.0.1:{7000 + n}", token(machine)))
        assert answers["with"] == "OK", (unit, answers)
    env = {**os.environ, "REDUCER_ADDRESSES": ",".join(f"127.0.0.1:{7000 + n}"
                                                        for n in range(count)),
           "REDUCER_JOB": "deploy-job", "REDUCER_WORLD_SIZE": "2", "REDUCER_TOKEN":
           token(machine), "REDUCER_WIRE_DTYPE": "float32", "REDUCER_NODE_LOCAL": "0",
           # The data plane or nothing: ports 7100 + N must answer.
           "REDUCER_DATA_PLANE": "tcp", "REDUCER_TIMEOUT": "30"}
    workers = [machine.in_netns([sys.executable, str(PROBE), "allreduce", str(rank)],
                                env={**env, "REDUCER_RANK": str(rank)}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for rank in range(2)]
    try:
        outputs = [w.communicate(timeout=60)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for rank, (w, out) in enumerate(zip(workers, outputs, strict=True)):
        assert w.returncode == 0 and f"ok {rank}" in out, out


def test_an_instance_that_is_not_a_cpu_fails_once(machine):
    n = cpu_count(machine)
    unit = f"reducerd@{n}"
    result = machine.run(["systemctl", "enable", "--now", unit], check=False)
    assert result.returncode != 0 and "Assertion failed" in result.stderr, result
    time.sleep(3)  # past RestartSec=2s
    state = machine.show(unit, "ActiveState", "NRestarts", "AssertResult")
    assert state == {"ActiveState": "inactive", "NRestarts": "0", "AssertResult": "no"}, state
    status = machine.run(["systemctl", "status", unit], check=False).stdout
    assert f"AssertCPUs=>{n} was not met" in status, status
    machine.run(["systemctl", "disable", unit])
    # Where a cpuset hides CPU n from the unit but not from the count, CPUAffinity
    # fails with 215: once, not until the start limit.
    drop_in = machine.path(f"/etc/systemd/system/{unit}.service.d/no-assert.conf")
    drop_in.parent.mkdir(parents=True)
    drop_in.write_text("[Unit]\nAssertCPUs=\n")
    try:
        machine.run(["systemctl", "daemon-reload"])
        assert machine.run(["systemctl", "start", unit], check=False).returncode != 0
        time.sleep(3)
        state = machine.show(unit, "ActiveState", "NRestarts", "ExecMainStatus")
        assert state == {"ActiveState": "failed", "NRestarts": "0", "ExecMainStatus": "215"}, (
            state, machine.journal(unit))
    finally:
        shutil.rmtree(drop_in.parent)
        machine.run(["systemctl", "daemon-reload"])
        machine.run(["systemctl", "reset-failed", unit], check=False)


def test_stopping_the_target_returns_once_the_instances_have_drained(machine):
    count = min(2, cpu_count(machine))
    start = machine.cursor()
    probe = machine.in_netns([sys.executable, str(PROBE), "drain", "127.0.0.1:7000",
                              token(machine), "target-job"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(probe.stdout.readline()) == {"open": [5.0]}
        stop_started = time.monotonic()
        stop = machine.popen(["systemctl", "stop", "reducerd.target"])
        wait_for(lambda: "draining" in text(machine.entries("reducerd@0", start)),
                 10, "reducerd@0 to drain")
        probe.stdin.write("go\n")
        probe.stdin.flush()
        assert stop.wait(timeout=60) == 0
        stop_s = time.monotonic() - stop_started
        # Right when the stop returns, not a moment later.
        units = [f"reducerd@{n}" for n in range(count)]
        active = machine.run(["systemctl", "is-active", *units], check=False).stdout.split()
        out, _ = probe.communicate(timeout=30)
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    assert active == ["inactive"] * count, active
    assert stop_s > DRAIN_GRACE_S - 0.5, f"stop returned after {stop_s:.1f} s"
    replies = json.loads(out.splitlines()[-1])
    assert replies["left0"].startswith("UNAVAILABLE"), replies
    for n in range(count):
        assert machine.show(f"reducerd@{n}", "Result")["Result"] == "success"
