"""Horovod's collectives over summing daemons, checked across ranks, with join.

The shims' allreduce, broadcast, allgather and grouped allreduce (and the
DistributedOptimizer's steps) each start with a *control round*: one small
float32 sum under the key "hvd/control/i" (i: the round's number modulo
DATA_KEYS) in which every rank writes a row
describing its call (what, name, dtype, shape, op, root, wire) into its own
slot of a world_size x ROW array, the others' slots zero. The sum is every
rank's row, exactly (each slot has one writer; values below 2^24). So every
rank learns at once whether all agree, and which ranks do not: a shape,
dtype, root_rank or op mismatch fails every rank with the same message
naming the ranks, after one round trip, not a timeout. The control round
travels beside the data, so an agreeing call still costs one round trip;
its bytes are world_size x ROW x 4 (124 per rank).

The data then goes under "hvd/data/i" ("hvd/gather" for allgather), i the
control round's number modulo DATA_KEYS (rounds counted per incarnation of an
elastic job), so calls pair up in call order, as
the control round checks anyway (a call takes both rounds under one lock, so
calls from several threads pair alike). The keys rotate because a small
key's chunks start at a daemon picked by its name (reducer_wire.layout): one
key for every call would put every small call on the same daemon.

join: a rank out of data calls join() and takes part in every control round
with an empty row; for each call the others make, it sends what they expect
from it (zeros, or no rows for allgather; a broadcast whose root_rank has
joined fails on the active ranks: the root sent zeros, not its tensor) and
for an optimizer step it runs the optimizer's shadow. "mean" then divides by
the ranks that contributed (Horovod's join semantics): the daemons' mean over
world_size is multiplied by world_size / active. join returns once every
rank has joined.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np

from reducer_client.api import Reducer
from reducer_client.compression import allreduce_async_on_wire
from reducer_client.control_rows import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    CHECK,
    FLOAT_DTYPES,
    REDUCIBLE_DTYPES,
    ROW,
    STEP,
    Call,
    active_count,
    active_ranks,
    call_shape,
    check,
    encode,
    gather_counts,
    joined_row,
    last_joined,
    shadowed,
)
from reducer_client.errors import ReducerError
from reducer_client.integers import INTEGER_INPUTS, horovod_scale, is_integer

__all__ = ["Call", "ALLREDUCE", "BROADCAST", "ALLGATHER", "STEP", "CHECK", "ROW", "control_async",
           "own_rows", "allreduce_async", "broadcast_async", "allgather_async", "check", "join",
           "active_count", "call_shape", "register_shadow", "drop_shadow", "FLOAT_DTYPES",
           "REDUCIBLE_DTYPES"]

CONTROL_KEY, DATA_KEY, GATHER_KEY = "hvd/control", "hvd/data", "hvd/gather"
# Control and data keys per client, taken in turn (module doc): bounded, and
# more than daemons.
DATA_KEYS = 32


def data_key(control_round: int) -> str:
    """The data key of the call whose control round is number `control_round`."""
    return f"{DATA_KEY}/{control_round % DATA_KEYS}"


class _Session:
    """Per Reducer: control rounds counted, joined or not, and the step shadows."""

    def __init__(self) -> None:
        # _lock guards everything below; taken by callers' threads.
        self._lock = threading.Lock()
        # Control rounds of the reducer's current incarnation (elastic: a
        # worker that joins counts from 0 as the others start again from 0).
        self.rounds = 0
        self.incarnation: str | None = None
        self.shadows: dict[int, Callable[[np.ndarray], None]] = {}
        self.next_tag = 1
        self.gather = ThreadPoolExecutor(1, thread_name_prefix="reducer-allgather")
        # Held across a call's control and data rounds: threads' calls pair alike on every rank.
        self.calls = threading.Lock()

    def count_round(self, reducer: Reducer) -> int:
        """The number of the control round `reducer` starts (1, 2, ... per incarnation)."""
        with self._lock:
            self._follow(reducer)
            self.rounds += 1
            return self.rounds

    def rounds_counted(self, reducer: Reducer) -> int:
        with self._lock:
            self._follow(reducer)
            return self.rounds

    def _follow(self, reducer: Reducer) -> None:
        """Count again from 0 under a new incarnation (reducer_client.elastic), whose
        keys, and so their rounds, start afresh on every rank."""
        incarnation = getattr(reducer, "incarnation", None)
        if incarnation != self.incarnation:
            self.incarnation, self.rounds = incarnation, 0


_sessions: weakref.WeakKeyDictionary[Reducer, _Session] = weakref.WeakKeyDictionary()
_sessions_lock = threading.Lock()  # guards _sessions


def _session(reducer: Reducer) -> _Session:
    with _sessions_lock:
        session = _sessions.get(reducer)
        if session is None:
            session = _sessions[reducer] = _Session()
        return session


def register_shadow(reducer: Reducer, shadow: Callable[[np.ndarray], None]) -> int:
    """Register what a joined rank runs for a STEP call; returns the call's tag.

    Tags count registrations per reducer, so they are the same on every rank
    that creates its optimizers in the same order.
    """
    session = _session(reducer)
    with session._lock:
        tag, session.next_tag = session.next_tag, session.next_tag + 1
        session.shadows[tag] = shadow
    return tag


def drop_shadow(reducer: Reducer, tag: int) -> None:
    """Forget tag's shadow (its optimizer is gone): a joined rank then fails its steps."""
    session = _session(reducer)
    with session._lock:
        session.shadows.pop(tag, None)


