"""An in-process Reducer for fast shim tests: N ranks as threads, no daemon.

    group = LocalGroup(world_size=2)                      # wire_dtype="float32"
    clients = [group.client(rank) for rank in range(2)]   # hand one to each thread

Numerics are ReducerClient's and the daemon's: each contribution is rounded
to the wire dtype, the contributions are added in float32 (in rank order;
a daemon adds them in arrival order), "mean" divides the float32 sum by the
world size, and the result is rounded to the wire dtype once and widened to
the output's dtype. The default wire is float32, not ReducerClient's
float16, so that shim tests of logic can compare exactly; pass
wire_dtype="float16" to see what a default client computes.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError

import grpc
import numpy as np
from reducer_wire import convert, dtypes

from reducer_client.errors import ReducerError
from reducer_client.integers import INTEGER_INPUTS, integer_wire_for

__all__ = ["LocalGroup", "LocalClient"]

_INPUT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _settle(future: Future, result: np.ndarray | None = None,
            error: BaseException | None = None) -> None:
    """Complete `future` unless the timeout already failed it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # expired meanwhile
        pass


class _Slot:
    """One round of one key: the contributions so far and who waits for the result."""

    def __init__(self, numel: int, wire: int, op: str) -> None:
        self.numel, self.wire, self.op = numel, wire, op
        # rank -> its contribution in the wire's storage (bytes for the 8-bit wires)
        self.parts: dict[int, np.ndarray] = {}
        self.waiting: list[tuple[Future, np.ndarray]] = []  # (future, output)


class LocalGroup:
    """Shared state of the fake ranks."""

    def __init__(self, world_size: int, timeout: float = 30.0,
                 wire_dtype: str = "float32") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if wire_dtype not in dtypes.WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire_dtype!r}: one of "
                             f"{', '.join(dtypes.WIRE_DTYPES)}")
        self.world_size = world_size
        self.timeout = timeout
        self.wire_dtype = wire_dtype
        # _lock guards _slots: (key, round) -> _Slot; taken by the rank threads.
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], _Slot] = {}

    def client(self, rank: int) -> LocalClient:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} must be in [0, {self.world_size})")
        return LocalClient(self, rank)

    def _contribute(self, key: str, round_: int, rank: int, wire: np.ndarray, dtype: int,
                    op: str, out: np.ndarray, future: Future) -> None:
        numel = out.size
        with self._lock:
            slot = self._slots.setdefault((key, round_), _Slot(numel, dtype, op))
            if (slot.numel, slot.wire, slot.op) != (numel, dtype, op):
                _settle(future, error=ReducerError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"key {key!r} round {round_}: rank {rank} sent {numel} elements "
                    f"(wire {dtypes.DTYPE_NAMES[dtype]}, op {op}), others "
                    f"{slot.numel} (wire {dtypes.DTYPE_NAMES[slot.wire]}, op {slot.op})"))
                return
            slot.parts[rank] = wire
            slot.waiting.append((future, out))
            if len(slot.parts) < self.world_size:
                return
            del self._slots[(key, round_)]
        result = self._reduce(slot)
        for waiting, target in slot.waiting:
            convert.from_wire(result, slot.wire, target.reshape(-1))
            _settle(waiting, target)

    def _reduce(self, slot: _Slot) -> np.ndarray:
        """The daemon's reduction: float32 sum (mean: / world_size), rounded to the
        wire; an integer wire's sum exact in int64, wrapped to its width."""
        integer = slot.wire in dtypes.INTEGER_WIRES
        total = np.empty(slot.numel, dtype=np.int64 if integer else np.float32)
        widened = np.empty_like(total)
        for index, rank in enumerate(sorted(slot.parts)):
            # The first contribution is copied, not added to zeros: keeps -0.0.
            convert.from_wire(slot.parts[rank], slot.wire, total if index == 0 else widened)
            if index:
                total += widened
        if slot.op == "mean":
            total /= np.float32(self.world_size)
        return convert.to_wire(total, slot.wire)


def _expire(future: Future, key: str, round_: int, rank: int, timeout: float) -> None:
    _settle(future, error=ReducerError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"key {key!r} round {round_}: no result within {timeout:g} s (rank {rank})"))


