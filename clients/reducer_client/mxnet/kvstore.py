"""The KVStore type "reducer": pushpull and broadcast through reducerd daemons.

MXNet's older calls work on top of them: init (a broadcast of rank 0's
value), push (a pushpull into the key's stored value, which it replaces, as
dist_sync does without an updater) and pull (a copy of the stored value).
row_sparse_pull and updaters are not supported: they raise
NotImplementedError saying so.

Error feedback (reducer_client.feedback), on by default for the 8-bit wires
("int8", "fp8_e4m3", "fp8_e5m2"), as in the torch shim: each pushpull
transfer (a store key, or a packed group of small ones: the same transfer
key every step) keeps what quantization dropped from this worker's
contribution and adds it to the next one; with node-local aggregation the
node's slice senders keep it instead (node/residues.py). set_error_feedback
(or the store's error_feedback=) turns it on or off per client.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc
import numpy as np
from mxnet import nd as mx_nd
from mxnet.kvstore import KVStoreBase

from reducer_client.api import Reducer as ReducerBackend
from reducer_client.compression import wire_scale
from reducer_client.errors import ReducerError
from reducer_client.feedback import ErrorFeedback
from reducer_client.mxnet._basics import basics
from reducer_client.mxnet._buffers import (
    BufferCache,
    copy_contribution,
    fusion_groups,
    wire_key,
    write_result,
)

__all__ = ["Reducer", "DEFAULT_FUSION_BYTES", "set_error_feedback"]

# Keys below this size share a transfer. 4 MiB of float32 is a few chunks of
# the core's 1 MiB wire chunk, spread over the daemons; larger keys gain
# nothing from packing and travel alone.
DEFAULT_FUSION_BYTES = 4 << 20
# Extra wait over the client's own timeout: the core fails a late operation
# itself; this bound only catches a client that does not.
_WAIT_MARGIN_S = 5.0


# Per client: the error feedback of its stores' pushpull transfers, chosen at
# first use (on for an 8-bit wire) or by set_error_feedback. _feedbacks_lock
# guards _feedbacks (any thread calling a store).
_feedbacks: weakref.WeakKeyDictionary[ReducerBackend, ErrorFeedback | None] = (
    weakref.WeakKeyDictionary())
_feedbacks_lock = threading.Lock()


def set_error_feedback(enabled: bool, reducer: ReducerBackend | None = None) -> None:
    """Error feedback on or off for the pushpull of every store on `reducer`
    (None: the process-wide client), as reducer_client.torch.set_error_feedback."""
    backend = basics.resolve(reducer)
    with _feedbacks_lock:
        _feedbacks[backend] = ErrorFeedback.choose(backend, enabled)


def _feedback_for(backend: ReducerBackend) -> ErrorFeedback | None:
    with _feedbacks_lock:
        if backend not in _feedbacks:
            _feedbacks[backend] = ErrorFeedback.choose(backend, None)
        return _feedbacks[backend]


def _unsupported(call: str) -> str:
    return (f"reducer kvstore: {call} is not supported by the reducer KVStore: use "
            "pushpull / broadcast")


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


@KVStoreBase.register
class Reducer(KVStoreBase):
    """KVStore type "reducer": allreduce and broadcast through reducerd daemons.

    Keys are int or str and must be used in the same order on every worker
    (each call is one round of its keys). Values are dense float16, float32 or
    float64 NDArrays on any context. op "sum" (the default, as MXNet's own
    dist_sync store) or "mean" combines the workers. error_feedback: on or
    off for the backend's stores (set_error_feedback); None leaves the
    choice as it is (by default on for the 8-bit wires).
    """

    def __init__(self, op: str = "sum", fusion_bytes: int = DEFAULT_FUSION_BYTES,
                 backend: ReducerBackend | None = None,
                 error_feedback: bool | None = None) -> None:
        if op not in ("sum", "mean"):
            raise ValueError(f"op {op!r}: 'sum' or 'mean'")
        if fusion_bytes < 0:
            raise ValueError(f"fusion_bytes must be >= 0, got {fusion_bytes}")
        self._op = op
        self._fusion_bytes = fusion_bytes
        self._backend = backend if backend is not None else basics.client()
        self._buffers = BufferCache()  # pushpull transfers reduce into these
        self._stored: dict[str, Any] = {}  # init / push / pull: key -> its NDArray
        if error_feedback is not None:
            set_error_feedback(error_feedback, self._backend)

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
        """"sum" or "mean": how the workers' contributions are combined."""
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
        Workers are combined with the store's op (sum by default). Blocks
        until every output holds its result; `priority` is accepted for the
        Trainer and otherwise ignored (all keys of a call travel at once).
        Each transfer is reduced in place in a host buffer the store keeps
        for it, so repeated calls allocate no host arrays.
        """
        keys, values, outs = self._normalize(key, value, out)
        feedback = _feedback_for(self._backend)

        def start(buffer: np.ndarray, transfer_key: str) -> Future:
            if feedback is not None:  # the transfer's last residue, added in place
                feedback.apply(transfer_key, buffer, wire_scale(self._backend, self._op))
            return self._backend.allreduce_async(buffer, transfer_key, self._op, out=buffer)

        try:
            results = self._transfer("pushpull", keys, values, start, self._buffers.get)
        except BaseException:
            # Transfers after the failed one may still be writing into their
            # buffers: the next call must not reuse those.
            self._buffers.clear()
            raise
        for result, targets in zip(results, outs, strict=True):
            write_result(result, targets)

    def broadcast(self, key, value, out=None, priority: int = 0,
                  root_rank: int = 0) -> None:
        """Copy root_rank's `value` into `out` on every worker (into `value` if out is None).

        key: int or str, or a list of them; value: per key an NDArray (or a
        list of per-device copies, of which the first is sent). Exact for
        float16 and float32 (it travels as float32). The Trainer calls this
        once per parameter at its first step, from rank 0. Its buffers are
        not kept (a broadcast is a one-off).
        """
        if not 0 <= root_rank < self.num_workers:
            raise ValueError(f"root_rank {root_rank} must be in [0, {self.num_workers})")
        keys, values, outs = self._normalize(key, value, out)

        def start(buffer: np.ndarray, transfer_key: str) -> Future:
            return self._backend.broadcast_async(buffer, transfer_key, root_rank)

        def fresh(_: str, numel: int, dtype: np.dtype) -> np.ndarray:
            return np.empty(numel, dtype=dtype)

        results = self._transfer("broadcast", keys, [v[:1] for v in values], start, fresh)
        for result, targets in zip(results, outs, strict=True):
            write_result(result, targets)

    # -- MXNet's older KVStore calls: init, push, pull ------------------------------

    def init(self, key, value) -> None:
        """Give each key its stored value: rank 0's `value` (its first copy, if
        a list), broadcast exactly (as float32 on the wire) to every worker.

        The store keeps one host copy per initialized key, in the value's
        dtype, until the store is gone. A key is initialized once.
        """
        keys, values, _ = self._normalize(key, value, None)
        for name in keys:
            if name in self._stored:
                raise ValueError(f"reducer kvstore: key {name!r} is already initialized "
                                 "(init is called once per key)")
        stored = [mx_nd.empty(v[0].shape, dtype=v[0].dtype) for v in values]
        self.broadcast(keys, [v[:1] for v in values], out=stored)
        self._stored.update(zip(keys, stored, strict=True))

    def push(self, key, value, priority: int = 0) -> None:
        """Replace each key's stored value with the sum over workers (and
        devices: a list of values is summed first) of `value`, combined with
        the store's op, as MXNet's dist_sync store does without an updater.

        Every worker must push the same keys in the same order; each push is
        one pushpull round of its keys.
        """
        keys, values, _ = self._normalize(key, value, None)
        stored = [self._stored_value(name, "push") for name in keys]
        for name, per_device, target in zip(keys, values, stored, strict=True):
            for v in per_device:
                if tuple(v.shape) != tuple(target.shape):
                    raise ValueError(f"reducer kvstore: push of key {name!r} with shape "
                                     f"{tuple(v.shape)}, initialized with "
                                     f"{tuple(target.shape)}")
        self.pushpull(keys, values, out=stored, priority=priority)

    def pull(self, key, out=None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Copy each key's stored value (init's, or the last push's) into `out`
        (per key an NDArray or a list of them). No communication: every
        worker holds the same stored values."""
        if out is None:
            raise ValueError("reducer kvstore: pull needs out=, the arrays to copy into")
        keys, outs, _ = self._normalize(key, out, None)
        for name, targets in zip(keys, outs, strict=True):
            stored = self._stored_value(name, "pull")
            for target in targets:
                stored.copyto(target)

    def row_sparse_pull(self, key, out=None, priority: int = 0, row_ids=None) -> None:
        raise NotImplementedError(_unsupported("row_sparse_pull"))

    def set_updater(self, updater) -> None:
        raise NotImplementedError(_unsupported("set_updater"))

    def _set_updater(self, updater) -> None:  # MXNet 1.x's name for it
        raise NotImplementedError(_unsupported("_set_updater"))

    def _stored_value(self, name: str, call: str):
        stored = self._stored.get(name)
        if stored is None:
            raise ValueError(f"reducer kvstore: {call} of key {name!r}, which was never "
                             "initialized: call init(key, value) first")
        return stored

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

    def _transfer(self, kind: str, keys: list[str], values: list[list],
                  start: Callable[[np.ndarray, str], Future],
                  buffer_for: Callable[[str, int, np.dtype], np.ndarray],
                  ) -> list[np.ndarray]:
        """Pack the keys' values into buffers (per fusion_groups), send, wait;
        return each key's result, a view of its buffer, in order."""
        shapes = [tuple(v[0].shape) for v in values]
        numels = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        dtypes = [np.dtype(v[0].dtype) for v in values]
        groups = fusion_groups([(n * d.itemsize, d) for n, d in zip(numels, dtypes,
                                                                   strict=True)],
                               self._fusion_bytes)
        futures = []
        for group in groups:
            transfer_key = wire_key(kind, [keys[i] for i in group])
            buffer = buffer_for(transfer_key, sum(numels[i] for i in group), dtypes[group[0]])
            offset = 0
            for i in group:
                copy_contribution(values[i], buffer[offset:offset + numels[i]])
                offset += numels[i]
            futures.append(start(buffer, transfer_key))
        results: list[np.ndarray | None] = [None] * len(keys)
        for group, future in zip(groups, futures, strict=True):
            flat = self._wait(future, kind, [keys[i] for i in group]).reshape(-1)
            offset = 0
            for i in group:
                results[i] = flat[offset:offset + numels[i]].reshape(shapes[i])
                offset += numels[i]
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
