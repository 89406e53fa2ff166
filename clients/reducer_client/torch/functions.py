"""allreduce and the broadcasts of the PyTorch shim.

Broadcasts are exact: float16, bfloat16 and float32 values widen to float32,
which is what broadcast carries; any other dtype (float64, integers, bool)
travels as its bytes, one byte per float32 element, so it survives the trip
bit for bit (the root sends the values, the others zeros, and x + 0 is x).
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from reducer_client.api import Reducer
from reducer_client.torch._basics import resolve, unnamed_key
from reducer_client.torch._tensors import to_numpy

__all__ = ["allreduce", "broadcast_parameters", "broadcast_optimizer_state",
           "broadcast_object"]

_WIDENS_EXACTLY = (torch.float16, torch.bfloat16, torch.float32)

def allreduce(tensor: torch.Tensor, name: str | None = None, op: str = "mean", *,
              reducer: Reducer | None = None) -> torch.Tensor:
    """Average (or sum) a floating-point tensor over all workers; a new tensor back.

    The result has the input's dtype, shape and device. It travels in the
    client's wire dtype. `name` must be the same on every rank; unnamed
    calls all share one key, so every rank must make them in the same order
    (as with Horovod).
    """
    reducer = resolve(reducer)
    key = unnamed_key("allreduce") if name is None else f"allreduce/{name}"
    result = reducer.allreduce(to_numpy(tensor), key, op)
    return torch.from_numpy(result).to(device=tensor.device, dtype=tensor.dtype)


def broadcast_parameters(params: Mapping[str, torch.Tensor]
                         | Iterable[tuple[str, torch.Tensor] | torch.Tensor],
                         root_rank: int = 0, *,
                         reducer: Reducer | None = None) -> None:
    """Overwrite the tensors on every rank with root_rank's, in place.

    `params` is a state_dict (parameters and buffers), (name, tensor)
    pairs such as model.named_parameters(), or tensors such as
    list(model.parameters()) (Horovod takes all three); every rank must pass
    the same shapes and dtypes in the same order. All tensors travel
    together as one flat array.
    """
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    _broadcast_tensors(resolve(reducer), [_tensor_of(item) for item in items],
                       "broadcast/parameters", root_rank)


def _tensor_of(item: Any) -> torch.Tensor:
    """The tensor of one of broadcast_parameters' items: a tensor or a (name, tensor) pair."""
    if isinstance(item, torch.Tensor):
        return item
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
        return item[1]
    raise ValueError("params must be a state_dict, (name, tensor) pairs or tensors")


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, *,
                     reducer: Reducer | None = None) -> Any:
    """Return root_rank's `obj` (pickled) on every rank; others may pass None."""
    reducer = resolve(reducer)
    key = unnamed_key("broadcast_object") if name is None else f"broadcast/object/{name}"
    is_root = reducer.rank == root_rank
    payload = np.frombuffer(pickle.dumps(obj) if is_root else b"", dtype=np.uint8)
    nbytes = _broadcast_bytes(reducer, np.array([payload.size], dtype=np.int64),
                              f"{key}/nbytes", root_rank)
    if not is_root:
        payload = np.zeros(int(nbytes[0]), dtype=np.uint8)
    payload = _broadcast_bytes(reducer, payload, f"{key}/data", root_rank)
    return obj if is_root else pickle.loads(payload.tobytes())


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor stood in the root's optimizer state, and what it was."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, *,
                              reducer: Reducer | None = None) -> None:
    """Make every rank's optimizer state and hyperparameters root_rank's.

    Works whether or not the other ranks have state yet (an Adam that has
    not stepped has none): the root's state_dict is sent as its structure
    (a pickled object with the tensors left out) and then its tensors, and
    each other rank loads it with load_state_dict. Nothing steps the
    optimizers, so no parameter changes. The optimizers must have the same
    parameter groups on every rank.
    """
    reducer = resolve(reducer)
    is_root = reducer.rank == root_rank
    tensors: list[torch.Tensor] = []
    skeleton = _strip_tensors(optimizer.state_dict(), tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, "optimizer_state", reducer=reducer)
    if not is_root:
        slots: list[_TensorSlot] = []
        _fill_tensors(skeleton, slots.append)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
    _broadcast_tensors(reducer, tensors, "broadcast/optimizer_state", root_rank)
    if not is_root:
        optimizer.load_state_dict(_fill_tensors(skeleton, lambda s: tensors[s.index]))


def _strip_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A copy of obj with each tensor replaced by a _TensorSlot; tensors collected in order."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _strip_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip_tensors(v, tensors) for v in obj)
    return obj


def _fill_tensors(obj: Any, tensor_for) -> Any:
    """The inverse of _strip_tensors: each slot replaced by tensor_for(slot)."""
    if isinstance(obj, _TensorSlot):
        return tensor_for(obj)
    if isinstance(obj, dict):
        return {k: _fill_tensors(v, tensor_for) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill_tensors(v, tensor_for) for v in obj)
    return obj


def _broadcast_tensors(reducer: Reducer, tensors: list[torch.Tensor], key: str,
                       root_rank: int) -> None:
    """Overwrite `tensors` on the non-root ranks with the root's, in one flat broadcast."""
    if not tensors:
        return
    encoded = [_encode(t) for t in tensors]
    result = reducer.broadcast(np.concatenate(encoded), key, root_rank)
    if reducer.rank == root_rank:
        return
    offsets = itertools.accumulate((e.size for e in encoded), initial=0)
    with torch.no_grad():
        for tensor, offset, values in zip(tensors, offsets, encoded, strict=False):
            tensor.copy_(_decode(result[offset:offset + values.size], tensor))


def _encode(tensor: torch.Tensor) -> np.ndarray:
    """The tensor as flat float32 values that cross a broadcast exactly."""
    host = tensor.detach().cpu().contiguous().reshape(-1)
    if host.dtype in _WIDENS_EXACTLY:
        return host.to(torch.float32).numpy()
    return host.view(torch.uint8).numpy().astype(np.float32)


def _decode(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Undo _encode: a CPU tensor with like's dtype and shape."""
    if like.dtype in _WIDENS_EXACTLY:
        return torch.from_numpy(values).to(like.dtype).view(like.shape)
    raw = torch.from_numpy(values.astype(np.uint8))
    return raw.view(like.dtype).view(like.shape)


def _broadcast_bytes(reducer: Reducer, array: np.ndarray, key: str,
                     root_rank: int) -> np.ndarray:
    """Broadcast a NumPy array of any dtype exactly, one byte per float32 element."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8).astype(np.float32)
    if raw.size == 0:
        return array
    out = reducer.broadcast(raw, key, root_rank)
    return out.astype(np.uint8).view(array.dtype).reshape(array.shape)
