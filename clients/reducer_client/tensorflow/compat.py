"""Horovod's TensorFlow collectives: allreduce, grouped_allreduce, allgather,
broadcast, broadcast_object, allgather_object, barrier, join.

Horovod's signatures and meaning (horovod.tensorflow and .keras): op=
Average / Sum (or the deprecated average=), compression= (the wire dtype,
reducer_client.compression; default: the client's), prescale / postscale
factors. Every call is checked across ranks first
(reducer_client.collectives): shape, dtype, root_rank, op or compression
that differ between ranks fail every rank at once, naming them. Calls pair
up in call order (inside a tf.function the stateful ops keep program
order). Each runs eagerly, or as one stateful tf.numpy_function op in a
graph (not under XLA: jit_compile=False). allreduce carries floating point
and integer tensors (uint8, int8, int16, int32, int64: exact, averaged as
Horovod averages integers, reducer_client.integers) and has Horovod's
gradient (the allreduce of the output's gradient); broadcast and allgather are exact for
every dtype; allgather costs world_size times a ring's bytes.
device_dense / device_sparse / process_set / ignore_name_scope are
accepted for Horovod's signatures (one process set: the whole job).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.compression import Compressor, wire_dtype_of
from reducer_client.exact import decode_exact, encode_exact, encoded_per_element
from reducer_client.horovod import resolve_op
from reducer_client.integers import horovod_scale, is_integer
from reducer_client.tensorflow._basics import basics
from reducer_client.tensorflow._bridge import densify
from reducer_client.tensorflow._ops import in_call_order, run_collective
from reducer_client.tensorflow.functions import broadcast_variables as assign_from_root
from reducer_client.tensorflow.steps import joinable

__all__ = ["allreduce", "grouped_allreduce", "allgather", "broadcast", "barrier", "join",
           "check_root", "Compression", "broadcast_variables"]


class _TFCompressor(Compressor):
    """A Compressor whose compress / decompress cast tf tensors, as Horovod's do
    (the shim never calls them: the core converts to the wire dtype)."""

    def __init__(self, name: str, wire_dtype: str, cast: tf.DType | None) -> None:
        super().__init__(name, wire_dtype)
        self.cast = cast

    def compress(self, tensor: Any) -> tuple[Any, Any]:  # type: ignore[override]
        tensor = tf.convert_to_tensor(tensor)
        if self.cast is None or not tensor.dtype.is_floating:
            return tensor, None
        return tf.cast(tensor, self.cast), tensor.dtype

    def decompress(self, tensor: Any, ctx: Any) -> Any:  # type: ignore[override]
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Horovod's tf Compression: the wire dtype (reducer_client.compression)."""

    none = _TFCompressor("none", "float32", None)
    fp16 = _TFCompressor("fp16", "float16", tf.float16)
    bf16 = _TFCompressor("bf16", "bfloat16", tf.bfloat16)
    int8 = _TFCompressor("int8", "int8", None)
    fp8_e4m3 = _TFCompressor("fp8_e4m3", "fp8_e4m3", None)
    fp8_e5m2 = _TFCompressor("fp8_e5m2", "fp8_e5m2", None)


def _check_set(process_set: Any) -> None:
    if process_set is not None:
        raise NotImplementedError("process sets are not supported by reducerd: every "
                                  "collective spans the whole job")


