"""The 8-bit wires of a "reducer" process group: error feedback, against float64.

Each group (dist.new_group with ReducerOptions(wire_dtype, error_feedback))
all-reduces one tensor ROUNDS times, as DDP reduces a bucket every step,
with the same contribution x on both ranks each time, so the float64
reference of every round is 2x. Per wire, element by element:
- the first round goes out as it is: within test_quant_wire.wire_bound;
- with error feedback (the default on these wires) the sum of the ROUNDS
  results is within one residual per rank of ROUNDS x 2x. Each rank sends
  Q(x + r) and keeps r' = x + r - Q(x + r), so its contributions add up to
  ROUNDS x x - r_last; |r| <= rho / (1 - slope), rho the wire's rounding of
  x (the bound's `rounding`) and slope how much that rounding grows per unit
  of r (1/254 of the block for int8, u for FP8). Both ranks sending the same
  Q(v), the daemons' float32 sum 2 Q(v) and its rounding to the wire are
  exact for FP8 and, for int8, exact up to the float32 rounding of the block
  scale (2^-23 relative: the ROUNDS x 4 U32 term);
- without it (error_feedback=False) the same rounding of x repeats ROUNDS
  times, beyond that bound: the feedback is what keeps the sum.
The same holds for a bfloat16 tensor, which goes through a float32 host
copy (plus the rounding of each result to bfloat16, u = 2^-8). A tensor's residual
goes with the tensor (the group holds none once it is
freed); DDP with no hook on such a group keeps one residual per bucket
buffer across its steps (two buffers in all: DDP rebuilds its bucket
after the first step), and error_feedback=True on a 16-bit wire is refused. The workers
share a host but aggregate no node-local sum (REDUCER_NODE_LOCAL=0): under
node-local aggregation the node's slice senders round, and the group leaves
feedback off (torch/_group_feedback.py).
"""

from __future__ import annotations

import datetime
import gc
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from backend_workers import init_worker, torchrun_env  # noqa: E402
from support import run_workers  # noqa: E402
from test_quant_wire import FP8, U32, _block_max, make_inputs, wire_bound  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

pytestmark = pytest.mark.timeout(240)

WIRES = ("int8", "fp8_e4m3", "fp8_e5m2")
ROUNDS = 8
NUMEL = 3001  # not a whole number of int8 blocks
DDP_STEPS = 5


def contribution(wire: str) -> np.ndarray:
    """x: every rank's contribution in every round (FP8: twice it stays in range)."""
    return make_inputs(1, 5, NUMEL, wire)[0]


def rounding_and_slope(x: np.ndarray, wire: str) -> tuple[np.ndarray, float]:
    """The wire's rounding error bound of x (wire_bound's `rounding`) and its slope."""
    wide = np.abs(x.astype(np.float64))
    if wire == "int8":
        return _block_max(wide) / 254 * (1 + 2.0 ** -14) + 2.0 ** -142, 1 / 254
    u, a, _ = FP8[wire]
    return u * wide + a / 2, u


def _held_once_freed(group, within_s: float = 5.0) -> int | None:
    """How many residuals the group holds once the tensors are freed: the
    thread that settled the last all_reduce may still hold its output a moment."""
    if group.feedback is None:
        return None
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        if len(group.feedback) == 0 or time.monotonic() > deadline:
            return len(group.feedback)
        time.sleep(0.05)


