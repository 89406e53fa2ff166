"""The shim's basics (reducer_client.process.Basics) and the counters behind default names.

Every other function of the shim takes the Reducer to use as an explicit
`reducer=` argument and falls back to the process-wide client of init() only
when that is None (basics.resolve), so tests and programs with several jobs
can pass their own.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator

from reducer_client.api import Reducer
from reducer_client.process import Basics

__all__ = ["basics", "resolve", "next_index", "unnamed_key"]

basics = Basics("reducer_client.torch")
resolve = basics.resolve


def unnamed_key(kind: str) -> str:
    """The one key of every unnamed call of `kind` ("allreduce", "broadcast", ...).

    One key per kind, not one per call: the client's round counter orders
    the calls (every rank makes them in the same order, as with Horovod), so
    nothing grows with the number of calls. Named calls use "KIND/NAME",
    which never collides with this.
    """
    return f"unnamed/{kind}"


# Default names of objects (the DistributedOptimizer's "optimizer.N") count
# per Reducer and kind, in creation order, which is the same on every rank
# that runs the same program. _counters_lock guards _counters (any caller's
# thread).
_counters_lock = threading.Lock()
_counters: weakref.WeakKeyDictionary[Reducer, dict[str, Iterator[int]]] = (
    weakref.WeakKeyDictionary())


def next_index(reducer: Reducer, kind: str) -> int:
    """0, 1, 2, ... on successive calls for the same reducer and kind."""
    with _counters_lock:
        return next(_counters.setdefault(reducer, {}).setdefault(kind, itertools.count()))
