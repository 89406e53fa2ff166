"""The DDP hook and the DistributedOptimizer reduce into their own buffers, exactly.

Against LocalGroup (ranks as threads) and a pass-through Reducer: which
buffers the core is handed (out=), that steady-state steps allocate no
result arrays (tracemalloc sees every NumPy allocation), and the numerics of
a float16 wire against a float64 reference with the bound derived below.
"""

from __future__ import annotations

import tracemalloc
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

STEPS = 4


class FakeBucket:
    """The part of dist.GradBucket the hook uses."""

    def __init__(self, index: int, buffer: torch.Tensor) -> None:
        self._index, self._buffer = index, buffer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return []  # recorded by the hook for join(), which these tests do not call


class Recording:
    """Forwards to a Reducer; records the memory of each call's input and out=."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.local_rank, self.local_size = inner.local_rank, inner.local_size
        self.timeout, self.wire_dtype = inner.timeout, inner.wire_dtype
        self.calls: list[tuple[str, int, int | None]] = []

    def allreduce_async(self, array, key, op="sum", *, out=None):
        if not key.startswith("hvd/control"):  # the hook's control round for join()
            self.calls.append((key, array.ctypes.data,
                               None if out is None else out.ctypes.data))
        return self.inner.allreduce_async(array, key, op, out=out)

    def close(self):
        self.inner.close()


def on_ranks(fn, world_size: int = 2, wire_dtype: str = "float32") -> list:
    group = LocalGroup(world_size, timeout=20, wire_dtype=wire_dtype)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, rank, group.client(rank)) for rank in range(world_size)]
        return [f.result(60) for f in futures]


def test_hook_reduces_a_cpu_bucket_in_place():
    """float32: the core gets the bucket's own memory as input and out=, every step."""
    def work(rank, reducer):
        recording = Recording(reducer)
        buffer = torch.empty(1000)
        results = []
        for step in range(STEPS):
            buffer.fill_(float(rank + step))
            reduced = rt.allreduce_hook(recording, FakeBucket(0, buffer)).wait()
            results.append((reduced.data_ptr(), reduced[0].item()))
        return buffer.data_ptr(), recording.calls, results
    for pointer, calls, results in on_ranks(work):
        assert calls == [("ddp/bucket/0", pointer, pointer)] * STEPS
        assert results == [(pointer, step + 0.5) for step in range(STEPS)]


def test_hook_bfloat16_bucket_reuses_one_host_buffer():
    def work(rank, reducer):
        recording = Recording(reducer)
        buffer = torch.empty(64, dtype=torch.bfloat16)
        values = []
        for step in range(STEPS):
            buffer.fill_(float(2 * rank + step))
            values.append(rt.allreduce_hook(recording, FakeBucket(1, buffer)).wait()[0].item())
        return buffer.data_ptr(), recording.calls, values
    for pointer, calls, values in on_ranks(work):
        staging = {inp for _, inp, _ in calls}
        assert len(staging) == 1 and staging != {pointer}
        assert all(out == inp for _, inp, out in calls)
        assert values == [1.0 + step for step in range(STEPS)]


def test_optimizer_reduces_each_bucket_into_its_flat_buffer():
    def work(rank, reducer):
        recording = Recording(reducer)
        model = make_model("mlp")
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      bucket_bytes=1024, reducer=recording)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch("mlp", step, rank)
            loss_of("mlp", model(x), y).backward()
            opt.step()
        flats = {b.key: b.flat.data_ptr() for b in opt._gradients.buckets}
        # Each step's cross-rank control round (reducer_client.steps) is no bucket.
        return flats, [c for c in recording.calls if not c[0].startswith("hvd/control")]
    for flats, calls in on_ranks(work):
        assert len(flats) > 1 and len(calls) == STEPS * len(flats)
        for key, inp, out in calls:
            assert inp == out == flats[key], key


