"""StepReducer: the Reducer under a DistributedOptimizer that joined ranks can follow.

Each optimizer step begins with a control round (collectives.STEP, tagged
with this optimizer), beside the step's bucket reductions. A rank that has
joined (collectives.join) sees it and runs the optimizer's shadow: the same
bucket reductions with zeros, so the others' step completes. "mean" then
divides by the ranks that took part in the step, not the world size: a
bucket's result is the daemons' mean times world_size / active.

The step's buckets may start (during backward) before the step's control
round does (in step() or synchronize(), on the caller's thread, so the
control rounds keep one order on every rank); each bucket's result waits
for the step's control result, a placeholder until then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.compression import CompressedReducer

__all__ = ["StepReducer"]


class StepReducer(CompressedReducer):
    """A CompressedReducer whose allreduces belong to optimizer steps (see module doc).

    base: a Reducer, or a function returning one (the process-wide client,
    looked up at each step, so that an elastic reset's new client counts).
    shadow: what this rank runs for a step while joined (reduce zeros into
    every bucket); called with begin/end handled here.
    """

    def __init__(self, base: Reducer | Callable[[], Reducer], wire_dtype: str | None,
                 predivide_factor: float, op: str, shadow: Callable[[], None]) -> None:
        super().__init__(base, wire_dtype, predivide_factor)
        self._op, self._shadow_fn = op, shadow
        # join's shadows belong to the client of the time (an elastic reset
        # replaces the process-wide client; join after it is not followed).
        self.tag = coll.register_shadow(self.base, self._shadow)
        # _lock guards _control and _begun; taken by autograd / staging
        # threads (allreduce_async) and the caller of step().
        self._lock = threading.Lock()
        self._control: Future[np.ndarray] | None = None
        self._begun = False

    def _call(self) -> coll.Call:
        return coll.Call(coll.STEP, None, "float32", (), 0, op=self._op, wire=self._wire,
                         tag=self.tag)

    def _placeholder(self) -> Future[np.ndarray]:
        with self._lock:
            if self._control is None:
                self._control = Future()
            return self._control

    def begin_step(self) -> None:
        """Start this step's control round, once per step (idempotent until end_step)."""
        with self._lock:
            if self._begun:
                return
            self._begun = True
        placeholder = self._placeholder()
        reducer = self.base
        if reducer.world_size == 1:  # nobody to join: no round to send
            placeholder.set_result(coll.own_rows(self._call()))
            return
        control = coll.control_async(reducer, self._call())

        def settle(done: Future) -> None:
            error = done.exception()
            if error is not None:
                placeholder.set_exception(error)
            else:
                placeholder.set_result(done.result())
        control.add_done_callback(settle)

    def end_step(self) -> None:
        """The next bucket belongs to the next step."""
        with self._lock:
            self._control, self._begun = None, False

    def _shadow(self, rows: np.ndarray) -> None:
        """A joined rank's part in the others' step: control rows known already."""
        with self._lock:
            self._control, self._begun = Future(), True
            self._control.set_result(rows)
        try:
            self._shadow_fn()
        finally:
            self.end_step()

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum", *,
                        out: np.ndarray | None = None, wire_dtype: str | None = None,
                        priority: int = 0) -> Future[np.ndarray]:
        control = self._placeholder()
        data = super().allreduce_async(array, key, op, out=out, wire_dtype=wire_dtype,
                                       priority=priority)
        call, world = self._call(), self.base.world_size
        target: Future[np.ndarray] = Future()

        def on_data(done: Future) -> None:
            if done.exception() is not None:
                target.set_exception(done.exception())
                return
            try:
                active = coll.check(control.result(), call)
                result = done.result()
                if op == "mean" and 0 < active < world:
                    np.multiply(result, world / active, out=result, casting="unsafe")
                target.set_result(result)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                target.set_exception(exc)

        def when_controlled(done: Future) -> None:
            data.add_done_callback(on_data)
        control.add_done_callback(when_controlled)
        return target
