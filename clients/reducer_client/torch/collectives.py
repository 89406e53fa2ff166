"""Horovod's torch collectives: allreduce (differentiable, in place, async),
grouped_allreduce, poll / synchronize (allgather, broadcast: broadcasts.py).

    t = rt.allreduce(t, name="loss")                 # op=rt.Average (the default)
    h = rt.allreduce_async_(p.grad); ...; rt.synchronize(h)
    rows = rt.allgather(t)                           # first dimensions may differ

Every call is checked across ranks first (reducer_client.collectives): a
shape, dtype, root_rank, op or compression that differs between ranks fails
every rank with one message naming them, within a round trip. Calls pair up
in call order (as in our contract; the name is checked, not used to match).
compression= chooses the wire dtype (reducer_client.compression; default:
the client's). allreduce carries floating point only (an integer tensor
fails on every rank); broadcast and allgather are exact for every dtype.
allgather costs world_size times a ring's bytes (summing daemons:
collectives.allgather_async). process_set: only the global set exists.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.compression import wire_dtype_of
from reducer_client.horovod import resolve_op
from reducer_client.integers import horovod_scale, is_integer
from reducer_client.torch._basics import resolve
from reducer_client.torch._tensors import numpy_view, to_numpy

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "poll", "synchronize", "future_of", "global_process_set"]

global_process_set = None  # Horovod's name for the one set there is


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_set(process_set: Any) -> None:
    if process_set is not None:
        raise NotImplementedError("process sets are not supported by reducerd: every "
                                  "collective spans the whole job")


def _name_first(average: Any, name: str | None) -> tuple[bool | None, str | None]:
    """(average, name): a str in average's place is a name (our older signature)."""
    if isinstance(average, str):
        return None, average
    return average, name


# Handles of the async forms: handle -> (future, finish, name); the names of
# those not synchronized yet. _handles_lock guards both (callers' threads).
_handles: dict[int, tuple[Future, Callable[[Any], Any], tuple[int, str] | None]] = {}
_names_in_flight: set[tuple[int, str]] = set()  # (id of the reducer, name)
_handles_lock = threading.Lock()
_next_handle = itertools.count(1)


def _claim(reducer: Reducer, name: str | None) -> tuple[int, str] | None:
    """ValueError if an operation of that name is not synchronized yet (Horovod's rule)."""
    if name is None:
        return None
    key = (id(reducer), name)
    with _handles_lock:
        if key in _names_in_flight:
            raise ValueError(f"an operation named {name!r} is still in flight: synchronize "
                             "it before starting another of the same name")
        _names_in_flight.add(key)
    return key


def _release(claim: tuple[int, str] | None) -> None:
    with _handles_lock:
        if claim is not None:
            _names_in_flight.discard(claim)


def _handle(future: Future, finish: Callable[[Any], Any],
            claim: tuple[int, str] | None = None) -> int:
    with _handles_lock:
        handle = next(_next_handle)
        _handles[handle] = (future, finish, claim)
    return handle


def handle_of(future: Future, finish: Callable[[Any], Any]) -> int:
    """A handle for `future` (synchronize gives finish(its result))."""
    return _handle(future, finish)


def poll(handle: int) -> bool:
    """Whether the operation of `handle` has finished (synchronize will not block)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)")
    return entry[0].done()


def future_of(handle: int) -> Future:
    """The core's future of `handle`'s operation: once it is done, synchronize
    will not block (a callback on it may call synchronize; it runs on the
    thread that settles the operation)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)")
    return entry[0]


