"""The training bench's figures: aggregation, tables, --json FILE and --plot FILE.png.

Per (system, workers), over the timed steps (each step's time is the slowest
rank's):
- step_time_s: median, min, max of the step period;
- samples_per_s = workers x batch / median step time;
- scaling_efficiency = samples_per_s / (workers x samples_per_s at 1 worker)
  of the same system (null without a 1-worker run);
- compute_s: the modeled compute a step actually waited (median);
- comm_alone_s: the median step with the compute waits off (communication
  and the framework's own work, nothing to hide behind);
- comm_hidden_fraction = 1 - (step - compute) / comm_alone, clipped to
  [0, 1]: the share of that communication the step did not pay for;
- compute_share = compute / step: the step's efficiency against compute
  alone, which does not depend on what the system pays at 1 worker
  (reducerd's 1-worker step still crosses its link to one daemon).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from reducer_wire import dtypes
from rich.console import Console
from rich.table import Table

from reducerd import __version__
from reducerd.bench.host import host_record
from reducerd.bench.train.config import TrainConfig, scaled_numel
from reducerd.bench.units import format_ms

__all__ = ["aggregate", "render_tables", "write_json", "write_plot", "BASELINE"]

BASELINE = "gloo-ddp-float16"  # the ratio column compares each system's step with this


def _per_step(ranks: dict[int, dict[str, Any]], phase: str, field: str) -> list[float]:
    """The field of each step, the largest over ranks."""
    series = [r["result"][phase] for r in ranks.values()]
    return [max(s[i][field] for s in series) for i in range(min(len(s) for s in series))]


def wire_bytes_per_param(config: TrainConfig, system: str) -> float:
    """Bytes a parameter's gradient takes on the system's wire (the 8-bit
    wires' scales included)."""
    if system == "gloo-ddp-float32":
        return 4.0
    if system == "gloo-ddp-float16":
        return 2.0
    wire = dtypes.WIRE_DTYPES[config.wire_dtype]
    block = dtypes.wire_block(wire)
    return dtypes.wire_nbytes(wire, block) / block


def link_factor(system: str, workers: int) -> float:
    """The gradient's share each link carries each way: a ring's 2(N-1)/N, the
    daemons' 1 (each worker sends its gradient once and receives the sum once)."""
    if workers == 1:
        return 0.0
    return 2 * (workers - 1) / workers if system.startswith("gloo-") else 1.0


def comm_theory(config: TrainConfig, system: str, workers: int) -> dict[str, float | None]:
    """The line-rate bound of a step's communication: at the emulated links'
    rate with the scaled gradient (None on loopback, which has no line rate),
    and in the real setting (the whole gradient over --real-link)."""
    spec = config.spec
    per_param = wire_bytes_per_param(config, system) * link_factor(system, workers)
    scaled = sum(scaled_numel(p.numel, config.byte_scale) for p in spec.params)
    rate = config.rate_bytes_per_s
    return {"link_factor": link_factor(system, workers),
            "comm_theory_s": scaled * per_param / rate if rate else None,
            "real_comm_theory_s": spec.param_count * per_param / config.real_link_bytes_per_s}


def _median_or_none(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _one(config: TrainConfig, system: str, workers: int,
         ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    periods = _per_step(ranks, "steps", "period_s")
    step_s = statistics.median(periods)
    compute_s = statistics.median(_per_step(ranks, "steps", "compute_s"))
    comm_s = statistics.median(_per_step(ranks, "comm_steps", "period_s"))
    exposed_s = step_s - compute_s
    hidden = min(1.0, max(0.0, 1 - exposed_s / comm_s)) if comm_s > 0 else None
    rank0 = ranks[0]["result"]["steps"]
    return {
        "system": system, "model": config.model, "workers": workers,
        "step_time_s": {"median": step_s, "min": min(periods), "max": max(periods)},
        "samples_per_s": workers * config.batch_per_worker / step_s,
        "scaling_efficiency": None,  # filled in by aggregate()
        "comm_hidden_fraction": hidden,
        "compute_s": compute_s, "comm_alone_s": comm_s, "exposed_comm_s": exposed_s,
        "compute_share": compute_s / step_s,
        "reductions_per_step": _median_or_none([s["launches"] for s in rank0]),
        "launched_in_backward": _median_or_none([s["launched_in_backward"] for s in rank0]),
        "launch_lag_s": _median_or_none([s["launch_lag_s"] for s in rank0]),
        "max_error_over_bound": max(r["check"]["max_error_over_bound"]
                                    for r in ranks.values()),
        **comm_theory(config, system, workers),
    }


def aggregate(config: TrainConfig, records: dict[tuple[str, int], dict[int, dict[str, Any]]],
              ) -> list[dict[str, Any]]:
    """One result per (system, workers) that finished, in run order."""
    results = [_one(config, system, workers, ranks)
               for (system, workers), ranks in records.items()
               if len(ranks) == workers
               and all("result" in r and "check" in r for r in ranks.values())]
    single = {r["system"]: r["samples_per_s"] for r in results if r["workers"] == 1}
    for r in results:
        base = single.get(r["system"])
        if base:
            r["scaling_efficiency"] = r["samples_per_s"] / (r["workers"] * base)
    return results


def _theory(value: float | None) -> str:
    return "" if value is None else format_ms(value)


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def render_tables(console: Console, config: TrainConfig, results: list[dict[str, Any]]) -> None:
    """Every (workers, system) row, then the original's 1 node against N nodes."""
    where = (f"emulated cluster, {config.emulate_cluster} links" if config.emulate_cluster
             else "loopback")
    baseline = {r["workers"]: r["step_time_s"]["median"] for r in results
                if r["system"] == BASELINE}
    table = Table(title=f"reducerd bench --train {config.model}: batch "
                        f"{config.batch_per_worker} per worker, {where}, median of "
                        f"{config.steps} steps (slowest rank)",
                  caption=f"ratio = step time / {BASELINE}'s; hidden = 1 - (step - compute)"
                          " / comm alone; theory = the gradient's bytes on the wire x link "
                          "share (ring 2(N-1)/N, reducerd 1) / link rate, emulated (real "
                          f"setting: {config.real_link_bytes_per_s * 8 / 1e9:g} Gbit/s)")
    columns = ["N", "system", "step ms", "min", "max", "samples/s", "efficiency",
               "compute ms", "compute share", "comm alone ms", "theory ms", "comm/theory",
               "real theory ms", "hidden", f"vs {BASELINE}"]
    for column in columns:
        table.add_column(column, justify="left" if column == "system" else "right",
                         no_wrap=True)
    for r in sorted(results, key=lambda r: r["workers"]):
        t = r["step_time_s"]
        base = baseline.get(r["workers"])
        table.add_row(str(r["workers"]), r["system"], format_ms(t["median"]),
                      format_ms(t["min"]), format_ms(t["max"]), f"{r['samples_per_s']:.4g}",
                      _pct(r["scaling_efficiency"]), format_ms(r["compute_s"]),
                      _pct(r["compute_share"]), format_ms(r["comm_alone_s"]),
                      _theory(r["comm_theory_s"]),
                      f"{r['comm_alone_s'] / r['comm_theory_s']:.2f}x"
                      if r["comm_theory_s"] else "",
                      _theory(r["real_comm_theory_s"]), _pct(r["comm_hidden_fraction"]),
                      f"{t['median'] / base:.2f}x" if base else "")
    console.print(table)
    largest = max(r["workers"] for r in results)
    if largest == 1:
        return
    summary = Table(title=f"1 node against {largest} nodes ({config.model})")
    for column in ("system", "samples/s, 1 node", f"samples/s, {largest} nodes", "speed-up",
                   "scaling efficiency"):
        summary.add_column(column, justify="left" if column == "system" else "right")
    by_key = {(r["system"], r["workers"]): r for r in results}
    for system in config.systems:
        one, many = by_key.get((system, 1)), by_key.get((system, largest))
        if one and many:
            summary.add_row(system, f"{one['samples_per_s']:.4g}",
                            f"{many['samples_per_s']:.4g}",
                            f"{many['samples_per_s'] / one['samples_per_s']:.2f}x",
                            _pct(many["scaling_efficiency"]))
    console.print(summary)


def write_json(path: Path, config: TrainConfig, results: list[dict[str, Any]],
               failed: dict[str, str], elapsed_s: float) -> None:
    record = {**config.record(), "failed": failed, "elapsed_s": round(elapsed_s, 1),
              "reducerd_version": __version__, "python": platform.python_version(),
              "cpus": os.cpu_count(), "host": host_record(config.command)}
    path.write_text(json.dumps({"config": record, "results": results}, indent=2) + "\n")


def write_plot(path: Path, config: TrainConfig, results: list[dict[str, Any]]) -> None:
    """Scaling efficiency against workers, one line per system, the ideal at 100%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    workers = sorted({r["workers"] for r in results})
    ax.plot(workers, [100] * len(workers), color="0.7", linestyle=":", label="ideal")
    lowest = min((100 * r["scaling_efficiency"] for r in results
                  if r["scaling_efficiency"] is not None), default=100)
    ax.set_ylim(min(80.0, lowest - 5), 102)  # a few per cent must not fill the height
    for system in config.systems:
        points = sorted((r["workers"], 100 * r["scaling_efficiency"]) for r in results
                        if r["system"] == system and r["scaling_efficiency"] is not None)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.set_xlabel("workers (one per node)")
    ax.set_ylabel("scaling efficiency (%)")
    where = config.emulate_cluster or "loopback"
    ax.set_title(f"{config.model}, batch {config.batch_per_worker}/worker, {where}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
