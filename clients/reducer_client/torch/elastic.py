"""Horovod's torch elastic API: run, TorchState, ObjectState (reducer_client.elastic).

    @rt.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...; state.optimizer.step()
                if state.batch % 4 == 0:
                    state.commit()
            state.batch = 0
    train(rt.elastic.TorchState(model, optimizer, epoch=0, batch=0))
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from reducer_client.elastic import HostsUpdatedInterrupt, ObjectState
from reducer_client.elastic import make_run as _make_run
from reducer_client.torch._basics import basics as _basics
from reducer_client.torch._lifetime import forget_all_residuals
from reducer_client.torch.compat import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["run", "TorchState", "ObjectState", "HostsUpdatedInterrupt"]

run = _make_run(_basics)


class TorchState(ObjectState):
    """A model, an optimizer and picklable attributes kept across failures.

    commit keeps deep copies of model.state_dict() and optimizer.state_dict();
    restore loads them back and forgets every error-feedback residual (they
    belong to the steps undone; the TensorFlow shim's restore does the same);
    sync copies rank 0's parameters, buffers, optimizer state and attributes
    to every rank and makes them the commit (a worker that just joined goes
    back to rank 0's state, not its own).
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self._saved_model: dict[str, Any] | None = None
        self._saved_optimizer: dict[str, Any] | None = None
        super().__init__(lambda obj, root: broadcast_object(obj, root), **kwargs)
        self._save_framework()

    def _save_framework(self) -> None:
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())

    def save(self) -> None:
        self._save_framework()
        super().save()

    def restore(self) -> None:
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        forget_all_residuals()
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()
        self._save_framework()
