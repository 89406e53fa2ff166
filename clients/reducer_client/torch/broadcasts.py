"""Horovod's torch allgather, allgather_object, broadcast (differentiable, in
place, async) and barrier.

allgather concatenates along dimension 0 and the first dimensions may
differ between ranks; through summing daemons it costs world_size times a
ring allgather's bytes (reducer_client.collectives.allgather_async).
Broadcast and allgather are exact for every dtype (reducer_client.exact).
Both are checked across ranks first, like allreduce (collectives.py).
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import numpy as np
import torch

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.exact import decode_exact, encode_exact, encoded_per_element
from reducer_client.torch._basics import resolve
from reducer_client.torch.collectives import (
    _check_set,
    _claim,
    _dtype_name,
    _handle,
    _release,
    allreduce,
    synchronize,
    to_like,
)

__all__ = ["allgather", "allgather_async", "allgather_object", "grouped_allgather", "broadcast",
           "broadcast_",
           "broadcast_async", "broadcast_async_", "barrier", "barrier_async"]


def _host_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values on the host in NumPy (bfloat16 widened to float32, exactly)."""
    host = tensor.detach().cpu().contiguous()
    return (host.float() if host.dtype == torch.bfloat16 else host).numpy()


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None,
                    *, reducer: Reducer | None = None) -> int:
    """Start concatenating every rank's `tensor` along dimension 0 (lengths may differ)."""
    _check_set(process_set)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor of at least one dimension")
    host = _host_numpy(tensor)
    per_row = int(np.prod(tensor.shape[1:], dtype=np.int64)) * encoded_per_element(host.dtype)
    call = coll.Call(coll.ALLGATHER, name, _dtype_name(tensor.dtype), tuple(tensor.shape),
                     per_row)
    reducer = resolve(reducer)
    claim = _claim(reducer, name)
    try:
        future = coll.allgather_async(reducer, encode_exact(host), call)
    except BaseException:
        _release(claim)
        raise

    def finish(result: tuple[np.ndarray, list[int]]) -> torch.Tensor:
        rows, counts = result
        values = decode_exact(rows, host.dtype, (sum(counts), *tensor.shape[1:]))
        return to_like(values, tensor)
    return _handle(future, finish, claim)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, reducer):  # type: ignore[override]
        ctx.rows, ctx.reducer = tensor.shape[0], reducer
        return synchronize(allgather_async(tensor, name, reducer=reducer))

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        # Horovod's rule: average the gradient, keep this rank's rows.
        reduced = allreduce(grad_output, op="mean", reducer=ctx.reducer)
        counts = allgather(torch.tensor([ctx.rows], dtype=torch.int64), reducer=ctx.reducer)
        offset = int(counts[:ctx.reducer.rank].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None, *,
              reducer: Reducer | None = None) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dimension 0, in rank order; differentiable."""
    _check_set(process_set)
    reducer = resolve(reducer)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name, reducer)
    return synchronize(allgather_async(tensor, name, reducer=reducer))


def grouped_allgather(tensors: Any, name: str | None = None, process_set: Any = None, *,
                      reducer: Reducer | None = None) -> list[torch.Tensor]:
    """allgather of each tensor of the list (one call each, in list order)."""
    _check_set(process_set)
    return [allgather(t, None if name is None else f"{name}.{i}", reducer=reducer)
            for i, t in enumerate(tensors)]


def allgather_object(obj: Any, name: str | None = None, *,
                     reducer: Reducer | None = None) -> list[Any]:
    """Every rank's (picklable) `obj`, as a list in rank order."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()]), name=None if name is None
                      else f"{name}.sizes", reducer=reducer)
    data = allgather(payload, name=name, reducer=reducer).numpy().tobytes()
    bounds = [0, *itertools.accumulate(int(s) for s in sizes)]
    return [pickle.loads(data[a:b]) for a, b in itertools.pairwise(bounds)]


def _broadcast_start(tensor: torch.Tensor, output: torch.Tensor, root_rank: int,
                     name: str | None, reducer: Reducer) -> int:
    host = _host_numpy(tensor)
    encoded = encode_exact(host)
    call = coll.Call(coll.BROADCAST, name, _dtype_name(tensor.dtype), tuple(tensor.shape),
                     encoded.size, root_rank=root_rank)
    claim = _claim(reducer, name)
    try:
        future = coll.broadcast_async(reducer, encoded, call)
    except BaseException:
        _release(claim)
        raise

    def finish(result: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            output.copy_(to_like(decode_exact(result, host.dtype, host.shape), output))
        return output
    return _handle(future, finish, claim)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None, *, reducer: Reducer | None = None) -> int:
    """Start sending root_rank's `tensor` to every rank (exact, any dtype)."""
    _check_set(process_set)
    return _broadcast_start(tensor, torch.empty_like(tensor), root_rank, name,
                            resolve(reducer))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = None, *, reducer: Reducer | None = None) -> int:
    """broadcast_async into `tensor` itself."""
    _check_set(process_set)
    return _broadcast_start(tensor, tensor, root_rank, name, resolve(reducer))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, reducer):  # type: ignore[override]
        ctx.root_rank, ctx.reducer = root_rank, reducer
        return synchronize(broadcast_async(tensor, root_rank, name, reducer=reducer))

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        # Horovod's rule: the averaged gradient on the root, zeros elsewhere.
        reduced = allreduce(grad_output, op="mean", reducer=ctx.reducer)
        if ctx.reducer.rank != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None, *, reducer: Reducer | None = None) -> torch.Tensor:
    """root_rank's `tensor` on every rank, a new tensor; differentiable (Horovod's rule)."""
    _check_set(process_set)
    reducer = resolve(reducer)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name, reducer)
    return synchronize(broadcast_async(tensor, root_rank, name, reducer=reducer))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None, *, reducer: Reducer | None = None) -> torch.Tensor:
    """Overwrite `tensor` with root_rank's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set,
                                        reducer=reducer))


def barrier_async(process_set: Any = None, *, reducer: Reducer | None = None) -> int:
    """Start a barrier; synchronize(handle) returns once every rank has called one."""
    _check_set(process_set)
    call = coll.Call(coll.CHECK, "barrier", "float32", (), 0)

    def finish(rows: np.ndarray) -> None:
        coll.check(rows, call)
    return _handle(coll.control_async(resolve(reducer), call), finish)


def barrier(process_set: Any = None, *, reducer: Reducer | None = None) -> None:
    """Return once every rank has called barrier()."""
    synchronize(barrier_async(process_set, reducer=reducer))
