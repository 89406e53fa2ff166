"""The control round's rows: one rank's call as a float32 row, and their check.

Each rank writes its row (what, name, dtype, shape, op, root, wire, optimizer
tag) into its own slot of a world_size x ROW array; the daemons' sum is every
rank's row, exactly (one writer per slot, values below 2^24). check() names
the ranks that disagree. reducer_client.collectives runs the rounds.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
from reducer_wire import dtypes

from reducer_client.errors import ReducerError
from reducer_client.integers import INTEGER_INPUTS

__all__ = ["Call", "ALLREDUCE", "BROADCAST", "ALLGATHER", "STEP", "CHECK", "ROW", "FLOAT_DTYPES",
           "REDUCIBLE_DTYPES", "encode", "check", "active_count", "active_ranks", "call_shape",
           "gather_counts",
           "Shadowed", "shadowed", "joined_row", "last_joined"]

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


def encode(call: Call) -> np.ndarray:
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


def active_ranks(rows: np.ndarray) -> list[int]:
    """The ranks that made the call (the others have joined)."""
    return [int(r) for r in np.flatnonzero(rows[:, _PRESENT] == 1)]


def call_shape(rows: np.ndarray) -> tuple[int, ...] | str:
    """The shape the first active rank's row names (what a STEP shadow reads)."""
    return _shape_of(rows[int(np.argmax(rows[:, _PRESENT] == 1))])


def gather_counts(rows: np.ndarray) -> list[int]:
    """Rows each rank contributes to an allgather (0 for joined ranks)."""
    return [_get(rows[r], _DIMS) if rows[r, _PRESENT] == 1 and rows[r, _NDIM] else 0
            for r in range(rows.shape[0])]


@dataclass(frozen=True)
class Shadowed:
    """The call a joined rank must mirror, as the first active rank's row names it."""

    kind: int
    data_numel: int
    dtype: str
    op: str
    wire: str | None
    tag: int


def shadowed(rows: np.ndarray) -> Shadowed:
    first = rows[int(np.argmax(rows[:, _PRESENT] == 1))]
    return Shadowed(kind=int(first[_KIND]), data_numel=_get(first, _DATA),
                    dtype=_dtype_of(first), op=_OPS[int(first[_OP]) - 1] if first[_OP] else "sum",
                    wire=_WIRES[int(first[_WIRE]) - 1] if first[_WIRE] else None,
                    tag=int(first[_TAG]))


def joined_row(joined_at: int) -> np.ndarray:
    """A joined rank's row: absent, carrying the control round it joined at."""
    row = np.zeros(ROW, np.float32)
    row[_JOINED_AT] = joined_at % _LIMB
    return row


def last_joined(rows: np.ndarray) -> int:
    """The rank that joined last (the highest such rank on a tie)."""
    last = rows[:, _JOINED_AT]
    return int(np.flatnonzero(last == last.max())[-1])