class PassThrough:
    """A one-rank Reducer that allocates exactly what ReducerClient does: the
    result array when no out= is given, nothing else."""

    rank, world_size, local_rank, local_size = 0, 1, 0, 1
    timeout, wire_dtype = 10.0, "float32"

    def allreduce_async(self, array, key, op="sum", *, out=None):
        result = np.empty(array.shape, array.dtype) if out is None else out
        np.copyto(result, array)
        future: Future = Future()
        future.set_result(result)
        return future

    def close(self):
        pass


def _peak_numpy_bytes(step, steps: int = 3) -> int:
    """Peak traced bytes above the start while running `step` `steps` times."""
    step()  # the first step may allocate (buffers are made then)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(steps):
            step()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_steady_state_steps_allocate_no_result_arrays():
    """A 4 MiB bucket: a step's NumPy allocations stay far below one bucket.

    The old path (np.empty per bucket per step in the core, no out=) would
    allocate the whole 4 MiB every step.
    """
    reducer = PassThrough()
    bucket_bytes = 4 << 20
    buffer = torch.ones(bucket_bytes // 4)
    hook_peak = _peak_numpy_bytes(
        lambda: rt.allreduce_hook(reducer, FakeBucket(0, buffer)).wait())

    model = torch.nn.Linear(1024, 1024, bias=False)  # one 4 MiB parameter
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                  reducer=reducer)
    x = torch.ones(2, 1024)

    def optimizer_step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).sum().backward()
        opt.step()
    optimizer_peak = _peak_numpy_bytes(optimizer_step)
    print(f"NumPy bytes per steady step: hook {hook_peak}, optimizer {optimizer_peak}")
    assert hook_peak < bucket_bytes // 64 and optimizer_peak < bucket_bytes // 64


# float16 wire, N ranks, mean. Each element travels as fl16(x_r) with
# |fl16(x) - x| <= u |x| (u = 2^-11, unit roundoff, for |x| in the normal
# range; the data below stay in [2^-6, 4]); the float32 sum and the float32
# division add at most N * 2^-24 relative, and the result is rounded to
# float16 once more (u again). So
#   |result - mean(x)| <= u * mean(|x|) + u * |mean(fl16 x)| + N * 2^-24 * mean(|x|)
# and with |mean(fl16 x)| <= (1 + u) mean(|x|):
#   bound = (2u + u^2 + N 2^-24) * mean(|x|).
_U16 = 2.0 ** -11


def _fp16_mean_bound(values: np.ndarray) -> np.ndarray:
    world_size = values.shape[0]
    scale = np.abs(values).mean(axis=0)
    return (2 * _U16 + _U16 ** 2 + world_size * 2.0 ** -24) * scale


@pytest.mark.parametrize("world_size", [2, 3])
def test_float16_wire_hook_and_optimizer_stay_within_the_derived_bound(world_size):
    rng = np.random.default_rng(world_size)
    signs = rng.choice([-1.0, 1.0], size=(world_size, 4096))
    values = (signs * rng.uniform(2.0 ** -6, 4.0, size=(world_size, 4096))).astype(np.float32)
    reference = values.astype(np.float64).mean(axis=0)
    bound = _fp16_mean_bound(values.astype(np.float64))

    def work(rank, reducer):
        buffer = torch.from_numpy(values[rank].copy())
        hooked = rt.allreduce_hook(reducer, FakeBucket(0, buffer)).wait().numpy().copy()
        param = torch.nn.Parameter(torch.zeros(4096))
        opt = rt.DistributedOptimizer(torch.optim.SGD([param], lr=1.0), reducer=reducer)
        param.grad = None
        (param * torch.from_numpy(values[rank])).sum().backward()
        opt.step()  # param = 0 - 1.0 * mean gradient
        return hooked, -param.detach().numpy()

    for hooked, stepped in on_ranks(work, world_size, wire_dtype="float16"):
        for got in (hooked, stepped):
            error = np.abs(got.astype(np.float64) - reference)
            assert np.all(error <= bound), float((error / bound).max())
            # The float16 wire is really there: results are float16 values.
            assert np.array_equal(got, got.astype(np.float16).astype(np.float32))
