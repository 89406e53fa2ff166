"""Local daemons as subprocesses on 127.0.0.1, for demos, scripts and tests.

    with running_daemons(2, "--round-timeout", "5") as daemons:
        client = ReducerClient(daemons.addresses, ...)

Each daemon listens on a port the kernel picks (127.0.0.1:0) and logs to a
file; the address is read from its "listening on" line. Every daemon started
here is stopped (SIGTERM, then SIGKILL after a bound) when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DaemonProcess", "Daemons", "start_daemon", "running_daemons", "LISTEN_RE"]

LISTEN_RE = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class DaemonProcess:
    """A reducerd subprocess on 127.0.0.1 with its log file."""

    process: subprocess.Popen
    address: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_daemon(*args: str, log_dir: Path | None = None, port: int = 0,
                 env: dict[str, str] | None = None, timeout: float = 20.0,
                 entry: Sequence[str] = ("-m", "reducerd")) -> DaemonProcess:
    """Start `python -m reducerd --listen 127.0.0.1:PORT ARGS` and wait until it listens.

    `entry`: the interpreter arguments before the daemon's own (tests start
    ("-c", code) that changes the daemon, then runs reducerd.__main__.main()).
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="reducerd-test-"))
    log_path = log_dir / f"reducerd-{time.monotonic_ns()}.log"
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, *entry, "--listen", f"127.0.0.1:{port}", *args],
        stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    log_file.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = LISTEN_RE.search(log_path.read_text(errors="replace"))
        if match:
            return DaemonProcess(process, f"127.0.0.1:{match.group(2)}", log_path)
        if process.poll() is not None:
            break
        time.sleep(0.02)
    process.kill()
    process.wait()
    raise RuntimeError(f"reducerd did not start:\n{log_path.read_text(errors='replace')}")


@dataclass
class Daemons:
    processes: list[DaemonProcess] = field(default_factory=list)

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self.processes]

    def logs(self) -> str:
        return "\n".join(d.log() for d in self.processes)


@contextlib.contextmanager
def running_daemons(count: int, *args: str, log_dir: Path | None = None,
                    round_timeout: float | None = None) -> Iterator[Daemons]:
    """Start `count` daemons; stop (SIGTERM, then SIGKILL) all of them on exit."""
    extra = [*args]
    if round_timeout is not None:
        extra += ["--round-timeout", str(round_timeout)]
    daemons = Daemons()
    try:
        for _ in range(count):
            daemons.processes.append(start_daemon(*extra, log_dir=log_dir))
        yield daemons
    finally:
        for daemon in daemons.processes:
            daemon.stop()