def wires_worker(rank: int, world: int, env: dict[str, str]) -> dict:
    init_worker(rank, world, env)
    from reducer_client.torch.backend import ReducerOptions
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=30))
    out: dict = {}
    try:
        for wire in WIRES:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.from_numpy(contribution(wire)).to(dtype)
                for feedback in (None, False):
                    group = dist.new_group(backend="reducer",
                                           pg_options=ReducerOptions(wire, feedback))
                    bucket = torch.empty_like(x)  # reduced again and again, as DDP's buckets
                    total = np.zeros(NUMEL)
                    for step in range(ROUNDS):
                        bucket.copy_(x)
                        dist.all_reduce(bucket, group=group)
                        got = bucket.double().numpy()
                        if step == 0:
                            out[wire, dtype, feedback, "first"] = got
                        total += got
                    out[wire, dtype, feedback] = total
                    held = len(group.feedback) if group.feedback is not None else None
                    del bucket
                    out[wire, dtype, feedback, "held"] = (held, _held_once_freed(group))
        group = dist.new_group(backend="reducer", pg_options=ReducerOptions("int8"))
        model = DDP(make_model("mlp"), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(DDP_STEPS):
            x, y = batch("mlp", step, rank)
            opt.zero_grad()
            loss_of("mlp", model(x), y).backward()
            opt.step()
        out["ddp"] = (len(group.feedback), group.feedback.tensors_seen)
        try:
            ReducerOptions("bfloat16", error_feedback=True)
        except ValueError as exc:
            out["refused"] = str(exc)
    finally:
        dist.destroy_process_group()
    return out


def test_8bit_group_wires_with_error_feedback_against_float64(daemons):
    world = 2
    with daemons(2, round_timeout=30) as d:
        results = run_workers(wires_worker, world,
                              (torchrun_env(d.addresses, REDUCER_WIRE_DTYPE="float32",
                                           REDUCER_NODE_LOCAL="0"),),
                              timeout=200)
    for rank, out in enumerate(results):
        assert "8-bit wires" in out["refused"] and "bfloat16" in out["refused"]
        assert out["ddp"] == (1, 2)  # the live bucket's residual; first and rebuilt buffers
        for wire in WIRES:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.from_numpy(contribution(wire)).to(dtype).double().numpy()
                reference = world * x
                first = out[wire, dtype, None, "first"]
                rho, slope = rounding_and_slope(x, wire)
                residual = world * rho / (1 - slope)
                # bfloat16: each round's result rounded to it (u = 2^-8 relative), of
                # at most |reference| + 2 residuals.
                result = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
                once = wire_bound([x.astype(np.float32)] * world, wire, "sum")
                assert np.all(np.abs(first - reference)
                              <= once + result * (np.abs(reference) + once))
                bound = residual + ROUNDS * ((4 * U32 + 2.0 ** -53) * np.abs(reference)
                                             + result * (np.abs(reference) + 2 * residual))
                fed = np.max(np.abs(out[wire, dtype, None] - ROUNDS * reference) / bound)
                plain = np.max(np.abs(out[wire, dtype, False] - ROUNDS * reference) / bound)
                print(f"rank {rank} {wire} {dtype}: |sum of {ROUNDS} rounds - float64| / "
                      f"bound: with feedback {fed:.3f}, without {plain:.3f}")
                assert fed <= 1.0, (wire, dtype, fed)
                assert plain > 1.0, (wire, dtype, plain)  # without it the rounding adds up
                # one live tensor; none once freed
                assert out[wire, dtype, None, "held"] == (1, 0)
                assert out[wire, dtype, False, "held"] == (None, None)


def test_error_feedback_options_are_checked():
    """ReducerOptions and the group's choice, without daemons: a fake client
    stands for one with node-local aggregation (its node group set)."""
    from types import SimpleNamespace

    from reducer_client.torch._group_feedback import group_feedback
    from reducer_client.torch.backend import ReducerOptions

    with pytest.raises(ValueError, match="8-bit wires"):
        ReducerOptions("float16", error_feedback=True)
    with pytest.raises(TypeError, match="None, True or False"):
        ReducerOptions("int8", error_feedback="yes")
    alone = SimpleNamespace(wire_dtype="float16", _node=None)
    assert group_feedback(alone, "int8", None).wire_dtype == "int8"
    assert group_feedback(alone, "int8", False) is None
    assert group_feedback(alone, None, None) is None  # the client's float16 wire
    with pytest.raises(ValueError, match="8-bit wires"):
        group_feedback(alone, None, True)
    on_a_node = SimpleNamespace(wire_dtype="int8", _node=object())
    assert group_feedback(on_a_node, None, None) is None
    with pytest.raises(ValueError, match="node-local aggregation"):
        group_feedback(on_a_node, "int8", True)
