"""join() in reducer_client.torch against LocalGroup (ranks as threads).

Horovod's join cases (allreduce, allgather, broadcast with joined ranks;
the same join() result on every rank) with this backend's divisor (the
ranks that contributed), and DistributedOptimizer steps followed by joined
ranks against one process training on the union of the batches. Real
daemons and workers: tests/integration/test_join.py.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as hvd  # noqa: E402
from test_horovod_local import ok, on_ranks  # noqa: E402


def test_join_allreduce_divides_by_the_ranks_that_contributed():
    """Rank r makes r + 1 averaged allreduces, then joins: each mean is over
    the ranks still in; every rank gets the same join() result, the last joiner."""
    size = 3

    def work(rank, reducer):
        means = [hvd.allreduce(torch.full((5, 5), float(rank + 1)), name="a",
                               reducer=reducer)[0, 0].item() for _ in range(rank + 1)]
        last = hvd.join(reducer=reducer)
        sums = []
        if rank > 0:  # rank 0 joins at once this time
            sums.append(hvd.allreduce(torch.full((2,), float(rank + 1)), op=hvd.Sum,
                                      reducer=reducer)[0].item())
        second = hvd.join(reducer=reducer)
        return means, last, hvd.allgather_object(last, reducer=reducer), sums, second
    results = ok(on_ranks(work, size))
    for rank, (means, last, everyone, sums, second) in enumerate(results):
        assert means == [2.0, 2.5, 3.0][:rank + 1]
        assert last == 2 and everyone == [2, 2, 2]
        assert sums == ([] if rank == 0 else [5.0]) and second != 0


def test_join_integer_allreduce_is_exact_and_averaged_over_the_ranks_in():
    """A joined rank mirrors an integer allreduce on its integer wire: the sum
    is exact (values past float32's 2^24) and the average, Horovod's integer
    one, divides by the ranks that contributed."""
    big = 1 << 40

    def work(rank, reducer):
        if rank == 2:
            hvd.join(reducer=reducer)
            return None
        total = hvd.allreduce(torch.full((3,), big + rank, dtype=torch.int64), op=hvd.Sum,
                              reducer=reducer)
        mean = hvd.allreduce(torch.full((3,), 7 + rank, dtype=torch.int32), reducer=reducer)
        hvd.join(reducer=reducer)
        return total.tolist(), mean.dtype, mean.tolist()
    results = ok(on_ranks(work, 3))
    for total, dtype, mean in results[:2]:
        assert total == [2 * big + 1] * 3
        assert dtype == torch.int32 and mean == [7] * 3  # (7 + 8) / 2, truncated


def test_join_allgather_and_broadcast():
    def work(rank, reducer):
        if rank == 0:
            return hvd.join(reducer=reducer), None, None
        gathered = hvd.allgather(torch.full((rank, 2), float(rank)), reducer=reducer)
        sent = hvd.broadcast(torch.full((3,), float(rank)), root_rank=2, reducer=reducer)
        return hvd.join(reducer=reducer), gathered, sent
    results = ok(on_ranks(work, 3))
    assert [r[0] for r in results] == [2, 2, 2]
    for _, gathered, sent in results[1:]:
        assert gathered.tolist() == [[1, 1], [2, 2], [2, 2]] and torch.all(sent == 2)


def test_optimizer_join_matches_one_process_on_the_union():
    """Ranks with 2, 4 and 3 batches: after join every rank holds the model of
    one process that trained, at each step, on the batches of the ranks
    still in (SGD with momentum: optimizer state follows too)."""
    steps_of = [2, 4, 3]
    torch.manual_seed(0)  # before the threads start
    base = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def data(rank, step):
        g = torch.Generator().manual_seed(100 * rank + step)
        return torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)

    def work(rank, reducer):
        model = copy.deepcopy(base)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                       momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       reducer=reducer)
        for step in range(steps_of[rank]):
            opt.zero_grad()
            x, y = data(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return hvd.join(reducer=reducer), [p.detach().clone() for p in model.parameters()]
    results = ok(on_ranks(work, 3))
    reference = copy.deepcopy(base)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(max(steps_of)):
        active = [r for r in range(3) if step < steps_of[r]]
        opt.zero_grad()
        x = torch.cat([data(r, step)[0] for r in active])
        y = torch.cat([data(r, step)[1] for r in active])
        torch.nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    for last, params in results:
        assert last == 1
        for got, want in zip(params, reference.parameters(), strict=True):
            # float32 sums in another order: a few ulps over 4 steps
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