def _allreduce_flat(tensors: list[tf.Tensor], name: str | None, op: str, wire: str | None,
                    pre: float, post: float, reducer: Reducer | None) -> list[tf.Tensor]:
    """One checked, fused allreduce of dense tensors; each result in its dtype and shape."""
    single = len(tensors) == 1
    dtype_names = [t.dtype.name for t in tensors]
    if len(set(dtype_names)) == 1 and is_integer(tensors[0].dtype.as_numpy_dtype):
        return _allreduce_integers(tensors, name, op, pre, post, reducer)
    floats = all(t.dtype.is_floating for t in tensors)
    flat = (tf.reshape(tf.cast(tensors[0], tf.float32) if floats else tensors[0], [-1])
            if single else tf.concat([tf.reshape(tf.cast(t, tf.float32) if floats else
                                                 tf.zeros_like(t, tf.float32), [-1])
                                      for t in tensors], axis=0))
    bad = next((n for n in dtype_names if not tf.as_dtype(n).is_floating), None)

    def body(values: np.ndarray) -> np.ndarray:
        target = basics.resolve(reducer)
        shape = tuple(tensors[0].shape) if single else (values.size,)
        if None in shape:  # a graph with unknown dimensions: the runtime shape
            shape = (values.size,)
        call = coll.Call(coll.ALLREDUCE, name, bad or dtype_names[0], shape, values.size,
                         op=op, wire=wire, tag=0 if single else len(tensors),
                         signature="" if single else repr([(t.dtype.name, tuple(t.shape))
                                                           for t in tensors]))
        floats_in = None if bad else values.reshape(-1)  # float32 (cast above)
        if floats_in is not None and pre != 1.0:
            floats_in = floats_in * pre
        result = coll.allreduce_async(target, floats_in, call).result()
        if post != 1.0:
            result = result * post
        return np.asarray(result, dtype=np.float32)
    out = run_collective(body, [flat], tf.float32, "allreduce")
    sizes = [tf.size(t) for t in tensors]
    parts = [out] if single else tf.split(out, tf.stack(sizes), num=len(tensors))
    results = []
    for part, tensor in zip(parts, tensors, strict=True):
        result = tf.cast(tf.reshape(part, tf.shape(tensor)), tensor.dtype)
        result.set_shape(tensor.shape)
        results.append(result)
    return results


def _allreduce_integers(tensors: list[tf.Tensor], name: str | None, op: str, pre: float,
                        post: float, reducer: Reducer | None) -> list[tf.Tensor]:
    """_allreduce_flat of integer tensors of one dtype: exact on its integer
    wire, average / prescale / postscale as Horovod scales integers."""
    single, dtype = len(tensors) == 1, tensors[0].dtype
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)

    def body(values: np.ndarray) -> np.ndarray:
        shape = tuple(tensors[0].shape) if single else (values.size,)
        if None in shape:
            shape = (values.size,)
        call = coll.Call(coll.ALLREDUCE, name, dtype.name, shape, values.size, op=op,
                         tag=0 if single else len(tensors),
                         signature="" if single else repr([(t.dtype.name, tuple(t.shape))
                                                           for t in tensors]))
        scaled = horovod_scale(values.reshape(-1), pre)
        return coll.allreduce_async(basics.resolve(reducer), np.array(scaled), call,
                                    postscale=post).result()
    out = run_collective(body, [flat], dtype, "allreduce")
    parts = [out] if single else tf.split(out, tf.stack([tf.size(t) for t in tensors]),
                                          num=len(tensors))
    results = []
    for part, tensor in zip(parts, tensors, strict=True):
        result = tf.reshape(part, tf.shape(tensor))
        result.set_shape(tensor.shape)
        results.append(result)
    return results


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = None, op: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: Any = None,
              ignore_name_scope: bool = False, *, reducer: Reducer | None = None,
              ) -> tf.Tensor:
    """Average (op=Average, the default) or sum a tensor over all ranks; same dtype back.

    IndexedSlices with a dense_shape come back dense (their dense sum is
    reduced); without one, as Horovod's: every rank's values and indices
    gathered (Average divides the values by size()). A str in average's place
    is taken as the name (this shim's older signature).
    """
    _check_set(process_set)
    if isinstance(average, str):
        average, name = None, average
    op = resolve_op(op, average)
    wire = wire_dtype_of(compression)
    if _gathered_sparse(tensor):
        return _allgather_slices(tensor, name, op, prescale_factor, postscale_factor, reducer)
    value = densify(tensor)

    if not value.dtype.is_floating:
        return _allreduce_flat([value], name, op, wire, prescale_factor, postscale_factor,
                               reducer)[0]

    @tf.custom_gradient
    def reduce(x):
        def grad(dy):
            return _allreduce_flat([tf.convert_to_tensor(dy)], None, op, wire,
                                   prescale_factor, postscale_factor, reducer)[0]
        return _allreduce_flat([x], name, op, wire, prescale_factor, postscale_factor,
                               reducer)[0], grad
    return reduce(value)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = None, op: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None, *, name: str | None = None,
                      reducer: Reducer | None = None) -> list[tf.Tensor]:
    """allreduce of each tensor of the list in one fused call; differentiable.

    IndexedSlices without dense_shape are gathered as in allreduce, each on
    its own, after the fused call of the others.
    """
    _check_set(process_set)
    op, wire = resolve_op(op, average), wire_dtype_of(compression)
    tensors = list(tensors)
    dense = [densify(t) for t in tensors if not _gathered_sparse(t)]

    def fused(*xs: tf.Tensor) -> list[tf.Tensor]:
        return _allreduce_flat(list(xs), name, op, wire, prescale_factor, postscale_factor,
                               reducer)
    if dense and all(t.dtype.is_floating for t in dense):
        @tf.custom_gradient
        def reduce(*xs):
            ys = fused(*xs)

            def grad(*dys):  # Horovod's: the same grouped allreduce of the gradients
                return fused(*[tf.zeros_like(y) if dy is None else tf.convert_to_tensor(dy)
                               for dy, y in zip(dys, ys, strict=True)])
            return ys, grad
        reduced = list(reduce(*dense))
    else:
        reduced = fused(*dense) if dense else []
    out = iter(reduced)
    return [_allgather_slices(t, name, op, prescale_factor, postscale_factor, reducer)
            if _gathered_sparse(t) else next(out) for t in tensors]


