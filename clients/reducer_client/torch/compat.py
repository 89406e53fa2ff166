"""Horovod's DistributedOptimizer signature over reducer_client.torch.optimizer.

    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=rt.Compression.fp16, op=rt.Average,
                                  gradient_predivide_factor=2.0)

Horovod's keywords with Horovod's meaning: compression (the wire dtype;
None: the client's), backward_passes_per_step, op (Average, Sum; Adasum is
refused), gradient_predivide_factor (Average only). Horovod's positional
order holds up to backward_passes_per_step (a compression in the third
place, where our older signature had op, is taken as compression). num_groups
and groups are accepted: gradients are grouped into buckets of about
bucket_bytes anyway. sparse_as_dense=True is refused (sparse gradients are
not supported). Ours on top: bucket_bytes, name, reducer, overlap_forward, prioritize.

Each step begins with a control round (reducer_client.steps), so a rank
that has called join() can follow the others' steps.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.compression import Compressor, wire_dtype_of
from reducer_client.horovod import Average, resolve_op
from reducer_client.steps import StepReducer
from reducer_client.torch import functions as _functions
from reducer_client.torch import optimizer as _optimizer
from reducer_client.torch._basics import basics, next_index, resolve
from reducer_client.torch._tensors import staging_for


class _TorchCompressor(Compressor):
    """A Compressor whose compress / decompress cast torch tensors, as Horovod's do.

    The shim never calls them (the core converts to the wire dtype); they
    are there for code that compresses by hand.
    """

    def __init__(self, name: str, wire_dtype: str, cast: torch.dtype | None) -> None:
        super().__init__(name, wire_dtype)
        self.cast = cast

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        if self.cast is None or not tensor.is_floating_point():
            return tensor, None
        return tensor.to(self.cast), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:  # type: ignore[override]
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Horovod's torch Compression: the wire dtype (reducer_client.compression)."""

    none = _TorchCompressor("none", "float32", None)
    fp16 = _TorchCompressor("fp16", "float16", torch.float16)
    bf16 = _TorchCompressor("bf16", "bfloat16", torch.bfloat16)
    int8 = _TorchCompressor("int8", "int8", None)
    fp8_e4m3 = _TorchCompressor("fp8_e4m3", "fp8_e4m3", None)
    fp8_e5m2 = _TorchCompressor("fp8_e5m2", "fp8_e5m2", None)


def _agree_on_root(reducer: Reducer, what: str, root_rank: int, count: int) -> None:
    """Fail every rank at once (naming them) unless all give the same root_rank."""
    call = coll.Call(coll.CHECK, what, "float32", (count,), 0, root_rank=root_rank)
    coll.check(coll.control_async(reducer, call).result(), call)


def broadcast_parameters(params: Any, root_rank: int = 0, *,
                         reducer: Reducer | None = None) -> None:
    """Overwrite the tensors on every rank with root_rank's (functions.py), after
    checking that every rank names the same root and number of tensors."""
    reducer = resolve(reducer)
    items = list(params.items()) if isinstance(params, dict) else list(params)
    _agree_on_root(reducer, "broadcast_parameters", root_rank, len(items))
    _functions.broadcast_parameters(items, root_rank, reducer=reducer)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, *,
                     reducer: Reducer | None = None) -> Any:
    """root_rank's `obj` on every rank (functions.py), the root checked first."""
    reducer = resolve(reducer)
    _agree_on_root(reducer, "broadcast_object", root_rank, 0)
    return _functions.broadcast_object(obj, root_rank, name, reducer=reducer)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, *,
                              reducer: Reducer | None = None) -> None:
    """Make every rank's optimizer state root_rank's (functions.py), as Horovod does.

    An optimizer without state gets it first, as with Horovod: each
    parameter that requires grad and has no .grad gets a zero one, and the
    wrapped optimizer's own step (no reduction) creates the state.
    """
    reducer = resolve(reducer)
    _agree_on_root(reducer, "broadcast_optimizer_state", root_rank, 0)
    if not optimizer.state_dict()["state"]:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        plain = next(c for c in type(optimizer).__mro__
                     if not issubclass(c, (_JoinableSteps, _optimizer._DistributedOptimizer)))
        plain.step(optimizer)  # type: ignore[attr-defined]
    _functions.broadcast_optimizer_state(optimizer, root_rank, reducer=reducer)

__all__ = ["DistributedOptimizer", "joinable_optimizers", "Compression",
           "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object"]

