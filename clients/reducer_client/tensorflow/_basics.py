"""The shim's basics (reducer_client.process.Basics), its op check and its key names."""

from __future__ import annotations

from reducer_client.process import Basics

__all__ = ["basics", "check_op", "unnamed_key", "OPS"]

basics = Basics("reducer_client.tensorflow")

OPS = ("sum", "mean")


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op {op!r}: one of {', '.join(OPS)}")


def unnamed_key(kind: str) -> str:
    """The one key of every unnamed call of `kind` ("allreduce", "broadcast").

    One key per kind, not one per call or per shape: the client's round
    counter orders the calls (every rank makes them in the same order, as
    with Horovod; inside a tf.function the stateful ops run in program
    order), so nothing grows with the number of calls. Named calls use
    "tf/KIND/NAME", which never collides with this.
    """
    return f"tf/unnamed/{kind}"