def _control(reducer: Reducer, row: np.ndarray) -> tuple[int, Future[np.ndarray]]:
    """Start a control round with this rank's `row`: its number (every rank
    counts the same rounds) and its future."""
    number = _session(reducer).count_round(reducer)
    slots = np.zeros((reducer.world_size, ROW), np.float32)
    slots[reducer.rank] = row
    key = f"{CONTROL_KEY}/{number % DATA_KEYS}"  # spread over the daemons, as the data
    return number, allreduce_async_on_wire(reducer, slots, key, "sum", "float32")


def own_rows(call: Call) -> np.ndarray:
    """The control rows of a one-rank job making `call` (what its round would return)."""
    return encode(call).reshape(1, ROW)


def control_async(reducer: Reducer, call: Call) -> Future[np.ndarray]:
    """Start the control round of `call`; the future holds every rank's row."""
    return _control(reducer, encode(call))[1]


def _checked_call(reducer: Reducer, call: Call) -> tuple[str, Future[np.ndarray]]:
    """Start `call`'s control round: its data key and the rows' future."""
    number, control = _control(reducer, encode(call))
    return data_key(number), control


def _chain(control: Future, call: Call, then: Callable[[np.ndarray, int], Future | None],
           finish: Callable[[object, np.ndarray, int], object]) -> Future:
    """control's rows checked, then `then(rows, active)` (a future or None), then finish."""
    target: Future = Future()

    def fail(exc: BaseException | None) -> None:
        if isinstance(exc, ReducerError):
            exc = exc.naming(call.describe())
        if not target.done():
            target.set_exception(exc)

    def on_control(done: Future) -> None:
        if done.exception() is not None:
            return fail(done.exception())
        try:
            rows = done.result()
            active = check(rows, call)
            data = then(rows, active)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            return fail(exc)

        def on_data(result: Future | None) -> None:
            if result is not None and result.exception() is not None:
                return fail(result.exception())
            try:
                target.set_result(finish(None if result is None else result.result(),
                                         rows, active))
            except BaseException as exc:  # noqa: BLE001
                fail(exc)
        if data is None:
            on_data(None)
        else:
            data.add_done_callback(on_data)
    control.add_done_callback(on_control)
    return target


def allreduce_async(reducer: Reducer, values: np.ndarray | None, call: Call,
                    out: np.ndarray | None = None, postscale: float = 1.0,
                    ) -> Future[np.ndarray]:
    """Checked allreduce of float or integer `values` (None: a dtype the wire
    cannot carry).

    A rank with values=None still sends zeros, so the rounds stay paired and
    every rank gets the same error from the control round. Integer values are
    summed exactly and "mean" and `postscale` become one scaling of the sum
    by postscale / (ranks that contributed), in float64 truncated toward
    zero, as Horovod scales integers; for floats the result is multiplied by
    `postscale` after the daemons' mean.
    """
    send = values if values is not None else np.zeros(call.data_numel, np.float32)
    integer = values is not None and is_integer(values.dtype)
    with _session(reducer).calls:
        key, control = _checked_call(reducer, call)
        data = allreduce_async_on_wire(reducer, send, key,
                                       "sum" if integer else call.op or "sum",
                                       None if integer else call.wire,
                                       out if values is not None else None)
    world = reducer.world_size

    def finish(result: object, rows: np.ndarray, active: int) -> np.ndarray:
        assert isinstance(result, np.ndarray)
        if integer:
            factor = postscale / active if call.op == "mean" and active else postscale
            if factor != 1.0:
                np.copyto(result, horovod_scale(result, factor))
            return result
        if call.op == "mean" and 0 < active < world:
            np.multiply(result, world / active, out=result, casting="unsafe")
        if postscale != 1.0:
            np.multiply(result, postscale, out=result, casting="unsafe")
        return result
    return _chain(control, call, lambda rows, active: data, finish)