def synchronize(handle: int) -> Any:
    """Wait for the operation of `handle` and return its output tensor(s)."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
        if entry is not None and entry[2] is not None:
            _names_in_flight.discard(entry[2])
    if entry is None:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)")
    future, finish, _ = entry
    return finish(future.result())  # the client's timeout bounds the wait


def _allreduce_start(tensors: Sequence[torch.Tensor], in_place: bool, name: str | None,
                     op: str, compression: Any, prescale: float, postscale: float,
                     reducer: Reducer) -> int:
    """Start one checked allreduce of `tensors` (fused into one call).

    synchronize gives the result tensor (a list for several), written into
    the tensors themselves when in_place.
    """
    wire = wire_dtype_of(compression)
    claim = _claim(reducer, name)
    floats = all(t.is_floating_point() for t in tensors)
    dtype = (_dtype_name(tensors[0].dtype) if floats else
             next(_dtype_name(t.dtype) for t in tensors if not t.is_floating_point()))
    numel = sum(t.numel() for t in tensors)
    single = len(tensors) == 1
    call = coll.Call(coll.ALLREDUCE, name, dtype,
                     tuple(tensors[0].shape) if single else (numel,), numel, op=op,
                     wire=wire, tag=0 if single else len(tensors),
                     signature="" if single else repr([(_dtype_name(t.dtype), tuple(t.shape))
                                                       for t in tensors]))
    values: np.ndarray | None = None
    out: np.ndarray | None = None
    if floats and single:
        view = numpy_view(tensors[0]) if in_place else None
        if view is not None:  # reduce straight into the tensor's memory
            values = out = view.reshape(-1)
            if prescale != 1.0:
                values *= prescale
        else:
            values = to_numpy(tensors[0]).reshape(-1)
            if prescale != 1.0:  # a copy: the input stays as it is
                # float16 in float32 math, rounded once (Horovod's CPU scaling)
                values = (values * np.float32(prescale) if values.dtype != np.float16 else
                          (values.astype(np.float32) * np.float32(prescale)).astype(np.float16))
    elif floats:
        values = out = np.concatenate([to_numpy(t).reshape(-1).astype(np.float32, copy=False)
                                       for t in tensors])
        if prescale != 1.0:
            values *= prescale
    elif len({t.dtype for t in tensors}) == 1 and is_integer(_numpy_dtype(tensors[0])):
        # Exact on an integer wire; scaled as Horovod scales integers.
        values = out = horovod_scale(np.concatenate(
            [t.detach().cpu().reshape(-1).numpy() for t in tensors]), prescale)
    try:
        future = coll.allreduce_async(reducer, values, call, out=out, postscale=postscale)
    except BaseException:
        _release(claim)
        raise

    def finish(result: np.ndarray) -> Any:
        flat, offset, results = result.reshape(-1), 0, []
        with torch.no_grad():
            for tensor in tensors:
                part = flat[offset:offset + tensor.numel()].reshape(tuple(tensor.shape))
                offset += tensor.numel()
                if not in_place:
                    results.append(to_like(part, tensor))
                    continue
                view = numpy_view(tensor)
                if view is None or not np.shares_memory(view, part):
                    tensor.copy_(to_like(part, tensor))
                results.append(tensor)
        return results[0] if single else results
    return _handle(future, finish, claim)


def _numpy_dtype(tensor: torch.Tensor) -> np.dtype:
    """The NumPy dtype of a CPU tensor's values (object for one NumPy lacks)."""
    try:
        return torch.empty(0, dtype=tensor.dtype).numpy().dtype
    except TypeError:
        return np.dtype(object)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None, *,
                    compression: Any = None, reducer: Reducer | None = None) -> int:
    """Start averaging (op=Average) or summing `tensor`; a handle for synchronize()."""
    _check_set(process_set)
    average, name = _name_first(average, name)
    return _allreduce_start([tensor], False, name, resolve_op(op, average), compression,
                            prescale_factor, postscale_factor, resolve(reducer))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None,
                     name: str | None = None, op: str | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None, *, compression: Any = None,
                     reducer: Reducer | None = None) -> int:
    """allreduce_async into `tensor` itself."""
    _check_set(process_set)
    average, name = _name_first(average, name)
    return _allreduce_start([tensor], True, name, resolve_op(op, average), compression,
                            prescale_factor, postscale_factor, resolve(reducer))


class _Allreduce(torch.autograd.Function):
    """allreduce whose gradient is the allreduce of the output's gradient (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, settings):  # type: ignore[override]
        ctx.settings = settings
        name, op, compression, pre, post, reducer = settings
        return synchronize(_allreduce_start([tensor], False, name, op, compression, pre,
                                            post, reducer))

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        _, op, compression, pre, post, reducer = ctx.settings
        return synchronize(_allreduce_start([grad_output], False, None, op, compression,
                                            pre, post, reducer)), None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = None, op: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None, *,
              reducer: Reducer | None = None) -> torch.Tensor:
    """Average (op=Average, the default) or sum `tensor` over all ranks; a new tensor.

    Same dtype, shape and device back. Differentiable: the gradient of the
    output is allreduced the same way (Horovod's rule), so every rank must
    run that backward too.
    """
    _check_set(process_set)
    average, name = _name_first(average, name)
    settings = (name, resolve_op(op, average), compression, prescale_factor,
                postscale_factor, resolve(reducer))
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allreduce.apply(tensor, settings)
    return synchronize(_allreduce_start([tensor], False, *settings))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None, *,
               compression: Any = None, reducer: Reducer | None = None) -> torch.Tensor:
    """allreduce into `tensor` itself; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set,
                                        compression=compression, reducer=reducer))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: str | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None, *, compression: Any = None,
                            reducer: Reducer | None = None) -> int:
    """Start one fused allreduce of a list of tensors; synchronize gives a list."""
    _check_set(process_set)
    tensors = list(tensors)
    return _allreduce_start(tensors, False, name, resolve_op(op, average), compression,
                            prescale_factor, postscale_factor, resolve(reducer))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: str | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None, *, compression: Any = None,
                             reducer: Reducer | None = None) -> int:
    """grouped_allreduce_async into the tensors themselves."""
    _check_set(process_set)
    tensors = list(tensors)
    return _allreduce_start(tensors, True, name, resolve_op(op, average), compression,
                            prescale_factor, postscale_factor, resolve(reducer))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, settings, *tensors):  # type: ignore[override]
        ctx.settings = settings
        name, op, compression, pre, post, reducer = settings
        return tuple(synchronize(_allreduce_start(tensors, False, name, op, compression,
                                                  pre, post, reducer)))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        _, op, compression, pre, post, reducer = ctx.settings
        return (None, *synchronize(_allreduce_start(grads, False, None, op, compression,
                                                    pre, post, reducer)))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = None, op: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None, *, reducer: Reducer | None = None,
                      ) -> list[torch.Tensor]:
    """allreduce of each tensor of the list, in one fused call; differentiable."""
    _check_set(process_set)
    tensors = list(tensors)
    settings = (name, resolve_op(op, average), compression, prescale_factor,
                postscale_factor, resolve(reducer))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_GroupedAllreduce.apply(settings, *tensors))
    return synchronize(_allreduce_start(tensors, False, *settings))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: str | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None, *, compression: Any = None,
                       reducer: Reducer | None = None) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set,
                                                compression=compression, reducer=reducer))


def to_like(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """`array` as a tensor of its own shape, with like's dtype and device.

    The reshape keeps a 0-d array 0-d: np.ascontiguousarray makes it 1-d."""
    contiguous = np.ascontiguousarray(array).reshape(array.shape)
    return torch.from_numpy(contiguous).to(device=like.device, dtype=like.dtype)
