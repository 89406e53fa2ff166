"""Error feedback with node-local aggregation: the node's slice senders carry the residue.

Scenario: one simulated node of 2 workers (local ranks 0 and 1) on real
daemons, the int8 wire. Every step each worker contributes a gradient whose
int8 blocks hold one outlier (+-1) and 127 small values (about 1e-3): the
node's sum of the small ones stays below half a quantization step of its
block (A / 254 with A = 2), so the node's rounding drops them on every
step. Each worker asks for feedback as a shim does (ErrorFeedback.default_for
gives a NodeFeedback, whose apply() marks the key); each local rank sends
its slice of the node's sum (the key has 2 slices, so both ranks' residues
count). With one node the daemons' result is what the node sent (int8
decoding then encoding again returns the same codes), so the test sees
what was sent.

Bound: with residues r_s (r_0 = 0) the node sends Q(x_s + r_{s-1}) =
x_s + r_{s-1} - r_s, so sum_s sent = sum_s x_s - r_S: the error of the sum
over S steps is one residual, at most e_in = A / 254 (1 + 2^-14) + 2^-142
(reducer_wire.quant.ERROR_BOUND_DOC) with A the block's largest |x_S +
r_{S-1}| <= 2 + e_in, plus per step the float32 node sum (2^-24 |x|) and
the daemons' re-encoding of the decoded values (within 2^-23 |y| of them):
independent of S but for those ulps. Without feedback the error grows with
S (the small values' sum, S x about 2e-3) and must pass the bound.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
from node_feedback_case import NUMEL, STEPS, check_sums, gradient
from reducer_client import ReducerClient
from reducer_client.feedback import ErrorFeedback, NodeFeedback
from support import run_workers


def feedback_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    sums = {"on": np.zeros(NUMEL), "off": np.zeros(NUMEL)}
    with ReducerClient(addresses, job=job, rank=rank, world_size=world_size,
                       wire_dtype="int8", timeout=60.0, node_local=True,
                       local_rank=rank, local_size=world_size) as client:
        feedback = ErrorFeedback.default_for(client)
        assert isinstance(feedback, NodeFeedback), feedback
        for step in range(STEPS):
            for mode, total in sums.items():
                values = gradient(rank, step)
                if mode == "on":
                    before = values.copy()
                    feedback.apply(f"grad/{mode}", values)
                    # the worker's own values go to the node unrounded, unchanged
                    assert np.array_equal(values, before)
                total += client.allreduce(values, f"grad/{mode}", "sum")
    return sums


def test_node_sends_its_residue_on(daemons):
    world = 2
    with daemons(2) as d:
        results = run_workers(feedback_worker, world, (d.addresses, f"nodefb-{os.getpid()}-"
                                                                    f"{uuid.uuid4().hex[:8]}"),
                              timeout=240)
    check_sums(results, world)
