"""Horovod's MXNet API: collectives, broadcast_parameters, DistributedTrainer keywords.

    import reducer_client.mxnet as hvd
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)   # before the first forward too
    trainer = hvd.DistributedTrainer(params, opt, compression=hvd.Compression.fp16,
                                     gradient_predivide_factor=2.0)

allreduce (average / op, prescale / postscale, in place with allreduce_),
grouped_allreduce(_), allgather (first dimensions may differ; world_size
times a ring's bytes), broadcast(_), broadcast_object, allgather_object,
with Horovod's meaning; each is checked across ranks first
(reducer_client.collectives: shape, dtype, root_rank, op mismatches fail
every rank at once, naming them). `priority` is accepted and unused.
allreduce carries floating point; broadcast and allgather are exact for
every dtype.

broadcast_parameters works before the first forward: a parameter whose
shape MXNet infers later (deferred initialization) is broadcast right
after MXNet initializes it, as Horovod does, so the first step already
runs on root_rank's weights.
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.compression import CompressedReducer, Compressor, wire_dtype_of
from reducer_client.exact import decode_exact, encode_exact, encoded_per_element
from reducer_client.horovod import Average, resolve_op
from reducer_client.mxnet import trainer as _trainer
from reducer_client.mxnet._basics import basics
from reducer_client.mxnet.kvstore import Reducer as _Store

__all__ = ["allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
           "broadcast", "broadcast_", "broadcast_object", "allgather_object",
           "broadcast_parameters", "DistributedTrainer"]


def _np(array: mx.nd.NDArray) -> np.ndarray:
    return array.asnumpy()


def _allreduce(tensors: Sequence[mx.nd.NDArray], outputs: Sequence[mx.nd.NDArray],
               average: bool | None, name: str | None, prescale: float, postscale: float,
               op: str | None, compression: Any, reducer: Reducer | None) -> None:
    target = basics.resolve(reducer)
    op = resolve_op(op, average)
    single = len(tensors) == 1
    dtypes = [np.dtype(t.dtype).name for t in tensors]
    floats = all(np.dtype(t.dtype).kind == "f" for t in tensors)
    numel = sum(t.size for t in tensors)
    call = coll.Call(coll.ALLREDUCE, name, dtypes[0] if floats else
                     next(d for d in dtypes if np.dtype(d).kind != "f"),
                     tuple(tensors[0].shape) if single else (numel,), numel, op=op,
                     wire=wire_dtype_of(compression), tag=0 if single else len(tensors),
                     signature="" if single else repr([(d, t.shape) for d, t in
                                                       zip(dtypes, tensors, strict=True)]))
    values = None
    if floats:
        values = (_np(tensors[0]).reshape(-1) if single else
                  np.concatenate([_np(t).reshape(-1).astype(np.float32) for t in tensors]))
        if prescale != 1.0:
            values = values * prescale
    result = coll.allreduce_async(target, values, call).result()
    if postscale != 1.0:
        result = result * postscale
    offset = 0
    for tensor, out in zip(tensors, outputs, strict=True):
        out[:] = result[offset:offset + tensor.size].reshape(tensor.shape).astype(out.dtype)
        offset += tensor.size


def allreduce(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None, op: str | None = None, *, compression: Any = None,
              reducer: Reducer | None = None) -> mx.nd.NDArray:
    """Average (op=Average, the default) or sum `tensor` over all ranks; a new NDArray."""
    out = mx.nd.zeros(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
    _allreduce([tensor], [out], average, name, prescale_factor, postscale_factor, op,
               compression, reducer)
    return out


def allreduce_(tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None, op: str | None = None, *, compression: Any = None,
               reducer: Reducer | None = None) -> mx.nd.NDArray:
    """allreduce into `tensor` itself; returns it."""
    _allreduce([tensor], [tensor], average, name, prescale_factor, postscale_factor, op,
               compression, reducer)
    return tensor


def grouped_allreduce(tensors: Sequence[mx.nd.NDArray], average: bool | None = None,
                      name: str | None = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None, op: str | None = None, *,
                      compression: Any = None, reducer: Reducer | None = None,
                      ) -> list[mx.nd.NDArray]:
    """allreduce of each NDArray of the list in one fused call; new NDArrays."""
    outs = [mx.nd.zeros(t.shape, ctx=t.context, dtype=t.dtype) for t in tensors]
    _allreduce(list(tensors), outs, average, name, prescale_factor, postscale_factor, op,
               compression, reducer)
    return outs


def grouped_allreduce_(tensors: Sequence[mx.nd.NDArray], average: bool | None = None,
                       name: str | None = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None, op: str | None = None, *,
                       compression: Any = None, reducer: Reducer | None = None,
                       ) -> list[mx.nd.NDArray]:
    _allreduce(list(tensors), list(tensors), average, name, prescale_factor,
               postscale_factor, op, compression, reducer)
    return list(tensors)


def allgather(tensor: mx.nd.NDArray, name: str | None = None, priority: int = 0,
              process_set: Any = None, *, reducer: Reducer | None = None) -> mx.nd.NDArray:
    """Every rank's `tensor` concatenated along dimension 0, in rank order (exact)."""
    host = _np(tensor)
    if host.ndim == 0:
        raise ValueError("allgather needs an array of at least one dimension")
    per_row = int(np.prod(host.shape[1:], dtype=np.int64)) * encoded_per_element(host.dtype)
    call = coll.Call(coll.ALLGATHER, name, host.dtype.name, host.shape, per_row)
    rows, counts = coll.allgather_async(basics.resolve(reducer), encode_exact(host),
                                        call).result()
    values = decode_exact(rows, host.dtype, (sum(counts), *host.shape[1:]))
    return mx.nd.array(values, ctx=tensor.context, dtype=host.dtype)


