"""Whether the daemon needs its summing threads now (--pool-busy-cores).

A chunk summed on the summing threads costs more CPU than one summed inline
on the event loop's thread: each task is a hand-off, and a sleeping thread's
wake-up (on a virtual machine, an exit to the hypervisor). That buys
throughput only when one core is not enough. So the daemon samples its own
CPU time (every thread's) every SAMPLE_S: while it used at least
`busy_cores` cores over the last sample, new chunks go to the summing
threads; once it uses less than OFF_FRACTION of that, they are summed inline
again. The band between the two keeps a load near the threshold from
switching at every sample (the threads' own cost raises the CPU that
pooling shows). Measured with scripts/daemon_threads.py: on a 2-vCPU machine shared with
its workers the pool cost 15 % more daemon CPU per byte for no speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["BusyGate", "SAMPLE_S", "OFF_FRACTION", "DEFAULT_POOL_BUSY_CORES"]

SAMPLE_S = 0.1
OFF_FRACTION = 2 / 3
DEFAULT_POOL_BUSY_CORES = 0.75


class BusyGate:
    """Samples the process's CPU; `busy` says whether to pool new chunks."""

    def __init__(self, busy_cores: float, wall: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.process_time) -> None:
        if busy_cores < 0:
            raise ValueError(f"busy_cores must be >= 0, got {busy_cores}")
        self.busy_cores = busy_cores
        self._wall, self._cpu = wall, cpu
        self._last = (wall(), cpu())
        self.busy = busy_cores == 0  # 0: always pool; else inline until the CPU says so
        self.cores = 0.0  # the last sample's

    def sample(self) -> bool:
        """Take a sample (the CPU since the last one); the state it leaves."""
        wall, cpu = self._wall(), self._cpu()
        elapsed = wall - self._last[0]
        if elapsed <= 0:
            return self.busy
        self.cores = (cpu - self._last[1]) / elapsed
        self._last = (wall, cpu)
        if self.busy_cores == 0:
            return self.busy
        if not self.busy and self.cores >= self.busy_cores:
            self.busy = True
        elif self.busy and self.cores < self.busy_cores * OFF_FRACTION:
            self.busy = False
        return self.busy
