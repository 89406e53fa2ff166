"""Keras callbacks of the TensorFlow shim (Horovod's hvd.callbacks).

    callbacks = [rtf.callbacks.BroadcastGlobalVariablesCallback(0),
                 rtf.callbacks.MetricAverageCallback(),
                 rtf.callbacks.LearningRateWarmupCallback(initial_lr=0.001 * rtf.size(),
                                                          warmup_epochs=3)]

With Horovod's meaning; where Keras 3 differs from the Keras Horovod
wrote them for: the learning rate is the optimizer's learning_rate variable
(a LearningRateSchedule cannot be set, and is refused), and momentum
correction applies only where the optimizer holds momentum in a variable
(Keras 3's SGD keeps a Python float, so it is skipped there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from reducer_client.api import Reducer
from reducer_client.tensorflow._basics import basics
from reducer_client.tensorflow.compat import Compression, grouped_allreduce
from reducer_client.tensorflow.functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]


def _fully_built(model: keras.Model) -> bool:
    return bool(model.built and model.variables)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Copy root_rank's model and optimizer variables to every rank, once.

    Before the first step when the model is built by then (every rank then
    starts from the same weights); a model that Keras builds in its first
    step (a Sequential without an Input) is broadcast after that step, with
    the optimizer state it made, as Horovod's callback does. `device` is
    Horovod's and unused (the broadcast runs on the host). `local_variables`
    (Horovod's): variables each rank keeps as they are (matched by identity;
    every rank must leave out as many).
    """

    def __init__(self, root_rank: int = 0, device: str | Reducer | None = "",
                 reducer: Reducer | None = None, local_variables: Any = None) -> None:
        super().__init__()
        if device is not None and not isinstance(device, str):
            reducer = device  # this shim's older (root_rank, reducer) order
        self.root_rank = root_rank
        self._reducer = reducer
        self._local = {id(v) for v in (local_variables or [])}
        self._done = False

    def _broadcast(self) -> None:
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        variables = [v for v in variables if id(v) not in self._local]
        broadcast_variables(variables, self.root_rank, self._reducer)
        self._done = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self._done and _fully_built(self.model):
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self._done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each metric in logs by its average over ranks.

    All metrics travel in one call, sorted by name (the same order on every
    rank). List it before callbacks that read the metrics (ReduceLROnPlateau,
    TensorBoard, ...). `device` is Horovod's and unused.
    """

    def __init__(self, device: str = "", reducer: Reducer | None = None) -> None:
        super().__init__()
        self._reducer = reducer

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        names = sorted(logs)
        values = [tf.constant(float(logs[n]), tf.float64) for n in names]
        # float32 on the wire, whatever the client's: metrics are few and read by people.
        averaged = grouped_allreduce(values, compression=Compression.none, name="metrics",
                                     reducer=self._reducer)
        for name, value in zip(names, averaged, strict=True):
            logs[name] = float(value.numpy())


def _set_learning_rate(optimizer: keras.optimizers.Optimizer, value: float) -> None:
    learning_rate = optimizer._learning_rate  # the variable, or a schedule
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError("the optimizer's learning rate is a LearningRateSchedule: "
                         "a learning-rate callback cannot set it; use a float")
    optimizer.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to initial_lr * multiplier(epoch) between start and end epoch.

    multiplier: a number (then multiplier ** (epoch - start_epoch), an
    exponential decay) or a function of the epoch. staircase=True adjusts
    at each epoch's first batch, else at every batch with fractional
    epochs (steps_per_epoch, detected from fit's parameters when None).
    momentum_correction scales a momentum variable by new_lr / old_lr for
    the batch (Goyal et al.); skipped where momentum is a Python float.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.multiplier = (multiplier if callable(multiplier)
                           else lambda epoch: multiplier ** (epoch - start_epoch))
        self.current_epoch = 0
        self._restore_momentum: float | None = None

    def _autodetect_steps_per_epoch(self) -> int:
        steps = (self.params or {}).get("steps")
        if steps:
            return int(steps)
        raise ValueError(f"Could not autodetect the number of steps per epoch: pass "
                         f"steps_per_epoch to {type(self).__name__}()")

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_learning_rate(optimizer, new_lr)
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr:
            self._restore_momentum = float(keras.ops.convert_to_numpy(momentum))
            momentum.assign(self._restore_momentum * new_lr / old_lr)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if (self.current_epoch < self.start_epoch
                or (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            assert self.steps_per_epoch
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(np.asarray(keras.ops.convert_to_numpy(
                self.model.optimizer.learning_rate)))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from initial_lr / size() to initial_lr over warmup_epochs.

    Horovod's gradual warmup (Goyal et al., https://arxiv.org/abs/1706.02677):
    pass the learning rate scaled by size() as initial_lr.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # Round numbers at the ends of epochs, as Horovod's.
            epoch += 1.0 / self.steps_per_epoch  # type: ignore[operator]
            size = basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and basics.rank() == 0:
            new_lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {new_lr:g}.")
