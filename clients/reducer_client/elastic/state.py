"""Horovod's elastic State: commit / restore / sync and reset callbacks.

    state = ObjectState(bcast_object, batch=0, epoch=0)
    state.commit()      # remember the current values (call every few steps)
    state.restore()     # back to the last commit (after a failure)
    state.sync()        # every rank takes rank 0's values (after a reset)
    state.register_reset_callbacks([fn])   # run after each reset

Framework states (reducer_client.torch.elastic.TorchState, ...) add a
model and optimizer. broadcast_object here is a NumPy one over any Reducer
(exact: pickled bytes, one per float32 element).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.exact import decode_exact, encode_exact

__all__ = ["State", "ObjectState", "broadcast_object"]


def _broadcast_bytes(reducer: Reducer, data: np.ndarray, root_rank: int,
                     name: str) -> np.ndarray:
    encoded = encode_exact(data)
    call = coll.Call(coll.BROADCAST, name, data.dtype.name, data.shape, encoded.size,
                     root_rank=root_rank)
    return decode_exact(coll.broadcast_async(reducer, encoded, call).result(), data.dtype,
                        data.shape)


def broadcast_object(reducer: Reducer, obj: Any, root_rank: int = 0,
                     name: str = "elastic.object") -> Any:
    """root_rank's (picklable) obj on every rank."""
    is_root = reducer.rank == root_rank
    payload = np.frombuffer(pickle.dumps(obj) if is_root else b"", np.uint8)
    size = _broadcast_bytes(reducer, np.array([payload.size], np.int64), root_rank,
                            f"{name}.size")
    if not is_root:
        payload = np.zeros(int(size[0]), np.uint8)
    data = _broadcast_bytes(reducer, payload, root_rank, name)
    return obj if is_root else pickle.loads(data.tobytes())


class State:
    """What a training loop keeps across failures (Horovod's hvd.elastic.State).

    Subclasses implement save (into the last commit), restore and sync.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        # Set by elastic.run for each incarnation (lobby.HostWatch): commit asks it.
        self._host_watch: Any = None

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions to call after every reset (a changed world size, say)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Remember the current state; a failure later goes back here."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank alike when a worker was
        admitted to the job (elastic/lobby.py); a round of every rank. Outside
        elastic.run: nothing to check."""
        if self._host_watch is not None:
            self._host_watch.check()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Picklable attributes (batch=0, epoch=0, ...) kept across failures.

    bcast_object(obj, root_rank) is the shim's broadcast_object; each
    keyword becomes an attribute, saved by commit, put back by restore and
    copied from rank 0 by sync.
    """

    def __init__(self, bcast_object: Callable[[Any, int], Any], **kwargs: Any) -> None:
        super().__init__()
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr))
                             for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, 0)
            self._set_attrs()
