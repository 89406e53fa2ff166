"""The TF shim's error feedback switched on explicitly under node-local aggregation.

The scenario and bound of tests/torch_shim/test_torch_node_feedback.py (and
tests/integration/test_node_feedback.py, which derives the bound): one
simulated node of 2 workers on real daemons, the int8 wire, gradients whose
int8 blocks hold one outlier (+-1) and small values (about 1e-3) that the
node's rounding drops on every step. Each worker runs them through the
GradientSteps under its DistributedOptimizer and DistributedGradientTape
(tensorflow/steps.py: the step's control round, feedback, the reduction),
after `rtf.set_error_feedback(True, client)`. The node's slice senders must
keep the residue (NodeFeedback): the sum over the steps is within one
residual of the truth. A worker-side residue would feed back a rounding that
never went on the wire and drift far outside it; so does feedback off.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
from node_feedback_case import NUMEL, STEPS, check_sums, gradient
from support import run_workers

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}



def steps_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import reducer_client.tensorflow as rtf
    from reducer_client import ReducerClient
    from reducer_client.tensorflow.steps import GradientSteps

    sums = {}
    for enabled in (True, False):
        total = np.zeros(NUMEL)
        with ReducerClient(addresses, job=f"{job}-{enabled}", rank=rank,
                           world_size=world_size, wire_dtype="int8", timeout=60.0,
                           node_local=True, local_rank=rank, local_size=world_size) as client:
            rtf.set_error_feedback(enabled, client)
            steps = GradientSteps(client, op="sum")
            for step in range(STEPS):
                total += steps.allreduce(gradient(rank, step), "grads", "sum")
        sums["on" if enabled else "off"] = total
    return sums


def test_explicit_feedback_on_a_node_keeps_the_nodes_residue(daemons):
    world = 2
    with daemons(2) as d:
        job = f"tfnodefb-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        results = run_workers(steps_worker, world, (d.addresses, job), timeout=240,
                              env=WORKER_ENV)
    check_sums(results, world)
