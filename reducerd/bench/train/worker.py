"""One training-bench worker: `python -m reducerd.bench.train.worker SPEC_JSON`.

For each system in turn, builds the modeled model and the system's trainer,
then:
1. one step, checked against the float64 reference (every parameter within
   the bound for the system's wire dtype; an 8-bit wire's error feedback
   holds nothing yet at the first step), then the rest of the warm-up;
2. `steps` timed steps with modeled compute;
3. `comm_steps` steps with the compute waits off: communication alone.

Each step's time is the interval between the starts of consecutive steps,
so work a step leaves pending (crossing the barrier) is charged to the step
that waits for it. Reports go to stdout as `@bench ` JSON lines
(reducerd.bench.worker's format).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np

from reducerd.bench.worker import emit

__all__ = ["main", "UNIT_ROUNDOFF"]

# Half an ulp of 1.0, relative: the largest relative rounding error of each dtype.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}


def wire_of(spec: dict[str, Any]) -> str:
    """The dtype gradients travel in for the spec's system."""
    system = spec["system"]
    if system.startswith("reducerd-"):
        return spec["wire_dtype"]
    return "float16" if system == "gloo-ddp-float16" else "float32"


def _check_first_step(model, reference, largest, spec: dict[str, Any]) -> dict[str, float]:
    from reducerd.bench.train.modeled import eight_bit_error_bound, error_bound

    worst_ratio, worst_abs = 0.0, 0.0
    params = [p for layer in model.modeled_layers() for p in layer.parameters(recurse=False)]
    wire, lr, world = wire_of(spec), spec["lr"], spec["world_size"]
    largest_anywhere = max(float(np.max(big)) for big in largest)
    for param, ref, big in zip(params, reference, largest, strict=True):
        got = param.detach().double().cpu().numpy().ravel()
        if wire in UNIT_ROUNDOFF:
            bound = error_bound(ref, big, lr, world, UNIT_ROUNDOFF[wire])
        else:
            bound = eight_bit_error_bound(ref, big, lr, world, wire, largest_anywhere)
        error = np.abs(got - ref)
        worst_ratio = max(worst_ratio, float(np.max(error / bound)))
        worst_abs = max(worst_abs, float(np.max(error)))
    if worst_ratio > 1:
        raise AssertionError(f"{spec['system']} rank {spec['rank']}: after one step a "
                             f"parameter is {worst_ratio:.3g}x its error bound from the "
                             "float64 reference")
    return {"max_error_over_bound": worst_ratio, "max_abs_error": worst_abs}


def _launch_figures(launches: list[float], backward_ends: list[float]) -> dict[str, Any]:
    """How many reductions one step started, how many before its backward ended."""
    if not launches or not backward_ends:
        return {"launches": len(launches), "launched_in_backward": None, "launch_lag_s": None}
    end = max(backward_ends)
    lags = [launch - max((e for e in backward_ends if e <= launch), default=launch)
            for launch in launches]
    return {"launches": len(launches),
            "launched_in_backward": sum(1 for t in launches if t < end) / len(launches),
            "launch_lag_s": statistics.median(lags)}


def _timed_steps(trainer, clock, count: int, system: str, phase: str,
                 ) -> list[dict[str, Any]]:
    """`count` steps; each one's period, compute waited and launch figures."""
    records = []
    clock.take()
    if trainer.reducer is not None:
        trainer.reducer.take()
    start = time.perf_counter()
    for i in range(count):
        trainer.iteration()
        if i == count - 1:
            trainer.settle()  # the last step's pending updates belong to it
        now = time.perf_counter()
        waited, ends = clock.take()
        launches = trainer.reducer.take() if trainer.reducer is not None else []
        records.append({"period_s": now - start, "compute_s": waited,
                        **_launch_figures(launches, ends)})
        start = now
        emit("iter", system=system, phase=phase, iteration=i)
    return records


def run_system(spec: dict[str, Any]) -> None:
    """Check, warm up, time and tear down one system on this rank."""
    from reducerd.bench.train.config import Accelerator, layer_flops, layer_times
    from reducerd.bench.train.modeled import ComputeClock, build_model, reference_step
    from reducerd.bench.train.specs import model_spec
    from reducerd.bench.train.trainers import make_trainer

    system = spec["system"]
    model_desc = model_spec(spec["model"])
    accelerator = Accelerator(spec["accelerator"], spec["peak_flops"], spec["utilisation"])
    device = spec.get("device", "cpu")
    if device == "cuda":
        import torch

        from reducerd.bench.train.gpu import GpuCompute

        torch.cuda.set_device(0)  # the workers share the machine's first GPU
        clock, costs = GpuCompute(torch.device("cuda", 0)), layer_flops(model_desc, spec["batch"])
    else:
        clock = ComputeClock()
        costs = layer_times(model_desc, spec["batch"], accelerator, spec["time_scale"])
    model = build_model(model_desc, costs, spec["byte_scale"], clock, spec["rank"], device)
    reference, largest = reference_step(model, spec["world_size"], spec["lr"])
    trainer = make_trainer(model, spec)
    try:
        trainer.iteration()
        trainer.settle()
        emit("check", system=system, **_check_first_step(model, reference, largest, spec))
        del reference, largest
        for i in range(spec["warmup"] - 1):
            trainer.iteration()
            emit("iter", system=system, phase="warmup", iteration=i + 1)
        trainer.settle()
        steps = _timed_steps(trainer, clock, spec["steps"], system, "steps")
        clock.enabled = False
        comm = _timed_steps(trainer, clock, spec["comm_steps"], system, "comm")
        emit("result", system=system, steps=steps, comm_steps=comm)
    finally:
        trainer.close()


def run(spec: dict[str, Any]) -> None:
    """Every system of the spec in turn, in this one process (torch is imported once).

    Each system has its own job (reducerd) or master port (Gloo), so one
    cannot see another's traffic; the first collective of each one's set-up
    (DDP's or broadcast_parameters' broadcast) lines the ranks up.
    """
    emit("ready")
    for system in spec["systems"]:
        run_system({**spec, "system": system, "master": spec["masters"][system],
                    "job": f"{spec['job']}-{system}"})


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    try:
        run(spec)
    except BaseException as exc:  # report everything, a KeyboardInterrupt included
        traceback.print_exc(file=sys.stderr)
        emit("error", message=f"{type(exc).__name__}: {exc}")
        return 1
    emit("done")
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: it would free the retired DDP models, whose
    # process groups' destructors can deadlock on the GIL (trainers.py).
    os._exit(code)
