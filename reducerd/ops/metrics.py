"""Prometheus metrics for one daemon, served over HTTP on --metrics-listen.

Two sources, one snapshot per scrape:
- hooks that the session calls on the event loop thread: `shard_in` for every
  valid shard (bytes in by dtype), `delivered` for every completed or failed
  chunk (bytes out by dtype, failures by reason, round latency);
- the ReductionTable's own counters (chunks completed, open chunks, bytes
  held), read at scrape time.

The table and the hook counters are only touched on the event loop thread: a
scrape (on the HTTP server's thread) asks the loop for a snapshot and renders
that, so nothing here needs a lock. A scrape while the loop is stuck fails
after SNAPSHOT_TIMEOUT_S, which is itself a useful signal.

Job labels are bounded: the first `max_jobs` jobs seen get their own label,
every later one is counted under reducer_job="other", so a cluster that runs
many short jobs cannot blow up the series count. The label is `reducer_job`,
not `job`: Prometheus sets `job` to the scrape job and would rename ours to
`exported_job`.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
import ssl
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString
from reducer_wire.dtypes import DTYPE_NAMES

from reducerd import __version__
from reducerd.core.reduction import Delivery, ReductionTable
from reducerd.ops.config import STALLED_AFTER_S, parse_host_port

__all__ = ["Metrics", "JobLabels", "BootTimeProcessCollector", "OTHER_JOB", "LATENCY_BUCKETS_S"]

log = logging.getLogger("reducerd")

OTHER_JOB = "other"
# First contribution to result: sub-millisecond on loopback, up to the round timeout.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SNAPSHOT_TIMEOUT_S = 5.0


class _Session(Protocol):
    streams: Any
    draining: bool


class BootTimeProcessCollector(ProcessCollector):
    """process_* metrics that also work under systemd's ProcSubset=pid.

    The stock collector needs /proc/stat (boot time) and exports nothing
    without it; the boot time also follows from CLOCK_BOOTTIME.
    """

    def _boot_time(self) -> float:
        try:
            return super()._boot_time()
        except OSError:
            return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


class JobLabels:
    """Sticky, bounded job -> label map: the first `max_jobs` jobs keep their name."""

    def __init__(self, max_jobs: int) -> None:
        self.max_jobs = max_jobs
        self._labels: dict[str, str] = {}

    def __call__(self, job: str) -> str:
        label = self._labels.get(job)
        if label is not None:
            return label
        if len(self._labels) >= self.max_jobs:
            return OTHER_JOB  # not stored: the map stays bounded too
        self._labels[job] = job
        return job


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    sum_s: float = 0.0

    def observe(self, value_s: float) -> None:
        # Bucket i counts LATENCY_BUCKETS_S[i-1] < value <= LATENCY_BUCKETS_S[i] ("le").
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, value_s)] += 1
        self.sum_s += value_s

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), total))
        return out


@dataclass
class _Snapshot:
    bytes_in: dict[tuple[str, str], int]
    bytes_out: dict[tuple[str, str], int]
    failed: dict[tuple[str, str], int]
    latency: dict[str, tuple[list[tuple[str, float]], float]]
    completed: dict[str, int]
    open_chunks: dict[str, int]
    open_chunk_bytes: dict[str, int]
    jobs: int
    stalled: int
    bytes_held: int
    max_inflight_bytes: int
    open_streams: int
    draining: bool


class Metrics:
    """The daemon's metrics: hooks for the session, a Collector, an HTTP endpoint."""

    def __init__(self, table: ReductionTable, session: _Session | None = None,
                 max_jobs: int = 20, stalled_after_s: float = STALLED_AFTER_S) -> None:
        self.table = table
        self.session = session
        self.stalled_after_s = stalled_after_s
        self.job_label = JobLabels(max_jobs)
        # Hook state: event loop thread only (see the module docstring).
        self._bytes_in: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._bytes_out: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._failed: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._latency: defaultdict[str, _Histogram] = defaultdict(_Histogram)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._httpd: Any = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        BootTimeProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    # -- hooks (event loop thread) -------------------------------------------

    def shard_in(self, job: str, dtype: int, nbytes: int) -> None:
        """Count one valid shard's data."""
        self._bytes_in[self.job_label(job), DTYPE_NAMES.get(dtype, "unknown")] += nbytes

    def delivered(self, d: Delivery) -> None:
        """Count one completed or failed chunk as the session delivers it.

        A repeat (a resent contribution answered from the cache, or with the
        failure already reported) counts its bytes, not a second chunk.
        """
        label = self.job_label(d.chunk.job)
        if not d.error_code:
            self._bytes_out[label, DTYPE_NAMES.get(d.dtype, "unknown")] += (
                len(d.data) * len(d.sinks))
        if d.repeat:
            return
        if d.error_code:
            self._failed[label, d.error_code.lower()] += 1
        else:
            self._latency[label].observe(d.latency_s)

    def _snapshot(self) -> _Snapshot:
        completed: defaultdict[str, int] = defaultdict(int)
        open_chunks: defaultdict[str, int] = defaultdict(int)
        open_bytes: defaultdict[str, int] = defaultdict(int)
        for job, stats in self.table.jobs.items():
            label = self.job_label(job)
            completed[label] += stats.chunks_completed
            open_chunks[label] += stats.open_chunks
            open_bytes[label] += stats.open_chunk_bytes
        stalled = self.table.stalled_count(self.stalled_after_s)
        return _Snapshot(
            bytes_in=dict(self._bytes_in), bytes_out=dict(self._bytes_out),
            failed=dict(self._failed),
            latency={k: (h.cumulative(), h.sum_s) for k, h in self._latency.items()},
            completed=dict(completed), open_chunks=dict(open_chunks),
            open_chunk_bytes=dict(open_bytes),
            jobs=len(self.table.jobs), stalled=stalled,
            bytes_held=self.table.budget.held_bytes,
            max_inflight_bytes=self.table.max_inflight_bytes,
            open_streams=len(self.session.streams) if self.session else 0,
            draining=bool(self.session and self.session.draining))

    # -- Collector (scrape thread) -------------------------------------------

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot_from_loop()
        info = GaugeMetricFamily("reducerd_build_info", "reducerd version", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield _labelled(CounterMetricFamily, "reducerd_bytes_in",
                        "Shard data received, by job and wire dtype", ["reducer_job", "dtype"],
                        snap.bytes_in)
        yield _labelled(CounterMetricFamily, "reducerd_bytes_out",
                        "Result data sent (once per receiving stream), by job and wire dtype",
                        ["reducer_job", "dtype"], snap.bytes_out)
        yield _labelled(CounterMetricFamily, "reducerd_chunks_completed",
                        "Chunks reduced and answered", ["reducer_job"],
                        {(k,): v for k, v in snap.completed.items()})
        yield _labelled(CounterMetricFamily, "reducerd_chunks_failed",
                        "Chunks failed, by reason (the gRPC status code, lower case)",
                        ["reducer_job", "reason"], snap.failed)
        latency = HistogramMetricFamily(
            "reducerd_round_latency_seconds",
            "Seconds from a chunk's first contribution to its result", labels=["reducer_job"])
        for label, (buckets, sum_s) in sorted(snap.latency.items()):
            latency.add_metric([label], buckets, sum_s)
        yield latency
        yield _labelled(GaugeMetricFamily, "reducerd_open_chunks",
                        "Chunks waiting for contributions", ["reducer_job"],
                        {(k,): v for k, v in snap.open_chunks.items()})
        yield _labelled(GaugeMetricFamily, "reducerd_open_chunk_bytes",
                        "Float32 accumulator bytes of the open chunks (per job at most "
                        "--max-inflight-bytes-per-job)", ["reducer_job"],
                        {(k,): v for k, v in snap.open_chunk_bytes.items()})
        for name, doc, value in (
            ("reducerd_stalled_chunks", "Open chunks older than stalled_after_s",
             snap.stalled),
            ("reducerd_bytes_held", "Bytes held against max_inflight_bytes: open chunks' "
             "accumulators, receive buffers, replies not yet sent", snap.bytes_held),
            ("reducerd_max_inflight_bytes", "The max_inflight_bytes limit",
             snap.max_inflight_bytes),
            ("reducerd_open_streams", "Open Reduce streams", snap.open_streams),
            ("reducerd_jobs", "Jobs seen since start", snap.jobs),
            ("reducerd_draining", "1 while the daemon drains for shutdown",
             int(snap.draining)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)

    def _snapshot_from_loop(self) -> _Snapshot:
        loop = self._loop
        if loop is None or not loop.is_running():
            return self._snapshot()  # no loop (tests, or after shutdown)
        try:
            if asyncio.get_running_loop() is loop:
                return self._snapshot()
        except RuntimeError:
            pass  # no loop in this thread: the usual scrape-thread case
        result: concurrent.futures.Future[_Snapshot] = concurrent.futures.Future()

        def take() -> None:
            try:
                result.set_result(self._snapshot())
            except BaseException as exc:  # hand it to the scrape thread
                result.set_exception(exc)

        loop.call_soon_threadsafe(take)
        return result.result(timeout=SNAPSHOT_TIMEOUT_S)

    # -- HTTP endpoint -------------------------------------------------------

    def start_http(self, address: str, loop: asyncio.AbstractEventLoop | None = None,
                   ssl_context: ssl.SSLContext | None = None,
                   basic_auth: tuple[str, str] | None = None) -> tuple[str, int]:
        """Serve /metrics on HOST:PORT (port 0: any free one), over TLS with
        `ssl_context`, behind basic auth with `basic_auth` (reducerd.ops.metrics_http);
        return the bound address."""
        from reducerd.ops.metrics_http import MetricsServer

        host, port = parse_host_port(address, "metrics_listen")
        self._loop = loop
        try:
            self._httpd = MetricsServer(self.registry, host, port, ssl_context, basic_auth)
        except OSError as exc:
            raise RuntimeError(f"metrics_listen {address}: {exc.strerror or exc}") from exc
        log.info("metrics on %s://%s:%d/metrics%s", self._httpd.scheme, _url_host(host),
                 self._httpd.port, " (basic auth)" if basic_auth else "")
        return host, self._httpd.port

    def stop_http(self) -> None:
        """Stop the HTTP endpoint (blocks up to two seconds for its thread)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.stop()


def _labelled(kind: Callable[..., Any], name: str, doc: str, labels: list[str],
              values: dict[Any, int]) -> Metric:
    family = kind(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
