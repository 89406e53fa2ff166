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

Order: calls pair up in call order, so every rank must run its collective
ops in one order. A tf.function runs stateful ops in program order; a TF1
graph (a Session) runs independent ops in any order, so there each
collective op takes a token of the one made before it in that graph as an
input: running one runs those made before it too (in_call_order).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import grpc
import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph

from reducer_client.errors import ReducerError
from reducer_client.tensorflow._bridge import _in_xla_context, remember_error

__all__ = ["CollectiveFailedPrecondition", "run_collective", "horovod_error", "in_call_order"]

# Codes of the failures Horovod reports as FailedPreconditionError: ranks that
# disagree (the control round), a collective the job's state refuses (join).
_PRECONDITION_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT,
                                 grpc.StatusCode.FAILED_PRECONDITION})
# What a graph's FailedPreconditionError names: the reason is printed above it.
_FAILED_VARIABLE = "reducer_collective_failed_the_reason_is_printed_above"


class _Made:
    """A collective op made in a TF1 graph; `token`, an output of its Python op."""

    def __init__(self, after: tf.Tensor | None) -> None:
        self.after = after  # the token of the op made before it, or None
        self.token: tf.Tensor | None = None

    def inputs(self, inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        """The op's inputs, and the token to run after as the last one (a data
        input: Grappler may drop control edges when it folds constant inputs)."""
        return inputs + ([] if self.after is None else [self.after])


# The last collective op made in each TF1 graph (a graph is built by one thread;
# the WeakKeyDictionary drops a graph's entry with it).
_last_in_graph: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def in_call_order() -> _Made:
    """For the making of one collective op (the caller passes made.inputs(...)
    to its Python op and sets `.token` to one of its outputs): in a TF1 graph
    the op runs after the op made before it in that graph. Running one
    therefore runs those made before it again (every rank alike), as a
    tf.function runs all of its collectives."""
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or isinstance(graph, FuncGraph):
        return _Made(None)
    previous = _last_in_graph.get(graph)
    made = _Made(None if previous is None else previous.token)
    _last_in_graph[graph] = made
    return made


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

    made = in_call_order()

    def body(*arrays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        try:
            return fn(*arrays[:len(inputs)]), np.array(b"", dtype=object)
        except ReducerError as exc:  # kept for elastic.run (TF passes on only the text)
            remember_error(exc)
            if exc.code not in _PRECONDITION_CODES:
                raise
            return empty, np.array(str(exc).encode(), dtype=object)
    out, reason = tf.numpy_function(body, made.inputs(inputs), [dtype, tf.string],
                                    stateful=True, name=f"Reducer_{what}")
    made.token = reason
    return tf.cond(tf.strings.length(reason) > 0,
                   lambda: _failed_precondition(reason, dtype), lambda: tf.identity(out))
