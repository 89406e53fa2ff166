"""Markdown tables for docs/benchmarks.md from `reducerd bench --json` files.

    python scripts/bench_markdown.py docs/bench/loopback-n4-d2.json [...]

One table per file: loopback runs give time, algbw and reducerd's ratio;
emulated runs add the bytes per worker, theory and the line-rate bound.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from reducerd.bench.figures import time_ratios
from reducerd.bench.units import format_ms


def _mib(value: float | None) -> str:
    return "" if value is None else f"{value / (1 << 20):.2f} MiB"


def _size(size_bytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size_bytes >= 1 << shift:
            return f"{size_bytes / (1 << shift):g} {unit}"
    return f"{size_bytes} B"


def table(path: Path) -> str:
    data = json.loads(path.read_text())
    config, results = data["config"], data["results"]
    emulated = bool(config.get("emulate_cluster"))
    where = f"{config['emulate_cluster']} links" if emulated else "loopback"
    daemons = config.get("reducerd_daemons") or {}
    rate = daemons.get("input_GB_per_cpu_s")
    rate_text = "not measured" if rate is None else f"{rate:.2f} GB of input per CPU-second"
    title = (f"**N={config['workers']}, D={config['daemons']}, {where}** (`{path.name}`; "
             f"daemons: {rate_text})")
    ratios = time_ratios(results)
    if emulated:
        lines = ["| size | system | median ms | reducerd / this | sent per worker | theory "
                 "| line-rate bound ms | time / bound |", "|---|---|---|---|---|---|---|---|"]
    else:
        lines = ["| size | system | median ms | algbw GB/s | reducerd / this |",
                 "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["size_bytes"], r["system"] != "reducerd")):
        median = r["time_s"]["median"]
        key = (r["system"], r["size_bytes"])
        ratio = "" if r["system"] == "reducerd" or key not in ratios else f"{ratios[key]:.2f}x"
        cells = [_size(r["size_bytes"]), r["system"], format_ms(median)]
        if emulated:
            bound = r.get("line_rate_bound_s")
            cells += [ratio, _mib(r.get("bytes_sent_per_worker")),
                      _mib(r.get("theory_bytes_per_worker")),
                      format_ms(bound) if bound else "", f"{median / bound:.2f}" if bound else ""]
        else:
            cells += [f"{r['algbw_GBps']:.3g}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([title, "", *lines])


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print("\n\n".join(table(Path(p)) for p in argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
