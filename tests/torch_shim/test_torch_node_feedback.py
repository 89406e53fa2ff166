"""The torch shim's error feedback switched on explicitly under node-local aggregation.

Scenario (the setup of tests/integration/test_node_feedback.py): one
simulated node of 2 workers on real daemons, the int8 wire, gradients whose
int8 blocks hold one outlier (+-1) and 127 small values (about 1e-3) that
the node's rounding drops on every step. Each worker reduces them through
the Staging that the DDP hook and the DistributedOptimizer use
(reducer_client.torch._tensors), after `rt.set_error_feedback(True, client)`.

Under node-local aggregation a worker's gradient enters the node's segment
unrounded; the residue belongs to the rank that sends each slice of the
node's sum (NodeFeedback). A worker-side ErrorFeedback there would add, on
every step, the rounding of a quantization that never went on the wire (and
keep no residue of what did), so the sum of what was sent would drift by
the sum of those residues. With the node's feedback the sum over S steps is
within one residual of the truth (the bound of test_node_feedback.py,
derived there); with feedback off (explicitly) it is far outside it, as the
small values are dropped.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from node_feedback_case import NUMEL, STEPS, check_sums, gradient  # noqa: E402
from support import run_workers  # noqa: E402

pytestmark = pytest.mark.timeout(300)




def staging_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import reducer_client.torch as rt
    from reducer_client import ReducerClient
    from reducer_client.torch._tensors import staging_for

    torch.set_num_threads(1)
    sums = {}
    for enabled in (True, False):
        total = np.zeros(NUMEL)
        with ReducerClient(addresses, job=f"{job}-{enabled}", rank=rank,
                           world_size=world_size, wire_dtype="int8", timeout=60.0,
                           node_local=True, local_rank=rank, local_size=world_size) as client:
            rt.set_error_feedback(enabled, client)
            staging = staging_for(client)
            for step in range(STEPS):
                flat = torch.from_numpy(gradient(rank, step))
                total += staging.start(client, flat, "bucket/0", "sum").result(60)
        sums["on" if enabled else "off"] = total
    return sums


def test_explicit_feedback_on_a_node_keeps_the_nodes_residue(daemons):
    world = 2
    with daemons(2) as d:
        job = f"torchnodefb-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        results = run_workers(staging_worker, world, (d.addresses, job), timeout=240)
    check_sums(results, world)
