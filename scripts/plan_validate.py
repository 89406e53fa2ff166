"""Check `reducerd plan`'s model against emulated clusters (issue 19, target: within 10 %).

For each N in --workers and D in --daemons it runs

    reducerd bench --workers N --daemons D --sizes S --emulate-cluster RATE --json F

(root and network namespaces needed: see `reducerd bench --help`), or reads
F files given with --from-json, and prints one row per (N, D, size): the
measured reducerd median, the planner's projection for the same cluster
(worker and daemon links at RATE, the bench's chunking and MTU, the run's own
daemon input GB per CPU-second), their ratio and whether it is within the
tolerance. With `--baselines gloo-float16` the ring's projection is checked
too. Exit status 1 when any row is outside the tolerance.

    sudo .venv/bin/python scripts/plan_validate.py --workers 2,4,8 --daemons 1,2,4 \\
        --sizes 16M --rate 200mbit --out-dir plan-check --markdown plan-check/table.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from reducer_wire.dtypes import WIRE_DTYPES, wire_block, wire_nbytes

from reducerd.plan.capacity import ClusterSpec, chunk_of, chunk_work, plan_reducerd, plan_ring

# The planner's daemon rate when a run reports none (CPU never bounds these runs).
FALLBACK_RATE_GBPS = 1.2


def run_bench(n: int, d: int, args: argparse.Namespace) -> Path:
    out = args.out_dir / f"plan-n{n}-d{d}.json"
    command = [sys.executable, "-m", "reducerd", "bench", "--workers", str(n),
               "--daemons", str(d), "--sizes", args.sizes, "--wire-dtype", args.wire_dtype,
               "--baselines", args.baselines, "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--emulate-cluster", args.rate, "--json", str(out)]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, timeout=args.run_timeout, stdout=subprocess.DEVNULL)
    return out


def projection(config: dict[str, Any], size_bytes: int, system: str) -> float:
    """The planner's time per step for one bench result."""
    rate = config["rate_bytes_per_s"]
    daemons_cpu = config.get("reducerd_daemons") or {}
    params = size_bytes // 4
    dtype = WIRE_DTYPES[config["wire_dtype"] if system == "reducerd"
                        else system.removeprefix("gloo-")]
    per_node = config.get("workers_per_node", 1)
    spec = ClusterSpec(
        params=params, wire_bytes_per_param=wire_nbytes(dtype, params) / params,
        wire_block=wire_block(dtype), wire_block_bytes=wire_nbytes(dtype, wire_block(dtype)),
        nodes=config["workers"] // per_node, gpus_per_node=per_node, link_Bps=rate,
        daemon_link_Bps=rate,
        daemon_rate_Bps_per_core=(daemons_cpu.get("input_GB_per_cpu_s")
                                  or FALLBACK_RATE_GBPS) * 1e9,
        daemons=config["daemons"], chunk_bytes=config.get("chunk_bytes"),
        # netem's delay sits on both links a message crosses.
        latency_s=2 * config.get("emulate_delay_s", 0.0), mtu=config.get("emulate_mtu", 9000))
    # The run's figure counts its chunks' fixed costs in; the planner's rate is
    # the bytes' alone (it adds them back, w = 1 + K / C).
    spec = replace(spec, daemon_rate_Bps_per_core=spec.daemon_rate_Bps_per_core
                   * chunk_work(chunk_of(spec, config["daemons"])))
    return plan_reducerd(spec).time_s if system == "reducerd" else plan_ring(spec).time_s


def rows(path: Path, tolerance: float) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    config = data["config"]
    if not config.get("rate_bytes_per_s"):
        raise SystemExit(f"{path}: not an --emulate-cluster run")
    out = []
    for result in data["results"]:
        system = result["system"]
        if system != "reducerd" and not system.startswith("gloo-"):
            continue
        measured = result["time_s"]["median"]
        projected = projection(config, result["size_bytes"], system)
        ratio = measured / projected
        out.append({"workers": config["workers"], "daemons": config["daemons"],
                    "system": system, "size_bytes": result["size_bytes"],
                    "measured_s": measured, "projected_s": projected, "ratio": ratio,
                    "ok": abs(ratio - 1) <= tolerance, "file": path.name})
    return out


def markdown(table: list[dict[str, Any]], tolerance: float) -> str:
    lines = ["| N | D | system | size | measured ms | planner ms | measured / planner | "
             f"within {tolerance:.0%} |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['workers']} | {r['daemons']} | {r['system']} | "
                     f"{r['size_bytes'] >> 20} MiB | {r['measured_s'] * 1e3:.1f} | "
                     f"{r['projected_s'] * 1e3:.1f} | {r['ratio']:.3f} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4,8", help="N values (default 2,4,8)")
    parser.add_argument("--daemons", default="1,2,4", help="D values (default 1,2,4)")
    parser.add_argument("--sizes", default="16M", help="float32 sizes (default 16M)")
    parser.add_argument("--rate", default="200mbit", help="link rate (default 200mbit)")
    parser.add_argument("--wire-dtype", default="float16", choices=sorted(WIRE_DTYPES))
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--baselines", default="none",
                        help="bench baselines, e.g. gloo-float16 to check the ring too")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--run-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--out-dir", type=Path, default=Path("plan-validation"))
    parser.add_argument("--from-json", type=Path, nargs="+", metavar="FILE",
                        help="check these bench JSON files instead of running")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.from_json:
        paths = args.from_json
    else:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        paths = [run_bench(int(n), int(d), args) for n in args.workers.split(",")
                 for d in args.daemons.split(",")]
    table = [row for path in paths for row in rows(path, args.tolerance)]
    text = markdown(table, args.tolerance)
    sys.stdout.write(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0 if all(r["ok"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
