"""reducer_client.tensorflow: the TensorFlow / Keras 3 shim (Horovod-shaped).

    import reducer_client.tensorflow as rtf
    rtf.init()                                          # ReducerClient.from_env()
    opt = rtf.DistributedOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[rtf.BroadcastGlobalVariablesCallback(root_rank=0)])

    tape = rtf.DistributedGradientTape(tape)            # custom training loops
    t = rtf.allreduce(tensor, name="x", op="mean")

The shim only converts tensors to and from NumPy and plugs into Keras and
tf.GradientTape; chunking, streams and retries stay in the core. What a step
sends:
- All gradients of a step are cast to float32 and concatenated into one flat
  buffer, reduced with one call (the core cuts it into chunks over all
  daemons), then split, reshaped and cast back. One call per step also means
  one blocking op per step in a graph, so no two workers can wait on each
  other's keys in a different order.
- Sparse gradients (tf.IndexedSlices, from Embedding layers) are summed into
  dense form first (duplicate indices add up, as the gradient says). The core
  has no allgather, and an allreduce-based gather would send indices through
  the float16 wire, so dense is the exact way here; it costs the full table.
- In a tf.function the reduction is a stateful tf.numpy_function op. XLA cannot
  compile Python ops, so under jit_compile=True the shim fails at trace time
  with a message that says to compile with jit_compile=False.
- Errors: eagerly a failed reduction raises reducer_client.ReducerError.
  Inside a graph (model.fit, tf.function) TensorFlow wraps exceptions of
  Python ops, so it arrives as tf.errors.UnknownError whose message ends with
  "ReducerError: <the core's message>" (TensorFlow keeps no other code).
  Either way it comes within the client's timeout, never as a hang.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from reducer_client import process
from reducer_client.api import Reducer

__all__ = ["init", "client", "shutdown", "rank", "size", "allreduce", "broadcast",
           "broadcast_variables", "DistributedOptimizer", "DistributedGradientTape",
           "BroadcastGlobalVariablesCallback", "load_model"]

_OPS = ("sum", "mean")

# -- the process-wide client of init(): reducer_client.process --------------

_SHIM = "reducer_client.tensorflow"


def init(reducer: Reducer | None = None, **client_kwargs: Any) -> Reducer:
    """Set the process-wide reducer that every function here uses by default.

    With no argument: keep the client already set, else
    ReducerClient.from_env() (REDUCER_ADDRESSES, REDUCER_JOB, rank and world
    size from REDUCER_RANK / REDUCER_WORLD_SIZE or TF_CONFIG...). Keyword
    arguments are ReducerClient's: given addresses, rank and world_size they
    build the client directly, otherwise they override the environment.
    `reducer` installs any reducer_client.api.Reducer (a LocalGroup client in
    tests). A client replaced by arguments is closed.
    """
    return process.init(reducer, **client_kwargs)


def client() -> Reducer:
    """The process-wide reducer; RuntimeError if init() was not called."""
    return process.client(_SHIM)


shutdown = process.shutdown


def rank() -> int:
    return client().rank


def size() -> int:
    return client().world_size


# -- the one bridge between TensorFlow and the core ---------------------------

def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"op {op!r}: one of {', '.join(_OPS)}")


def _in_xla_context() -> bool:
    try:  # private, but the only way to see jit_compile while tracing
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a future TF moved it
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _run_reduction(array: np.ndarray, key: str, op: str, root_rank: int | None,
                   reducer: Reducer | None) -> np.ndarray:
    """The body of the reduction op: NumPy in, NumPy out, through the core.

    A module-level function (bound with functools.partial), so that autograph
    never rewrites it when the caller is being traced.
    """
    target = reducer if reducer is not None else client()
    if root_rank is None:
        return np.asarray(target.allreduce(array, key, op), dtype=np.float32)
    return np.asarray(target.broadcast(array, key, root_rank), dtype=np.float32)


def _reduce_flat(flat: tf.Tensor, key: str, op: str, root_rank: int | None,
                 reducer: Reducer | None) -> tf.Tensor:
    """Allreduce (root_rank None) or broadcast a 1-D float32 tensor, eagerly or as an op.

    The reducer is looked up when the op runs, not when it is traced, so a
    traced step keeps working after init() replaces the client.
    """
    run = functools.partial(_run_reduction, key=key, op=op, root_rank=root_rank,
                            reducer=reducer)
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


def _densify(grad: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """IndexedSlices to a dense tensor; rows of repeated indices add up."""
    if isinstance(grad, tf.IndexedSlices):
        if grad.dense_shape is None:
            raise ValueError("an IndexedSlices gradient without dense_shape cannot be "
                             "reduced; its variable's shape is unknown")
        dense = tf.math.unsorted_segment_sum(grad.values, grad.indices, grad.dense_shape[0])
        return tf.reshape(dense, grad.dense_shape)
    return tf.convert_to_tensor(grad)


def _fused_allreduce(tensors: list, key: str, op: str, reducer: Reducer | None) -> list:
    """Reduce a list of float tensors (dense or IndexedSlices) with one call.

    Everything travels as one float32 buffer: the daemons accumulate in
    float32 anyway, and float64 gradients lose nothing the float16 or float32
    wire keeps. Each result is cast back to its tensor's dtype.
    """
    dense = [_densify(t) for t in tensors]
    for t in dense:
        if not t.dtype.is_floating:
            raise TypeError(f"{key!r}: cannot allreduce a {t.dtype.name} tensor; the wire "
                            "carries floating point only")
    if len(dense) == 1:
        flat = tf.reshape(tf.cast(dense[0], tf.float32), [-1])
    else:
        flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in dense], axis=0)
    out = _reduce_flat(flat, key, op, None, reducer)
    parts = tf.split(out, tf.stack([tf.size(t) for t in dense]), num=len(dense))
    results = []
    for part, t in zip(parts, dense, strict=True):
        result = tf.cast(tf.reshape(part, tf.shape(t)), t.dtype)
        result.set_shape(t.shape)
        results.append(result)
    return results


def _reduce_gradients(grads: Iterable, key: str, op: str, reducer: Reducer | None) -> list:
    """Reduce the non-None gradients of a step in one call; None stays None."""
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    if present:
        reduced = _fused_allreduce([grads[i] for i in present], key, op, reducer)
        for i, g in zip(present, reduced, strict=True):
            grads[i] = g
    return grads


def allreduce(tensor: tf.Tensor | tf.IndexedSlices, name: str | None = None,
              op: str = "mean", reducer: Reducer | None = None) -> tf.Tensor:
    """Average (op="mean") or sum a float tensor over all workers; same dtype back.

    Every worker must make the same allreduce calls in the same order. `name`
    is the key on the wire (each name counts its own rounds); without one the
    key is derived from dtype and shape. IndexedSlices come back dense.
    """
    _check_op(op)
    dense = _densify(tensor)
    key = f"tf/allreduce/{name or f'{dense.dtype.name}{dense.shape}'}"
    return _fused_allreduce([dense], key, op, reducer)[0]


# -- exact broadcast ----------------------------------------------------------
# The core broadcasts float32 exactly. float16 / bfloat16 / bool fit float32
# exactly; every other dtype is sent bit for bit as four 16-bit limbs of its
# 64-bit pattern, each exact in float32.

_LIMB_SHIFTS = (48, 32, 16, 0)


def _encode_exact(value: tf.Tensor) -> tf.Tensor:
    dtype = value.dtype
    if dtype in (tf.float32, tf.float16, tf.bfloat16, tf.bool):
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
    if dtype in (tf.float32, tf.float16, tf.bfloat16, tf.bool):
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


def _fused_broadcast(values: list[tf.Tensor], key: str, root_rank: int,
                     reducer: Reducer | None) -> list[tf.Tensor]:
    encoded = [_encode_exact(v) for v in values]
    flat = encoded[0] if len(encoded) == 1 else tf.concat(encoded, axis=0)
    out = _reduce_flat(flat, key, "sum", root_rank, reducer)
    parts = tf.split(out, tf.stack([tf.size(e) for e in encoded]), num=len(encoded))
    return [_decode_exact(p, v) for p, v in zip(parts, values, strict=True)]


def broadcast(tensor: tf.Tensor, root_rank: int = 0, name: str | None = None,
              reducer: Reducer | None = None) -> tf.Tensor:
    """root_rank's value of `tensor` on every worker, bit for bit (-0.0 becomes +0.0)."""
    value = tf.convert_to_tensor(tensor)
    key = f"tf/broadcast/{name or f'{value.dtype.name}{value.shape}'}"
    return _fused_broadcast([value], key, root_rank, reducer)[0]


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
    for variable, value in zip(variables, _fused_broadcast(values, key, root_rank, reducer),
                               strict=True):
        variable.assign(value)


