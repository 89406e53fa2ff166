"""DistributedOptimizer: reduce gradients during backward, apply them in step().

    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())

Each parameter's gradient counts as final once it has been accumulated
`backward_passes_per_step` times (a post-accumulate-grad hook). Parameters
are packed into buckets of about `bucket_bytes`, in reverse order of
`named_parameters` (roughly the order backward produces them, as DDP does);
a bucket's reduction starts as soon as all its gradients are final, so it
overlaps the rest of backward. step() starts the buckets that are still
missing gradients, waits for all of them and then runs the wrapped
optimizer's own step.

A parameter that got no gradient on some rank in a step is sent as zeros,
with a flag that says so: the flags are reduced with the bucket, so every
rank learns whether any rank had a gradient. If one did, the parameter gets
the average on every rank (ranks without a gradient contributed zero, which
is what a single process would compute for the concatenated batch); if none
did, its .grad stays None on every rank and the optimizer skips it, as it
would in a single process. Every rank therefore reduces every bucket once
per step, whatever it used: no rank waits for a round that others skip.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch

from reducer_client.api import Reducer
from reducer_client.errors import ReducerError, first_cause
from reducer_client.steps import StepReducer
from reducer_client.torch._basics import next_index, resolve
from reducer_client.torch._buckets import Bucket as _Bucket
from reducer_client.torch._buckets import plan_buckets as _plan_buckets
from reducer_client.torch._lifetime import Leftovers, drop_leftovers, weak_hook
from reducer_client.torch._tensors import Staging, staging_for
from reducer_client.torch.overlap import ForwardOverlap

__all__ = ["DistributedOptimizer", "DEFAULT_BUCKET_BYTES"]

# Horovod's words: step() after synchronize() outside skip_synchronize() (the
# gradients are not reduced twice here, but the idiom is Horovod's).
SYNCHRONIZED_STEP_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
    "your code.")
# DDP's default bucket_cap_mb.
DEFAULT_BUCKET_BYTES = 25 << 20


class _GradientReducer:
    """The buckets of one optimizer and the hooks that launch them."""

    def __init__(self, reducer: Reducer, named_params: list[tuple[str, torch.Tensor]],
                 op: str, backward_passes_per_step: int, bucket_bytes: int,
                 prefix: str, prioritize: bool = False) -> None:
        self.reducer, self.op = reducer, op
        self.backward_passes_per_step = backward_passes_per_step
        self.buckets = _plan_buckets(named_params, bucket_bytes, prefix)
        drop_leftovers()  # of optimizers gone before this one
        # Dropped once the optimizer is gone (DistributedOptimizer's finalizer).
        self.leftovers = Leftovers(staging_for(reducer), [b.key for b in self.buckets])
        if isinstance(reducer, StepReducer):  # its join shadow
            self.leftovers.shadow = (weakref.ref(reducer.base), reducer.tag)
        # Buckets go in reverse order of the parameters, so bucket i + 1 holds
        # layers nearer the input: the next forward needs it sooner.
        self._priorities = {id(b): i + 1 if prioritize else 0
                            for i, b in enumerate(self.buckets)}
        # id(param) -> (bucket, name); tensors hash by identity anyway.
        self._where = {id(p): (b, n) for b in self.buckets
                       for p, n in zip(b.params, b.names, strict=True)}
        # _lock guards the step state (_passes_left, bucket.ready / launched /
        # future); taken by autograd threads in the hook and by the caller
        # of synchronize(). Launches happen outside it.
        self._lock = threading.Lock()
        self._passes_left = {pid: backward_passes_per_step for pid in self._where}
        # Weak: the parameters must not keep a dropped optimizer's reducer running.
        hook = weak_hook(self._on_accumulated)
        self._handles = [p.register_post_accumulate_grad_hook(hook)
                         for b in self.buckets for p in b.params]
        self.leftovers.removers.extend(h.remove for h in self._handles)

    @property
    def staging(self) -> Staging:
        """Where the buckets are reduced (the client's, or the optimizer's wire's)."""
        return self.leftovers.staging

    @staging.setter
    def staging(self, staging: Staging) -> None:
        self.leftovers.staging = staging

    def _on_accumulated(self, param: torch.Tensor) -> None:
        bucket, name = self._where[id(param)]
        with self._lock:
            left = self._passes_left[id(param)] - 1
            if left < 0:
                raise RuntimeError(
                    f"gradient of {name!r} was accumulated more than "
                    f"backward_passes_per_step={self.backward_passes_per_step} times "
                    "before step(): call step() (or synchronize()) after that many "
                    "backward passes")
            self._passes_left[id(param)] = left
            if left > 0:
                return
            bucket.ready += 1
            if bucket.ready < len(bucket.params) or bucket.launched:
                return
            bucket.launched = True
        self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            flat = bucket.fill_flat()
            bucket.future = self.staging.start(self.reducer, flat, bucket.key, self.op,
                                               self._priorities[id(bucket)])

    def in_flight(self) -> bool:
        with self._lock:
            return any(b.launched for b in self.buckets)

    def synchronize(self) -> None:
        """Start the buckets still open, wait for all, set the averaged gradients.

        Where a bucket fails while another already failed because its daemon
        went away, the latter is raised (errors.first_cause), with the first
        as its context."""
        try:
            self.launch_missing()
            for bucket in self.buckets:
                try:
                    self.finish(bucket)
                except ReducerError as exc:
                    others = [b.future for b in self.buckets if b.future and b is not bucket]
                    raise first_cause(exc, others)  # noqa: B904 (exc stays its __context__)
        finally:
            self.reset()

    def launch_missing(self) -> None:
        """Start the buckets whose gradients are not all final yet (sent as they are)."""
        with self._lock:
            missing = [b for b in self.buckets if not b.launched]
            for bucket in missing:
                bucket.launched = True
        for bucket in missing:
            self._launch(bucket)

    def finish(self, bucket: _Bucket) -> None:
        """Wait for one launched bucket and set its parameters' averaged gradients."""
        assert bucket.future is not None and bucket.flat is not None
        with torch.no_grad():
            result = bucket.future.result()  # the core's timeout bounds the wait
            self.staging.finish(result, bucket.flat, bucket.key)
            bucket.write_back(result)

    def reset(self) -> None:
        """Forget this step's progress (after synchronize, or zero_grad)."""
        with self._lock:
            for pid in self._passes_left:
                self._passes_left[pid] = self.backward_passes_per_step
            for bucket in self.buckets:
                bucket.ready, bucket.launched, bucket.future = 0, False, None


class _DistributedOptimizer:
    """Mixin put in front of the wrapped optimizer's class (see DistributedOptimizer)."""

    _gradients: _GradientReducer
    _synchronized: bool  # synchronize() was called since the last step()
    _skip_sync: bool  # inside skip_synchronize()
    _overlap: ForwardOverlap | None  # overlap_forward's hooks (overlap.py)

    def synchronize(self) -> None:
        """Wait for the averaged gradients now (to clip them, say) instead of in step()."""
        self.finish_step()
        self._gradients.synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's idiom: `opt.synchronize(); clip; with opt.skip_synchronize(): opt.step()`."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Callable[[], float] | None = None):
        """Evaluate the closure if any, average the gradients, run the optimizer's step.

        The closure (its backward included) is evaluated once, before the
        reduction; optimizers that call it several times per step (LBFGS)
        are not supported.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._overlap is not None and not (self._synchronized or self._skip_sync):
            # Weakly: the overlap keeps it after the step, and the model keeps the overlap.
            base_step = weakref.WeakMethod(super().step)  # type: ignore[misc]
            self._overlap.step(lambda: base_step()())  # type: ignore[misc]
            return loss  # the updates apply in the next forward
        if self._synchronized and not self._skip_sync:
            warnings.warn(SYNCHRONIZED_STEP_WARNING, stacklevel=2)
        if not (self._synchronized or self._skip_sync):
            self._gradients.synchronize()
        self._synchronized = False
        super().step()  # type: ignore[misc]
        return loss

    def finish_step(self) -> None:
        """Apply the updates overlap_forward leaves to the next forward now (else a no-op)."""
        if self._overlap is not None:
            self._overlap.finish()

    # Optimizer.load_state_dict re-patches `type(self).step` for profiling
    # unless it is marked hooked; the wrapped class's step, which ours calls,
    # is already patched, so ours must not run the step hooks a second time.
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Buckets that overlap_forward left pending reset themselves once applied.
        if self._overlap is None or not self._overlap.pending:
            if self._gradients.in_flight():
                raise RuntimeError("zero_grad() was called after backward() started reducing "
                                   "gradients but before step() or synchronize(): call step() "
                                   "first, or zero_grad() before backward()")
            self._gradients.reset()
        super().zero_grad(set_to_none)  # type: ignore[misc]


@functools.cache
def _distributed_class(base: Any) -> Any:
    return type(base.__name__, (_DistributedOptimizer, base),
                {"__module__": _DistributedOptimizer.__module__,
                 "__doc__": f"{base.__name__} with gradients averaged through reducerd."})


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 (Horovod's name)
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         op: str = "mean", backward_passes_per_step: int = 1,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, name: str | None = None,
                         *, reducer: Reducer | None = None,
                         overlap_forward: torch.nn.Module | None = None,
                         prioritize: bool = False) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that step() applies gradients averaged over all workers.

    Returns an instance of a subclass of the optimizer's own class that
    shares its parameter groups and state (isinstance, LR schedulers,
    state_dict and load_state_dict work as before); use it instead of the
    original. `named_parameters` (e.g. model.named_parameters()) fixes the
    bucket order and the names in error messages; it must name every
    parameter of the optimizer. Without it, the optimizer's own order is used.
    Only parameters with requires_grad at wrap time take part.

    op is "mean" (the default, as Horovod's) or "sum". Gradients accumulated
    over `backward_passes_per_step` backward passes are reduced once, as they
    are: scale the loss as you would in a single process. Call zero_grad()
    before backward or after step(), not between them. `name` prefixes the
    keys of this optimizer's buckets (default "optimizer.N", N counting the
    DistributedOptimizers created with this reducer); it must be the same on
    every rank. `reducer` defaults to the process-wide client of init().
    Once the returned optimizer is gone (no reference left), its gradient
    hooks are removed and its keys' error-feedback residuals and join shadow
    dropped, so a new DistributedOptimizer may wrap the same parameters.

    overlap_forward=model: step() only starts the buckets still open and
    returns; each module's next forward first waits for the buckets holding
    its parameters and applies their update, so it starts while later
    buckets are still on the wire (crossing the barrier, overlap.py says
    what changes for the caller). Only for optimizers that update each
    parameter from its own gradient and state (SGD, Adam, ...).

    prioritize=True: each bucket's reduction carries a priority, higher for
    layers nearer the input (the core's allreduce priority=), so the buckets
    the next forward needs first overtake earlier ones on the client's links
    and in the daemons' replies; with overlap_forward that forward starts
    sooner. Results are the same either way.
    """
    if op not in ("mean", "sum"):
        raise ValueError(f"op {op!r}: one of mean, sum")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got "
                         f"{backward_passes_per_step}")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise TypeError("optimizer is already a DistributedOptimizer")
    named = named_optimizer_params(optimizer, named_parameters)
    cls = _distributed_class(type(optimizer))  # type: ignore[arg-type]
    distributed = cls.__new__(cls)
    # Share everything (param_groups, state, defaults, hooks) with the
    # wrapped optimizer, rather than constructing a second one.
    distributed.__dict__.update(optimizer.__dict__)
    reducer = resolve(reducer)
    distributed._gradients = _GradientReducer(
        reducer, named, op, backward_passes_per_step, bucket_bytes,
        name if name is not None else f"optimizer.{next_index(reducer, 'optimizer')}",
        prioritize)
    distributed._synchronized = distributed._skip_sync = False
    # The model's hooks hold the overlap: it holds the optimizer weakly.
    distributed._overlap = (None if overlap_forward is None else ForwardOverlap(
        cast(torch.optim.Optimizer, weakref.proxy(distributed)), distributed._gradients,
        overlap_forward))
    if distributed._overlap is not None:
        distributed._gradients.leftovers.removers.append(distributed._overlap.remove_hooks)
    weakref.finalize(distributed, distributed._gradients.leftovers).atexit = False
    return distributed


def named_optimizer_params(optimizer: torch.optim.Optimizer,
                            named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                            ) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) for each parameter of the optimizer that requires grad."""
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
    else:
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError("named_parameters must be (name, tensor) pairs, e.g. "
                             "model.named_parameters()")
        names = [n for n, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names: {duplicates}")
        wanted = {id(p) for p in in_optimizer}
        named = [(n, p) for n, p in named if id(p) in wanted]
        unnamed = len(wanted - {id(p) for _, p in named})
        if unnamed:
            raise ValueError(f"named_parameters does not name {unnamed} parameter(s) "
                             "of the optimizer")
    return [(n, p) for n, p in named if p.requires_grad]
