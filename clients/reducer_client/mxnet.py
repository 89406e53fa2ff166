"""MXNet shim: the "reducer" KVStore, so gluon.Trainer reduces through reducerd.

    import mxnet as mx
    import reducer_client.mxnet            # registers the KVStore type "reducer"
    kv = mx.kv.create("reducer")           # configured by ReducerClient.from_env()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    ...
    trainer.step(local_batch_size)         # see "Batch size" below

Pass the store object, not the string: gluon.Trainer(kvstore="reducer") on a
single device quietly uses no kvstore at all (MXNet only creates non-"dist"
stores by name for several devices).

Configuration: `mx.kv.create("reducer")` takes its client from `init(...)`
when that was called, else from the environment (REDUCER_ADDRESSES,
REDUCER_JOB, REDUCER_RANK / REDUCER_WORLD_SIZE or DMLC_WORKER_ID /
DMLC_NUM_WORKER, ...; see reducer_client.env). All stores of a process share
that one client, so their per-key round counters agree. `Reducer(op=...,
fusion_bytes=..., backend=...)` builds a store with other settings.

Batch size: the store's default op is "mean" (as Horovod's shims). Each
worker's gradients (summed over its devices) are averaged over the workers,
so `trainer.step(b)` with b = this worker's batch size (all its devices
together) gives the same update as single-process training on the global
batch of world_size * b samples. With `Reducer(op="sum")` (the reduction
MXNet's own dist_sync store makes) call `trainer.step(world_size * b)`.

Initial weights: the Trainer broadcasts rank 0's weights at its first
step(), after that step's gradients were computed on each worker's own
weights. Start every worker from the same weights (same seed), or broadcast
them first: `kv.broadcast(keys, [p.data() for p in params], root_rank=0)`.

The Trainer updates the weights locally (is_capable("optimizer") is False),
so optimizer state never leaves the worker and needs no checkpoint support
from the store.

Transfers: pushpull and broadcast block until `out` holds the result (the
Trainer reads the gradients right after). A call with a list of keys sends all
of them at once; keys smaller than `fusion_bytes` are packed into shared
buffers (per dtype, in call order, so every worker packs the same way) and
each buffer travels as one allreduce. `DistributedTrainer` is a gluon.Trainer
that hands the store all its gradients in one such call per step; the plain
Trainer calls pushpull once per parameter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc
import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet.kvstore import KVStoreBase

from reducer_client import process
from reducer_client.api import Reducer as ReducerBackend
from reducer_client.errors import ReducerError

__all__ = ["Reducer", "DistributedTrainer", "init", "shutdown", "client",
           "DEFAULT_FUSION_BYTES"]

# Keys below this size share a transfer. 4 MiB of float32 is a few chunks of
# the core's 1 MiB wire chunk, spread over the daemons; larger keys gain
# nothing from packing and travel alone.
DEFAULT_FUSION_BYTES = 4 << 20
# Extra wait over the client's own timeout: the core fails a late operation
# itself; this bound only catches a client that does not.
_WAIT_MARGIN_S = 5.0

_SHIM = "reducer_client.mxnet"


def init(backend: ReducerBackend | None = None, **client_kwargs: Any) -> ReducerBackend:
    """Set the client that mx.kv.create("reducer") uses, and return it.

    With no arguments an existing client is kept, else one comes from the
    environment (ReducerClient.from_env); keyword arguments build a
    ReducerClient; `backend` may be any reducer_client.api.Reducer (e.g. a
    LocalGroup client in tests). The client is reducer_client.process's, shared
    with the other shims; one replaced by arguments is closed.
    """
    if backend is not None and client_kwargs:
        raise ValueError("init: give either a backend or ReducerClient keyword arguments")
    return process.init(backend, **client_kwargs)


def client() -> ReducerBackend:
    """The process-wide client, created from the environment on first use."""
    return process.client(_SHIM, create=True)


shutdown = process.shutdown


# -- conversion and fusion (NumPy only) -----------------------------------------


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _to_numpy(arrays: Sequence[mx.nd.NDArray]) -> np.ndarray:
    """This worker's contribution: the sum of its per-device values.

    Several devices are summed in float64 and rounded once to the values'
    dtype, so the local sum adds no error beyond that one rounding.
    """
    for array in arrays:
        if array.stype != "default":
            raise TypeError(f"reducer kvstore: {array.stype} arrays are not supported; "
                            "use dense gradients")
    if len(arrays) == 1:
        return arrays[0].asnumpy()
    dtype = arrays[0].dtype
    total = np.zeros(arrays[0].shape, dtype=np.float64)
    for array in arrays:
        if array.shape != total.shape:
            raise ValueError(f"reducer kvstore: values of one key differ in shape: "
                             f"{array.shape} vs {total.shape}")
        total += array.asnumpy()
    return total.astype(dtype)


def _write(result: np.ndarray, outs: Sequence[mx.nd.NDArray]) -> None:
    for out in outs:
        out[:] = result.reshape(out.shape)


def _fusion_groups(items: Sequence[tuple[str, np.ndarray]], fusion_bytes: int,
                   ) -> list[list[int]]:
    """Indices of `items` grouped into transfers, the same on every worker.

    A key of `fusion_bytes` or more travels alone; smaller keys of one dtype
    fill a buffer in call order until the next would pass `fusion_bytes`.
    """
    groups: list[list[int]] = []
    open_group: dict[np.dtype, tuple[list[int], int]] = {}
    for index, (_, array) in enumerate(items):
        if array.nbytes >= fusion_bytes:
            groups.append([index])
            continue
        members, nbytes = open_group.get(array.dtype, (None, 0))
        if members is None or nbytes + array.nbytes > fusion_bytes:
            members, nbytes = [], 0
            groups.append(members)
        members.append(index)
        open_group[array.dtype] = (members, nbytes + array.nbytes)
    return groups


def _wire_key(kind: str, keys: Sequence[str]) -> str:
    """The core's key for one transfer: the store key, or a digest of a packed group."""
    if len(keys) == 1:
        return f"mx/{kind}/{keys[0]}"
    digest = hashlib.sha1("\0".join(keys).encode()).hexdigest()[:16]
    return f"mx/{kind}/fused/{len(keys)}/{digest}"