def _gathered_sparse(tensor: Any) -> bool:
    """IndexedSlices without dense_shape: Horovod's two allgathers (no dense form)."""
    return isinstance(tensor, tf.IndexedSlices) and tensor.dense_shape is None


def _allgather_slices(slices: tf.IndexedSlices, name: str | None, op: str, pre: float,
                      post: float, reducer: Reducer | None) -> tf.IndexedSlices:
    """Horovod's allreduce of IndexedSlices: every rank's values and indices,
    gathered (exact); Average divides the values by size()."""
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("prescale_factor / postscale_factor are not supported "
                                  "with tf.IndexedSlices (as in Horovod)")
    values = allgather(slices.values, None if name is None else f"{name}.values",
                       reducer=reducer)
    indices = allgather(slices.indices, None if name is None else f"{name}.indices",
                        reducer=reducer)
    if op == "mean":
        values = values / tf.cast(basics.resolve(reducer).world_size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = None, *, reducer: Reducer | None = None) -> tf.Tensor:
    """Every rank's tensor concatenated along dimension 0, in rank order (exact).

    First dimensions may differ between ranks; in a graph the result's first
    dimension is unknown until it runs.
    """
    _check_set(process_set)
    value = tf.convert_to_tensor(tensor)
    if value.shape.rank == 0:
        raise ValueError("allgather needs a tensor of at least one dimension")

    def body(array: np.ndarray) -> np.ndarray:
        per_row = int(np.prod(array.shape[1:], dtype=np.int64)) * encoded_per_element(
            array.dtype)
        call = coll.Call(coll.ALLGATHER, name, value.dtype.name, tuple(array.shape), per_row)
        rows, counts = coll.allgather_async(basics.resolve(reducer), encode_exact(array),
                                            call).result()
        return decode_exact(rows, array.dtype, (sum(counts), *array.shape[1:]))

    def gather(x: tf.Tensor) -> tf.Tensor:
        out = run_collective(body, [x], value.dtype, "allgather")
        out.set_shape([None, *value.shape[1:]])
        return out
    if not value.dtype.is_floating:
        return gather(value)

    @tf.custom_gradient
    def differentiable(x):
        def grad(dy):  # Horovod's: the average of the gradients, this rank's rows
            counts = allgather(tf.reshape(tf.shape(x, tf.int64)[0], [1]), reducer=reducer)
            with tf.control_dependencies([counts]):  # the rounds in one order on every rank
                reduced = _allreduce_flat([tf.convert_to_tensor(dy)], None, "mean", None,
                                          1.0, 1.0, reducer)[0]
            start = tf.reduce_sum(counts[:basics.resolve(reducer).rank])
            return reduced[start:start + tf.shape(x, tf.int64)[0]]
        return gather(x), grad
    return differentiable(value)


