"""The steps of the TF shim's optimizers and tapes: joinable, with error feedback.

Every step of a DistributedOptimizer or DistributedGradientTape is one fused
reduction (_bridge: one flat float32 buffer, one op). GradientSteps is the
Reducer that op runs through, one per optimizer (one per tape name and
variable set):

- join (reducer_client.steps.StepReducer, the core's, as the torch shim's
  optimizer uses it): each step starts with a control round tagged with
  this optimizer, beside the step's data. A rank that has called join()
  sees it and sends zeros of the step's size under the step's key (its own
  last step's: the model is the same on every rank), contributing nothing;
  "mean" divides by the ranks that took part. A StepReducer is made per
  client (the process-wide one is looked up at each step, so a later init()
  or an elastic reset counts); its tag is registered when the optimizer is
  made (when a client is set by then) or at its first step.
- error feedback (reducer_client.feedback): on by default for the 8-bit
  wires (int8, fp8_e4m3, fp8_e5m2); what quantization dropped from this
  worker's step is added to its next step of the same key (under node-local
  aggregation the node's slice senders keep it, node/residues.py).
  set_error_feedback(enabled, reducer) switches it for a client, as the
  torch shim's does. A joined rank's zeros get no residual.

Cost per step beyond the data: the control round (124 bytes per rank, one
round trip beside the data); with feedback one copy, quantization and
dequantization of the buffer. Memory: per client one StepReducer and per
key one residual; keys are per optimizer and gradient count, a fixed set.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from reducer_wire import dtypes

from reducer_client.api import Reducer
from reducer_client.compression import wire_scale
from reducer_client.errors import ReducerError
from reducer_client.feedback import ErrorFeedback
from reducer_client.steps import StepReducer
from reducer_client.tensorflow._basics import basics, check_op

__all__ = ["GradientSteps", "tape_steps", "set_error_feedback", "joinable", "forget_feedback"]

# Per client: feedback forced on (True) or off (False); absent: the default.
# _lock guards it, _all and _tapes (any thread that builds or steps).
_feedback_setting: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_all: weakref.WeakSet[GradientSteps] = weakref.WeakSet()
_tapes: dict[tuple, GradientSteps] = {}
_tapes_of: weakref.WeakKeyDictionary[Any, dict[tuple, GradientSteps]] = \
    weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _PerClient:
    """What one GradientSteps keeps for one client."""

    def __init__(self, steps: StepReducer) -> None:
        self.steps = steps
        self.feedback_setting: object = ()  # the setting `feedback` was chosen for
        self.feedback: ErrorFeedback | None = None


class GradientSteps:
    """The Reducer under one optimizer's (or tape name's) steps; see the module doc.

    reducer: a fixed Reducer, or None (the process-wide client at each step).
    wire_dtype / predivide_factor: Horovod's compression and
    gradient_predivide_factor (CompressedReducer). op: "mean" or "sum".
    what: names it in errors ("optimizer 'optimizer'", "tape 'tape'").
    """

    def __init__(self, reducer: Reducer | None, wire_dtype: str | None = None,
                 predivide_factor: float = 1.0, op: str = "mean", what: str = "optimizer",
                 ) -> None:
        check_op(op)
        if wire_dtype is not None and wire_dtype not in dtypes.WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire_dtype!r}: one of {', '.join(dtypes.WIRE_DTYPES)}")
        if not predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide_factor}")
        if isinstance(reducer, GradientSteps):
            raise TypeError("reducer is already a GradientSteps")
        self._fixed, self._wire, self._predivide = reducer, wire_dtype, predivide_factor
        self.op, self.what = op, what
        # _state_lock guards _clients, _last, _variables; taken by the threads
        # that run steps (TF's op threads), join() and the owner's traces.
        self._state_lock = threading.Lock()
        self._clients: weakref.WeakKeyDictionary[Any, _PerClient] = \
            weakref.WeakKeyDictionary()
        self._last: tuple[str, int] | None = None  # this rank's last step: key, size
        self._variables: Callable[[], list] = list
        with _lock:
            _all.add(self)
        if reducer is not None or basics.is_initialized():
            self._for(self.base())  # register the tag now, in creation order

    def base(self) -> Reducer:
        """The Reducer this step runs on: the fixed one, else the process-wide client."""
        return basics.resolve(self._fixed)

    def _for(self, base: Reducer) -> _PerClient:
        with self._state_lock:
            entry = self._clients.get(base)
            if entry is None:
                ref = weakref.ref(self)
                holder: list[StepReducer] = []

                def shadow() -> None:
                    owner = ref()
                    if owner is None:
                        raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION,
                                           "join: the other ranks step an optimizer this "
                                           "rank has dropped")
                    owner._shadow(holder[0])
                steps = StepReducer(base, self._wire, self._predivide, self.op, shadow)
                holder.append(steps)
                entry = self._clients[base] = _PerClient(steps)
            return entry

    def tag_for(self, base: Reducer) -> int | None:
        """This optimizer's step tag on `base`, None if it never stepped there."""
        with self._state_lock:
            entry = self._clients.get(base)
        return None if entry is None else entry.steps.tag

    # -- the Reducer the _bridge op calls ------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.base(), name)  # rank, world_size, wire_dtype, ...

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum", **_: Any) -> np.ndarray:
        """One step: its control round, feedback, the reduction (blocking)."""
        base = self.base()
        entry = self._for(base)
        feedback = self._feedback(base, entry)
        values = array
        if feedback is not None:  # in place, and the input may be a tensor's memory
            values = np.array(array, dtype=np.float32, copy=True).reshape(-1)
            feedback.apply(key, values, wire_scale(entry.steps, op))
        with self._state_lock:
            self._last = (key, int(values.size))
        if base.world_size == 1 and self._wire is None and self._predivide == 1.0:
            return base.allreduce(values, key, op)  # nobody to join: the plain call
        entry.steps.begin_step()
        try:
            return entry.steps.allreduce(values, key, op)
        finally:
            entry.steps.end_step()

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray:
        return self.base().broadcast(array, key, root_rank)

    def _feedback(self, base: Reducer, entry: _PerClient) -> ErrorFeedback | None:
        with _lock:
            setting = _feedback_setting.get(base)
        with self._state_lock:
            if entry.feedback_setting != setting:
                entry.feedback = ErrorFeedback.choose(entry.steps, setting)
                entry.feedback_setting = setting
            return entry.feedback

    def _shadow(self, steps: StepReducer) -> None:
        """A joined rank's part in the others' step: zeros of this rank's last step."""
        with self._state_lock:
            last = self._last
        if last is None:
            raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"join: the other ranks step {self.what}, which this rank "
                               "never stepped, so the size of its step is not known here: "
                               "take at least one step on every rank before join()")
        key, size = last
        steps.allreduce(np.zeros(size, np.float32), key, self.op)

    # -- what join() copies from the last rank --------------------------------

    def track(self, variables: Callable[[], list]) -> None:
        """Set what join() copies from the rank that joined last (called at trace time)."""
        with self._state_lock:
            self._variables = variables

    def variables(self) -> list:
        with self._state_lock:
            variables = self._variables
        return list(variables())

    def forget_feedback(self) -> None:
        with self._state_lock:
            entries = list(self._clients.values())
        for entry in entries:
            if entry.feedback is not None:
                entry.feedback.forget()


