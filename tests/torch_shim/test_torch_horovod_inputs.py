"""Horovod's inputs the torch shim takes as Horovod does (LocalGroup, no daemon).

0-d tensors through allreduce, grouped_allreduce and broadcast keep their
shape (Horovod's ImageNet example broadcasts torch.tensor(resume_from_epoch));
broadcast_parameters takes plain tensors, list(model.parameters()).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def on_ranks(fn, world_size: int = 2, timeout: float = 20.0) -> list:
    """Run fn(rank, reducer) on `world_size` threads sharing one LocalGroup."""
    group = LocalGroup(world_size, timeout=timeout)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, rank, group.client(rank)) for rank in range(world_size)]
        return [f.result(timeout) for f in futures]


def test_zero_dim_tensors_keep_their_shape():
    def work(rank, reducer):
        total = rt.allreduce(torch.tensor(1.0 + rank), name="a", reducer=reducer)
        grouped = rt.grouped_allreduce([torch.tensor(1.0), torch.tensor(2.0)], name="g",
                                       reducer=reducer)
        in_place = torch.tensor(2.0 * rank, dtype=torch.bfloat16)
        rt.allreduce_(in_place, name="i", reducer=reducer)
        value = rt.broadcast(torch.tensor(5.0 + rank), root_rank=0, name="b", reducer=reducer)
        into = torch.tensor(5.0 + rank)
        rt.broadcast_(into, root_rank=0, name="b_", reducer=reducer)
        # Horovod's ImageNet example.
        epoch = rt.broadcast(torch.tensor(3 if rank == 0 else 0), root_rank=0,
                             name="resume_from_epoch", reducer=reducer)
        return total, grouped, in_place, value, into, epoch
    for total, grouped, in_place, value, into, epoch in on_ranks(work):
        assert total.shape == () and total.item() == 1.5
        assert [t.shape for t in grouped] == [(), ()]
        assert in_place.shape == () and in_place.item() == 1.0
        assert value.shape == () and value.item() == 5.0 and into.item() == 5.0
        assert epoch.shape == () and epoch.dtype == torch.int64 and epoch.item() == 3


def test_broadcast_parameters_takes_plain_tensors():
    def work(rank, reducer):
        torch.manual_seed(rank)
        model = torch.nn.Linear(2, 1)
        rt.broadcast_parameters(list(model.parameters()), root_rank=0, reducer=reducer)
        return [p.detach().clone() for p in model.parameters()]
    first, second = on_ranks(work)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
