"""DistributedGradientTape: tf.GradientTape whose gradient() averages over workers."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import tensorflow as tf

from reducer_client.api import Reducer
from reducer_client.tensorflow._basics import check_op
from reducer_client.tensorflow._bridge import reduce_gradients
from reducer_client.tensorflow.steps import GradientSteps, tape_steps

__all__ = ["DistributedGradientTape"]

# Per reducer (None: the process-wide one), per tape name: the variable sets
# seen so far, in order of first appearance; _sets_lock guards both tables
# (any thread that computes a tape's gradient).
_sets: dict[str, list[_SourceSet]] = {}
_sets_of: weakref.WeakKeyDictionary[Any, dict[str, list[_SourceSet]]] = \
    weakref.WeakKeyDictionary()
_sets_lock = threading.Lock()


class _SourceSet:
    """The sources of one tape's gradient() call, told apart from other sets.

    Variables by identity (weakly held: a set whose variables are gone
    matches nothing again), other tensors (watched inputs, new each step)
    by shape and dtype.
    """

    def __init__(self, sources: list) -> None:
        self.refs = [weakref.ref(s) if hasattr(s, "assign") else None for s in sources]
        self.specs = [None if hasattr(s, "assign") else (tuple(s.shape), str(s.dtype))
                      for s in sources]

    def matches(self, sources: list) -> bool:
        if len(sources) != len(self.refs):
            return False
        for source, ref, spec in zip(sources, self.refs, self.specs, strict=True):
            if ref is not None:
                if ref() is not source:
                    return False
            elif hasattr(source, "assign") or spec != (tuple(source.shape), str(source.dtype)):
                return False
        return True


def _part(reducer: Reducer | None, name: str, sources: list) -> int:
    """Which variable set of tape `name` `sources` are: 0 for the first seen, 1, ...

    The number travels in the wire key, so it must be the same on every rank:
    it counts sets in the order this process first computes their gradients,
    which is the training loop's order (ids and names may differ by rank).
    """
    with _sets_lock:
        table = _sets if reducer is None else _sets_of.setdefault(reducer, {})
        seen = table.setdefault(name, [])
        for index, known in enumerate(seen):
            if known.matches(sources):
                return index
        seen.append(_SourceSet(sources))
        return len(seen) - 1


class DistributedGradientTape:
    """Wrap a tf.GradientTape so that gradient() returns gradients averaged over workers.

        with tf.GradientTape() as tape:
            loss = ...
        tape = rtf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)   # one call, fused

    Everything else is the wrapped tape's (watch, stop_recording, ...); it can
    also wrap a tape before recording: `with DistributedGradientTape(tf.GradientTape())`.
    Tapes of one name over different variables (a GAN's generator and
    discriminator) each get their own wire key, residuals and join() copy:
    the first variable set keeps the key "tf/<name>/<count>", later ones
    are "tf/<name>#<n>/<count>", numbered as they first appear. A None
    gradient on one rank counts as zeros (_bridge.reduce_gradients).
    """

    def __init__(self, tape: tf.GradientTape, op: str = "mean", name: str = "tape",
                 reducer: Reducer | None = None, *, wire_dtype: str | None = None,
                 predivide_factor: float = 1.0) -> None:
        check_op(op)
        self._tape, self._op, self._name = tape, op, name
        self._settings = (reducer, wire_dtype, predivide_factor, op)
        # One GradientSteps per tape name and variable set (steps.py: joinable,
        # error feedback); the first set's is made now, its tag in creation order.
        self._steps = tape_steps(reducer, name, wire_dtype, predivide_factor, op)

    def __getattr__(self, attribute: str) -> Any:
        if attribute in ("_tape", "_steps", "_settings"):  # not set yet (copy, unpickling)
            raise AttributeError(attribute)
        return getattr(self._tape, attribute)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        return self._tape.__exit__(*exc_info)

    def _steps_for(self, sources: list) -> tuple[GradientSteps, str]:
        reducer, wire_dtype, predivide_factor, op = self._settings
        part = _part(reducer, self._name, sources)
        if part == 0:
            return self._steps, f"tf/{self._name}/{len(sources)}"
        steps = tape_steps(reducer, self._name, wire_dtype, predivide_factor, op, part)
        return steps, f"tf/{self._name}#{part}/{len(sources)}"

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        flat_sources = tf.nest.flatten(sources)
        steps, key = self._steps_for(flat_sources)
        variables = [s for s in flat_sources if hasattr(s, "assign")]
        steps.track(lambda: variables)  # what join() copies from the last rank
        return tf.nest.pack_sequence_as(grads, reduce_gradients(flat, flat_sources, key,
                                                                self._op, steps))