def tape_steps(reducer: Reducer | None, name: str, wire_dtype: str | None,
               predivide_factor: float, op: str, part: int = 0) -> GradientSteps:
    """The GradientSteps of every DistributedGradientTape of `name` (and settings).

    One per name and part, not per tape: a loop that wraps a new tape each
    step keeps one tag and one set of residuals. part: which variable set
    of that name (gradient_tape.py numbers them as they first appear), so
    that two models' tapes (a GAN's) never share residuals, join shadows or
    the variables join() copies.
    """
    settings = (name, wire_dtype, float(predivide_factor), op, part)
    with _lock:
        table = _tapes if reducer is None else _tapes_of.setdefault(reducer, {})
        steps = table.get(settings)
    if steps is None:
        made = GradientSteps(reducer, wire_dtype, predivide_factor, op, f"tape {name!r}")
        with _lock:
            steps = table.setdefault(settings, made)
    return steps


def joinable(base: Reducer) -> list[GradientSteps]:
    """The GradientSteps that stepped on `base`, in tag order (the same on every rank)."""
    with _lock:
        candidates = list(_all)
    tagged = [(tag, s) for s in candidates if (tag := s.tag_for(base)) is not None]
    return [s for _, s in sorted(tagged, key=lambda pair: pair[0])]


def set_error_feedback(enabled: bool, reducer: Reducer | None = None) -> None:
    """Error feedback on or off for the DistributedOptimizer and DistributedGradientTape.

    On by default for the 8-bit wires ("int8", "fp8_e4m3", "fp8_e5m2")
    (reducer_client.feedback; node-local: NodeFeedback): each step's
    key keeps what quantization dropped from this worker's gradients and
    adds it to the next step's. reducer: the client to set it for (None:
    init()'s); an optimizer made with reducer= is set through that reducer.
    """
    target = basics.resolve(reducer)
    with _lock:
        _feedback_setting[target] = bool(enabled)


def forget_feedback() -> None:
    """Drop every residual (after an elastic restore: they belong to undone steps)."""
    with _lock:
        candidates = list(_all)
    for steps in candidates:
        steps.forget_feedback()
