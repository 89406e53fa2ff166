"""Horovod's collectives over summing daemons, checked across ranks, with join.

The shims' allreduce, broadcast, allgather and grouped allreduce (and the
DistributedOptimizer's steps) each start with a *control round*: one small
float32 sum under the key "hvd/control" in which every rank writes a row
describing its call (what, name, dtype, shape, op, root, wire) into its own
slot of a world_size x ROW array, the others' slots zero. The sum is every
rank's row, exactly (each slot has one writer; values below 2^24). So every
rank learns at once whether all agree, and which ranks do not: a shape,
dtype, root_rank or op mismatch fails every rank with the same message
naming the ranks, after one round trip, not a timeout. The control round
travels beside the data, so an agreeing call still costs one round trip;
its bytes are world_size x ROW x 4 (124 per rank).

The data then goes under one key, "hvd/data" ("hvd/gather" for allgather),
so calls pair up in call order, as the control round checks anyway (a call
takes both rounds under one lock, so calls from several threads pair alike).

join: a rank out of data calls join() and takes part in every control round
with an empty row; for each call the others make, it sends what they expect
from it (zeros, or no rows for allgather) and for an optimizer step it runs
the optimizer's shadow. "mean" then divides by the ranks that contributed
(Horovod's join semantics): the daemons' mean over world_size is multiplied
by world_size / active. join returns once every rank has joined.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
from reducer_wire import dtypes

from reducer_client.api import Reducer
from reducer_client.compression import allreduce_async_on_wire
from reducer_client.errors import ReducerError
from reducer_client.integers import INTEGER_INPUTS, horovod_scale, is_integer

__all__ = ["Call", "ALLREDUCE", "BROADCAST", "ALLGATHER", "STEP", "CHECK", "ROW", "control_async",
           "own_rows", "allreduce_async", "broadcast_async", "allgather_async", "check", "join",
           "active_count", "call_shape", "register_shadow", "drop_shadow", "FLOAT_DTYPES",
           "REDUCIBLE_DTYPES"]

CONTROL_KEY, DATA_KEY, GATHER_KEY = "hvd/control", "hvd/data", "hvd/gather"
ALLREDUCE, BROADCAST, ALLGATHER, STEP, CHECK = 1, 2, 3, 4, 5
_KINDS = {ALLREDUCE: "allreduce", BROADCAST: "broadcast", ALLGATHER: "allgather",
          STEP: "optimizer step", CHECK: "check"}
_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "bool", "int8", "uint8",
                "int16", "uint16", "int32", "uint32", "int64", "uint64", "complex64",
                "complex128")
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
# What allreduce sums: floats on the client's wire, integers exactly (reducer_client.integers).
REDUCIBLE_DTYPES = FLOAT_DTYPES | frozenset(INTEGER_INPUTS)
_WIRES = tuple(dtypes.WIRE_DTYPES)
_OPS = ("sum", "mean")
_MAX_DIMS = 8
_LIMB = 1 << 24

# Row fields. Numbers up to 2^48 take two 24-bit limbs.
(_PRESENT, _KIND, _NAME, _DTYPE, _OP, _ROOT, _WIRE, _TAG, _NDIM, _SHAPE_HASH,
 _JOINED_AT) = range(11)
_NUMEL, _DATA, _DIMS = 11, 13, 15
ROW = _DIMS + 2 * _MAX_DIMS


@dataclass(frozen=True)
class Call:
    """One rank's view of a collective call.

    dtype: the framework's dtype name ("float32", "bfloat16", "int64", ...).
    data_numel: elements sent under the data key (per row for allgather).
    signature: what else must agree (grouped calls: every shape), hashed.
    """

    kind: int
    name: str | None
    dtype: str
    shape: tuple[int, ...]
    data_numel: int
    op: str | None = None
    root_rank: int | None = None
    wire: str | None = None
    tag: int = 0
    signature: str = ""

    def describe(self) -> str:
        return _KINDS[self.kind] + ("" if self.name is None else f" {self.name!r}")


def _hash24(text: str) -> int:
    return zlib.crc32(text.encode()) % (_LIMB - 1) + 1


def _put(row: np.ndarray, at: int, value: int) -> None:
    row[at], row[at + 1] = value % _LIMB, value // _LIMB


def _get(row: np.ndarray, at: int) -> int:
    return int(row[at]) + int(row[at + 1]) * _LIMB


def _row(call: Call) -> np.ndarray:
    row = np.zeros(ROW, np.float32)
    row[_PRESENT], row[_KIND] = 1, call.kind
    row[_NAME] = 0 if call.name is None else _hash24(call.name)
    row[_DTYPE] = (_DTYPE_NAMES.index(call.dtype) + 1 if call.dtype in _DTYPE_NAMES
                   else len(_DTYPE_NAMES) + 1)
    row[_OP] = 0 if call.op is None else _OPS.index(call.op) + 1
    row[_ROOT] = 0 if call.root_rank is None else call.root_rank + 1
    row[_WIRE] = 0 if call.wire is None else _WIRES.index(call.wire) + 1
    row[_TAG], row[_NDIM] = call.tag, len(call.shape)
    agreed = call.shape[1:] if call.kind == ALLGATHER else call.shape
    row[_SHAPE_HASH] = _hash24(f"{agreed}|{call.signature}")
    _put(row, _NUMEL, int(np.prod(call.shape, dtype=np.int64)))
    _put(row, _DATA, call.data_numel)
    for i, dim in enumerate(call.shape[:_MAX_DIMS]):
        _put(row, _DIMS + 2 * i, dim)
    return row


def _shape_of(row: np.ndarray) -> tuple[int, ...] | str:
    ndim = int(row[_NDIM])
    return f"{ndim}-d" if ndim > _MAX_DIMS else tuple(_get(row, _DIMS + 2 * i) for i in range(ndim))


def _dtype_of(row: np.ndarray) -> str:
    code = int(row[_DTYPE])
    return _DTYPE_NAMES[code - 1] if 0 < code <= len(_DTYPE_NAMES) else "another dtype"


_FIELDS: tuple[tuple[str, Callable[[np.ndarray, int], object]], ...] = (
    ("what they call", lambda r, k: _KINDS.get(int(r[_KIND]), "?")),
    ("the name", lambda r, k: "unnamed" if not r[_NAME] else f"name #{int(r[_NAME])}"),
    ("dtype", lambda r, k: _dtype_of(r)),
    ("shape", lambda r, k: (_shape_of(r)[1:] if k == ALLGATHER
                            and isinstance(_shape_of(r), tuple) else _shape_of(r),
                            int(r[_SHAPE_HASH]))),
    ("op", lambda r, k: _OPS[int(r[_OP]) - 1] if r[_OP] else None),
    ("root_rank", lambda r, k: int(r[_ROOT]) - 1 if r[_ROOT] else None),
    ("compression (wire dtype)", lambda r, k: _WIRES[int(r[_WIRE]) - 1] if r[_WIRE] else
     "the client's"),
    ("the optimizer", lambda r, k: int(r[_TAG])),
)


def check(rows: np.ndarray, call: Call) -> int:
    """Raise if the active ranks' rows disagree; return how many ranks are active."""
    active = [r for r in range(rows.shape[0]) if rows[r, _PRESENT] == 1]
    for field, value_of in _FIELDS:
        values = {r: value_of(rows[r], call.kind) for r in active}
        if len(set(values.values())) > 1:
            by_value: dict[object, list[int]] = {}
            for r, v in values.items():
                by_value.setdefault(v, []).append(r)
            parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} "
                              f"{', '.join(map(str, rs))}: {v[0] if isinstance(v, tuple) else v}"
                              for v, rs in by_value.items())
            raise ReducerError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{call.describe()}: ranks disagree on {field} ({parts})")
    bad = sorted({_dtype_of(rows[r]) for r in active} - REDUCIBLE_DTYPES)
    if call.kind == ALLREDUCE and bad:
        raise TypeError(f"{call.describe()}: dtype {', '.join(bad)} cannot be reduced: "
                        f"allreduce carries {', '.join(sorted(REDUCIBLE_DTYPES))} "
                        "(broadcast and allgather carry any dtype)")
    return len(active)