def broadcast(tensor: Any, root_rank: int = 0, name: str | None = None,
              ignore_name_scope: bool = False, process_set: Any = None, *,
              reducer: Reducer | None = None) -> tf.Tensor:
    """root_rank's value of `tensor` on every rank, bit for bit (any dtype)."""
    _check_set(process_set)
    value = tf.convert_to_tensor(tensor)

    def body(array: np.ndarray) -> np.ndarray:
        encoded = encode_exact(array)
        call = coll.Call(coll.BROADCAST, name, value.dtype.name, tuple(array.shape),
                         encoded.size, root_rank=root_rank)
        result = coll.broadcast_async(basics.resolve(reducer), encoded, call).result()
        return decode_exact(result, array.dtype, array.shape)

    def send(x: tf.Tensor) -> tf.Tensor:
        out = run_collective(body, [x], value.dtype, "broadcast")
        out.set_shape(value.shape)
        return out
    if not value.dtype.is_floating:
        return send(value)

    @tf.custom_gradient
    def differentiable(x):
        def grad(dy):  # Horovod's: the average of the gradients, on the root only
            reduced = _allreduce_flat([tf.convert_to_tensor(dy)], None, "mean", None, 1.0,
                                      1.0, reducer)[0]
            return reduced if basics.resolve(reducer).rank == root_rank else reduced * 0
        return send(x), grad
    return differentiable(value)


def check_root(what: str, root_rank: int, count: int, reducer: Reducer | None) -> Any:
    """Every rank must name the same root_rank (and count): an op in a graph, else None."""
    call = coll.Call(coll.CHECK, what, "float32", (count,), 0, root_rank=root_rank)

    if tf.executing_eagerly():
        coll.check(coll.control_async(basics.resolve(reducer), call).result(), call)
        return None
    made = in_call_order()

    def body(*after: np.ndarray) -> np.ndarray:
        coll.check(coll.control_async(basics.resolve(reducer), call).result(), call)
        return np.zeros(0, np.float32)
    made.token = tf.numpy_function(body, made.inputs([]), tf.float32, stateful=True,
                                   name="Reducer_check")
    return made.token


def barrier(process_set: Any = None, *, reducer: Reducer | None = None) -> None:
    """Return once every rank has called barrier() (eagerly)."""
    _check_set(process_set)
    target = basics.resolve(reducer)
    call = coll.Call(coll.CHECK, "barrier", "float32", (), 0)
    coll.check(coll.control_async(target, call).result(), call)


def join(process_set: Any = None, *, reducer: Reducer | None = None) -> int:
    """A rank out of data joins: it follows the others' collectives, contributing
    nothing, until every rank has joined; returns the rank that joined last.

    Eagerly, after this rank's last step (model.fit returned, the loop ended).
    While joined, the rank takes part in every allreduce, grouped_allreduce,
    allgather and broadcast the others still make (reducer_client.collectives)
    and in every step of their DistributedOptimizer and DistributedGradientTape
    (steps.py): zeros from it, and "mean" divides by the ranks that took part,
    so each step's gradient is the average over the ranks that had data (as
    Horovod's hvd.join()). Once all have joined, each such optimizer's
    variables (its trainable variables and its own: iterations, slots) and
    each tape's sources are copied from the rank that joined last, which took
    every step, so every rank ends with the same model. A plain optimizer
    applying a tape's gradients keeps its own state: broadcast_variables(
    opt.variables, root_rank=join()) copies it. Every rank must have taken at
    least one step of each optimizer and tape before it joins (the size of
    their steps is learnt from its own), and the ranks still training must
    step within the client's timeout of each other; a joined rank waits that
    long for each.
    """
    _check_set(process_set)
    target = basics.resolve(reducer)
    last = coll.join(target)
    for steps in joinable(target):
        broadcast_variables(steps.variables(), root_rank=last, reducer=target)
    return last


def broadcast_variables(variables: Any, root_rank: int = 0, process_set: Any = None,
                        inplace: bool = False, *, reducer: Reducer | None = None) -> None:
    """Assign root_rank's values to `variables` on every rank (functions.py), after
    checking that every rank names the same root and number of variables."""
    if hasattr(process_set, "allreduce_async"):  # this shim's older (variables, root, reducer)
        process_set, reducer = None, process_set
    _check_set(process_set)
    variables = list(variables)
    check = check_root("broadcast_variables", root_rank, len(variables), reducer)
    with tf.control_dependencies([] if check is None else [check]):
        assign_from_root(variables, root_rank, reducer)
