"""The process-wide client of the Horovod-shaped API: init(), client(), shutdown().

Also the per-Reducer counters behind default names.

This module is the one place that holds it. Every other function of the shim
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

from reducer_client.api import Reducer
from reducer_client.client import ReducerClient

__all__ = ["init", "client", "shutdown", "is_initialized", "rank", "size", "resolve",
           "next_index"]

# _lock guards _client; taken by whichever thread calls init/client/shutdown.
_lock = threading.Lock()
_client: Reducer | None = None


def init(reducer: Reducer | None = None, **client_kwargs: Any) -> Reducer:
    """Create the process-wide client (once) and return it.

    With no arguments the client is built from the environment
    (ReducerClient.from_env: REDUCER_ADDRESSES, REDUCER_JOB, rank and world
    size from REDUCER_RANK / REDUCER_WORLD_SIZE or torchrun's RANK /
    WORLD_SIZE). Keyword arguments are ReducerClient's; when `addresses`,
    `rank` and `world_size` are all given the environment is not read,
    otherwise they override what it says. `reducer` installs a ready Reducer
    instead (a LocalGroup client in tests, say). Calling init again after a
    successful init returns the existing client unchanged, as Horovod does;
    call shutdown() first to replace it.
    """
    global _client
    with _lock:
        if _client is not None:
            return _client
        if reducer is None:
            if {"addresses", "rank", "world_size"} <= client_kwargs.keys():
                reducer = ReducerClient(**client_kwargs)
            else:
                reducer = ReducerClient.from_env(**client_kwargs)
        _client = reducer
        return reducer


def client() -> Reducer:
    """The process-wide client; raises if init() has not been called."""
    with _lock:
        if _client is None:
            raise RuntimeError("reducer_client.torch is not initialised: call "
                               "reducer_client.torch.init() first")
        return _client


def resolve(reducer: Reducer | None) -> Reducer:
    """`reducer` when given, else the process-wide client."""
    return reducer if reducer is not None else client()


def is_initialized() -> bool:
    with _lock:
        return _client is not None


def shutdown() -> None:
    """Close the process-wide client (open reductions fail) and forget it."""
    global _client
    with _lock:
        reducer, _client = _client, None
    if reducer is not None:
        reducer.close()


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
