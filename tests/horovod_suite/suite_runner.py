"""Run vendored Horovod test functions as one rank of a job on real daemons.

`run_cases(rank, world_size, addresses, job, suites)` is a run_workers
target: it sets the environment a launcher would (reducerd's REDUCER_*
variables and Horovod's HOROVOD_RANK / HOROVOD_SIZE, as horovodrun sets
them; REDUCER_WIRE_DTYPE=float32, Horovod's uncompressed numerics, which the
suites compare exactly), imports each vendored module from upstream/parallel and runs the named
test functions of its TestCase class in order, in this one process. Every
case gets a job id of its own (the client is shut down between cases), so a
case that fails on one rank only costs the other rank one client timeout and
never leaves rounds behind for the next case; a one-element allreduce under
a job of its own ("gate") lines the ranks up before each case.

`names` None runs every test function of the module. With `progress`, each
outcome is also appended as a JSON line to `{progress}.{rank}` as it comes
(a survey keeps what it learnt if a later case hangs).

Returns {module: {function: (outcome, detail)}}, outcome one of "pass",
"fail" (an assertion), "error" (any other exception), "skip" (the function
skipped itself, e.g. a GPU case on a CPU host).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import unittest
from pathlib import Path

import numpy as np

UPSTREAM = Path(__file__).resolve().parent / "upstream" / "parallel"
# The client's timeout for one collective: a case whose peer failed waits this long.
CASE_TIMEOUT_S = 15.0
# A rank may reach the next case up to two case timeouts after the other.
GATE_TIMEOUT_S = 3 * CASE_TIMEOUT_S


def _test_case_class(module) -> type[unittest.TestCase]:
    classes = [value for value in vars(module).values()
               if isinstance(value, type) and issubclass(value, unittest.TestCase)
               and value.__module__ == module.__name__]
    if len(classes) != 1:
        raise RuntimeError(f"{module.__name__}: expected one TestCase class, found {classes}")
    return classes[0]


def _outcome(result: unittest.TestResult) -> tuple[str, str]:
    if result.failures:
        return "fail", result.failures[0][1]
    if result.errors:
        return "error", result.errors[0][1]
    if result.skipped:
        return "skip", result.skipped[0][1]
    if result.unexpectedSuccesses:
        return "fail", "unexpected success"
    return "pass", ""


def _gate(job: str) -> None:
    """Wait for every rank to reach this case: a case that failed fast on one
    rank must not start the next case while the other still waits out its
    timeout (the daemons' round timeout would fail the next case too)."""
    from reducer_client.client import ReducerClient

    client = ReducerClient.from_env(job=f"{job}.gate", timeout=GATE_TIMEOUT_S)
    try:
        client.allreduce(np.zeros(1, np.float32), "gate")
    finally:
        client.close()


def case_names(module) -> list[str]:
    """Every test function of a vendored module's TestCase class, in source order."""
    case_class = _test_case_class(module)
    return [name for name, value in vars(case_class).items()
            if name.startswith("test") and callable(value)]


def run_cases(rank: int, world_size: int, addresses: list[str], job: str,
              suites: list[tuple[str, list[str] | None]],
              progress: str | None = None) -> dict[str, dict[str, tuple[str, str]]]:
    os.environ.update(
        REDUCER_ADDRESSES=",".join(addresses), REDUCER_RANK=str(rank),
        REDUCER_WORLD_SIZE=str(world_size), REDUCER_TIMEOUT=str(CASE_TIMEOUT_S),
        REDUCER_WIRE_DTYPE="float32",
        HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(world_size),
        OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    sys.path.insert(0, str(UPSTREAM))
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for module_name, names in suites:
        module = importlib.import_module(module_name)
        case_class = _test_case_class(module)
        hvd = module.hvd
        results = out.setdefault(module_name, {})
        for name in names if names is not None else case_names(module):
            if hvd.is_initialized():
                hvd.shutdown()
            _gate(f"{job}.{module_name}.{name}")
            os.environ["REDUCER_JOB"] = f"{job}.{module_name}.{name}"
            result = unittest.TestResult()
            start = time.monotonic()
            case_class(name).run(result)
            outcome, detail = _outcome(result)
            results[name] = (outcome, f"{time.monotonic() - start:.1f} s\n{detail}")
            if progress is not None:
                with open(f"{progress}.{rank}", "a") as log:
                    log.write(json.dumps([module_name, name, outcome, results[name][1]]) + "\n")
        if hvd.is_initialized():
            hvd.shutdown()
    return out
