"""The DDP comm hook's keys per model and per bucket layout (LocalGroup, no daemon).

Scenarios: two DDP models on one client (a GAN, teacher and student) with
error feedback on must not share residuals, and join() must re-sync both;
DDP's bucket rebuild keeps a bucket's size and reorders its parameters, so
the first layout's residual must not land on other parameters, and each
parameter's residual goes with it to its new place; models get keys in the order
of their first backward, and models the hook cannot tell apart raise (a
HookState per model separates them).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from reducer_client.torch import hooks  # noqa: E402
from reducer_client.torch.hooks import hook_parameters  # noqa: E402
from support import KeySpy  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank Gloo default process group (DDP needs one); destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


class Scaled(torch.nn.Module):
    """sum(w * scale): w's gradient is `scale`, whatever w is."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(scale.numel()))
        self.register_buffer("scale", scale)

    def forward(self):
        return (self.w * self.scale).sum()


def test_two_ddp_models_keep_their_own_residuals(one_rank_group):
    """int8 wire, two models whose buckets have the same size and very different
    gradients: each model's gradient stays its own (a shared residual adds the
    big model's rounding to the small model's), and join() re-syncs both."""
    reducer = LocalGroup(1, wire_dtype="int8").client(0)
    big = DDP(Scaled(torch.full((128,), 1000.0) + torch.arange(128) * 0.37))
    small = DDP(Scaled(torch.full((128,), 0.001)))
    for model in (big, small):
        model.register_comm_hook(state=reducer, hook=rt.allreduce_hook)
    for _ in range(3):
        for model in (big, small):
            model.zero_grad()
            model().backward()
        # 0.001 in its own int8 blocks: the rounding is below 1% (1/127 of the block's max).
        torch.testing.assert_close(small.module.w.grad, torch.full((128,), 0.001),
                                   rtol=0.01, atol=0.0)
    hooked = {id(p) for p in hook_parameters(reducer)}
    assert all(id(p) in hooked for m in (big, small) for p in m.parameters())


def test_ddp_rebuild_keeps_residuals_off_other_parameters(one_rank_group):
    """DDP's bucket rebuild keeps the bucket's size and reorders its parameters:
    the residual of the first layout must not be added to the second."""

    class Crossed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.full((128,), 0.001))  # registered first
            self.w2 = torch.nn.Parameter(torch.full((128,), 1000.0) + torch.arange(128) * 0.37)

        def forward(self):
            # w1 is used first, so its gradient (w2, ~1000) is ready last;
            # w2's gradient is w1 (0.001).
            return (self.w2 * (self.w1 * 1.0)).sum()

    reducer = LocalGroup(1, wire_dtype="int8").client(0)
    model = DDP(Crossed())
    model.register_comm_hook(state=reducer, hook=rt.allreduce_hook)
    for _ in range(3):
        model.zero_grad()
        model().backward()
        torch.testing.assert_close(model.module.w2.grad, torch.full((128,), 0.001),
                                   rtol=0.01, atol=0.0)


def test_ddp_rebuild_carries_each_parameters_residual_to_its_new_place(one_rank_group):
    """The residual of a parameter DDP's rebuild moves within its bucket goes
    with it. Each parameter is one int8 block: an outlier 1.0 and small values
    below half a step (1/254), +0.003 in w1's gradient and -0.003 in w2's. The
    first step drops them (their residual is kept); the second, on the rebuilt
    layout (w2 first), sends twice them, which rounds to one step, +-1/127,
    only if each residual followed its parameter (forgotten: 0; left in place,
    w1's +0.003 meets w2's -0.003: 0)."""
    step, small = 1.0 / 127, 0.003

    def pattern(sign: float) -> torch.Tensor:
        values = torch.full((128,), sign * small)
        values[0] = 1.0
        return values

    class Crossed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Parameter(pattern(-1.0))  # w2's gradient
            self.w2 = torch.nn.Parameter(pattern(+1.0))  # w1's gradient

        def forward(self):  # w1 is used first, so its gradient is ready last
            return (self.w2 * (self.w1 * 1.0)).sum()

    reducer = LocalGroup(1, wire_dtype="int8").client(0)
    model = DDP(Crossed())
    model.register_comm_hook(state=reducer, hook=rt.allreduce_hook)
    seen = []
    for _ in range(2):
        model.zero_grad()
        model().backward()
        seen.append((model.module.w1.grad[1:].clone(), model.module.w2.grad[1:].clone()))
    (w1_first, w2_first), (w1_second, w2_second) = seen
    assert not w1_first.any() and not w2_first.any()  # dropped by the rounding
    torch.testing.assert_close(w1_second, torch.full((127,), step), rtol=1e-3, atol=0.0)
    torch.testing.assert_close(w2_second, torch.full((127,), -step), rtol=1e-3, atol=0.0)


class Bucket:
    """The part of dist.GradBucket the hook uses, with parameters."""

    def __init__(self, index: int, params: list, last: bool) -> None:
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([p.detach().reshape(-1) for p in params])

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return self._params

    def is_last(self) -> bool:
        return self._last


def _params(count: int) -> list:
    return [torch.nn.Parameter(torch.ones(4)) for _ in range(count)]


def test_hook_keys_follow_the_model_in_order_of_first_backward():
    """Models get keys in the order of their first backward; a later backward of
    the first model keeps its keys."""
    reducer = KeySpy(LocalGroup(1, wire_dtype="float32").client(0))
    a, b = _params(2), _params(1)
    for index, params, last in [(0, a[1:], False), (1, a[:1], True), (0, b, True),
                                (0, a[1:], False), (1, a[:1], True), (0, b, True)]:
        rt.allreduce_hook(reducer, Bucket(index, params, last)).wait()
    assert reducer.keys == ["ddp/bucket/0", "ddp/bucket/1", "ddp/model.1/bucket/0"] * 2


def test_hook_refuses_models_it_cannot_tell_apart_and_hook_state_separates_them():
    """Two models' first backward passes interleaved on one default state: the
    hook cannot tell whose bucket 1 comes first, so it raises; a HookState per
    model separates them."""
    reducer = KeySpy(LocalGroup(1, wire_dtype="float32").client(0))
    a, b = _params(2), _params(2)
    rt.allreduce_hook(reducer, Bucket(0, a[1:], False)).wait()
    rt.allreduce_hook(reducer, Bucket(0, b[1:], False)).wait()
    with pytest.raises(RuntimeError, match="HookState"):
        rt.allreduce_hook(reducer, Bucket(1, a[:1], True))
    reducer.keys.clear()
    states = [hooks.HookState(reducer), hooks.HookState(reducer)]
    c, d = _params(2), _params(2)
    for state, params, index in [(states[0], c[1:], 0), (states[1], d[1:], 0),
                                 (states[0], c[:1], 1), (states[1], d[:1], 1)]:
        rt.allreduce_hook(state, Bucket(index, params, index == 1)).wait()
    assert len(set(reducer.keys)) == 4