# Optimizers made here, per base Reducer, for join's final sync (torch/join.py).
_made: weakref.WeakKeyDictionary[Reducer, weakref.WeakSet] = weakref.WeakKeyDictionary()


def joinable_optimizers(reducer: Reducer) -> list[torch.optim.Optimizer]:
    """The DistributedOptimizers of `reducer`, in creation order."""
    return sorted(_made.get(reducer, ()), key=lambda o: o._steps.tag)


class _JoinableSteps:
    """Mixed in front of the DistributedOptimizer's class: begins and ends each step."""

    _steps: StepReducer
    _shadowing: bool = False

    def synchronize(self) -> None:
        if not self._shadowing:
            self._steps.begin_step()
        super().synchronize()  # type: ignore[misc]

    def step(self, closure=None):
        self._steps.begin_step()
        try:
            return super().step(closure)  # type: ignore[misc]
        finally:
            self._steps.end_step()

    step.hooked = True  # type: ignore[attr-defined]  # see optimizer.py

    def _shadow_step(self) -> None:
        """A joined rank's part in a step of the others: every bucket with zeros."""
        self._shadowing = True
        try:
            self.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
            self.synchronize()
        finally:
            self._shadowing = False
            self._synchronized = False  # this rank's own next step() reduces again
            self.zero_grad(set_to_none=True)  # type: ignore[attr-defined]


@functools.cache
def _joinable_class(base: type) -> type:
    return type(base.__name__, (_JoinableSteps, base),
                {"__module__": base.__module__, "__doc__": base.__doc__})


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Any = None, backward_passes_per_step: int = 1,
                         op: str | None = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False, process_set: Any = None, *,
                         bucket_bytes: int = _optimizer.DEFAULT_BUCKET_BYTES,
                         name: str | None = None, reducer: Reducer | None = None,
                         overlap_forward: torch.nn.Module | None = None,
                         prioritize: bool = False) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() applies gradients averaged over all ranks.

    See reducer_client.torch.optimizer.DistributedOptimizer for how the
    gradients travel, and the module docstring for Horovod's keywords.
    """
    if isinstance(compression, str) and compression in ("mean", "sum"):
        compression, op = None, compression  # our older positional (optimizer, params, op)
    if compression is not None and not isinstance(compression, Compressor | str):
        raise TypeError(f"compression {compression!r}: use rt.Compression.none / .fp16 / ...")
    if process_set is not None:
        raise NotImplementedError("process sets are not supported by reducerd")
    if sparse_as_dense:
        raise NotImplementedError("sparse_as_dense: sparse gradients are not supported; "
                                  "use dense embeddings (sparse=False)")
    if num_groups < 0:
        raise ValueError(f"num_groups must be >= 0, got {num_groups}")
    op = resolve_op(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(optimizer, _optimizer._DistributedOptimizer):
        raise TypeError("optimizer is already a DistributedOptimizer")
    wire = wire_dtype_of(compression)
    # Checked before the client is needed, as Horovod checks them (named_parameters
    # may be an iterator: it is read once, here).
    named_parameters = None if named_parameters is None else list(named_parameters)
    _optimizer.named_optimizer_params(optimizer, named_parameters)
    base = resolve(reducer)
    holder: list[Any] = []
    # Without reducer=, the process-wide client of each step (elastic resets replace it).
    steps = StepReducer(basics.client if reducer is None else base, wire,
                        gradient_predivide_factor, op,
                        shadow=lambda: holder[0]._shadow_step())
    distributed = _optimizer.DistributedOptimizer(
        optimizer, named_parameters, op=op, backward_passes_per_step=backward_passes_per_step,
        bucket_bytes=bucket_bytes,
        name=name if name is not None else f"optimizer.{next_index(base, 'optimizer')}",
        reducer=steps, overlap_forward=overlap_forward,  # type: ignore[arg-type]
        prioritize=prioritize)
    if wire is None or wire == base.wire_dtype:
        # The client's staging, so rt.set_error_feedback(..., reducer) reaches these
        # buckets too (an optimizer on another wire keeps its own: feedback on for 8 bits).
        distributed._gradients.staging = staging_for(base)  # type: ignore[attr-defined]
    distributed.__class__ = _joinable_class(type(distributed))  # type: ignore[arg-type]
    distributed._steps = steps  # type: ignore[attr-defined]
    holder.append(weakref.proxy(distributed))
    _made.setdefault(base, weakref.WeakSet()).add(distributed)
    return distributed
