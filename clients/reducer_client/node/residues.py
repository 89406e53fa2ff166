"""Error feedback for the node's sum: the residue of the slice this worker sends.

With node-local aggregation local rank l sums slice l of every key over the
node's workers and sends it, quantized to the wire dtype (group.py). On an
8-bit wire that rounding is the only one before the daemons', so its
residue lives here, with the slice's sender: what Q dropped from this
slice's node sum (or node mean) is added to the same slice of the key's
next round (reducer_client.feedback: EF-SGD, with the node as the worker).
The sum over steps of what the node sent then equals the sum of its true
sums to within one residual, not one rounding per step.

A shim asks for it per call (feedback.NodeFeedback marks the key before
the key's allreduce starts); a key without the mark (control rounds,
broadcasts, unnamed one-off calls) is sent as it is. The shim runs the same
program on every local rank, so each slice's sender sees the same marks.
Memory: one float32 residual and one wire buffer per marked key and wire
dtype, a slice of the key's size.
"""

from __future__ import annotations

import threading

import numpy as np
from reducer_wire import dtypes

from reducer_client.feedback import FEEDBACK_WIRES, ErrorFeedback

__all__ = ["SliceResidues"]


class SliceResidues:
    """The residues of this worker's slices, per key and wire dtype."""

    def __init__(self) -> None:
        # _lock guards _wanted and _feedback: the shims' threads mark keys, the
        # node group's work thread (one) claims the marks and applies.
        self._lock = threading.Lock()
        self._wanted: set[str] = set()
        self._feedback: dict[int, ErrorFeedback] = {}

    def want(self, key: str) -> None:
        """Feed back the rounding of this key's next slice sum."""
        with self._lock:
            self._wanted.add(key)

    def apply(self, key: str, wire: int, values: np.ndarray) -> None:
        """If the key's round was marked and `wire` (a proto dtype) is 8-bit, add
        the slice's residue to `values` (float32, in place) and keep the new one."""
        name = dtypes.DTYPE_NAMES.get(wire)
        with self._lock:
            if key not in self._wanted:
                return
            self._wanted.discard(key)
            if name not in FEEDBACK_WIRES:
                return
            feedback = self._feedback.get(wire)
            if feedback is None:
                feedback = self._feedback[wire] = ErrorFeedback(name)
        # One slice per key and worker, and one round per key at a time.
        feedback.apply(key, values)

    def forget(self, key: str | None = None) -> None:
        """Drop one key's residues, or all."""
        with self._lock:
            feedbacks = list(self._feedback.values())
            if key is None:
                self._wanted.clear()
            else:
                self._wanted.discard(key)
        for feedback in feedbacks:
            feedback.forget(key)
