"""Horovod's TensorFlow / Keras elastic API: run, TensorFlowKerasState (KerasState),
ObjectState (reducer_client.elastic).

    @rtf.elastic.run
    def train(state):
        ...
    train(rtf.elastic.TensorFlowKerasState(model, optimizer, epoch=0))

commit keeps a copy of the model's (and optimizer's) variable values;
restore assigns them back; sync copies rank 0's to every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reducer_client.elastic import ObjectState
from reducer_client.elastic import make_run as _make_run
from reducer_client.tensorflow._basics import basics as _basics
from reducer_client.tensorflow.compat import broadcast_object, broadcast_variables

__all__ = ["run", "TensorFlowKerasState", "KerasState", "ObjectState"]

run = _make_run(_basics)


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
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        super().sync()


KerasState = TensorFlowKerasState
