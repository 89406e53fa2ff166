"""The process-wide client behind the Horovod-shaped init() of every shim.

One Reducer per process, shared by reducer_client.torch, .tensorflow and
.mxnet (a process trains with one framework, and one client keeps the round
counters of its keys in one place). Each shim's init(), client() and
shutdown() are these functions; nothing else in the package holds a client.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from reducer_client.api import Reducer

__all__ = ["init", "client", "shutdown", "is_initialized"]

# _lock guards _client and _atexit_set; taken by whichever thread calls these
# functions (the user's, or a framework's worker thread running a reduction).
_lock = threading.Lock()
_client: Reducer | None = None
_atexit_set = False


def init(reducer: Reducer | None = None, **client_kwargs: Any) -> Reducer:
    """Set the process-wide client and return it.

    With no arguments: keep the client already set, else build one with
    ReducerClient.from_env() (REDUCER_ADDRESSES, REDUCER_JOB, rank and world
    size from REDUCER_RANK / REDUCER_WORLD_SIZE or the launcher's variables).
    Keyword arguments are ReducerClient's: with addresses, rank and world_size
    all given the environment is not read, otherwise they override it.
    `reducer` installs any reducer_client.api.Reducer (a LocalGroup client in
    tests). A client replaced by arguments is closed. The client is closed at
    interpreter exit.
    """
    global _client, _atexit_set
    if reducer is None:
        with _lock:
            if _client is not None and not client_kwargs:
                return _client
        from reducer_client.client import ReducerClient  # grpc only when needed

        if {"addresses", "rank", "world_size"} <= client_kwargs.keys():
            reducer = ReducerClient(**{"job": "default", **client_kwargs})
        else:
            reducer = ReducerClient.from_env(**client_kwargs)
    with _lock:
        previous, _client = _client, reducer
        if not _atexit_set:
            atexit.register(shutdown)
            _atexit_set = True
    if previous is not None and previous is not reducer:
        previous.close()
    return reducer


def client(shim: str = "reducer_client", create: bool = False) -> Reducer:
    """The process-wide client; with create=True built from the environment
    on first use, else RuntimeError naming `shim`'s init() when none is set."""
    with _lock:
        current = _client
    if current is not None:
        return current
    if create:
        return init()
    raise RuntimeError(f"{shim} is not initialised: call {shim}.init() first")


def is_initialized() -> bool:
    with _lock:
        return _client is not None


def shutdown() -> None:
    """Close the process-wide client (its open reductions fail) and forget it."""
    global _client
    with _lock:
        current, _client = _client, None
    if current is not None:
        current.close()
