"""A booted systemd in a container: systemd-nspawn over a copy of the cached rootfs.

The host runs no systemd, so nspawn cannot register the machine or make a
scope for it (--register=no --keep-unit); --private-network gives it a network
namespace of its own with only loopback, so the units' fixed ports clash with
nothing. Commands run inside through nsenter into all of the container's
namespaces, with a clean environment; host processes (probes, workers) join
only its network namespace, so they reach 127.0.0.1:7000 of the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_host import terminate_with_parent

# deploy/systemd/README.md gives the same command.
NSPAWN_ARGS = ("-b", "--register=no", "--keep-unit", "--private-network")
# nspawn's own seccomp filter refuses the keyring calls (keyrings have no
# namespace); the KeyringMode= check needs them.
NSPAWN_EXTRA = ("--system-call-filter=@keyring", "--console=pipe", "--quiet")
MACHINE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
PROBE = Path(__file__).with_name("netns_probe.py")


class Machine:
    """A booted container; stop() powers it off and removes its root filesystem."""

    def __init__(self, rootfs: Path, workdir: Path) -> None:
        self.root = workdir / f"reducerd-deploy-{os.getpid()}"
        self.console = workdir / "console.log"
        self.process: subprocess.Popen | None = None
        self.leader = 0
        shutil.rmtree(self.root, ignore_errors=True)
        subprocess.run(["cp", "-a", "--reflink=auto", str(rootfs), str(self.root)],
                       check=True, timeout=300)

    def boot(self, timeout_s: float = 120.0) -> None:
        with open(self.console, "w") as console:
            self.process = subprocess.Popen(
                ["systemd-nspawn", *NSPAWN_ARGS, *NSPAWN_EXTRA, "-D", str(self.root)],
                stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
                preexec_fn=terminate_with_parent)
        deadline = time.monotonic() + timeout_s
        while not self.leader:
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"systemd-nspawn exited {self.process.returncode} before "
                            f"booting:\n{self.console.read_text()[-3000:]}", pytrace=False)
            self.leader = self._child_of(self.process.pid)
            time.sleep(0.1)
        while True:  # the manager may not answer yet in its first moments
            result = self.run(["systemctl", "is-system-running", "--wait"], check=False,
                              timeout=max(1.0, deadline - time.monotonic()))
            state = result.stdout.strip()
            if state in ("running", "degraded"):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"the machine did not boot (state {state!r}: {result.stderr}):\n"
                            f"{self.console.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.2)

    @staticmethod
    def _child_of(pid: int) -> int:
        """The machine's PID 1 as the host sees it: nspawn's child once it runs systemd."""
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if children and Path(f"/proc/{children[0]}/comm").read_text().strip() == "systemd":
                return int(children[0])
        except OSError:
            pass
        return 0

    def run(self, argv: list[str], check: bool = True, timeout: float = 60.0,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run argv inside the machine (as its root) and return its output."""
        env_args = [f"{k}={v}" for k, v in MACHINE_ENV.items()]
        result = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "env", "-i",
                                 *env_args, *argv], capture_output=True, text=True,
                                timeout=timeout, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"in the machine, {' '.join(argv)} exited "
                                 f"{result.returncode}:\n{result.stdout}{result.stderr}")
        return result

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start argv inside the machine without waiting for it."""
        env_args = [f"{k}={v}" for k, v in MACHINE_ENV.items()]
        return subprocess.Popen(["nsenter", "-t", str(self.leader), "-a", "env", "-i",
                                 *env_args, *argv], **kwargs)

    def sh(self, script: str, check: bool = True, timeout: float = 60.0):
        return self.run(["bash", "-euo", "pipefail", "-c", script], check=check,
                        timeout=timeout)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        out = self.run(["systemctl", "show", unit, "-p", ",".join(properties)]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, *options: str) -> str:
        return self.run(["journalctl", "--no-pager", "-q", "-u", unit, *options]).stdout

    def cursor(self) -> str:
        """The journal's position now: later reads see only what came after."""
        last = self.run(["journalctl", "-n", "1", "-o", "json", "--no-pager"]).stdout
        return json.loads(last.splitlines()[-1])["__CURSOR"]

    def entries(self, unit: str, after: str, max_priority: int = 7) -> list[dict]:
        """The unit's journal entries (its own and systemd's about it) after a cursor.

        Filtered here: journalctl --after-cursor with -u or -p skips the first
        match when the cursor's own entry does not match (systemd 252).
        """
        out = self.run(["journalctl", "--no-pager", "-o", "json", "--after-cursor", after]).stdout
        found = (json.loads(line) for line in out.splitlines() if line.strip())
        return [e for e in found if unit + ".service" in (e.get("_SYSTEMD_UNIT"), e.get("UNIT"))
                and int(e.get("PRIORITY", 6)) <= max_priority]

    def proc_status(self, pid: str) -> dict[str, str]:
        """/proc/PID/status of a process of the machine (PID as the machine numbers it)."""
        lines = self.run(["cat", f"/proc/{pid}/status"]).stdout.splitlines()
        return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}

    def main_pid(self, unit: str) -> str:
        pid = self.show(unit, "MainPID")["MainPID"]
        assert pid != "0", f"{unit} has no main process:\n{self.journal(unit)}"
        return pid

    def path(self, inside: str) -> Path:
        """Where the host sees a path of the machine (stopped services' files only)."""
        return self.root / inside.lstrip("/")

    def in_netns(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start a host process inside the machine's network namespace."""
        return subprocess.Popen(["nsenter", f"--net=/proc/{self.leader}/ns/net", "--",
                                 *argv], **kwargs)

    def probe(self, *args: str, timeout: float = 30.0, input: str | None = None) -> str:
        """netns_probe.py's one-shot commands; their last line of output."""
        process = self.in_netns([sys.executable, str(PROBE), *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        try:
            out, err = process.communicate(input, timeout=timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 0, f"netns_probe {' '.join(args)}:\n{out}{err}"
        return out.strip().splitlines()[-1]

    def stop(self) -> None:
        """Power off (SIGTERM makes nspawn ask the machine's systemd), then remove it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def text(entries: list[dict]) -> str:
    """Journal entries' messages, one a line."""
    return "\n".join(e["MESSAGE"] for e in entries)
