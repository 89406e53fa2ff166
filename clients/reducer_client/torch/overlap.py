"""Crossing the barrier: the next forward starts before every bucket is back.

    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  overlap_forward=model)

Without it, step() waits for every bucket and then updates every parameter,
so the next forward starts only once the last bucket is back. With it,
step() only starts the buckets still open and returns; a forward pre-hook on
each module that owns parameters waits for the buckets holding them, writes
the averaged gradients and updates just those parameters, so the layers
whose buckets came back first compute while the others are still on the
wire (BytePS's "crossing the barrier", Peng et al., SOSP'19). A forward hook
on the model applies whatever its forward did not reach before backward
starts again.

What changes for the caller: the parameters change during the next forward
(or the model's or optimizer's state_dict(), or finish_step()), not in
step(); each parameter's .grad is cleared once its update is applied, so
zero_grad() is optional; the hyper-parameters of a step are those at step()
(an LR scheduler stepped after step() takes effect from the next step, as
it would without overlap). The wrapped optimizer must update each parameter
from that parameter's own gradient and state (SGD, Adam, AdamW, RMSprop...):
each bucket's update is the wrapped step() over that bucket's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["ForwardOverlap"]


class _Gradients(Protocol):
    """What ForwardOverlap needs of the optimizer's gradient reducer (optimizer.py)."""

    buckets: list[Any]  # each with .params (list of tensors)

    def launch_missing(self) -> None: ...
    def finish(self, bucket: Any) -> None: ...
    def reset(self) -> None: ...


class ForwardOverlap:
    """Per-bucket updates, each applied just before the next forward first needs it.

    All of it runs on the thread that calls step() and forward (pre-hooks
    run in forward), so no lock: the core's reader threads only complete
    the futures waited for here.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradients: _Gradients,
                 model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"overlap_forward must be the model (a torch.nn.Module), got "
                            f"{type(model).__name__}")
        self._optimizer, self._gradients = optimizer, gradients
        # id(bucket) -> bucket, in bucket order: launched by step(), not yet applied.
        self._pending: dict[int, Any] = {}
        self._groups: list[dict[str, Any]] = []  # the param groups as they were at step()
        self._base_step: Callable[[], Any] | None = None
        bucket_of = {id(p): b for b in gradients.buckets for p in b.params}
        self._handles = []
        covered: set[int] = set()
        for module in model.modules():
            owned: dict[int, Any] = {}
            for param in module.parameters(recurse=False):
                bucket = bucket_of.get(id(param))
                if bucket is not None:
                    owned[id(bucket)] = bucket
                    covered.add(id(param))
            if owned:
                self._handles.append(module.register_forward_pre_hook(
                    self._hook_for(list(owned.values()))))
        if not covered:
            raise ValueError("overlap_forward: the model owns none of the optimizer's "
                             "parameters")
        self._handles.append(model.register_forward_hook(lambda *_: self.finish()))
        self._handles.append(model.register_state_dict_pre_hook(lambda *_: self.finish()))
        self._handles.append(optimizer.register_state_dict_pre_hook(lambda *_: self.finish()))

    @property
    def pending(self) -> bool:
        """Some bucket launched by step() has not been applied yet."""
        return bool(self._pending)

    def step(self, base_step: Callable[[], Any]) -> None:
        """Start the buckets still open and return; `base_step` is the wrapped step()."""
        self.finish()  # a second step() without a forward in between
        self._gradients.launch_missing()
        self._groups = [dict(group) for group in self._optimizer.param_groups]
        self._base_step = base_step
        self._pending = {id(b): b for b in self._gradients.buckets}

    def finish(self) -> None:
        """Apply every update still pending, in bucket order."""
        for bucket in list(self._pending.values()):
            self._apply(bucket)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook_for(self, buckets: list[Any]) -> Callable[..., None]:
        def before_forward(module: torch.nn.Module, args: Any) -> None:
            for bucket in buckets:
                self._apply(bucket)
        return before_forward

    def _apply(self, bucket: Any) -> None:
        if self._pending.pop(id(bucket), None) is None:
            return
        try:
            self._gradients.finish(bucket)  # waits; the core's timeout bounds it
            self._update(bucket.params)
        except BaseException:
            # A failed round fails the step: forget it whole, so the next
            # backward starts from a clean state instead of a stale count.
            self._pending.clear()
            self._gradients.reset()
            raise
        for param in bucket.params:
            param.grad = None
        if not self._pending:
            self._gradients.reset()

    def _update(self, params: list[torch.Tensor]) -> None:
        """The wrapped step() over `params` alone, with the groups as they were at step()."""
        wanted = {id(p) for p in params}
        optimizer = self._optimizer
        saved = optimizer.param_groups
        optimizer.param_groups = [
            {**group, "params": [p for p in group["params"] if id(p) in wanted]}
            for group in self._groups]
        try:
            assert self._base_step is not None
            self._base_step()
        finally:
            optimizer.param_groups = saved
