"""The shim's basics (reducer_client.process: Basics, next_index for default names).

Every other function of the shim takes the Reducer to use as an explicit
`reducer=` argument and falls back to the process-wide client of init() only
when that is None (basics.resolve), so tests and programs with several jobs
can pass their own.
"""

from __future__ import annotations

from reducer_client.process import Basics, next_index

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
