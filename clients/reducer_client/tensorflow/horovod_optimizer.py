"""Horovod's DistributedOptimizer and DistributedGradientTape signatures for TF / Keras 3.

    opt = rtf.DistributedOptimizer(opt, compression=rtf.Compression.fp16,
                                   backward_passes_per_step=4,
                                   average_aggregated_gradients=True)
    tape = rtf.DistributedGradientTape(tape, compression=rtf.Compression.none)

Horovod's keywords with Horovod's meaning: compression (the wire dtype;
None: the client's), op (Average, Sum; Adasum refused),
gradient_predivide_factor (Average only), backward_passes_per_step with
average_aggregated_gradients (the optimizer applies every N-th step the
gradients of N steps, summed or, with average_aggregated_gradients=True,
averaged; reduced once per N steps). Accepted for the signatures, with no
effect here: device_dense, device_sparse, sparse_as_dense (sparse gradients
are always reduced as their dense sum), num_groups, groups (one fused call
per step already), scale_local_gradients, use_locking. process_set: only
the whole job.

backward_passes_per_step > 1 uses Keras 3's own gradient accumulation
(gradient_accumulation_steps): Keras clips (clipnorm, clipvalue) the
accumulated local gradients before the reduction, where Horovod clips
after it; optimizer.iterations counts applied steps.
"""

from __future__ import annotations

import functools
from typing import Any

import keras

from reducer_client.api import Reducer
from reducer_client.compression import wire_dtype_of
from reducer_client.horovod import Average, resolve_op
from reducer_client.tensorflow import gradient_tape as _tape
from reducer_client.tensorflow import optimizer as _optimizer
from reducer_client.tensorflow._bridge import reduce_gradients
from reducer_client.tensorflow.steps import GradientSteps

__all__ = ["DistributedOptimizer", "DistributedGradientTape"]


def _steps_for(compression: Any, predivide: float, op: str, reducer: Reducer | None,
               what: str) -> GradientSteps:
    """The GradientSteps an optimizer's steps go through (steps.py: joinable, with
    error feedback on the 8-bit wires), at the compression and predivide factor."""
    if predivide != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    return GradientSteps(reducer, wire_dtype_of(compression), predivide, op, what)


def _check_set(process_set: Any) -> None:
    if process_set is not None:
        raise NotImplementedError("process sets are not supported by reducerd")


class _AggregatingMixin:
    """Reduce in the update step of Keras's gradient accumulation, once per N steps."""

    _aggregated_average = False

    def apply(self, grads, trainable_variables=None):
        # Keras accumulates first; _backend_update_step reduces on update steps.
        self._gradient_steps(trainable_variables)  # type: ignore[attr-defined]
        return super(_optimizer._DistributedOptimizerMixin, self).apply(  # type: ignore[misc]
            grads, trainable_variables)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        steps = self.gradient_accumulation_steps  # type: ignore[attr-defined]
        grads = list(grads)
        if not self._aggregated_average:  # Keras averaged the N steps; Horovod sums them
            grads = [g * steps for g in grads]
        through = self._reducer_override  # a GradientSteps since apply()  # type: ignore[attr-defined]
        grads = reduce_gradients(grads, trainable_variables,
                                 self._wire_key(len(grads), through),  # type: ignore[attr-defined]
                                 self._reducer_op, through)  # type: ignore[attr-defined]
        return super()._backend_update_step(  # type: ignore[misc]
            grads, trainable_variables, learning_rate)


@functools.cache
def _aggregating_class(base: type) -> type:
    return type(base.__name__, (_AggregatingMixin, _optimizer._DistributedOptimizerMixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__})


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802 (Horovod's name)
                         name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = None,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: str | None = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = None,
                         scale_local_gradients: bool = True, use_locking: bool = False, *,
                         reducer: Reducer | None = None) -> keras.optimizers.Optimizer:
    """A copy of a Keras 3 optimizer whose updates use gradients averaged over all ranks.

    See reducer_client.tensorflow.optimizer.DistributedOptimizer (an
    instance of the optimizer's own class, built from its config; wrap
    before training) and the module docstring for Horovod's keywords. A
    "mean" / "sum" in name's place is taken as op (this shim's older order).
    """
    _check_set(process_set)
    if name in ("mean", "sum"):
        name, op = None, name
    op = resolve_op(op)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got "
                         f"{backward_passes_per_step}")
    through = _steps_for(compression, gradient_predivide_factor, op, reducer,
                         f"optimizer {name or 'optimizer'!r}")
    if backward_passes_per_step == 1:
        return _optimizer.DistributedOptimizer(optimizer, op=op, name=name, reducer=through)
    wrapped = _optimizer.DistributedOptimizer(optimizer, op=op, name=name, reducer=through)
    config = optimizer.get_config()
    config["gradient_accumulation_steps"] = backward_passes_per_step
    aggregating = _aggregating_class(type(optimizer)).from_config(config)
    for attribute in ("_reducer_op", "_reducer_key", "_reducer_override"):
        setattr(aggregating, attribute, getattr(wrapped, attribute))
    aggregating._aggregated_average = average_aggregated_gradients
    return aggregating


def DistributedGradientTape(gradtape: Any, device_dense: str = "",  # noqa: N802
                            device_sparse: str = "", compression: Any = None,
                            sparse_as_dense: bool = False, op: str | None = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: Any = None,
                            scale_local_gradients: bool = True, *, name: str = "tape",
                            reducer: Reducer | None = None) -> _tape.DistributedGradientTape:
    """A tape whose gradient() averages over all ranks (one fused call), Horovod's keywords."""
    _check_set(process_set)
    if device_dense in ("mean", "sum"):  # this shim's older (tape, op) order
        device_dense, op = "", device_dense
    op = resolve_op(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    return _tape.DistributedGradientTape(gradtape, op=op, name=name, reducer=reducer,
                                         wire_dtype=wire_dtype_of(compression),
                                         predivide_factor=gradient_predivide_factor)