# -- Keras and tf.GradientTape hook points ------------------------------------

class _DistributedOptimizerMixin:
    """Reduces the gradients of each apply() through the daemons, then applies them.

    apply_gradients() and the Keras train step both end in apply(), so this
    covers model.fit and custom loops. Mixed in front of the wrapped class,
    whose name, module and config are kept, so saving works unchanged.
    """

    _reducer_op = "mean"
    _reducer_key = None
    _reducer_override: Reducer | None = None

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        # Not self.name: Keras numbers optimizer names per process (sgd, sgd_1),
        # and a rank that made one more optimizer would then wait on another key.
        key = f"tf/{self._reducer_key or 'optimizer'}/{len(grads)}"
        grads = _reduce_gradients(grads, key, self._reducer_op, self._reducer_override)
        return super().apply(grads, trainable_variables)


@functools.cache
def _distributed_class(base: type) -> type:
    return type(base.__name__, (_DistributedOptimizerMixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__})


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, op: str = "mean",  # noqa: N802
                         name: str | None = None, reducer: Reducer | None = None,
                         ) -> keras.optimizers.Optimizer:
    """A copy of a Keras 3 optimizer that averages gradients over all workers.

    The copy is an instance of the optimizer's own class (isinstance holds),
    built from its config; get_config() and saving are unchanged, so a saved
    model loads back with the plain optimizer (or use load_model() here to get
    it wrapped again). Wrap before training: an optimizer that already has
    state is refused. `name` sets the wire key (default "optimizer"; give
    each optimizer its own when several train at once).
    Compile the model with jit_compile=False: the reduction is a Python op.
    """
    _check_op(op)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a keras.optimizers.Optimizer, got {type(optimizer)!r}")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    if optimizer.built:
        raise ValueError("the optimizer already holds state (it was built or used); wrap "
                         "it before training, or load a saved model with "
                         "reducer_client.tensorflow.load_model()")
    wrapped = _distributed_class(type(optimizer)).from_config(optimizer.get_config())
    wrapped._reducer_op = op
    wrapped._reducer_key = name
    wrapped._reducer_override = reducer
    return wrapped


