"""What the shim's objects leave in state shared per Reducer, and dropping it.

One Staging per Reducer (torch/_tensors.py) serves every DDP model and
DistributedOptimizer on it; with error feedback on it keeps a float32
residual and a wire-sized buffer per key, and the collectives session keeps
a join shadow per optimizer. Parameter hooks would keep an optimizer's
gradient reducer running after the optimizer is gone. So a
DistributedOptimizer's hooks hold it weakly, and once it is gone its
Leftovers remove the hooks, forget its keys' residuals and its shadow.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.torch import _tensors
from reducer_client.torch._tensors import Staging

__all__ = ["forget_residuals", "move_residual", "forget_all_residuals", "weak_hook",
           "Leftovers", "drop_leftovers"]


def forget_residuals(staging: Staging, keys: Iterable[str] | None = None) -> None:
    """Drop the error-feedback residuals of `keys` (None: every key) of `staging`."""
    feedback = staging.feedback
    if feedback is None:
        return
    if keys is None:
        feedback.forget()
    else:
        for key in keys:
            feedback.forget(key)


def move_residual(staging: Staging, key: str, before: list[torch.Tensor],
                  after: list[torch.Tensor]) -> None:
    """Carry a bucket's residual over to its new layout: the same parameters in
    another order (DDP's rebuild) keep what each of them had; other parameters
    start afresh. A bucket's elements are its parameters' in order."""
    feedback = staging.feedback
    if feedback is None:
        return
    starts, offset = {}, 0
    for param in before:
        starts[id(param)] = (offset, param.numel())
        offset += param.numel()
    if len(before) != len(after) or any(id(p) not in starts for p in after):
        feedback.forget(key)
        return
    order = np.concatenate([np.arange(start, start + numel)
                            for start, numel in (starts[id(p)] for p in after)])
    feedback.move(key, order)


def forget_all_residuals() -> None:
    """Drop every Reducer's residuals (an elastic restore: they belong to undone steps)."""
    drop_leftovers()
    for staging in _tensors.all_stagings():
        forget_residuals(staging)


def weak_hook(method: Callable[[Any], None]) -> Callable[[Any], None]:
    """A hook that calls the bound `method` while its object lives, and then nothing."""
    ref = weakref.WeakMethod(method)

    def hook(arg: Any) -> None:
        target = ref()
        if target is not None:
            target(arg)
    return hook


class Leftovers:
    """What one DistributedOptimizer leaves behind: its hooks (as their removers),
    its buckets' keys in `staging` and its join shadow (the reducer it was
    registered with, held weakly, and its tag). Calling it drops them all;
    weakref.finalize calls it once the optimizer is gone."""

    def __init__(self, staging: Staging, keys: list[str]) -> None:
        self.staging, self.keys = staging, keys
        self.removers: list[Callable[[], Any]] = []
        self.shadow: tuple[weakref.ref[Reducer], int] | None = None

    def __call__(self) -> None:
        """The optimizer is gone: its hooks go now; the rest at the next
        drop_leftovers(). A finalizer can run inside a garbage collection,
        in any thread, even one that holds the feedback's or the session's
        lock, so it takes neither: appending to a deque takes no lock of ours."""
        for remove in self.removers:
            remove()
        _dropped.append(self)

    def drop(self) -> None:
        forget_residuals(self.staging, self.keys)
        if self.shadow is not None:
            reducer = self.shadow[0]()
            if reducer is not None:
                coll.drop_shadow(reducer, self.shadow[1])


# Leftovers of optimizers that are gone, waiting for drop_leftovers().
_dropped: deque[Leftovers] = deque()


def drop_leftovers() -> None:
    """Forget the residuals and shadows of every optimizer gone since the last
    call (each new DistributedOptimizer calls it: what one leaves stays bounded
    by one optimizer's)."""
    while True:
        try:
            leftovers = _dropped.popleft()
        except IndexError:
            return
        leftovers.drop()
