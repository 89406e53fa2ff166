"""The process-wide client of the Horovod-shaped API: init(), client(), shutdown().

Also the per-Reducer counters behind default names.

The client itself lives in reducer_client.process, shared by every shim.
Every other function of the shim
takes the Reducer to use as an explicit `reducer=` argument and falls back to
this one only when that is None, so tests and programs with several jobs can
pass their own.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from reducer_client import process
from reducer_client.api import Reducer

__all__ = ["init", "client", "shutdown", "is_initialized", "rank", "size", "resolve",
           "next_index"]

_SHIM = "reducer_client.torch"


def init(reducer: Reducer | None = None, **client_kwargs: Any) -> Reducer:
    """Set the process-wide client (reducer_client.process.init) and return it.

    With no arguments an existing client is kept, else one is built from the
    environment (REDUCER_ADDRESSES, REDUCER_JOB, rank and world size from
    REDUCER_RANK / REDUCER_WORLD_SIZE or torchrun's RANK / WORLD_SIZE).
    Keyword arguments are ReducerClient's; `reducer` installs a ready Reducer
    (a LocalGroup client in tests).
    """
    return process.init(reducer, **client_kwargs)


def client() -> Reducer:
    """The process-wide client; raises if init() has not been called."""
    return process.client(_SHIM)


def resolve(reducer: Reducer | None) -> Reducer:
    """`reducer` when given, else the process-wide client."""
    return reducer if reducer is not None else client()


is_initialized = process.is_initialized
shutdown = process.shutdown


def rank() -> int:
    """This worker's rank in the process-wide client's job."""
    return client().rank


def size() -> int:
    """The number of workers in the process-wide client's job."""
    return client().world_size


# Default names ("optimizer.0", unnamed allreduce calls, ...) count per
# Reducer and kind, in call order, which is the same on every rank that runs
# the same program. _counters_lock guards _counters (any caller's thread).
_counters_lock = threading.Lock()
_counters: weakref.WeakKeyDictionary[Reducer, dict[str, Iterator[int]]] = (
    weakref.WeakKeyDictionary())


def next_index(reducer: Reducer, kind: str) -> int:
    """0, 1, 2, ... on successive calls for the same reducer and kind."""
    with _counters_lock:
        return next(_counters.setdefault(reducer, {}).setdefault(kind, itertools.count()))
