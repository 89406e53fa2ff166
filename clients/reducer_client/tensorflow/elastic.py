"""Horovod's TensorFlow / Keras elastic API: run, TensorFlowKerasState (KerasState),
ObjectState (reducer_client.elastic), and the Keras callbacks
CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback.

    @rtf.elastic.run
    def train(state):
        state.model.fit(x, y, steps_per_epoch=..., epochs=epochs - state.epoch,
                        callbacks=[rtf.elastic.UpdateBatchStateCallback(state),
                                   rtf.elastic.UpdateEpochStateCallback(state),
                                   rtf.elastic.CommitStateCallback(state)])
    train(rtf.elastic.KerasState(model, batch=0, epoch=0))

commit keeps a copy of the model's (and optimizer's) variable values;
restore assigns them back (and drops the error-feedback residuals, which
belong to the steps undone); sync copies rank 0's to every rank and makes
them the commit, as Horovod's and TorchState's do (a worker that just joined
rolls back to rank 0's state, not its own). HostsUpdatedInterrupt is what
every rank's commit raises when a worker was admitted (REDUCER_ELASTIC_JOIN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from reducer_client.elastic import HostsUpdatedInterrupt, ObjectState
from reducer_client.elastic import make_run as _make_run
from reducer_client.tensorflow._basics import basics as _basics
from reducer_client.tensorflow._bridge import original_error
from reducer_client.tensorflow.compat import broadcast_variables
from reducer_client.tensorflow.objects import broadcast_object
from reducer_client.tensorflow.steps import forget_feedback

__all__ = ["run", "TensorFlowKerasState", "KerasState", "ObjectState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "HostsUpdatedInterrupt"]

_run = _make_run(_basics)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's elastic.run (reducer_client.elastic.run), for TensorFlow: a
    collective that fails inside a graph (model.fit, a tf.function) reaches
    the caller as tf.errors.UnknownError; the ReducerError behind it is what
    elastic.run sees, so a lost round in model.fit resets like an eager one."""
    @functools.wraps(func)
    def unwrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - only ours are replaced
            original = original_error(exc)
            if original is None or original is exc:
                raise
            raise original from exc
    return _run(unwrapped)


class TensorFlowKerasState(ObjectState):
    """A Keras model, its optimizer and picklable attributes kept across failures."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self._saved_values: list[np.ndarray] = []
        super().__init__(lambda obj, root: broadcast_object(obj, root), **kwargs)
        self._save_variables()

    def _variables(self) -> list:
        variables = list(self.model.variables)
        if self.optimizer is not None and getattr(self.optimizer, "built", True):
            variables += list(self.optimizer.variables)
        return variables

    def _save_variables(self) -> None:
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self._variables()]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) == len(self._saved_values):  # an optimizer built since: keep it
            for variable, value in zip(variables, self._saved_values, strict=True):
                variable.assign(value)
        else:
            for variable, value in zip(self.model.variables, self._saved_values, strict=False):
                variable.assign(value)
        forget_feedback()
        super().restore()

    def sync(self) -> None:
        """Rank 0's variables and attributes on every rank, and the commit."""
        broadcast_variables(self._variables(), root_rank=0)
        self._save_variables()
        super().sync()  # ObjectState: the attributes of rank 0's commit, saved


KerasState = TensorFlowKerasState


# -- Horovod's Keras callbacks (horovod/_keras/elastic.py), with its meaning --

class CommitStateCallback(keras.callbacks.Callback):
    """state.commit() every `batches_per_commit` batches and at the end of each epoch.

    The count starts again at every fit (so every rank commits at the same
    batches after a reset).
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """state.batch is the index of the last finished batch of the epoch (0 after it).

    As Horovod's: when fit knows its steps per epoch, the first epoch after
    a reset runs steps - state.batch batches, so an epoch cut short by a
    failure is not counted in full again. Keras 3 does not read
    params["steps"] back, so the epoch is ended there through stop_training,
    which this callback clears at the epoch's end: list it before callbacks
    that stop training at an epoch's end (EarlyStopping).
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None
        self._epoch_steps: int | None = None
        self._stopped_epoch = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_steps = None
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self._epoch_steps = self.steps_per_epoch - self.state.batch
            self.params["steps"] = self._epoch_steps

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch
        if self._epoch_steps is not None and batch + 1 >= self._epoch_steps \
                and self._epoch_steps < (self.steps_per_epoch or 0):
            self.model.stop_training = True  # ends this epoch (cleared below)
            self._stopped_epoch = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0
        if self._stopped_epoch:
            self.model.stop_training = False
            self._stopped_epoch = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """state.epoch counts the finished epochs, across resets.

    fit's epoch numbers start from 0 at every fit (run it with epochs=
    total - state.epoch), so each is offset by state.epoch at the fit's
    start, plus one: after a failure the last finished epoch is not run again.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