def active_count(rows: np.ndarray) -> int:
    return int((rows[:, _PRESENT] == 1).sum())


def call_shape(rows: np.ndarray) -> tuple[int, ...] | str:
    """The shape the first active rank's row names (what a STEP shadow reads)."""
    return _shape_of(rows[int(np.argmax(rows[:, _PRESENT] == 1))])


class _Session:
    """Per Reducer: control rounds counted, joined or not, and the step shadows."""

    def __init__(self) -> None:
        # _lock guards everything below; taken by callers' threads.
        self._lock = threading.Lock()
        self.rounds = 0
        self.shadows: dict[int, Callable[[np.ndarray], None]] = {}
        self.next_tag = 1
        self.gather = ThreadPoolExecutor(1, thread_name_prefix="reducer-allgather")
        # Held across a call's control and data rounds: threads' calls pair alike on every rank.
        self.calls = threading.Lock()

    def count_round(self) -> int:
        with self._lock:
            self.rounds += 1
            return self.rounds


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


def _control(reducer: Reducer, row: np.ndarray) -> Future[np.ndarray]:
    _session(reducer).count_round()
    slots = np.zeros((reducer.world_size, ROW), np.float32)
    slots[reducer.rank] = row
    return allreduce_async_on_wire(reducer, slots, CONTROL_KEY, "sum", "float32")


