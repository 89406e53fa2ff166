"""Test helpers: real daemons as subprocesses, real worker processes.

    with running_daemons(2, round_timeout=5) as daemons:
        results = run_workers(worker_fn, world_size=4, args=(daemons.addresses,))

Workers are spawned processes (a fresh interpreter, as on a real cluster);
`worker_fn(rank, world_size, *args)` must be importable at module level. A
worker's exception comes back with its traceback and fails the test; a
worker that outlives the timeout is killed and fails the test too.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LISTEN_RE = re.compile(r"listening on (\S+):(\d+)")


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
                 env: dict[str, str] | None = None, timeout: float = 20.0) -> DaemonProcess:
    """Start `python -m reducerd --listen 127.0.0.1:PORT ARGS` and wait until it listens."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="reducerd-test-"))
    log_path = log_dir / f"reducerd-{time.monotonic_ns()}.log"
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "reducerd", "--listen", f"127.0.0.1:{port}", *args],
        stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    log_file.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = _LISTEN_RE.search(log_path.read_text(errors="replace"))
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


class WorkerFailed(AssertionError):
    pass


def _worker_main(fn, rank, world_size, args, results) -> None:
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException as exc:  # report everything, including SystemExit
        results.put((rank, False, f"{exc!r}\n{traceback.format_exc()}"))


def run_workers(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                timeout: float = 120.0, env: dict[str, str] | None = None,
                allow_errors: bool = False) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` spawned processes.

    Returns the per-rank results in rank order. With allow_errors=True a
    rank's failure is returned as a WorkerFailed instead of raised.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=_worker_main, args=(fn, rank, world_size, tuple(args),
                                                        results), daemon=True)
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    collected: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerFailed(f"workers {sorted(set(range(world_size)) - set(collected))}"
                                   f" did not finish within {timeout} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except Exception:
                dead = [r for r, p in enumerate(procs)
                        if r not in collected and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # a result may still be in the pipe
                    while not results.empty():
                        rank, ok, value = results.get()
                        collected[rank] = (ok, value)
                    dead = [r for r in dead if r not in collected]
                    if dead and not allow_errors:
                        raise WorkerFailed(f"worker(s) {dead} died without a result "
                                           f"(exit codes {[procs[r].exitcode for r in dead]})"
                                           ) from None
                    for r in dead:
                        collected[r] = (False, f"worker {r} died without a result "
                                               f"(exit code {procs[r].exitcode})")
                continue
            collected[rank] = (ok, value)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    out = []
    for rank in range(world_size):
        ok, value = collected[rank]
        if not ok:
            if not allow_errors:
                raise WorkerFailed(f"rank {rank} failed:\n{value}")
            value = WorkerFailed(value)
        out.append(value)
    return out
