"""DistributedTrainer: a gluon.Trainer that averages all gradients of a step in one call."""

from __future__ import annotations

from typing import Any

from mxnet import gluon

from reducer_client.mxnet.kvstore import Reducer, set_error_feedback

__all__ = ["DistributedTrainer"]


class DistributedTrainer(gluon.Trainer):
    """gluon.Trainer that reduces all gradients of a step in one store call.

    Same arguments as gluon.Trainer; `kvstore` defaults to a new "reducer"
    store that averages over the workers (op="mean", as Horovod's
    DistributedTrainer), so `trainer.step(b)` with b = this worker's batch
    size gives the update of one process on the global batch. A store
    passed in keeps its own op. The plain Trainer calls pushpull once per
    parameter (one round trip each); this one passes every dense gradient
    at once, so small ones are packed together and all travel concurrently.
    error_feedback: on or off for the store's client (kvstore.set_error_feedback;
    None: as chosen, by default on for the 8-bit wires).
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore=None,
                 error_feedback: bool | None = None, **kwargs: Any) -> None:
        if kvstore is None:
            kvstore = Reducer(op="mean")
        if error_feedback is not None and isinstance(kvstore, Reducer):
            set_error_feedback(error_feedback, kvstore._backend)
        super().__init__(params, optimizer, optimizer_params, kvstore=kvstore, **kwargs)

    def _allreduce_grads(self) -> None:
        if not self._kvstore:
            return
        keys, grads = [], []
        for index, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grad_list = param.list_grad()
            if grad_list[0].stype != "default":
                raise TypeError(f"parameter {param.name}: sparse gradients are not "
                                "supported by the reducer kvstore")
            keys.append(index)
            grads.append(grad_list)
        if keys:
            self._kvstore.pushpull(keys, grads)