def load_model(filepath: Any, custom_objects: dict | None = None, **kwargs: Any,
               ) -> keras.Model:
    """keras.models.load_model, with the saved optimizer loaded as a DistributedOptimizer.

    The optimizer's state (slots, iterations) is restored as usual; only its
    class is the distributed one (op="mean", the process-wide reducer).
    """
    objects = {cls.__name__: _distributed_class(cls) for cls in _keras_optimizer_classes()}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects, **kwargs)


def _keras_optimizer_classes() -> list[type]:
    return [obj for obj in vars(keras.optimizers).values()
            if isinstance(obj, type) and issubclass(obj, keras.optimizers.Optimizer)
            and obj is not keras.optimizers.Optimizer]


class DistributedGradientTape:
    """Wrap a tf.GradientTape so that gradient() returns gradients averaged over workers.

        with tf.GradientTape() as tape:
            loss = ...
        tape = rtf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)   # one call, fused

    Everything else is the wrapped tape's (watch, stop_recording, ...); it can
    also wrap a tape before recording: `with DistributedGradientTape(tf.GradientTape())`.
    """

    def __init__(self, tape: tf.GradientTape, op: str = "mean", name: str = "tape",
                 reducer: Reducer | None = None) -> None:
        _check_op(op)
        self._tape, self._op, self._name, self._reducer = tape, op, name, reducer

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "_tape":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(attribute)
        return getattr(self._tape, attribute)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        return self._tape.__exit__(*exc_info)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        key = f"tf/{self._name}/{len(flat)}"
        return tf.nest.pack_sequence_as(grads, _reduce_gradients(flat, key, self._op,
                                                                 self._reducer))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, copy root_rank's model and optimizer variables to all.

    Runs once (at the first fit), eagerly, before the first step, so every
    worker starts from the same weights whatever its initialisation.
    """

    def __init__(self, root_rank: int = 0, reducer: Reducer | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self._reducer = reducer
        self._done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank, self._reducer)
        self._done = True
