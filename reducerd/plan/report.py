"""The plan as text: what each link carries, what bounds the step, and why."""

from __future__ import annotations

from typing import Any

from reducerd.plan.units import format_bytes, format_rate, format_seconds

__all__ = ["render"]


def _int(value: float) -> str:
    return f"{value:,.0f}"


def _header(i: dict[str, Any]) -> list[str]:
    return [
        f"model: {i['model']}, {_int(i['params'])} parameters, "
        f"{format_bytes(i['model_bytes'])} of {i['wire_dtype']} gradient per step",
        f"cluster: {i['workers']} worker node(s) x {i['gpus_per_node']} GPU(s) = "
        f"{i['ranks']} ranks; worker links {format_rate(i['link_Bps'])}, daemon links "
        f"{format_rate(i['daemon_link_Bps'])}, each way; MTU {i['mtu']} "
        f"(payload {i['link_efficiency']:.1%} of a link)",
        f"daemons: {i['daemon_rate_GBps_per_core']:g} GB of input summed per CPU-second "
        f"per core, {i['daemon_cores']} summing core(s) per daemon link"
        + (f"; latency {format_seconds(i['latency_s'])} per hop" if i["latency_s"] else ""),
    ]


def _reducerd(i: dict[str, Any], r: dict[str, Any]) -> list[str]:
    given = i["daemons"] is not None
    needed = (f"{r['daemons_needed']} keep the workers' links full" if given
              else "the fewest that keep the workers' links full")
    cores_per_link = i["daemon_link_Bps"] * i["link_efficiency"] * r["daemon_work_per_byte"] / (
        i["daemon_rate_GBps_per_core"] * 1e9)
    terms = (("worker link", r["worker_link_s"]), ("daemon link", r["daemon_link_s"]),
             ("daemon CPU", r["daemon_cpu_wall_s"]))
    return [
        f"reducerd: {r['daemons']} daemon(s) ({needed})",
        f"  bytes per step, each way: {format_bytes(r['worker_link_bytes'])} on each worker "
        f"link, {format_bytes(r['daemon_link_bytes'])} on each daemon link",
        f"  summing per step: {r['daemon_cpu_s']:.3g} CPU-s on each daemon, "
        f"{r['total_cpu_s']:.4g} CPU-s in all (each byte taken costs "
        f"{r['daemon_work_per_byte']:.3g}x its summing: the chunks' fixed costs)",
        f"  to keep every worker link full: {_int(-(-r['cores_to_fill_links'] // 1))} summing "
        f"cores in all, {cores_per_link:.3g} per {format_rate(i['daemon_link_Bps'])} "
        "daemon link",
        "  time per step: " + ", ".join(
            f"{name} {format_seconds(s)}" + (" (bound)" if name == r["bottleneck"] else "")
            for name, s in terms),
        f"    + pipeline fill and drain {format_seconds(r['pipeline_s'])} (chunks of "
        f"{format_bytes(r['chunk_bytes'])})"
        + (f" + latency {format_seconds(r['latency_s'])}" if r["latency_s"] else "")
        + f" = {format_seconds(r['time_s'])}",
    ]


def _ring(g: dict[str, Any]) -> list[str]:
    return [
        f"ring over {g['ranks']} ranks: {format_bytes(g['worker_link_bytes'])} on each "
        "worker link per step, each way",
        f"  time per step: {format_seconds(g['bandwidth_s'])} on the links"
        + (f" + {format_seconds(g['latency_s'])} latency" if g["latency_s"] else "")
        + f" = {format_seconds(g['time_s'])}",
    ]


def _training(t: dict[str, Any]) -> list[str]:
    lines = [f"training: {format_seconds(t['compute_time_s'])} of compute per step, "
             f"{t['overlap']:.0%} of it overlapped with communication"]
    for name in ("reducerd", "ring"):
        s = t[name]
        line = (f"  {name}: step {format_seconds(s['step_time_s'])}, scaling efficiency "
                f"{s['scaling_efficiency']:.1%}")
        if s["minutes_to_train"] is not None:
            line += f", {s['minutes_to_train']:.1f} minutes for {_int(t['steps'])} steps"
        lines.append(line)
    return lines


def _preset(p: dict[str, Any]) -> list[str]:
    rep = p["reported"]
    lines = [f"preset {p['name']}: {p['description']}"]
    if rep:
        lines.append(f"  the original reported: {rep['minutes_to_train']:g} minutes to train, "
                     f"{rep['scaling_efficiency']:.0%} scaling efficiency on {rep['gpus']:,} "
                     f"GPUs (compute per step here: {rep['compute_time_derivation']})")
    return lines


def render(plan: dict[str, Any]) -> str:
    """The plan of `reducerd plan` as the lines it prints."""
    i = plan["inputs"]
    lines = [*_header(i), "", *_reducerd(i, plan["reducerd"]), "", *_ring(plan["ring"])]
    ratio = plan["reducerd_time_over_ring"]
    if ratio is not None:
        lines.append(f"reducerd / ring time per step: {ratio:.2f}x")
    if "training" in plan:
        lines += ["", *_training(plan["training"])]
    if "preset" in plan:
        lines += ["", *_preset(plan["preset"])]
    return "\n".join(lines) + "\n"