def _check_out(out: np.ndarray | None, array: np.ndarray, key: str) -> None:
    """out=, as ReducerClient accepts it: writable, C-contiguous, the input's shape and dtype."""
    if out is None or (isinstance(out, np.ndarray) and out.shape == array.shape
                       and out.dtype == array.dtype and out.flags.c_contiguous
                       and out.flags.writeable):
        return
    got = (f"shape {out.shape}, dtype {out.dtype}, contiguous {out.flags.c_contiguous}, "
           f"writable {out.flags.writeable}" if isinstance(out, np.ndarray)
           else type(out).__name__)
    raise ValueError(f"key {key!r}: out must be a writable C-contiguous array of shape "
                     f"{array.shape} and dtype {array.dtype}, got {got}")


class LocalClient:
    """One fake rank; implements reducer_client.api.Reducer.

    All ranks of a LocalGroup share one host: local_rank is the rank,
    local_size the world size.
    """

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size
        self.local_rank, self.local_size = rank, group.world_size
        self.timeout = group.timeout
        self.wire_dtype = group.wire_dtype
        # _lock guards _rounds (the rank's thread, or a framework's threads).
        self._lock = threading.Lock()
        self._rounds: dict[str, int] = {}

    def _start(self, array: np.ndarray, key: str, wire: int, op: str,
               out: np.ndarray | None) -> Future[np.ndarray]:
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty string")
        array = np.asarray(array)
        if array.dtype not in _INPUT_DTYPES and dtypes.integer_wire(array.dtype) != wire:
            raise TypeError(f"key {key!r}: dtype {array.dtype} is not supported; "
                            "use float16, float32 or float64 (allreduce also takes "
                            f"{', '.join(INTEGER_INPUTS)})")
        _check_out(out, array, key)
        # Converted now, as ReducerClient does: the caller may reuse `array`
        # (and `out` may be `array`).
        encoded = convert.to_wire(array.reshape(-1), wire)
        target = np.empty(array.shape, dtype=array.dtype) if out is None else out
        with self._lock:
            round_ = self._rounds.get(key, 0)
            self._rounds[key] = round_ + 1
        future: Future[np.ndarray] = Future()
        self.group._contribute(key, round_, self.rank, encoded, wire, op, target, future)
        if not future.done():  # as the real client: nothing waits past the timeout
            timer = threading.Timer(self.timeout, _expire, (future, key, round_, self.rank,
                                                            self.timeout))
            timer.daemon = True
            timer.start()
            future.add_done_callback(lambda _: timer.cancel())
        return future

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum", *,
                        out: np.ndarray | None = None, wire_dtype: str | None = None,
                        priority: int = 0) -> Future[np.ndarray]:
        """As ReducerClient's; priority is checked and otherwise has no effect here."""
        dtypes.op_value(op)  # ValueError naming the choices
        if not (isinstance(priority, int) and 0 <= priority < 1 << 32):
            raise ValueError(f"priority must be an integer in [0, 2**32), got {priority!r}")
        wire = self.wire_dtype if wire_dtype is None else wire_dtype
        if wire not in dtypes.WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire!r}: one of {', '.join(dtypes.WIRE_DTYPES)}")
        array = np.asarray(array)
        integer = integer_wire_for(array, op, key)
        return self._start(array, key, dtypes.WIRE_DTYPES[wire] if integer is None else integer,
                           op, out)

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum", *,
                  out: np.ndarray | None = None, wire_dtype: str | None = None,
                  priority: int = 0) -> np.ndarray:
        return self.allreduce_async(array, key, op, out=out, wire_dtype=wire_dtype,
                                    priority=priority).result(self.timeout)

    def broadcast_async(self, array: np.ndarray, key: str, root_rank: int = 0,
                        ) -> Future[np.ndarray]:
        if not 0 <= root_rank < self.world_size:
            raise ValueError(f"root_rank {root_rank} must be in [0, {self.world_size})")
        array = np.asarray(array)
        data = array if self.rank == root_rank else np.full_like(array, -0.0)
        return self._start(data, key, dtypes.WIRE_DTYPES["float32"], "sum", None)

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray:
        return self.broadcast_async(array, key, root_rank).result(self.timeout)

    def close(self) -> None:
        pass
