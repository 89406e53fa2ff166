"""The reducer process group's parts below it (reducer_client.torch.backend).

Its options (pg_options), the ops all_reduce takes, its Work objects, and how
a group finds its client (the process-wide one for the default group, its own
keys for a dist.new_group) and which device torch made it for.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from reducer_wire import dtypes
from torch.distributed.constants import default_pg_timeout

from reducer_client.api import Reducer
from reducer_client.compression import allreduce_async_on_wire
from reducer_client.errors import ReducerError
from reducer_client.horovod import Average, Sum, UnsupportedOpError
from reducer_client.torch._basics import basics
from reducer_client.torch._gloo_side import GLOO_INSTEAD
from reducer_client.torch._tensors import numpy_view, to_numpy
from reducer_client.torch.collectives import future_of, handle_of, synchronize

__all__ = ["ReducerOptions", "ReducerWork"]

@dataclass(frozen=True)
class ReducerOptions:
    """pg_options of a "reducer" process group (init_process_group / new_group).

    wire_dtype: what all_reduce values travel as in this group: "float16",
    "bfloat16", "float32", "int8", "fp8_e4m3" or "fp8_e5m2"; None keeps the
    client's (REDUCER_WIRE_DTYPE, float16 by default).
    error_feedback: on an 8-bit wire, a tensor all-reduced again (DDP's
    buckets) carries what the wire dropped from its last contribution
    (torch/_group_feedback.py); None: on for the 8-bit wires, False: off,
    True: on (an error on any other wire).
    check_calls: whether all_reduce of one floating-point CPU tensor is
    checked across ranks first (a control round: a shape or dtype that
    differs fails every rank at once, naming each rank's shape) or goes
    straight to the daemons, which check each chunk's length, wire dtype and
    op (a length that differs fails every rank, naming the ranks; the
    default, as Gloo and NCCL check nothing). None: checked where
    TORCH_DISTRIBUTED_DEBUG=DETAIL, torch's switch for such checks.
    """

    wire_dtype: str | None = None
    error_feedback: bool | None = None
    check_calls: bool | None = None

    def __post_init__(self) -> None:
        if self.wire_dtype is not None and self.wire_dtype not in dtypes.WIRE_DTYPES:
            raise ValueError(f"ReducerOptions(wire_dtype={self.wire_dtype!r}): one of "
                             f"{', '.join(dtypes.WIRE_DTYPES)}")
        if self.error_feedback not in (None, True, False):
            raise TypeError(f"ReducerOptions(error_feedback={self.error_feedback!r}): "
                            "None, True or False")
        if (self.error_feedback and self.wire_dtype is not None
                and self.wire_dtype not in dtypes.EIGHT_BIT_DTYPES):
            raise ValueError(f"ReducerOptions(error_feedback=True) on the {self.wire_dtype} "
                             f"wire: error feedback is for the 8-bit wires "
                             f"({', '.join(dtypes.EIGHT_BIT_DTYPES)})")
        if self.check_calls not in (None, True, False):
            raise TypeError(f"ReducerOptions(check_calls={self.check_calls!r}): "
                            "None, True or False")

    def checks_calls(self) -> bool:
        """check_calls, with None resolved from TORCH_DISTRIBUTED_DEBUG."""
        if self.check_calls is not None:
            return self.check_calls
        return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


_OPS = {dist.ReduceOp.SUM: Sum, dist.ReduceOp.AVG: Average}
_REFUSED_OPS = ("MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM")
# How much longer than the client's timeout Work.wait() waits before it raises
# itself: the client fails every operation within its timeout (a control round
# and a data round, one after the other for a gather), this only catches a bug.
_WAIT_ROUNDS, _WAIT_SLACK_S = 3, 10.0


# The keys of a group's unchecked all_reduce calls, taken in turn: bounded, and
# spread over the daemons (a small key's chunks start at a daemon its name picks).
CALL_KEYS = 32


def call_key(number: int) -> str:
    """The key of a group's `number`-th unchecked all_reduce (every rank
    numbers its calls alike: torch's rule that ranks call in the same order)."""
    return f"pg/all_reduce/{number % CALL_KEYS}"


def naming_errors(future: Future, what: str) -> Future:
    """`future`, its ReducerError naming the user's call `what` (the key on the
    wire is the backend's own)."""
    named: Future = Future()

    def settle(done: Future) -> None:
        exc = done.exception()
        if exc is None:
            named.set_result(done.result())
        elif isinstance(exc, ReducerError):
            named.set_exception(exc.naming(what))
        else:
            named.set_exception(exc)
    future.add_done_callback(settle)
    return named


def unchecked_allreduce(reducer: Reducer, key: str, tensor: torch.Tensor,
                        values: torch.Tensor, sent: torch.Tensor, op: str,
                        wire: str | None) -> int:
    """Start the all_reduce of `tensor` straight to the daemons under `key`:
    its handle. `values` is the tensor or its real view (complex), `sent`
    what goes on the wire in its place (values, or error feedback's host
    copy). Reduced in place where `sent` has a NumPy view, else in a float32
    copy written back."""
    view = numpy_view(sent)
    array = view.reshape(-1) if view is not None else to_numpy(sent).reshape(-1)
    what = f"all_reduce of {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
    future = allreduce_async_on_wire(reducer, array, key, op, wire, out=array)

    def finish(result: np.ndarray) -> torch.Tensor:
        if view is None or sent is not values:
            with torch.no_grad():
                values.copy_(torch.from_numpy(result).reshape(values.shape))
        return tensor
    return handle_of(naming_errors(future, what), finish)


def _split_exact(tensors: Sequence[torch.Tensor],
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """all_reduce's tensors: those summed on the wire (floating point, and
    complex as its real and imaginary parts, in place: torch.view_as_real),
    and those summed exactly (integers and bool)."""
    wire = [torch.view_as_real(t) if t.is_complex() else t for t in tensors
            if t.is_floating_point() or t.is_complex()]
    return wire, [t for t in tensors if not (t.is_floating_point() or t.is_complex())]


def _sum_exactly(tensors: Sequence[torch.Tensor], gathered: Sequence[torch.Tensor]) -> None:
    """Write into each integer or bool tensor the sum of its gathered rows (one
    per rank), in int64 (bool: any), as Gloo sums them."""
    with torch.no_grad():
        for tensor, rows in zip(tensors, gathered, strict=True):
            total = rows.any(0) if tensor.dtype == torch.bool else rows.to(torch.int64).sum(0)
            tensor.copy_(total.reshape(tensor.shape).to(tensor.dtype))


def _op_name(op: Any) -> str:
    """"sum" or "mean" for torch's ReduceOp; UnsupportedOpError for the others."""
    op = getattr(op, "op", op)  # a ReduceOp instance or its RedOpType
    for known, name in _OPS.items():
        if op == known:
            return name
    refused = next((n for n in _REFUSED_OPS if op == getattr(dist.ReduceOp, n, None)), str(op))
    raise UnsupportedOpError(
        f"the reducer backend cannot do ReduceOp.{refused}: reducerd's daemons only sum, so "
        f"all_reduce takes ReduceOp.SUM and ReduceOp.AVG; {GLOO_INSTEAD}")


class ReducerWork(dist.Work):
    """The Work of one collective: done once all of its operations are.

    `handles` are the shim's (synchronize(handle) finishes each one, writing
    into the tensors); `then(results)` runs after them, on the thread that
    settles the last one, and returns the output tensors. get_future()'s
    value is that list; a failure fails it (as Gloo's), and wait() raises it.
    """

    def __init__(self, handles: Sequence[int], outputs: list[torch.Tensor],
                 timeout_s: float, then: Callable[[list[Any]], None] | None = None) -> None:
        super().__init__()
        self._outputs, self._then = outputs, then
        self._wait_s = _WAIT_ROUNDS * timeout_s + _WAIT_SLACK_S
        self._done = threading.Event()
        self._error: BaseException | None = None
        settled = torch.futures.Future()
        # A torch Future holding a Python exception as its value cannot be read
        # from C++ (DDP waits on it there); an exception raised in then() fails
        # the C++ future instead (hooks.py does the same).
        self._future = settled.then(self._value_or_raise)
        self._settled = settled
        # _lock guards _pending; taken by the core's threads settling operations.
        self._lock = threading.Lock()
        self._pending = len(handles)
        self._handles = list(handles)
        if not handles:
            self._finish()
        for handle in handles:
            future_of(handle).add_done_callback(self._one_done)

    def _one_done(self, _: Future) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        results: list[Any] = []
        for handle in self._handles:
            try:
                results.append(synchronize(handle))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                if self._error is None:
                    self._error = exc
        if self._error is None and self._then is not None:
            try:
                self._then(results)
            except BaseException as exc:  # noqa: BLE001
                self._error = exc
        try:  # the future first: once wait() returns, get_future() is done too
            self._settled.set_result(self._outputs)
        finally:
            self._done.set()

    def _value_or_raise(self, done: torch.futures.Future) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return done.value()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until done (timeout: at most that long; 0, torch's default: the
        client's timeout bounds it); raise the operation's error."""
        limit = timeout.total_seconds() if timeout and timeout.total_seconds() > 0 \
            else self._wait_s
        if not self._done.wait(limit):
            raise RuntimeError(f"reducer backend: the operation did not finish within "
                               f"{limit:.0f} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs


class _GroupKeys:
    """A Reducer whose keys are `inner`'s under `prefix`, with the group's rank and
    size: a dist.new_group's, so that its rounds never pair with another group's."""

    def __init__(self, inner: Reducer, prefix: str, rank: int, world_size: int) -> None:
        self.inner, self.prefix = inner, prefix
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_size = 0, 1
        self.timeout, self.wire_dtype = inner.timeout, inner.wire_dtype

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum",
                        **kwargs: Any) -> Future[np.ndarray]:
        return self.inner.allreduce_async(array, self.prefix + key, op, **kwargs)

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum",
                  **kwargs: Any) -> np.ndarray:
        return self.allreduce_async(array, key, op, **kwargs).result()

    def broadcast_async(self, array: np.ndarray, key: str,
                        root_rank: int = 0) -> Future[np.ndarray]:
        return self.inner.broadcast_async(array, self.prefix + key, root_rank)

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray:
        return self.broadcast_async(array, key, root_rank).result()

    def close(self) -> None:
        """The process-wide client is closed with the default group, not here."""


def _default_client(rank: int, world_size: int, timeout_s: float | None) -> tuple[Reducer, bool]:
    """The process-wide client for the default group, and whether it was made here.

    A client already set with this rank and world size is used as it is (its
    own timeout and wire dtype); otherwise one is made from the environment
    with torch's rank, world size and timeout, and set process-wide.
    """
    if basics.is_initialized():
        client = basics.client()
        if (client.rank, client.world_size) == (rank, world_size):
            return client, False
    from reducer_client.client import ReducerClient  # grpc only when a group is made

    # torch's rank and size win over the launcher's variables (a file:// or
    # tcp:// init gives them as arguments).
    environ = {**os.environ, "REDUCER_RANK": str(rank), "REDUCER_WORLD_SIZE": str(world_size)}
    overrides = {} if timeout_s is None else {"timeout": timeout_s}
    return basics.init(ReducerClient.from_env(environ, **overrides)), True


def _check_list(tensors: Sequence[torch.Tensor], like: torch.Tensor, world_size: int,
                what: str) -> None:
    """A list argument of a collective: one tensor per rank, each of like's size."""
    if len(tensors) != world_size:
        raise ValueError(f"{what} has {len(tensors)} tensors, the group has "
                         f"{world_size} ranks")
    for t in tensors:
        if t.numel() != like.numel():
            raise ValueError(f"{what}: a tensor of {t.numel()} elements where this "
                             f"rank's has {like.numel()}")


def _timeout_s(timeout: timedelta | None) -> float | None:
    """The op timeout torch gives, None where it is torch's default (not chosen)."""
    if timeout is None or timeout == default_pg_timeout or timeout.total_seconds() <= 0:
        return None
    return timeout.total_seconds()


class _AllOf(dist.Work):
    """Done when every Work of `works` is (the coalesced forms)."""

    def __init__(self, works: list[dist.Work], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._works, self._outputs = works, outputs
        # value() of each re-raises its failure: the collected future fails then.
        self._future = torch.futures.collect_all([w.get_future() for w in works]).then(
            lambda done: [f.value() for f in done.value()] and outputs)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for work in self._works:
            work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs
