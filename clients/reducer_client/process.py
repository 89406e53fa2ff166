"""The process-wide client and the shims' basics, bound once.

One Reducer per process, shared by reducer_client.torch, .tensorflow and
.mxnet (a process trains with one framework, and one client keeps the round
counters of its keys in one place). As Horovod binds one HorovodBasics
object into each framework module, each shim makes one `Basics(shim_name)`
and binds the functions of `shim_basics` (in the order of BASICS_NAMES) as
its own:

    _basics = Basics("reducer_client.torch")
    (init, shutdown, is_initialized, client, rank, size, local_rank, local_size,
     cross_rank, cross_size, is_homogeneous) = shim_basics(_basics)

Every Basics works on the same process-wide client; the shim's name only
goes into its error messages. Nothing else in the package holds a client.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from reducer_client.api import Reducer
from reducer_client.horovod import bind_basics

__all__ = ["BASICS_NAMES", "Basics", "ShimBasics", "next_index", "shim_basics"]


class _ProcessClient:
    """The one process-wide Reducer (module-level singleton _PROCESS below)."""

    def __init__(self) -> None:
        # _lock guards current and _atexit_set; taken by whichever thread
        # calls the basics (the user's, or a framework's thread running a
        # reduction).
        self._lock = threading.Lock()
        self.current: Reducer | None = None
        self._atexit_set = False

    def get(self) -> Reducer | None:
        with self._lock:
            return self.current

    def install(self, reducer: Reducer) -> None:
        """Make `reducer` the process-wide client; close the one it replaces."""
        with self._lock:
            previous, self.current = self.current, reducer
            if not self._atexit_set:
                atexit.register(self.clear)
                self._atexit_set = True
        # A facade over the client it replaces (elastic's IncarnationReducer) keeps it.
        if previous is not None and previous is not reducer \
                and previous is not getattr(reducer, "inner", None):
            previous.close()

    def clear(self) -> None:
        with self._lock:
            current, self.current = self.current, None
        if current is not None:
            current.close()


_PROCESS = _ProcessClient()


def _build_client(client_kwargs: dict[str, Any]) -> Reducer:
    from reducer_client.client import ReducerClient  # grpc only when needed

    if {"addresses", "rank", "world_size"} <= client_kwargs.keys():
        return ReducerClient(**{"job": "default", **client_kwargs})
    return ReducerClient.from_env(**client_kwargs)


class Basics:
    """init / shutdown / is_initialized / rank / size / local_rank / local_size of a shim.

    `shim` (e.g. "reducer_client.torch") names the shim in errors.
    create_on_use: client() builds the client from the environment when none
    is set (the MXNet store, which mx.kv.create makes without arguments),
    instead of raising.
    """

    def __init__(self, shim: str, *, create_on_use: bool = False) -> None:
        self.shim = shim
        self.create_on_use = create_on_use

    def init(self, reducer: Reducer | None = None, **client_kwargs: Any) -> Reducer:
        """Set the process-wide client and return it.

        With no arguments: keep the client already set, else build one with
        ReducerClient.from_env() (REDUCER_ADDRESSES, REDUCER_JOB, rank and
        world size from REDUCER_RANK / REDUCER_WORLD_SIZE or the launcher's
        variables: torchrun, TF_CONFIG, DMLC_*). Keyword arguments are
        ReducerClient's: with addresses, rank and world_size all given the
        environment is not read, otherwise they override it. `reducer`
        installs any reducer_client.api.Reducer (a LocalGroup client in
        tests). A client replaced by another is closed; the client is closed
        at interpreter exit. Every shim shares this one client.
        """
        if reducer is not None and client_kwargs:
            raise ValueError(f"{self.shim}.init: give either a reducer or ReducerClient "
                             f"keyword arguments, not both (got {sorted(client_kwargs)})")
        if reducer is None:
            current = _PROCESS.get()
            if current is not None and not client_kwargs:
                return current
            reducer = _build_client(client_kwargs)
        _PROCESS.install(reducer)
        return reducer

    def client(self) -> Reducer:
        """The process-wide client; RuntimeError naming this shim's init() when none is set."""
        current = _PROCESS.get()
        if current is not None:
            return current
        if self.create_on_use:
            return self.init()
        raise RuntimeError(f"{self.shim} is not initialised: call {self.shim}.init() first")

    def resolve(self, reducer: Reducer | None) -> Reducer:
        """`reducer` when given, else the process-wide client (the shims' `reducer=`)."""
        return reducer if reducer is not None else self.client()

    def is_initialized(self) -> bool:
        """Whether a process-wide client is set."""
        return _PROCESS.get() is not None

    def shutdown(self) -> None:
        """Close the process-wide client (its open reductions fail) and forget it."""
        _PROCESS.clear()

    def rank(self) -> int:
        """This worker's rank in the job, 0 .. size() - 1."""
        return self.client().rank

    def size(self) -> int:
        """The number of workers in the job."""
        return self.client().world_size

    def local_rank(self) -> int:
        """This worker's rank among the workers on its host (0 when not known)."""
        return self.client().local_rank

    def local_size(self) -> int:
        """The number of workers on this worker's host (1 when not known)."""
        return self.client().local_size


class ShimBasics(NamedTuple):
    """The process-wide functions every shim exports, bound to its Basics.

    A tuple, so a shim binds them all in one statement that static analysis
    still reads (each name a plain module attribute); its field names are
    BASICS_NAMES, in the order the shims unpack them.
    """

    init: Callable[..., Reducer]
    shutdown: Callable[[], None]
    is_initialized: Callable[[], bool]
    client: Callable[[], Reducer]
    rank: Callable[[], int]
    size: Callable[[], int]
    local_rank: Callable[[], int]
    local_size: Callable[[], int]
    cross_rank: Callable[[], int]
    cross_size: Callable[[], int]
    is_homogeneous: Callable[[], bool]


BASICS_NAMES: tuple[str, ...] = ShimBasics._fields


def shim_basics(basics: Basics) -> ShimBasics:
    """The shim's public basics: Basics' own, plus Horovod's init (which also
    records elastic's settings and says where the default wire differs from
    Horovod's), cross_rank, cross_size and is_homogeneous."""
    horovod = bind_basics(basics)
    return ShimBasics(
        init=horovod["init"], shutdown=basics.shutdown, is_initialized=basics.is_initialized,
        client=basics.client, rank=basics.rank, size=basics.size,
        local_rank=basics.local_rank, local_size=basics.local_size,
        cross_rank=horovod["cross_rank"], cross_size=horovod["cross_size"],
        is_homogeneous=horovod["is_homogeneous"])


# Default names of objects (torch's DistributedOptimizer "optimizer.N", TF's
# "optimizer", "optimizer.1", ...) count per Reducer and kind, in the order
# the program makes or first uses them, which is the same on every rank that
# runs the same program. _counters_lock guards _counters (any caller's thread).
_counters_lock = threading.Lock()
_counters: weakref.WeakKeyDictionary[Reducer, dict[str, Iterator[int]]] = (
    weakref.WeakKeyDictionary())


def next_index(reducer: Reducer, kind: str) -> int:
    """0, 1, 2, ... on successive calls for the same reducer and kind."""
    with _counters_lock:
        return next(_counters.setdefault(reducer, {}).setdefault(kind, itertools.count()))
