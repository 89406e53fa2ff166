"""DistributedGradientTape: tf.GradientTape whose gradient() averages over workers."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from reducer_client.api import Reducer
from reducer_client.tensorflow._basics import check_op
from reducer_client.tensorflow._bridge import reduce_gradients
from reducer_client.tensorflow.steps import tape_steps

__all__ = ["DistributedGradientTape"]


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
                 reducer: Reducer | None = None, *, wire_dtype: str | None = None,
                 predivide_factor: float = 1.0) -> None:
        check_op(op)
        self._tape, self._op, self._name = tape, op, name
        # One GradientSteps per tape name (steps.py: joinable, error feedback).
        self._steps = tape_steps(reducer, name, wire_dtype, predivide_factor, op)

    def __getattr__(self, attribute: str) -> Any:
        if attribute in ("_tape", "_steps"):  # not set yet (copy, unpickling): no recursion
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
        variables = [s for s in tf.nest.flatten(sources) if hasattr(s, "assign")]
        self._steps.track(lambda: variables)  # what join() copies from the last rank
        return tf.nest.pack_sequence_as(grads, reduce_gradients(flat, key, self._op,
                                                                self._steps))
