"""Child processes of the bench: start them, follow the workers' reports, stop them all.

Children run in their own session, so a Ctrl-C in the terminal reaches only
the bench, which then stops them in order; with util-linux's setpriv they
also get SIGKILL if the bench itself dies without cleaning up.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from reducerd.bench.worker import MARKER

__all__ = ["Proc", "ProcessSet", "SystemFailed", "follow_workers", "wait_for_log",
           "cpu_seconds"]

_SETPRIV = shutil.which("setpriv")


class SystemFailed(RuntimeError):
    """One system could not finish its sweep; the message says which process and why."""


@dataclass
class Proc:
    name: str
    process: subprocess.Popen
    log_path: Path
    rank: int | None = None
    # The last lines a worker printed that were not reports (for error messages).
    chatter: deque = field(default_factory=lambda: deque(maxlen=20))

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            text = []
        return "\n".join([*self.chatter, *text][-lines:])


class ProcessSet:
    """Every child of one run; stop_all() ends them (SIGTERM, then SIGKILL after a bound)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str],
              rank: int | None = None) -> Proc:
        """Start argv with `env` added to ours; workers get a stdout pipe for reports."""
        log_path = self.log_dir / f"{name}.log"
        if _SETPRIV:
            argv = [*argv[:4], _SETPRIV, "--pdeathsig", "KILL", *argv[4:]] \
                if argv[:3] == ["ip", "netns", "exec"] else \
                [_SETPRIV, "--pdeathsig", "KILL", *argv]
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if rank is not None else log, stderr=log,
                env={**os.environ, **env}, start_new_session=True,
                text=rank is not None, bufsize=1 if rank is not None else -1)
        proc = Proc(name, process, log_path, rank)
        self.procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every live child, wait up to grace_s in all, then SIGKILL the rest."""
        for proc in self.procs:
            if proc.process.poll() is None:
                _signal(proc.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc.process, signal.SIGKILL)
                proc.process.wait()
            if proc.process.stdout:
                proc.process.stdout.close()
        self.procs.clear()


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        process.send_signal(sig)
    except ProcessLookupError:
        pass


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """user + system CPU time of a live process, or of its thread `tid` (Linux /proc)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in bytes, and Threads, of a live process (/proc/PID/status)."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
        elif name == "Threads":
            fields[name] = int(value)
    return fields


def wait_for_log(proc: Proc, pattern: str, timeout_s: float) -> re.Match:
    """Wait until the child's log matches `pattern`; SystemFailed if it exits or times out."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = regex.search(proc.log_path.read_text(errors="replace"))
        if match:
            return match
        if proc.process.poll() is not None:
            raise SystemFailed(f"{proc.name} exited with {proc.process.returncode} before "
                               f"it was ready:\n{proc.tail()}")
        time.sleep(0.05)
    raise SystemFailed(f"{proc.name} not ready within {timeout_s:g} s:\n{proc.tail()}")


def _exit_code(proc: Proc, timeout_s: float) -> int | None:
    try:
        return proc.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def _reader(proc: Proc, events: queue.Queue) -> None:
    assert proc.process.stdout is not None
    for line in proc.process.stdout:
        if line.startswith(MARKER):
            events.put((proc, json.loads(line[len(MARKER):])))
        else:
            proc.chatter.append(line.rstrip())
    events.put((proc, {"event": "eof"}))


def follow_workers(workers: list[Proc], helpers: list[Proc], stall_timeout_s: float,
                   on_event: Callable[[Proc, dict], None]) -> None:
    """Pass every report to on_event until all workers have said "done" and exited.

    SystemFailed when a worker reports an error or exits without "done", when
    a helper (daemon, server, scheduler) exits first, or when nothing arrives
    for stall_timeout_s.
    """
    events: queue.Queue = queue.Queue()
    for proc in workers:
        threading.Thread(target=_reader, args=(proc, events), daemon=True,
                         name=f"bench-{proc.name}").start()
    done: set[str] = set()
    open_streams = len(workers)
    last_event = time.monotonic()
    while open_streams:
        try:
            proc, event = events.get(timeout=0.5)
        except queue.Empty:
            for helper in helpers:
                code = helper.process.poll()
                # ps-lite's servers may exit once every worker said "done".
                if code is not None and (code != 0 or len(done) < len(workers)):
                    raise SystemFailed(f"{helper.name} exited with "
                                       f"{helper.process.returncode}:\n{helper.tail()}") from None
            if time.monotonic() - last_event > stall_timeout_s:
                raise SystemFailed(f"no progress for {stall_timeout_s:g} s (see "
                                   f"--stall-timeout); last lines of {workers[0].name}:\n"
                                   f"{workers[0].tail()}") from None
            continue
        last_event = time.monotonic()
        kind = event["event"]
        if kind == "error":
            _exit_code(proc, 10)
            raise SystemFailed(f"{proc.name}: {event['message']}\n{proc.tail()}")
        if kind == "eof":
            open_streams -= 1
            code = _exit_code(proc, 30)
            if proc.name not in done or code != 0:
                raise SystemFailed(f"{proc.name} exited with {code} before it finished:\n"
                                   f"{proc.tail()}")
            continue
        if kind == "done":
            done.add(proc.name)
        on_event(proc, event)
