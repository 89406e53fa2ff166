"""reducerd.ops.busy: the summing threads take new chunks only while the daemon is busy.

BusyGate with fake clocks (threshold, hysteresis, 0 = always, a clock that
stands still); the table's pool honouring `busy` (a chunk above the pool
size summed inline while the daemon is not busy, bit for bit the same); the
option; and a Daemon (in this process) whose sampling loop keeps the pool
closed while idle and opens it once the process burns CPU.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_summing import loop_and_pool, parse, part  # noqa: F401 (loop_and_pool: the fixture)

from reducerd.core.chunks import ChunkId
from reducerd.core.reduction import ReductionTable
from reducerd.ops.busy import OFF_FRACTION, BusyGate
from reducerd.ops.config import ConfigError

pytestmark = pytest.mark.timeout(60)


class Clocks:
    """A wall clock and a CPU clock that the test moves."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 5.0

    def run(self, seconds: float, cores: float) -> None:
        self.wall += seconds
        self.cpu += seconds * cores


def gate(busy_cores: float) -> tuple[BusyGate, Clocks]:
    clocks = Clocks()
    return BusyGate(busy_cores, wall=lambda: clocks.wall, cpu=lambda: clocks.cpu), clocks


def test_the_gate_opens_at_the_threshold_and_closes_below_its_band():
    g, clocks = gate(0.75)
    assert g.busy is False  # inline until the CPU says otherwise
    clocks.run(0.1, 0.74)
    assert g.sample() is False and g.cores == pytest.approx(0.74)
    clocks.run(0.1, 0.75)
    assert g.sample() is True
    # Inside the band (the pool's own cost shows as CPU): stays open.
    clocks.run(0.1, 0.75 * OFF_FRACTION + 0.01)
    assert g.sample() is True
    clocks.run(0.1, 0.75 * OFF_FRACTION - 0.01)
    assert g.sample() is False
    clocks.run(0.1, 0.6)  # in the band again, from below: stays closed
    assert g.sample() is False


def test_zero_cores_means_always_and_a_still_clock_changes_nothing():
    g, clocks = gate(0)
    assert g.busy is True
    clocks.run(0.1, 0.0)
    assert g.sample() is True
    g, clocks = gate(0.75)
    clocks.run(0.0, 0.0)
    assert g.sample() is False  # no time passed: no sample, no division by zero
    clocks.run(0.1, 2.0)
    assert g.sample() is True and g.cores == pytest.approx(2.0)
    with pytest.raises(ValueError, match="busy_cores must be >= 0, got -1"):
        BusyGate(-1)


def test_the_option(tmp_path):
    assert parse().pool_busy_cores == 0.75
    assert parse("--pool-busy-cores", "0").pool_busy_cores == 0
    assert parse("--pool-busy-cores", "1.5").pool_busy_cores == 1.5
    with pytest.raises(ConfigError, match="pool_busy_cores: must be >= 0, got -0.5"):
        parse("--pool-busy-cores", "-0.5")


def test_a_pool_that_is_not_busy_leaves_large_chunks_inline(loop_and_pool):  # noqa: F811
    """pool.busy False: a chunk above --pool-chunk-bytes completes inside
    contribute (the loop thread summed it); busy again, the next one lands
    later from a summing thread. Both sums are exact (0.5 + 1.5 + 2.5)."""
    loop, pool = loop_and_pool(2, min_chunk_bytes=4096)
    table = ReductionTable(5.0, 1 << 30, summing=pool)
    delivered: list = []
    table.on_deliveries = delivered.extend
    parts = [part(rank, np.full(8192, rank + 0.5), 3) for rank in range(3)]
    pool.busy = False
    inline = [table.contribute(ChunkId("job", "k", 0, 0), p, f"s{r}") for r, p in enumerate(parts)]
    assert inline[:2] == [[], []] and not delivered
    assert np.all(np.frombuffer(inline[2][0].data, "<f2") == 4.5)
    pool.busy = True
    pooled = ChunkId("job", "k", 0, 1 << 20)
    assert all(table.contribute(pooled, p, f"s{r}") == [] for r, p in enumerate(parts))
    loop.run(pool)
    (landed,) = delivered
    assert landed.chunk == pooled and np.all(np.frombuffer(landed.data, "<f2") == 4.5)
    assert table.bytes_held == 0 and table.budget.transport_bytes == 0


def test_the_daemon_samples_its_cpu_into_the_pool():
    """In a real Daemon (in this process), _busy_loop starts the pool closed
    and opens it once the process burns more than the threshold. The
    threshold is low (0.1 cores) so that a spinning process crosses it even
    on a machine loaded many times over, where it gets a fraction of a core."""
    import asyncio

    from reducerd.daemon.server import Daemon
    from reducerd.ops.config import Config

    async def main() -> list[bool]:
        daemon = Daemon(Config(listen="127.0.0.1:0", threads=2, pool_busy_cores=0.1,
                               data_listen="off"))
        assert daemon.summing is not None
        task = asyncio.create_task(daemon._busy_loop())
        seen = []
        await asyncio.sleep(0.25)  # idle: the pool stays closed
        seen.append(daemon.summing.busy)
        deadline = time.monotonic() + 15
        while not daemon.summing.busy and time.monotonic() < deadline:
            spin_until = time.monotonic() + 0.05  # this process, busy on its loop
            while time.monotonic() < spin_until:
                pass
            await asyncio.sleep(0)
        seen.append(daemon.summing.busy)
        task.cancel()
        return seen

    assert asyncio.run(main()) == [False, True]
