"""allreduce, broadcast and broadcast_variables of the TensorFlow shim.

Broadcasts are exact. The core broadcasts float32 exactly; float16 /
bfloat16 / bool fit float32 exactly, and every other dtype is sent bit for
bit as four 16-bit limbs of its 64-bit pattern, each exact in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import tensorflow as tf

from reducer_client.api import Reducer
from reducer_client.tensorflow._basics import check_op, unnamed_key
from reducer_client.tensorflow._bridge import densify, fused_allreduce, reduce_flat

__all__ = ["allreduce", "broadcast", "broadcast_variables"]


def allreduce(tensor: tf.Tensor | tf.IndexedSlices, name: str | None = None,
              op: str = "mean", reducer: Reducer | None = None) -> tf.Tensor:
    """Average (op="mean") or sum a float tensor over all workers; same dtype back.

    Every worker must make the same allreduce calls in the same order. `name`
    is the key on the wire (each name counts its own rounds); unnamed calls
    all share one key, ordered by call. IndexedSlices come back dense.
    """
    check_op(op)
    dense = densify(tensor)
    key = unnamed_key("allreduce") if name is None else f"tf/allreduce/{name}"
    return fused_allreduce([dense], key, op, reducer)[0]


_LIMB_SHIFTS = (48, 32, 16, 0)
_AS_FLOAT32 = (tf.float32, tf.float16, tf.bfloat16, tf.bool)


def _encode_exact(value: tf.Tensor) -> tf.Tensor:
    dtype = value.dtype
    if dtype in _AS_FLOAT32:
        return tf.reshape(tf.cast(value, tf.float32), [-1])
    if dtype == tf.float64:
        bits = tf.bitcast(value, tf.uint64)
    elif dtype.is_integer:
        bits = tf.bitcast(tf.cast(value, tf.int64), tf.uint64)
    else:
        raise TypeError(f"cannot broadcast a {dtype.name} tensor")
    bits = tf.reshape(bits, [-1, 1])
    limbs = [tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, tf.constant(s, tf.uint64)),
                                    tf.constant(0xFFFF, tf.uint64)) for s in _LIMB_SHIFTS]
    return tf.reshape(tf.cast(tf.concat(limbs, axis=1), tf.float32), [-1])


def _decode_exact(flat: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    dtype = like.dtype
    if dtype in _AS_FLOAT32:
        return tf.reshape(tf.cast(flat, dtype), tf.shape(like))
    limbs = tf.cast(tf.reshape(flat, [-1, len(_LIMB_SHIFTS)]), tf.uint64)
    bits = functools.reduce(tf.bitwise.bitwise_or, [
        tf.bitwise.left_shift(limbs[:, i], tf.constant(s, tf.uint64))
        for i, s in enumerate(_LIMB_SHIFTS)])
    if dtype == tf.float64:
        value = tf.bitcast(bits, tf.float64)
    else:
        value = tf.cast(tf.bitcast(bits, tf.int64), dtype)
    return tf.reshape(value, tf.shape(like))


def fused_broadcast(values: list[tf.Tensor], key: str, root_rank: int,
                    reducer: Reducer | None) -> list[tf.Tensor]:
    """root_rank's `values`, all in one call under `key`, bit for bit."""
    encoded = [_encode_exact(v) for v in values]
    flat = encoded[0] if len(encoded) == 1 else tf.concat(encoded, axis=0)
    out = reduce_flat(flat, key, "sum", root_rank, reducer)
    parts = tf.split(out, tf.stack([tf.size(e) for e in encoded]), num=len(encoded))
    return [_decode_exact(p, v) for p, v in zip(parts, values, strict=True)]


def broadcast(tensor: tf.Tensor, root_rank: int = 0, name: str | None = None,
              reducer: Reducer | None = None) -> tf.Tensor:
    """root_rank's value of `tensor` on every worker, bit for bit (-0.0 becomes +0.0).

    Unnamed calls all share one key, ordered by call, as allreduce's.
    """
    value = tf.convert_to_tensor(tensor)
    key = unnamed_key("broadcast") if name is None else f"tf/broadcast/{name}"
    return fused_broadcast([value], key, root_rank, reducer)[0]


def broadcast_variables(variables: Iterable, root_rank: int = 0,
                        reducer: Reducer | None = None) -> None:
    """Assign root_rank's values to `variables` (tf or Keras) on every worker, in one call.

    Every worker must pass the same variables in the same order. Bit-exact for
    every numeric dtype, except that a float -0.0 arrives as +0.0.
    """
    variables = list(variables)
    if not variables:
        return
    values = [tf.convert_to_tensor(v) for v in variables]
    key = f"tf/broadcast_variables/{len(values)}"
    for variable, value in zip(variables, fused_broadcast(values, key, root_rank, reducer),
                               strict=True):
        variable.assign(value)
