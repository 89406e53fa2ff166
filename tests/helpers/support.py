"""Test helpers: real daemons as subprocesses, real worker processes.

    with running_daemons(2, round_timeout=5) as daemons:
        results = run_workers(worker_fn, world_size=4, args=(daemons.addresses,))

Workers are spawned processes (a fresh interpreter, as on a real cluster);
`worker_fn(rank, world_size, *args)` must be importable at module level. A
worker's exception comes back with its traceback and fails the test; a
worker that outlives the timeout is killed and fails the test too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from reducerd.ops.local import DaemonProcess, Daemons, running_daemons, start_daemon

# A daemon under RLIMIT_AS: a memory regression fails with MemoryError instead
# of taking the machine down.
AS_LIMIT_BYTES = 3 << 30
_LIMITED_ENTRY = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
                  "{1}; from reducerd.__main__ import main; sys.exit(main(sys.argv[1:]))")

__all__ = ["DaemonProcess", "Daemons", "running_daemons", "start_daemon", "limited_daemon",
           "AS_LIMIT_BYTES", "run_workers", "WorkerFailed"]

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


class KeySpy:
    """A Reducer that forwards to `inner` and records the key of every allreduce."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.keys = inner, []
        self.rank, self.world_size = inner.rank, inner.world_size
        self.timeout, self.wire_dtype = inner.timeout, inner.wire_dtype

    def allreduce_async(self, array: Any, key: str, op: str = "sum", **kwargs: Any) -> Any:
        self.keys.append(key)
        return self.inner.allreduce_async(array, key, op, **kwargs)


def limited_daemon(*args: str, log_dir: Path, as_limit_bytes: int = AS_LIMIT_BYTES,
                   env: dict[str, str] | None = None, prelude: str = "pass") -> DaemonProcess:
    """`reducerd --listen 127.0.0.1:0 ARGS` with its address space capped;
    `prelude`: Python run first (e.g. a smaller cap patched into a module)."""
    return start_daemon(*args, log_dir=log_dir, env=env,
                        entry=("-c", _LIMITED_ENTRY.format(int(as_limit_bytes), prelude)))


def collect_outputs(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[str]:
    """Each process's output, all within one deadline; any still running after
    (or on a failure) is killed and reaped."""
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs
