"""The one bridge between TensorFlow and the core: flat float32 tensors to NumPy and back.

All gradients of a step are cast to float32 and concatenated into one flat
buffer, reduced with one call (the core cuts it into chunks over all
daemons), then split, reshaped and cast back. One call per step also means
one blocking op per step in a graph, so no two workers can wait on each
other's keys in a different order.

Buffers: the core reduces into a new NumPy array per call, which TensorFlow
takes over as the op's output without a copy. A reused buffer would not
save anything here: tf.numpy_function keeps the returned array's memory as
the output tensor (measured, eager and in graphs), so handing back one
buffer every step would overwrite tensors still alive, and its input array
may be the memory of the caller's own tensor, so reducing into the input
could change a tensor the user holds.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import grpc
import numpy as np
import tensorflow as tf
from reducer_wire import dtypes

from reducer_client.api import Reducer
from reducer_client.errors import ReducerError
from reducer_client.tensorflow._basics import basics

__all__ = ["reduce_flat", "densify", "fused_allreduce", "reduce_gradients", "remember_error",
           "original_error"]

# The largest block of any wire dtype (int8's): reduce_gradients' flags start on one.
_FLAG_ALIGN = max(dtypes.wire_block(value) for value in dtypes.WIRE_DTYPES.values())


def _in_xla_context() -> bool:
    try:  # private, but the only way to see jit_compile while tracing
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a future TF moved it
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


# The last ReducerError raised in an op body (one slot, _errors_lock guards it):
# TensorFlow hands a graph's caller only the text (tf.errors.UnknownError), and
# elastic.run needs the error itself, its code included (original_error).
_last_error: list[ReducerError] = []
_errors_lock = threading.Lock()


def remember_error(exc: ReducerError) -> None:
    with _errors_lock:
        _last_error[:] = [exc]


def original_error(exc: BaseException) -> ReducerError | None:
    """The ReducerError behind a TensorFlow op error, None if it is not one of ours."""
    if isinstance(exc, ReducerError):
        return exc
    if not isinstance(exc, tf.errors.OpError) or "ReducerError" not in str(exc):
        return None
    with _errors_lock:
        last = _last_error[0] if _last_error else None
    return last if last is not None and str(last) in str(exc) else None


def _run_reduction(array: np.ndarray, key: str, op: str, root_rank: int | None,
                   reducer: Reducer | None,
                   check: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """The body of the reduction op: NumPy in, NumPy out, through the core.

    A module-level function (bound with functools.partial), so that autograph
    never rewrites it when the caller is being traced.
    """
    target = basics.resolve(reducer)
    try:
        if root_rank is None:
            result = np.asarray(target.allreduce(array, key, op), dtype=np.float32)
            if check is not None:
                check(result)
            return result
        return np.asarray(target.broadcast(array, key, root_rank), dtype=np.float32)
    except ReducerError as exc:
        remember_error(exc)
        raise


def reduce_flat(flat: tf.Tensor, key: str, op: str, root_rank: int | None,
                reducer: Reducer | None,
                check: Callable[[np.ndarray], None] | None = None) -> tf.Tensor:
    """Allreduce (root_rank None) or broadcast a 1-D float32 tensor, eagerly or as an op.

    check: called with an allreduce's result in the op (may raise ReducerError).

    The reducer is looked up when the op runs, not when it is traced, so a
    traced step keeps working after init() replaces the client.
    """
    run = functools.partial(_run_reduction, key=key, op=op, root_rank=root_rank,
                            reducer=reducer, check=check)
    if tf.executing_eagerly():
        return tf.convert_to_tensor(run(flat.numpy()))
    if _in_xla_context():
        raise ValueError(
            f"reducer_client.tensorflow: reduction {key!r} runs as a Python op "
            "(tf.numpy_function) that XLA cannot compile. Compile the step without "
            "XLA: model.compile(..., jit_compile=False), or tf.function(jit_compile="
            "False) around a custom training step. (Keras turns jit_compile on by "
            "default when a GPU is visible.)")
    out = tf.numpy_function(run, [flat], tf.float32, stateful=True,
                            name="ReducerAllreduce" if root_rank is None
                            else "ReducerBroadcast")
    out.set_shape(flat.shape)
    return out


def densify(grad: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """IndexedSlices to a dense tensor; rows of repeated indices add up."""
    if isinstance(grad, tf.IndexedSlices):
        if grad.dense_shape is None:
            raise ValueError("an IndexedSlices gradient without dense_shape cannot be "
                             "reduced; its variable's shape is unknown")
        dense = tf.math.unsorted_segment_sum(grad.values, grad.indices, grad.dense_shape[0])
        return tf.reshape(dense, grad.dense_shape)
    return tf.convert_to_tensor(grad)


def fused_allreduce(tensors: list, key: str, op: str, reducer: Reducer | None) -> list:
    """Reduce a list of float tensors (dense or IndexedSlices) with one call.

    Everything travels as one float32 buffer: the daemons accumulate in
    float32 anyway, and float64 gradients lose nothing the float16 or float32
    wire keeps. Each result is cast back to its tensor's dtype.
    """
    dense = [densify(t) for t in tensors]
    for t in dense:
        if not t.dtype.is_floating:
            raise TypeError(f"{key!r}: cannot allreduce a {t.dtype.name} tensor; the wire "
                            "carries floating point only")
    if len(dense) == 1:
        flat = tf.reshape(tf.cast(dense[0], tf.float32), [-1])
    else:
        flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in dense], axis=0)
    out = reduce_flat(flat, key, op, None, reducer)
    parts = tf.split(out, tf.stack([tf.size(t) for t in dense]), num=len(dense))
    results = []
    for part, t in zip(parts, dense, strict=True):
        result = tf.cast(tf.reshape(part, tf.shape(t)), t.dtype)
        result.set_shape(t.shape)
        results.append(result)
    return results


def _zeros_like_source(source) -> tf.Tensor:
    """float32 zeros of a source's shape: a missing gradient's place in the buffer."""
    shape = tf.TensorShape(source.shape)
    return tf.zeros(shape if shape.is_fully_defined() else tf.shape(source), tf.float32)


def _check_presence(result: np.ndarray, count: int, key: str) -> None:
    """Fail every rank's step where one rank dropped a gradient another rank had."""
    present, dropped = result[-2 * count:-count] > 0, result[-count:] > 0
    both = np.flatnonzero(present & dropped)
    if both.size:
        raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION, (
            f"{key!r}: gradients {both.tolist()} (in source order) are None on this rank "
            "or another that traced its step in a tf.function, but other ranks have them; "
            "a traced None cannot become the others' sum. Compute the same gradients on "
            "every rank, or pass unconnected_gradients=tf.UnconnectedGradients.ZERO"))


