"""Horovod's small names, with Horovod's meaning, for every shim.

- Op constants: Average and Sum (the daemons sum, and divide for "mean");
  Adasum, Min, Max and Product exist so that `op=hvd.Adasum if ... else
  hvd.Average` still reads, and are refused with an error that says why.
- resolve_op(op, average): Horovod's rules for op= and the deprecated
  average= (op wins; not both; None is Average).
- The build queries answer truthfully for this backend: no MPI, Gloo, NCCL,
  DDL, oneCCL, CUDA or ROCm kernels are built in; reductions run on the
  reducerd daemons' CPUs (GPU tensors are staged through host memory).
- cross_rank / cross_size: the node's index and the number of nodes.
- not_supported(name): Horovod's collectives that summing daemons do not
  offer (alltoall, reducescatter, process sets), bound in each shim so that a
  ported script fails at the call with NotImplementedError saying why,
  rather than with an AttributeError.
- announce_wire: the one log line at init that says where this backend's
  default differs from Horovod's (the wire dtype).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from reducer_client.api import Reducer

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "resolve_op", "UnsupportedOpError",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
           "is_homogeneous", "cross_rank", "cross_size", "announce_wire", "QUERIES",
           "bind_basics", "NOT_SUPPORTED", "not_supported"]

Average = "mean"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "product"

_UNSUPPORTED = {
    Adasum: ("Adasum", "the daemons sum (op=Sum) or average (op=Average); use op=Average "
             "(and the usual learning-rate scaling by size())"),
    Min: ("Min", "the daemons only sum or average"),
    Max: ("Max", "the daemons only sum or average"),
    Product: ("Product", "the daemons only sum or average"),
}


class UnsupportedOpError(NotImplementedError, ValueError):
    """An op reducerd cannot do (Adasum, Min, Max, Product); also a ValueError."""


def resolve_op(op: str | None = None, average: bool | None = None) -> str:
    """"mean" or "sum" from Horovod's op= / average= arguments.

    op: Average ("mean"), Sum ("sum"), or None (Average unless average=False).
    average: Horovod's deprecated flag (True: Average, False: Sum); giving
    both is an error, as in Horovod.
    """
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of "
                         "them.")
    if op is None:
        return Sum if average is False else Average
    if op in _UNSUPPORTED:
        what, reason = _UNSUPPORTED[op]
        raise UnsupportedOpError(f"op {op!r} ({what}) is not supported by reducerd: {reason}")
    if op not in (Average, Sum):
        raise ValueError(f"op {op!r}: one of Average ({Average!r}), Sum ({Sum!r})")
    return op


def mpi_built() -> bool:
    """False: no MPI in this backend."""
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def gloo_built() -> bool:
    """False: no Gloo controller; the reducerd daemons reduce."""
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> bool:
    """False (Horovod answers a version number, 0 without NCCL; False == 0)."""
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """False: no CUDA kernels; CUDA tensors are staged through pinned host memory."""
    return False


def rocm_built() -> bool:
    return False


QUERIES = (mpi_built, mpi_enabled, mpi_threads_supported, gloo_built, gloo_enabled,
           nccl_built, ddl_built, ccl_built, cuda_built, rocm_built)


def _topology(client: Reducer) -> tuple[int, int]:
    """(node index, node count): the client's node group's, else node-major ranks."""
    node = getattr(client, "_node", None)
    topology = getattr(node, "topology", None)
    if topology is not None:
        return topology.node, topology.nodes
    local_size = max(1, client.local_size)
    if client.world_size % local_size:
        return client.rank, client.world_size  # no regular layout: one worker per node
    return client.rank // local_size, client.world_size // local_size


def cross_rank(client: Reducer) -> int:
    """This worker's node among the nodes (Horovod's cross_rank)."""
    return _topology(client)[0]


def cross_size(client: Reducer) -> int:
    """The number of nodes (Horovod's cross_size)."""
    return _topology(client)[1]


def is_homogeneous(client: Reducer) -> bool:
    """Whether every node runs the same number of workers (the core requires it)."""
    return client.world_size % max(1, client.local_size) == 0


_log = logging.getLogger("reducer_client")
_announced_lock = threading.Lock()  # guards _announced (any thread calling init)
_announced = False


def announce_wire(client: Any, shim: str) -> None:
    """Say once per process (on rank 0) where the default wire differs from Horovod's."""
    global _announced
    wire = getattr(client, "wire_dtype", "float32")
    with _announced_lock:
        if _announced or wire == "float32" or getattr(client, "rank", 0) != 0:
            return
        _announced = True
    _log.warning("%s: the default wire dtype is %s (REDUCER_WIRE_DTYPE), where Horovod's "
                 "default is uncompressed float32: calls without compression= travel as %s; "
                 "compression=Compression.none (as Horovod's examples pass it) or "
                 "REDUCER_WIRE_DTYPE=float32 gives Horovod's numerics", shim, wire, wire)


def bind_basics(basics: Any) -> dict[str, Any]:
    """The Horovod basics a shim binds on top of process.Basics: init (which
    announces the wire), cross_rank, cross_size, is_homogeneous."""
    def init(reducer: Reducer | None = None, **client_kwargs: Any) -> Reducer:
        client = basics.init(reducer, **client_kwargs)
        if reducer is None:  # elastic resets rebuild the client from these
            from reducer_client.elastic.run import record_settings

            record_settings(basics.shim, client_kwargs)
        announce_wire(client, basics.shim)
        return client
    init.__doc__ = basics.init.__doc__

    def cross_rank_() -> int:
        """This worker's node among the nodes (Horovod's cross_rank)."""
        return cross_rank(basics.client())

    def cross_size_() -> int:
        """The number of nodes (Horovod's cross_size)."""
        return cross_size(basics.client())

    def is_homogeneous_() -> bool:
        """Whether every node runs the same number of workers."""
        return is_homogeneous(basics.client())
    return {"init": init, "cross_rank": cross_rank_, "cross_size": cross_size_,
            "is_homogeneous": is_homogeneous_}


_SUMS_ONLY = "the reducerd daemons sum whole tensors for the whole job"
NOT_SUPPORTED: dict[str, str] = {
    "alltoall": f"alltoall is not supported by reducerd: {_SUMS_ONLY}; no rank can "
                "send a different part to each other rank",
    "reducescatter": f"reducescatter is not supported by reducerd: {_SUMS_ONLY}; "
                     "allreduce and keep this rank's slice",
    "grouped_reducescatter": f"grouped_reducescatter is not supported by reducerd: "
                             f"{_SUMS_ONLY}; grouped_allreduce and keep this rank's slices",
    "add_process_set": "process sets are not supported by reducerd: every collective "
                       "spans the whole job (start a job of its own per group instead)",
    "remove_process_set": "process sets are not supported by reducerd: every collective "
                          "spans the whole job",
}
for _name in ("alltoall", "reducescatter", "grouped_reducescatter"):
    NOT_SUPPORTED[f"{_name}_async"] = NOT_SUPPORTED[_name]


def not_supported(name: str) -> Any:
    """A stand-in for Horovod's `name` that raises NotImplementedError saying why."""
    reason = NOT_SUPPORTED[name]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(reason)
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not supported: {reason}."
    return refuse
