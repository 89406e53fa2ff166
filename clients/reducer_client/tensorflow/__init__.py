"""reducer_client.tensorflow: the TensorFlow / Keras 3 shim (Horovod-shaped).

    import reducer_client.tensorflow as rtf
    rtf.init()                                          # ReducerClient.from_env()
    opt = rtf.DistributedOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[rtf.BroadcastGlobalVariablesCallback(root_rank=0)])

    tape = rtf.DistributedGradientTape(tape)            # custom training loops
    t = rtf.allreduce(tensor, name="x", op="mean")
    rtf.rank(), rtf.size(), rtf.local_rank(), rtf.local_size(), rtf.shutdown()
    rtf.set_error_feedback(False)                       # on by default for the 8-bit wires

Horovod's names with Horovod's meaning (horovod.tensorflow and
horovod.tensorflow.keras; `import reducer_client.tensorflow.keras as hvd`
works too): Compression, Average / Sum (Adasum, Min, Max, Product refused),
allreduce, grouped_allreduce, allgather, broadcast, broadcast_object,
allgather_object, barrier, join, cross_rank, cross_size, the *_built
queries, callbacks.MetricAverageCallback / LearningRateWarmupCallback /
LearningRateScheduleCallback, and DistributedOptimizer(compression=,
backward_passes_per_step=, average_aggregated_gradients=,
gradient_predivide_factor=) (compat.py, horovod_optimizer.py).

The shim only converts tensors to and from NumPy and plugs into Keras and
tf.GradientTape; chunking, streams and retries stay in the core. Its parts:
_basics (init, rank, ... bound from reducer_client.process), _bridge (the
reduction op, one fused call per step), functions (allreduce, exact
broadcasts), optimizer, gradient_tape, callbacks. What a step sends:
- All gradients of a step travel as one flat float32 buffer, one call
  (_bridge).
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
  Ranks that disagree in allreduce, allgather or broadcast (shape, dtype,
  root_rank) fail as Horovod's do, with tf.errors.FailedPreconditionError,
  eagerly (also a ReducerError) and in graphs (_ops.py). Either way it comes
  within the client's timeout, never as a hang.
"""

import types as _types

import tensorflow as _tf

from reducer_client.errors import ReducerError
from reducer_client.horovod import (
    NOT_SUPPORTED,
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    not_supported,
    rocm_built,
)
from reducer_client.process import shim_basics
from reducer_client.tensorflow import _keras2, callbacks, elastic
from reducer_client.tensorflow._basics import basics as _basics
from reducer_client.tensorflow.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from reducer_client.tensorflow.compat import (
    Compression,
    allgather,
    allreduce,
    barrier,
    broadcast,
    broadcast_variables,
    grouped_allreduce,
    join,
)
from reducer_client.tensorflow.horovod_optimizer import (
    DistributedGradientTape,
    DistributedOptimizer,
)
from reducer_client.tensorflow.objects import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
)
from reducer_client.tensorflow.optimizer import load_model
from reducer_client.tensorflow.steps import set_error_feedback
from reducer_client.tensorflow.variants import (
    broadcast_,
    broadcast_global_variables,
    grouped_allgather,
)

# Bound once in reducer_client.process, as Horovod binds its basics into each
# framework module; init also says (once, on rank 0) where the default wire
# differs from Horovod's.
(init, shutdown, is_initialized, client, rank, size, local_rank, local_size,
 cross_rank, cross_size, is_homogeneous) = shim_basics(_basics)

__all__ = ["init", "client", "shutdown", "is_initialized", "rank", "size", "local_rank",
           "local_size", "cross_rank", "cross_size", "is_homogeneous", "allreduce",
           "grouped_allreduce", "allgather", "allgather_object", "broadcast",
           "broadcast_object", "broadcast_object_fn", "broadcast_variables", "barrier", "join",
           "DistributedOptimizer", "DistributedGradientTape",
           "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "load_model",
           "callbacks", "elastic", "set_error_feedback", "ReducerError", "Compression",
           "Average", "Sum", "Adasum", "Min", "Max", "Product", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
           "ccl_built", "cuda_built", "rocm_built"]

_keras2.install()  # opt.variables() as Horovod's TF2 examples call it

# Horovod's alltoall, reducescatter and process sets: NotImplementedError saying why.
globals().update({_name: not_supported(_name) for _name in NOT_SUPPORTED})
__all__ += list(NOT_SUPPORTED)


def _executing_eagerly() -> bool:
    """Horovod's helper (hvd._executing_eagerly, hvd.util._executing_eagerly)."""
    return _tf.executing_eagerly()


util = _types.SimpleNamespace(_executing_eagerly=_executing_eagerly)


def rank_op(name: str | None = None) -> _tf.Tensor:
    """rank() as an int32 tensor (Horovod's)."""
    return _tf.constant(rank(), _tf.int32, name=name)


def size_op(process_set_id: int = 0, name: str | None = None) -> _tf.Tensor:
    """size() as an int32 tensor (Horovod's)."""
    return _tf.constant(size(), _tf.int32, name=name)


def local_rank_op(name: str | None = None) -> _tf.Tensor:
    """local_rank() as an int32 tensor (Horovod's)."""
    return _tf.constant(local_rank(), _tf.int32, name=name)


def local_size_op(name: str | None = None) -> _tf.Tensor:
    """local_size() as an int32 tensor (Horovod's)."""
    return _tf.constant(local_size(), _tf.int32, name=name)


__all__ += ["grouped_allgather", "broadcast_", "broadcast_global_variables", "rank_op",
            "size_op", "local_rank_op", "local_size_op"]
