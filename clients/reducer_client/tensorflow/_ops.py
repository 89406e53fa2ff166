"""The shim's collectives as TensorFlow ops, failing with Horovod's error classes.

run_collective(fn, inputs, dtype, what) runs fn on the inputs' NumPy values
eagerly, or as one stateful tf.numpy_function op in a graph (not under XLA).

Horovod fails ranks that disagree (shape, dtype, root_rank, ...) with
tf.errors.FailedPreconditionError. Eagerly the ReducerError of such a
disagreement is raised as CollectiveFailedPrecondition, which is both (a
ReducerError with its code and message, and the tf.errors class). In a graph
a Python op can only fail as UnknownError (TensorFlow keeps no error class of
a Python exception but ValueError / TypeError), so the op hands the reason
out as a string and a tf.cond fails the step with FailedPreconditionError by
reading a variable that does not exist, named for the purpose, after
printing the reason (to stderr) on that rank. Any other ReducerError fails
the op as before (UnknownError carrying its text; remember_error keeps it
for elastic.run).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import grpc
import numpy as np
import tensorflow as tf

from reducer_client.errors import ReducerError
from reducer_client.tensorflow._bridge import _in_xla_context, remember_error

__all__ = ["CollectiveFailedPrecondition", "run_collective", "horovod_error"]

# Codes of the failures Horovod reports as FailedPreconditionError: ranks that
# disagree (the control round), a collective the job's state refuses (join).
_PRECONDITION_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT,
                                 grpc.StatusCode.FAILED_PRECONDITION})
# What a graph's FailedPreconditionError names: the reason is printed above it.
_FAILED_VARIABLE = "reducer_collective_failed_the_reason_is_printed_above"


class CollectiveFailedPrecondition(ReducerError, tf.errors.FailedPreconditionError):
    """A ReducerError that is also tf.errors.FailedPreconditionError (Horovod's class)."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 retryable: bool | None = None) -> None:
        ReducerError.__init__(self, code, message, retryable)
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


def horovod_error(exc: ReducerError) -> ReducerError:
    """`exc` as Horovod's class where Horovod has one, else `exc` itself."""
    if exc.code in _PRECONDITION_CODES and not isinstance(exc, CollectiveFailedPrecondition):
        return CollectiveFailedPrecondition(exc.code, str(exc), exc.retryable)
    return exc


def _failed_precondition(reason: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    with tf.control_dependencies([tf.print("reducer_client.tensorflow:", reason,
                                           output_stream=sys.stderr)]):
        handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=[], shared_name=_FAILED_VARIABLE)
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def run_collective(fn: Callable[..., np.ndarray], inputs: list[tf.Tensor], dtype: tf.DType,
                   what: str) -> tf.Tensor:
    """fn on the inputs' NumPy values, eagerly or as one stateful graph op."""
    if tf.executing_eagerly():
        try:
            return tf.convert_to_tensor(fn(*[t.numpy() for t in inputs]), dtype=dtype)
        except ReducerError as exc:
            error = horovod_error(exc)
            if error is exc:
                raise
            raise error from exc
    if _in_xla_context():
        raise ValueError(f"reducer_client.tensorflow: {what} runs as a Python op "
                         "(tf.numpy_function) that XLA cannot compile: compile with "
                         "jit_compile=False")
    empty = np.zeros(0, dtype.as_numpy_dtype)

    def body(*arrays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        try:
            return fn(*arrays), np.array(b"", dtype=object)
        except ReducerError as exc:  # kept for elastic.run (TF passes on only the text)
            remember_error(exc)
            if exc.code not in _PRECONDITION_CODES:
                raise
            return empty, np.array(str(exc).encode(), dtype=object)
    out, reason = tf.numpy_function(body, inputs, [dtype, tf.string], stateful=True,
                                    name=f"Reducer_{what}")
    return tf.cond(tf.strings.length(reason) > 0,
                   lambda: _failed_precondition(reason, dtype), lambda: tf.identity(out))