# -- the store ------------------------------------------------------------------


@KVStoreBase.register
class Reducer(KVStoreBase):
    """KVStore type "reducer": allreduce and broadcast through reducerd daemons.

    Keys are int or str and must be used in the same order on every worker
    (each call is one round of its keys). Values are dense float16, float32 or
    float64 NDArrays on any context.
    """

    def __init__(self, op: str = "mean", fusion_bytes: int = DEFAULT_FUSION_BYTES,
                 backend: ReducerBackend | None = None) -> None:
        if op not in ("sum", "mean"):
            raise ValueError(f"op {op!r}: 'sum' or 'mean'")
        if fusion_bytes < 0:
            raise ValueError(f"fusion_bytes must be >= 0, got {fusion_bytes}")
        self._op = op
        self._fusion_bytes = fusion_bytes
        self._backend = backend if backend is not None else client()

    # -- identity -----------------------------------------------------------

    @property
    def type(self) -> str:
        return "reducer"

    @property
    def rank(self) -> int:
        return self._backend.rank

    @property
    def num_workers(self) -> int:
        return self._backend.world_size

    @property
    def op(self) -> str:
        """"mean" or "sum": how the workers' contributions are combined."""
        return self._op

    @staticmethod
    def is_capable(capability: str) -> bool:
        """Only "optimizer" is known, and it is False: the Trainer updates locally."""
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return False
        raise ValueError(f"reducer kvstore: unknown capability {capability!r}")

    # -- operations -----------------------------------------------------------

    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """Reduce `value` over all workers into `out` (into `value` when out is None).

        key: int or str, or a list of them. value: per key an NDArray or a
        list of NDArrays (one per device), which are summed first. out: per
        key an NDArray or a list of NDArrays, each receiving the result.
        Workers are combined with the store's op ("mean" by default).
        Blocks until every output holds its result; `priority` is accepted
        for the Trainer and otherwise ignored (all keys of a call travel at
        once).
        """
        keys, values, outs = self._normalize(key, value, out)
        items = [(k, _to_numpy(v)) for k, v in zip(keys, values, strict=True)]
        results = self._transfer("pushpull", items, self._backend_allreduce)
        for result, targets in zip(results, outs, strict=True):
            _write(result, targets)

    def broadcast(self, key, value, out=None, priority: int = 0,
                  root_rank: int = 0) -> None:
        """Copy root_rank's `value` into `out` on every worker (into `value` if out is None).

        key: int or str, or a list of them; value: per key an NDArray (or a
        list of per-device copies, of which the first is sent). Exact for
        float16 and float32 (it travels as float32). The Trainer calls this
        once per parameter at its first step, from rank 0.
        """
        if not 0 <= root_rank < self.num_workers:
            raise ValueError(f"root_rank {root_rank} must be in [0, {self.num_workers})")
        keys, values, outs = self._normalize(key, value, out)
        items = [(k, _to_numpy(v[:1])) for k, v in zip(keys, values, strict=True)]

        def start(array: np.ndarray, wire_key: str) -> Future:
            return self._backend.broadcast_async(array, wire_key, root_rank)

        results = self._transfer("broadcast", items, start)
        for result, targets in zip(results, outs, strict=True):
            _write(result, targets)

    def set_optimizer(self, optimizer) -> None:
        raise NotImplementedError(
            "reducer kvstore does not run optimizers: create gluon.Trainer with "
            "update_on_kvstore=None or False so each worker updates its weights")

    def save_optimizer_states(self, fname, dump_optimizer=False) -> None:
        raise NotImplementedError(
            "reducer kvstore holds no optimizer state: the Trainer updates locally, so "
            "save with trainer.save_states(fname) on the workers")

    def load_optimizer_states(self, fname) -> None:
        raise NotImplementedError(
            "reducer kvstore holds no optimizer state: load with "
            "trainer.load_states(fname) on the workers")

    def set_gradient_compression(self, compression_params) -> None:
        raise NotImplementedError(
            "reducer kvstore does not compress gradients; choose the wire dtype "
            "instead (ReducerClient(wire_dtype=...) or REDUCER_WIRE_DTYPE)")

    # -- internals ------------------------------------------------------------

    def _backend_allreduce(self, array: np.ndarray, wire_key: str) -> Future:
        return self._backend.allreduce_async(array, wire_key, self._op)

    @staticmethod
    def _normalize(key, value, out) -> tuple[list[str], list[list], list[list]]:
        """Per key: its name, its list of values and its list of outputs."""
        if isinstance(key, (list, tuple)):
            keys = list(key)
            values = _as_list(value)
            if len(values) != len(keys):
                raise ValueError(f"reducer kvstore: {len(keys)} keys but "
                                 f"{len(values)} values")
            outs = values if out is None else _as_list(out)
            if len(outs) != len(keys):
                raise ValueError(f"reducer kvstore: {len(keys)} keys but {len(outs)} outs")
        else:
            keys, values, outs = [key], [value], [value if out is None else out]
        for k in keys:
            if not isinstance(k, (int, str)) or k == "":
                raise TypeError(f"reducer kvstore: key {k!r} must be an int or a "
                                "non-empty str")
        return ([str(k) for k in keys], [_as_list(v) for v in values],
                [_as_list(o) for o in outs])

    def _transfer(self, kind: str, items: list[tuple[str, np.ndarray]],
                  start: Callable[[np.ndarray, str], Future]) -> list[np.ndarray]:
        """Send `items` (packed per _fusion_groups), wait, return results in order."""
        groups = _fusion_groups(items, self._fusion_bytes)
        futures = []
        for group in groups:
            names = [items[i][0] for i in group]
            if len(group) == 1:
                payload = items[group[0]][1]
            else:
                payload = np.concatenate([items[i][1].reshape(-1) for i in group])
            futures.append(start(payload, _wire_key(kind, names)))
        results: list[np.ndarray | None] = [None] * len(items)
        for group, future in zip(groups, futures, strict=True):
            flat = self._wait(future, kind, [items[i][0] for i in group]).reshape(-1)
            offset = 0
            for i in group:
                array = items[i][1]
                results[i] = flat[offset:offset + array.size].reshape(array.shape)
                offset += array.size
        return results  # type: ignore[return-value]

    def _wait(self, future: Future, kind: str, keys: Sequence[str]) -> np.ndarray:
        """The transfer's result; errors name the store's keys, not the fused wire key."""
        where = f"reducer kvstore {kind} of key(s) {', '.join(keys)}"
        try:
            return future.result(self._backend.timeout + _WAIT_MARGIN_S)
        except FutureTimeout:
            raise ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"{where}: no result within {self._backend.timeout:g} s",
                               ) from None
        except ReducerError as exc:
            raise ReducerError(exc.code, f"{where}: {exc}") from exc


class DistributedTrainer(gluon.Trainer):
    """gluon.Trainer that reduces all gradients of a step in one store call.

    Same arguments as gluon.Trainer; `kvstore` defaults to a new "reducer"
    store. The plain Trainer calls pushpull once per parameter (one round trip
    each); this one passes every dense gradient at once, so small ones are
    packed together and all travel concurrently.
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore=None,
                 **kwargs: Any) -> None:
        super().__init__(params, optimizer, optimizer_params,
                         kvstore=kvstore if kvstore is not None else Reducer(), **kwargs)

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
