"""Keras callbacks of the TensorFlow shim (Horovod's hvd.callbacks)."""

from __future__ import annotations

import keras

from reducer_client.api import Reducer
from reducer_client.tensorflow.functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, copy root_rank's model and optimizer variables to all.

    Runs once (at the first fit), eagerly, before the first step, so every
    worker starts from the same weights whatever its initialisation.
    """

    def __init__(self, root_rank: int = 0, reducer: Reducer | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self._reducer = reducer
        self._done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank, self._reducer)
        self._done = True