def reduce_gradients(grads, sources, key: str, op: str, reducer: Reducer | None) -> list:
    """Reduce a step's gradients in one call; a None counts as zeros on this rank.

    sources: the variables (or tensors) of `grads`, in their order: a None
    gradient takes their shape. The buffer is every gradient (zeros for a
    None), zeros up to the next whole block of any wire dtype, then two
    flags per gradient: "present" (this rank had it) and "dropped" (this
    rank had None while tracing a tf.function). The flags start a block of
    their own so that an 8-bit wire's scale per block never covers a flag
    and a gradient together (as the torch shim's buckets). Eagerly, a
    gradient that no rank had stays None and one that some rank had is
    their reduction on every rank (zeros from the others, and "mean"
    divides by every rank, as the torch shim's buckets; Horovod reduces
    each gradient on its own and skips a None, so ranks that differ there
    wait on each other until its stall warning). In a tf.function a None
    is fixed when it is traced, so it stays None; should another rank have
    that gradient, the step fails on every rank (the flags say so to all)
    instead of training on gradients that differ by rank.
    """
    grads, sources = list(grads), list(sources)
    if len(grads) != len(sources):
        raise ValueError(f"{key!r}: {len(grads)} gradients for {len(sources)} sources")
    if not grads:
        return grads
    count, eager = len(grads), tf.executing_eagerly()
    dense = [None if g is None else densify(g) for g in grads]
    for d in dense:
        if d is not None and not d.dtype.is_floating:
            raise TypeError(f"{key!r}: cannot allreduce a {d.dtype.name} tensor; the wire "
                            "carries floating point only")
    shaped = [_zeros_like_source(s) if d is None else tf.cast(d, tf.float32)
              for d, s in zip(dense, sources, strict=True)]
    parts = [tf.reshape(t, [-1]) for t in shaped]
    sizes = tf.stack([tf.size(p) for p in parts])
    numel = tf.reduce_sum(sizes)
    padding = tf.zeros([(-numel) % _FLAG_ALIGN], tf.float32)
    missing = [d is None for d in dense]
    flags = np.array([0.0 if m else 1.0 for m in missing]
                     + [1.0 if m and not eager else 0.0 for m in missing], np.float32)
    flat = tf.concat(parts + [padding, tf.constant(flags)], axis=0)
    check = functools.partial(_check_presence, count=count, key=key)
    out = reduce_flat(flat, key, op, None, reducer, check)
    present = out[-2 * count:-count].numpy() > 0 if eager else None
    results: list = []
    for index, part in enumerate(tf.split(out[:numel], sizes, num=count)):
        d, like = dense[index], shaped[index]
        if d is None and (present is None or not present[index]):
            results.append(None)  # no rank had it, or traced: see the docstring
            continue
        dtype = d.dtype if d is not None else tf.as_dtype(sources[index].dtype)
        result = tf.cast(tf.reshape(part, tf.shape(like)), dtype if dtype.is_floating
                         else tf.float32)
        result.set_shape(like.shape)
        results.append(result)
    return results
