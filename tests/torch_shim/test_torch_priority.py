"""DistributedOptimizer(prioritize=True), against LocalGroup: each bucket's
reduction carries a priority that grows toward the input (the bucket the next
forward needs first is the most urgent), and the updates stay exactly the
plain optimizer's, with crossing the barrier or without.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

STEPS = 3
_MODEL_LOCK = threading.Lock()  # make_model seeds torch's global generator


class Recording:
    """A rank's LocalGroup client that records each allreduce's key and priority
    (None: the keyword was left out)."""

    def __init__(self, base) -> None:
        self.base = base
        self.calls: list[tuple[str, int | None]] = []

    def __getattr__(self, name):
        return getattr(self.base, name)

    def allreduce_async(self, array, key, op="sum", *, out=None, **extra):
        self.calls.append((key, extra.get("priority")))
        return self.base.allreduce_async(array, key, op, out=out, **extra)


def _train(rank: int, reducer, prioritize: bool, overlap: bool):
    with _MODEL_LOCK:
        model = make_model("mlp")
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  bucket_bytes=600, reducer=reducer, name="opt",
                                  overlap_forward=model if overlap else None,
                                  prioritize=prioritize)
    for step in range(STEPS):
        x, y = batch("mlp", step, rank)
        opt.zero_grad()
        loss_of("mlp", model(x), y).backward()
        opt.step()
    opt.finish_step()
    return [p.detach().clone() for p in model.parameters()], opt


def _on_ranks(prioritize: bool, overlap: bool, world_size: int = 2):
    group = LocalGroup(world_size, timeout=30)
    reducers = [Recording(group.client(r)) for r in range(world_size)]
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(_train, r, reducers[r], prioritize, overlap)
                   for r in range(world_size)]
        return [f.result(60) for f in futures], reducers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
def test_prioritized_updates_equal_the_plain_optimizer(overlap: bool):
    plain, _ = _on_ranks(prioritize=False, overlap=False)
    urgent, reducers = _on_ranks(prioritize=True, overlap=overlap)
    for rank in range(2):
        for a, b in zip(plain[rank][0], urgent[rank][0], strict=True):
            assert torch.equal(a, b)
    buckets = urgent[0][1]._gradients.buckets
    assert len(buckets) >= 3  # several buckets, so the order has a meaning
    step_calls = [c for c in reducers[0].calls if c[0].startswith("opt/bucket.")]
    priorities = dict(step_calls)
    # Bucket i holds layers nearer the input than bucket i - 1: priority i + 1.
    assert priorities == {b.key: i + 1 for i, b in enumerate(buckets)}
    assert len(step_calls) == STEPS * len(buckets)


@pytest.mark.timeout(60)
def test_without_prioritize_no_priority_is_passed():
    _, reducers = _on_ranks(prioritize=False, overlap=False)
    assert all(priority is None for _, priority in reducers[0].calls)