def _broadcast_host(host: np.ndarray, root_rank: int, name: str | None,
                    reducer: Reducer | None) -> np.ndarray:
    encoded = encode_exact(host)
    call = coll.Call(coll.BROADCAST, name, host.dtype.name, host.shape, encoded.size,
                     root_rank=root_rank)
    result = coll.broadcast_async(basics.resolve(reducer), encoded, call).result()
    return decode_exact(result, host.dtype, host.shape)


def broadcast(tensor: mx.nd.NDArray, root_rank: int = 0, name: str | None = None,
              priority: int = 0, process_set: Any = None, *,
              reducer: Reducer | None = None) -> mx.nd.NDArray:
    """root_rank's `tensor` on every rank, a new NDArray (exact)."""
    host = _np(tensor)
    return mx.nd.array(_broadcast_host(host, root_rank, name, reducer), ctx=tensor.context,
                       dtype=host.dtype)


def broadcast_(tensor: mx.nd.NDArray, root_rank: int = 0, name: str | None = None,
               priority: int = 0, process_set: Any = None, *,
               reducer: Reducer | None = None) -> mx.nd.NDArray:
    """Overwrite `tensor` with root_rank's, in place; returns it."""
    tensor[:] = _broadcast_host(_np(tensor), root_rank, name, reducer)
    return tensor


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, *,
                     reducer: Reducer | None = None) -> Any:
    """root_rank's (picklable) `obj` on every rank."""
    target = basics.resolve(reducer)
    is_root = target.rank == root_rank
    payload = np.frombuffer(pickle.dumps(obj) if is_root else b"", np.uint8)
    size = _broadcast_host(np.array([payload.size], np.int64), root_rank, None, target)
    if not is_root:
        payload = np.zeros(int(size[0]), np.uint8)
    data = _broadcast_host(payload, root_rank, name, target)
    return obj if is_root else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None, *,
                     reducer: Reducer | None = None) -> list[Any]:
    """Every rank's (picklable) `obj`, as a list in rank order."""
    payload = mx.nd.array(np.frombuffer(pickle.dumps(obj), np.uint8), dtype=np.uint8)
    sizes = allgather(mx.nd.array([payload.size], dtype=np.int64), reducer=reducer)
    data = allgather(payload, name=name, reducer=reducer).asnumpy().tobytes()
    bounds = np.concatenate([[0], np.cumsum(sizes.asnumpy())])
    return [pickle.loads(data[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _broadcast_after_init(param: mx.gluon.Parameter, root_rank: int, name: str,
                          reducer: Reducer | None) -> None:
    """Make `param`'s deferred initialization end with root_rank's values (Horovod's way)."""
    init_impl = param._init_impl

    def wrapped(self: mx.gluon.Parameter, *args: Any, **kwargs: Any) -> None:
        init_impl(*args, **kwargs)
        # MXNet initializes inside the first forward, usually under
        # autograd.record(): the copy must not be recorded.
        with mx.autograd.pause():
            for array in self.list_data():
                broadcast_(array, root_rank, name=name, reducer=reducer)
    param._init_impl = types.MethodType(wrapped, param)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None, *,
                         reducer: Reducer | None = None) -> None:
    """Overwrite parameters on every rank with root_rank's; works before the first forward.

    params: a ParameterDict (net.collect_params()) or a dict of Parameters
    or NDArrays, sorted by name (every rank must pass the same). Parameters
    already initialized travel now, in one fused broadcast; those waiting
    for their shape (deferred initialization) are broadcast as soon as MXNet
    initializes them in the first forward. prefix tells apart the
    broadcasts of several calls, as Horovod's.
    """
    target = basics.resolve(reducer)
    if not hasattr(params, "items"):
        raise ValueError(f"invalid params of type: {type(params)}")
    prefix = prefix or ""
    ready: list[mx.nd.NDArray] = []
    for name, param in sorted(params.items()):
        if not isinstance(param, mx.gluon.Parameter):
            ready.append(param)
            continue
        try:
            ready.extend(param.list_data())
        except mx.gluon.parameter.DeferredInitializationError:
            _broadcast_after_init(param, root_rank, prefix + str(name), target)
    if target.world_size == 1 or not ready:
        return
    hosts = [_np(a) for a in ready]
    encoded = [encode_exact(h) for h in hosts]
    flat = np.concatenate(encoded)
    call = coll.Call(coll.BROADCAST, f"{prefix}parameters", "float32", (flat.size,),
                     flat.size, root_rank=root_rank,
                     signature=repr([(h.dtype.name, h.shape) for h in hosts]))
    result = coll.broadcast_async(target, flat, call).result()
    offset = 0
    for array, host, enc in zip(ready, hosts, encoded, strict=True):
        array[:] = decode_exact(result[offset:offset + enc.size], host.dtype, host.shape)
        offset += enc.size


class DistributedTrainer(_trainer.DistributedTrainer):
    """gluon.Trainer averaging all gradients of a step in one call, Horovod's keywords.

    compression (the wire dtype; None: the client's), gradient_predivide_factor
    (gradients scaled by 1/f before the sum and f/size after it); prefix and
    num_groups are accepted (transfers are keyed and fused by the store
    already, in call order). A store passed as kvstore= keeps
    its own op and backend.
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None,
                 compression: Any = None, gradient_predivide_factor: float = 1.0,
                 prefix: str | None = None, num_groups: int = 0, process_set: Any = None,
                 *, kvstore: Any = None, reducer: Reducer | None = None,
                 **kwargs: Any) -> None:
        if isinstance(compression, _Store):  # this shim's older (..., kvstore) order
            compression, kvstore = None, compression
        if compression is not None and not isinstance(compression, Compressor | str):
            raise TypeError(f"compression {compression!r}: use hvd.Compression.none / .fp16")
        if process_set is not None:
            raise NotImplementedError("process sets are not supported by reducerd")
        if gradient_predivide_factor != 1.0 and kvstore is not None:
            raise ValueError("gradient_predivide_factor applies to the trainer's own store; "
                             "do not pass kvstore= with it")
        if kvstore is None:
            backend = CompressedReducer(reducer if reducer is not None else basics.client,
                                        wire_dtype_of(compression), gradient_predivide_factor)
            kvstore = _Store(op=Average, backend=backend)
        super().__init__(params, optimizer, optimizer_params, kvstore=kvstore, **kwargs)