def own_rows(call: Call) -> np.ndarray:
    """The control rows of a one-rank job making `call` (what its round would return)."""
    return _row(call).reshape(1, ROW)


def control_async(reducer: Reducer, call: Call) -> Future[np.ndarray]:
    """Start the control round of `call`; the future holds every rank's row."""
    return _control(reducer, _row(call))


def _chain(control: Future, call: Call, then: Callable[[np.ndarray, int], Future | None],
           finish: Callable[[object, np.ndarray, int], object]) -> Future:
    """control's rows checked, then `then(rows, active)` (a future or None), then finish."""
    target: Future = Future()

    def fail(exc: BaseException | None) -> None:
        if isinstance(exc, ReducerError) and not str(exc).startswith(call.describe()):
            # Name the user's call: the keys on the wire are the shims' own.
            exc = ReducerError(exc.code, f"{call.describe()}: {exc}", exc.retryable)
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
        control = control_async(reducer, call)
        data = allreduce_async_on_wire(reducer, send, DATA_KEY,
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
        control = control_async(reducer, call)
        if call.root_rank is not None and 0 <= call.root_rank < reducer.world_size:
            data = reducer.broadcast_async(encoded, DATA_KEY, call.root_rank)
        else:  # the control round reports it on every rank; keep the rounds paired
            data = allreduce_async_on_wire(reducer, np.zeros_like(encoded), DATA_KEY, "sum",
                                           "float32")
    return _chain(control, call, lambda rows, active: data, lambda r, rows, a: r)


def _gather_rows(rows: np.ndarray) -> list[int]:
    """Rows each rank contributes to an allgather (0 for joined ranks)."""
    return [_get(rows[r], _DIMS) if rows[r, _PRESENT] == 1 and rows[r, _NDIM] else 0
            for r in range(rows.shape[0])]


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
        counts = _gather_rows(rows)
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
                  lambda result, rows, active: (result, _gather_rows(rows)))


def _shadow(reducer: Reducer, rows: np.ndarray) -> None:
    """What a joined rank sends for the call the active ranks' rows describe."""
    first = rows[int(np.argmax(rows[:, _PRESENT] == 1))]
    kind, numel = int(first[_KIND]), _get(first, _DATA)
    if kind == ALLREDUCE:
        wire = _WIRES[int(first[_WIRE]) - 1] if first[_WIRE] else None
        op = _OPS[int(first[_OP]) - 1] if first[_OP] else "sum"
        allreduce_async_on_wire(reducer, np.zeros(numel, np.float32), DATA_KEY, op,
                                wire).result()
    elif kind == BROADCAST:
        allreduce_async_on_wire(reducer, np.zeros(numel, np.float32), DATA_KEY, "sum",
                                "float32").result()
    elif kind == ALLGATHER:
        total = sum(_gather_rows(rows)) * numel
        session = _session(reducer)
        session.gather.submit(lambda: allreduce_async_on_wire(
            reducer, np.zeros(total, np.float32), GATHER_KEY, "sum", "float32").result()
        ).result()
    elif kind == STEP:
        tag = int(first[_TAG])
        shadow = _session(reducer).shadows.get(tag)
        if shadow is None:
            raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"join: the other ranks step optimizer #{tag}, which this "
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
    joined_at = session.rounds + 1
    while True:
        row = np.zeros(ROW, np.float32)
        row[_JOINED_AT] = joined_at % _LIMB
        rows = _control(reducer, row).result()
        if active_count(rows) == 0:
            last = rows[:, _JOINED_AT]
            return int(np.flatnonzero(last == last.max())[-1])
        _shadow(reducer, rows)