def broadcast_async(reducer: Reducer, encoded: np.ndarray, call: Call) -> Future[np.ndarray]:
    """Checked broadcast of exact float32 `encoded` values (exact.encode_exact)."""
    with _session(reducer).calls:
        key, control = _checked_call(reducer, call)
        if call.root_rank is not None and 0 <= call.root_rank < reducer.world_size:
            data = reducer.broadcast_async(encoded, key, call.root_rank)
        else:  # the control round reports it on every rank; keep the rounds paired
            data = allreduce_async_on_wire(reducer, np.zeros_like(encoded), key, "sum",
                                           "float32")
    def finish(result: object, rows: np.ndarray, active: int) -> object:
        if call.root_rank not in active_ranks(rows):  # it sent zeros, not its tensor
            raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{call.describe()}: root_rank {call.root_rank} has joined: "
                               "a joined rank has no tensor to broadcast")
        return result
    return _chain(control, call, lambda rows, active: data, finish)


def allgather_async(reducer: Reducer, encoded: np.ndarray, call: Call,
                    ) -> Future[tuple[np.ndarray, list[int]]]:
    """Checked allgather of `encoded` (rows x data_numel float32, exact).

    Each rank's first dimension may differ: the control round gives every
    rank's row count, then each rank places its rows at its offset in a
    zero buffer of all rows and the daemons' sum is the concatenation. That
    costs world_size times the bytes of a ring allgather's input per rank.
    The future holds (all rows, rows per rank).
    """
    session = _session(reducer)
    rank = reducer.rank

    def gather() -> np.ndarray:
        rows = control.result()  # settles within the client's timeout
        check(rows, call)
        counts = gather_counts(rows)
        total = np.zeros((sum(counts), call.data_numel), np.float32)
        start = sum(counts[:rank])
        total[start:start + counts[rank]] = encoded.reshape(counts[rank], call.data_numel)
        return allreduce_async_on_wire(reducer, total, GATHER_KEY, "sum", "float32",
                                       out=total).result()
    # The second round goes out from one thread, in call order: the same on every rank.
    with session.calls:
        control = control_async(reducer, call)
        data = session.gather.submit(gather)
    return _chain(control, call, lambda rows, active: data,
                  lambda result, rows, active: (result, gather_counts(rows)))


def _shadow(reducer: Reducer, rows: np.ndarray, key: str) -> None:
    """What a joined rank sends, under `key`, for the call the active ranks'
    rows describe."""
    call = shadowed(rows)
    if call.kind == ALLREDUCE and call.dtype in INTEGER_INPUTS:
        allreduce_async_on_wire(reducer, np.zeros(call.data_numel, call.dtype), key,
                                "sum", None).result()
    elif call.kind == ALLREDUCE:
        allreduce_async_on_wire(reducer, np.zeros(call.data_numel, np.float32), key,
                                call.op, call.wire).result()
    elif call.kind == BROADCAST:
        allreduce_async_on_wire(reducer, np.zeros(call.data_numel, np.float32), key,
                                "sum", "float32").result()
    elif call.kind == ALLGATHER:
        total = sum(gather_counts(rows)) * call.data_numel
        session = _session(reducer)
        session.gather.submit(lambda: allreduce_async_on_wire(
            reducer, np.zeros(total, np.float32), GATHER_KEY, "sum", "float32").result()
        ).result()
    elif call.kind == STEP:
        shadow = _session(reducer).shadows.get(call.tag)
        if shadow is None:
            raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"join: the other ranks step optimizer #{call.tag}, which this "
                               "rank never created")
        shadow(rows)


def join(reducer: Reducer) -> int:
    """Take part in the others' calls with nothing of its own until all joined.

    Returns the rank that joined last. Every rank must call join() once it
    is out of data. Each wait lasts up to the client's timeout: the ranks
    still training must make a collective call (an optimizer step) within
    it.
    """
    session = _session(reducer)
    joined_at = session.rounds_counted(reducer) + 1
    while True:
        number, control = _control(reducer, joined_row(joined_at))
        rows = control.result()
        if active_count(rows) == 0:
            return last_joined(rows)
        _shadow(reducer, rows, data_key(number))
