"""broadcast_object / allgather_object of the TensorFlow shim (Horovod's names).

A picklable object travels as bytes through the core's checked broadcast and
allgather directly, not through TensorFlow ops: the call works the same
eagerly, in a TF1 graph (no session is needed) and while a tf.function is
traced (it runs then, once per trace, as any Python code there does).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.exact import decode_exact, encode_exact, encoded_per_element
from reducer_client.tensorflow._basics import basics

__all__ = ["broadcast_object", "broadcast_object_fn", "allgather_object"]


def _check_set(process_set: Any) -> None:
    if process_set is not None:
        raise NotImplementedError("process sets are not supported by reducerd: every "
                                  "collective spans the whole job")


def _broadcast_array(target: Reducer, array: np.ndarray, root_rank: int,
                     name: str | None) -> np.ndarray:
    encoded = encode_exact(array)
    call = coll.Call(coll.BROADCAST, name, array.dtype.name, array.shape, encoded.size,
                     root_rank=root_rank)
    return decode_exact(coll.broadcast_async(target, encoded, call).result(), array.dtype,
                        array.shape)


def _allgather_array(target: Reducer, array: np.ndarray, name: str | None) -> np.ndarray:
    per_row = int(np.prod(array.shape[1:], dtype=np.int64)) * encoded_per_element(array.dtype)
    encoded = encode_exact(array)
    call = coll.Call(coll.ALLGATHER, name, array.dtype.name, array.shape, per_row)
    rows, counts = coll.allgather_async(target, encoded, call).result()
    return decode_exact(rows, array.dtype, (sum(counts), *array.shape[1:]))


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: str | None = None, process_set: Any = None, *,
                     reducer: Reducer | None = None) -> Any:
    """root_rank's (picklable) `obj` on every rank. `session` is Horovod's, unused."""
    _check_set(process_set)
    if isinstance(session, str):  # this shim's older (obj, root_rank, name)
        session, name = None, session
    target = basics.resolve(reducer)
    payload = (np.frombuffer(pickle.dumps(obj), np.uint8) if target.rank == root_rank
               else np.zeros(0, np.uint8))
    size = _broadcast_array(target, np.array([payload.size], np.int64), root_rank,
                            None if name is None else f"{name}.sz")
    if target.rank != root_rank:
        payload = np.zeros(int(size[0]), np.uint8)
    data = _broadcast_array(target, payload, root_rank, name)
    return obj if target.rank == root_rank else pickle.loads(data.tobytes())


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = None, *, reducer: Reducer | None = None,
                        ) -> Callable[[Any], Any]:
    """A function obj -> broadcast_object(obj, root_rank, ...) (Horovod's)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set,
                                        reducer=reducer)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = None, *, reducer: Reducer | None = None) -> list[Any]:
    """Every rank's (picklable) `obj`, as a list in rank order. `session` is unused."""
    _check_set(process_set)
    if isinstance(session, str):  # this shim's older (obj, name)
        session, name = None, session
    target = basics.resolve(reducer)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = _allgather_array(target, np.array([payload.size], np.int64),
                             None if name is None else f"{name}.sz")
    data = _allgather_array(target, payload, name).tobytes()
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
