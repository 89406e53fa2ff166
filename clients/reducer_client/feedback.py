"""Error feedback for the 8-bit wires: what quantization dropped from this
worker's contribution to a key is added to its next contribution to that key.

With an 8-bit wire a contribution x goes out as Q(x). A worker that keeps
r = (x + r_prev) - Q(x + r_prev) and sends x_next + r next time has, summed
over its steps, sent its true gradients to within one residual (at most one
quantization error, reducer_wire.quant.ERROR_BOUND_DOC's e_in) instead of
one error per step (EF-SGD; Karimireddy et al., 2019). Only the worker's own
rounding is fed back: the daemon's one rounding of the result is the same on
every worker and is not known to any of them.

Q here is exactly the client's: convert.to_wire of the whole flat key, whose
int8 blocks are the chunks' blocks (chunks start on whole blocks, layout.py).
With node-local aggregation a worker's gradient goes into the node's shared
segment in float32 and is not quantized; the node's sum is, slice by slice,
by the local rank that sends each slice. So there the residue belongs to
that slice's sender: the shim's feedback object is a NodeFeedback, which
only marks the call's key, and the node group (node/residues.py) keeps the
residue of the slice this worker sends and adds it to the key's next slice
sum, with the same Q (each slice is planned and quantized as one array).

Cost per call: one more quantization and dequantization of the key on this
worker. Memory: per key a float32 residual and one wire-sized buffer; the
shims' keys are their buckets, a fixed set, so this does not grow.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from reducer_wire import convert, dtypes

__all__ = ["ErrorFeedback", "NodeFeedback", "FEEDBACK_WIRES"]

# The wires whose rounding error feedback is on for by default: the 8-bit ones.
FEEDBACK_WIRES = frozenset(dtypes.EIGHT_BIT_DTYPES)


@dataclass
class _KeyState:
    residual: np.ndarray  # float32: what the last contribution's rounding dropped
    wire: np.ndarray  # the wire bytes of the last contribution (scratch)


class ErrorFeedback:
    """Residuals per key for one worker and one wire dtype."""

    def __init__(self, wire_dtype: str) -> None:
        if wire_dtype not in dtypes.WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire_dtype!r}: one of "
                             f"{', '.join(dtypes.WIRE_DTYPES)}")
        self.wire_dtype = wire_dtype
        self._dtype = dtypes.WIRE_DTYPES[wire_dtype]
        # _lock guards _keys; taken by whoever starts a reduction (autograd
        # threads, a staging thread, step() callers). One key is never in two
        # calls at once (one reduction per key in flight), so the state of a
        # key is used outside the lock.
        self._lock = threading.Lock()
        self._keys: dict[str, _KeyState] = {}

    @classmethod
    def for_reducer(cls, reducer: Any) -> ErrorFeedback:
        """Feedback on for reducer's wire dtype: this worker's own residue, or
        with node-local aggregation its node's (a NodeFeedback)."""
        node = getattr(reducer, "_node", None)  # ReducerClient's node group
        if node is not None:
            return NodeFeedback(reducer.wire_dtype, node.residues)
        return cls(reducer.wire_dtype)

    @classmethod
    def default_for(cls, reducer: Any) -> ErrorFeedback | None:
        """On (for_reducer) for an 8-bit wire_dtype, else None."""
        if getattr(reducer, "wire_dtype", None) not in FEEDBACK_WIRES:
            return None
        return cls.for_reducer(reducer)

    @classmethod
    def choose(cls, reducer: Any, enabled: bool | None) -> ErrorFeedback | None:
        """What a shim's set_error_feedback(enabled) means for `reducer`, in one
        place: None (never set) the default, True on (for_reducer: the node's
        slice senders keep the residue under node-local aggregation), False off."""
        if enabled is None:
            return cls.default_for(reducer)
        return cls.for_reducer(reducer) if enabled else None

    def apply(self, key: str, values: np.ndarray, scale: float = 1.0) -> None:
        """Add the key's residual to `values` (1-D, float16/32/64, in place) and
        keep what rounding the result to the wire drops, for the next call.

        scale: what the reducer multiplies the values by before they go on the
        wire (compression.wire_scale: 1/f under gradient_predivide_factor f).
        The rounding is that of the scaled values, and the residual is kept in
        the values' own units: r = v - Q(s v) / s.
        """
        with self._lock:
            state = self._keys.get(key)
            if state is None or state.residual.size != values.size:
                # A new key, or a bucket rebuilt with another size (DDP does that
                # once, after its first step): start without a residual.
                state = self._keys[key] = _KeyState(
                    np.zeros(values.size, np.float32),
                    np.empty(dtypes.wire_nbytes(self._dtype, values.size), np.uint8))
        residual = state.residual
        np.add(values, residual, out=values, casting="unsafe")
        # What the client sends: float64 is rounded to float32 first, float16
        # widens exactly; CompressedReducer scales in place, with the same rounding.
        sent = values if values.dtype == np.float32 else values.astype(np.float32)
        if scale != 1.0:
            sent = np.multiply(sent, scale, dtype=np.float32, casting="unsafe")
        convert.to_wire(sent, self._dtype, out=state.wire)
        convert.from_wire(state.wire, self._dtype, residual)
        with np.errstate(invalid="ignore"):  # Inf - Inf: dropped just below
            np.subtract(sent, residual, out=residual)
        if scale != 1.0:
            np.multiply(residual, 1.0 / scale, out=residual)
        # An element the wire could not carry (beyond its finite range, Inf,
        # NaN, or in an int8 block holding one) arrives non-finite on every
        # worker, and a loss scaler skips the step: it keeps no residue, which
        # would pay a clipped excess, or NaN, into the later steps.
        if not np.isfinite(residual).all():
            residual[~np.isfinite(residual)] = 0.0

    def move(self, key: str, order: np.ndarray) -> None:
        """Reorder the key's residual: element i takes what element order[i] had
        (a bucket whose parameters were laid out anew, as DDP's rebuild does).
        A residual of another size is dropped instead."""
        with self._lock:
            state = self._keys.get(key)
            if state is None:
                return
            if state.residual.size != order.size:
                del self._keys[key]
                return
        state.residual[:] = state.residual[order]

    def forget(self, key: str | None = None) -> None:
        """Drop one key's residual, or all (a fresh start, e.g. after a restore)."""
        with self._lock:
            if key is None:
                self._keys.clear()
            else:
                self._keys.pop(key, None)


class NodeFeedback(ErrorFeedback):
    """Error feedback under node-local aggregation: the node group keeps the residue.

    apply() leaves the values alone (they enter the node's segment in
    float32, unrounded) and asks the node group to feed back the rounding of
    the slice of this key's node sum that this worker sends
    (node/residues.py): the shim's call is unchanged.
    """

    def __init__(self, wire_dtype: str, residues: Any) -> None:
        super().__init__(wire_dtype)
        self._residues = residues

    def apply(self, key: str, values: np.ndarray, scale: float = 1.0) -> None:
        self._residues.want(key)

    def move(self, key: str, order: np.ndarray) -> None:
        self._residues.forget(key)  # the node's slices are cut anew: start afresh

    def forget(self, key: str | None = None) -> None:
        self._residues.forget(key)
