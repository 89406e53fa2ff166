"""What every `reducerd bench` run shares, the sweep's and the training bench's alike.

A BenchSession holds one run's log folder, child processes and emulated
cluster. Cleanup is unconditional: on leaving the `with` block every child
process is stopped and every namespace removed, which SIGINT
(KeyboardInterrupt), SIGTERM and SIGHUP (turned into KeyboardInterrupt here)
all reach; further signals are blocked while it runs, so a second Ctrl-C
cannot interrupt the cleanup itself. An interrupt ends the block (the partial
results are reported after it); any other exception goes on up after the
cleanup.

Also here: reducerd daemons started on a list of hosts, free loopback ports,
the progress bar and the console the result tables go to.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from reducerd.bench import netns
from reducerd.bench.netns import Host
from reducerd.bench.procs import Proc, ProcessSet, wait_for_log
from reducerd.ops.local import LISTEN_RE

__all__ = ["BenchError", "BenchSession", "start_daemons", "free_port", "progress_bar",
           "results_console", "READY_TIMEOUT_S"]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
READY_TIMEOUT_S = 60.0  # a daemon's start, until it logs its address


class BenchError(RuntimeError):
    """The bench cannot run at all (e.g. --emulate-cluster without root)."""


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class BenchSession:
    """One run's log folder, child processes and emulated cluster; a context manager.

    log_dir: keep every log there (--log-dir); None: a temporary folder named
    `prefix`..., removed by finish() after a run without failures.
    """

    def __init__(self, console: Console, log_dir: Path | None, prefix: str) -> None:
        self.console = console
        self.keep_logs = log_dir is not None
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=prefix))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessSet(self.log_dir)
        self.cluster: netns.Cluster | None = None
        self.interrupted = False
        self._previous_handlers: dict[int, Any] = {}

    def __enter__(self) -> BenchSession:
        if threading.current_thread() is threading.main_thread():  # signal() needs it
            # SIGINT too: a shell starts a background job with SIGINT ignored, and
            # Python then leaves it ignored instead of raising KeyboardInterrupt.
            self._previous_handlers = {sig: signal.signal(sig, _interrupt)
                                       for sig in _STOP_SIGNALS}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        if interrupted:
            self.interrupted = True
            self.console.print("[yellow]interrupted:[/] stopping every process and namespace")
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self.procs.stop_all()
            if self.cluster is not None:
                self.cluster.destroy()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
        return interrupted  # the interrupt ends the block; the report follows

    def emulate_cluster(self, rate: str, rate_bytes_per_s: float, nodes: int, daemons: int,
                        delay_s: float, mtu: int, described: str) -> netns.Cluster:
        """Build the namespaces (leftovers of a killed run removed first); BenchError
        when they cannot be. `described` says what was built ("2 node(s) and ...")."""
        try:
            netns.check_available()
            for name in netns.cleanup_leftovers():
                self.console.print(f"removed leftover namespace {name}")
            # Set before create(), so that a half-built cluster is removed too.
            self.cluster = netns.Cluster(rate, rate_bytes_per_s, nodes, daemons, delay_s, mtu)
            self.console.print(f"emulated cluster: {described}, links {rate} each way; "
                               f"reducerd's clients size their chunks for them "
                               f"(link_gbit={rate_bytes_per_s * 8e-9:g})")
            self.cluster.create()
        except netns.NetnsError as exc:
            raise BenchError(str(exc)) from None
        return self.cluster

    def keep_records(self, records: Any) -> None:
        """The raw per-rank records as records.json beside the logs, when they are kept."""
        if self.keep_logs:
            (self.log_dir / "records.json").write_text(json.dumps(records))

    def wrote(self, path: Path) -> None:
        self.console.print(f"wrote {path}")

    def finish(self, failed: bool) -> int:
        """The exit status: 130 interrupted, 1 failed (logs kept either way), else 0
        (a temporary log folder removed)."""
        if failed or self.interrupted:
            self.console.print(f"process logs kept in {self.log_dir}")
            return 130 if self.interrupted else 1
        if not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return 0


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process that cannot take 0 (a Gloo
    master, a daemon whose address the workers get in advance).

    Taken below the kernel's ephemeral range: a port that bind(0) gives is
    one that any connect() may take next as its source port (the bench and
    other tests open hundreds), and a listener started later on it then fails
    or, worse, a worker reaches another process there. Outside that range
    only a listener can hold it, and bind() here checks for one."""
    low, _ = _ephemeral_range()
    lowest = _LOWEST_PORT if low > _LOWEST_PORT + 1000 else 1024
    span = max(1, low - lowest)
    start = random.randrange(span)
    for step in range(span):
        port = lowest + (start + step) % span
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise BenchError(f"no free port on 127.0.0.1 between {lowest} and {low}")


_LOWEST_PORT = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def start_daemons(procs: ProcessSet, hosts: list[Host], name: str, round_timeout_s: float,
                  port: Callable[[Host], int] = lambda host: 0,
                  ) -> tuple[list[Proc], list[str]]:
    """A reducerd daemon on each host (process `{name}{i}`, listening on port(host));
    (their processes, their addresses) once every one logs where it listens."""
    daemons = []
    for i, host in enumerate(hosts):
        argv = host.command([sys.executable, "-m", "reducerd",
                             "--listen", f"{host.address}:{port(host)}",
                             "--round-timeout", str(round_timeout_s), "--drain-grace", "2"])
        daemons.append(procs.start(f"{name}{i}", argv, {}))
    addresses = [f"{host.address}:{wait_for_log(d, LISTEN_RE.pattern, READY_TIMEOUT_S).group(2)}"
                 for host, d in zip(hosts, daemons, strict=True)]
    return daemons, addresses


def progress_bar(console: Console, description_width: int) -> Progress:
    return Progress(TextColumn(f"{{task.description:<{description_width}}}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=False)


def results_console() -> Console:
    """stdout for the tables: its own width on a terminal, 200 columns in a pipe or a
    file (not squeezed into 80)."""
    out = Console()
    return out if out.is_terminal else Console(width=200)
