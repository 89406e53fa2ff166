"""The bench's outputs: the table on the terminal, --json FILE and --plot FILE.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from reducerd import __version__
from reducerd.bench.config import BenchConfig
from reducerd.bench.figures import time_ratios
from reducerd.bench.host import host_record
from reducerd.bench.units import format_bytes, format_ms, format_size

__all__ = ["render_table", "config_record", "write_json", "write_plot"]


def render_table(console: Console, config: BenchConfig, results: list[dict[str, Any]]) -> None:
    """One row per (size, system); ratio = reducerd's median time / the row's."""
    emulated = bool(config.emulate_cluster)
    per_node = config.workers_per_node > 1
    where = f"emulated cluster, {config.emulate_cluster} links" if emulated else "loopback"
    table = Table(title=f"reducerd bench: N={config.workers} workers, D={config.daemons} "
                        f"daemons, {where}, wire {config.wire_dtype}, median of "
                        f"{config.iters} (slowest rank)",
                  caption=f"busbw = algbw x 2(N-1)/N = x{config.busbw_factor:.3g} for every "
                          "system (nccl-tests); ratio = reducerd time / this time")
    columns = ["size", "system", "median ms", "min ms", "max ms", "algbw GB/s",
               "busbw GB/s", "ratio"]
    if emulated:
        columns += ["sent/worker", "recv/worker", "theory", "bound ms", "t/bound"]
    if per_node:
        columns += ["sent/node", "recv/node"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("size", "system") else "right",
                         no_wrap=True)
    ratios = time_ratios(results)
    previous_size = None
    # By size; sorted() is stable, so systems keep their run order within a size.
    for r in sorted(results, key=lambda r: r["size_bytes"]):
        time_s = r["time_s"]
        ratio = ratios.get((r["system"], r["size_bytes"]))
        row = [format_size(r["size_bytes"]) if r["size_bytes"] != previous_size else "",
               r["system"], format_ms(time_s["median"]), format_ms(time_s["min"]),
               format_ms(time_s["max"]),
               f"{r['algbw_GBps']:.3g}", f"{r['busbw_GBps']:.3g}",
               "" if r["system"] == "reducerd" or ratio is None else f"{ratio:.2f}x"]
        if emulated:
            row += [format_bytes(r["bytes_sent_per_worker"]),
                    format_bytes(r["bytes_received_per_worker"]),
                    format_bytes(r["theory_bytes_per_worker"]),
                    format_ms(r["line_rate_bound_s"]),
                    f"{time_s['median'] / r['line_rate_bound_s']:.2f}"
                    if r["line_rate_bound_s"] else ""]
        if per_node:
            row += [format_bytes(r["bytes_sent_per_node"]),
                    format_bytes(r["bytes_received_per_node"])]
        table.add_row(*row, end_section=False)
        previous_size = r["size_bytes"]
    console.print(table)
    for r in results:
        if "paired_core" in r:
            ratio, core = r["paired_core"]["ratio"], r["paired_core"]["time_s"]
            console.print(
                f"{r['system']} {format_size(r['size_bytes'])}: {ratio['median']:.3f}x the "
                f"core's allreduce(out=) in the same iterations (median of {config.iters} "
                f"pairs, {ratio['min']:.2f}-{ratio['max']:.2f}x; core median "
                f"{format_ms(core['median'])} ms)")


def config_record(config: BenchConfig, systems: list[str], skipped: dict[str, str],
                  failed: dict[str, str]) -> dict[str, Any]:
    """The JSON's "config": everything needed to read or rerun the figures."""
    return {
        "workers": config.workers, "daemons": config.daemons,
        "workers_per_node": config.workers_per_node, "nodes": config.nodes,
        "sizes_bytes": list(config.sizes_bytes), "wire_dtype": config.wire_dtype,
        "mxnet_dtype": config.mxnet_dtype, "iters": config.iters, "warmup": config.warmup,
        "systems": systems, "skipped": skipped, "failed": failed,
        "emulate_cluster": config.emulate_cluster,
        "rate_bytes_per_s": config.rate_bytes_per_s,
        "emulate_delay_s": config.emulate_delay_s, "emulate_mtu": config.emulate_mtu,
        "chunk_bytes": config.chunk_bytes,
        "busbw_factor": config.busbw_factor,
        "timing": "each iteration as long as its slowest rank; median/min/max over the "
                  "timed iterations; algbw = size_bytes / median; GB = 1e9 bytes",
        "reducerd_version": __version__,
        "host": host_record(config.command),
    }


def write_json(path: Path, config: dict[str, Any], results: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")


def write_plot(path: Path, config: BenchConfig, results: list[dict[str, Any]]) -> None:
    """algbw against size, log-log, one line per system; the line-rate bound when emulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    systems = list(dict.fromkeys(r["system"] for r in results))
    for system in systems:
        rows = sorted((r for r in results if r["system"] == system),
                      key=lambda r: r["size_bytes"])
        ax.plot([r["size_bytes"] for r in rows], [r["algbw_GBps"] for r in rows],
                marker="o", linewidth=2.5 if system == "reducerd" else 1.5, label=system)
        bounded = [r for r in rows if r.get("line_rate_bound_s")]
        if bounded:
            ax.plot([r["size_bytes"] for r in bounded],
                    [r["size_bytes"] / r["line_rate_bound_s"] / 1e9 for r in bounded],
                    linestyle=":", color=ax.lines[-1].get_color(),
                    label=f"{system} line-rate bound")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["size_bytes"] for r in results})
    ticks = sizes if len(sizes) <= 12 else sizes[::2]
    ax.set_xticks(ticks, [format_size(s).replace(" ", "") for s in ticks])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("float32 gradient size (bytes)")
    ax.set_ylabel("algorithm bandwidth (GB/s)")
    where = f"emulated {config.emulate_cluster} links" if config.emulate_cluster else "loopback"
    ax.set_title(f"allreduce, N={config.workers}, D={config.daemons}, {where}, "
                 f"wire {config.wire_dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
