"""MXNet shim: the "reducer" KVStore, so gluon.Trainer reduces through reducerd.

    import mxnet as mx
    import reducer_client.mxnet            # registers the KVStore type "reducer"
    kv = mx.kv.create("reducer")           # configured by ReducerClient.from_env()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    trainer = reducer_client.mxnet.DistributedTrainer(net.collect_params(), "sgd", {...})
    reducer_client.mxnet.set_error_feedback(False)  # on by default for the 8-bit wires

Pass the store object, not the string: gluon.Trainer(kvstore="reducer") on a
single device quietly uses no kvstore at all (MXNet only creates non-"dist"
stores by name for several devices).

Horovod's names with Horovod's meaning (compat.py): rank, size,
local_rank, local_size, cross_rank, cross_size, Compression, Average / Sum,
the *_built queries, allreduce(_), grouped_allreduce(_), allgather,
broadcast(_), broadcast_object, allgather_object, broadcast_parameters
(before the first forward too) and DistributedTrainer(compression=,
gradient_predivide_factor=).

Configuration: `mx.kv.create("reducer")` takes its client from `init(...)`
when that was called, else from the environment (REDUCER_ADDRESSES,
REDUCER_JOB, REDUCER_RANK / REDUCER_WORLD_SIZE or DMLC_WORKER_ID /
DMLC_NUM_WORKER, ...; see reducer_client.env). All stores of a process share
that one client, so their per-key round counters agree. `Reducer(op=...,
fusion_bytes=..., backend=...)` builds a store with other settings.

Sum or mean: `kv.pushpull` sums over devices and workers, as MXNet's own
dist_sync store does, so a gluon.Trainer moved from "dist_sync" to "reducer"
trains the same: call `trainer.step(world_size * b)` with b = this worker's
batch size (all its devices together) for the update of one process on the
global batch. `DistributedTrainer` averages (as Horovod's): there
`trainer.step(b)` gives that update. `Reducer(op="mean")` is an averaging
store for the plain Trainer.

Initial weights: the Trainer broadcasts rank 0's weights at its first
step(), after that step's gradients were computed on each worker's own
weights. Start every worker from the same weights (same seed), or broadcast
them first: `kv.broadcast(keys, [p.data() for p in params], root_rank=0)`.

The Trainer updates the weights locally (is_capable("optimizer") is False),
so optimizer state never leaves the worker and needs no checkpoint support
from the store.

Transfers: pushpull and broadcast block until `out` holds the result (the
Trainer reads the gradients right after). A call with a list of keys sends all
of them at once; keys smaller than `fusion_bytes` are packed into shared
buffers (per dtype, in call order, so every worker packs the same way) and
each buffer travels as one allreduce, reduced in place in a host buffer the
store keeps (_buffers). `DistributedTrainer` is a gluon.Trainer that hands
the store all its gradients in one such call per step; the plain Trainer
calls pushpull once per parameter.
"""

from reducer_client.compression import Compression
from reducer_client.errors import ReducerError
from reducer_client.horovod import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from reducer_client.mxnet._basics import basics as _basics
from reducer_client.mxnet.compat import (
    DistributedTrainer,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_parameters,
    grouped_allreduce,
    grouped_allreduce_,
)
from reducer_client.mxnet.kvstore import DEFAULT_FUSION_BYTES, Reducer, set_error_feedback
from reducer_client.process import shim_basics

# Bound once in reducer_client.process, as Horovod binds its basics into each
# framework module; init also says (once, on rank 0) where the default wire
# differs from Horovod's.
(init, shutdown, is_initialized, client, rank, size, local_rank, local_size,
 cross_rank, cross_size, is_homogeneous) = shim_basics(_basics)

__all__ = ["Reducer", "DistributedTrainer", "DEFAULT_FUSION_BYTES", "ReducerError", "init",
           "shutdown", "is_initialized", "client", "rank", "size", "local_rank",
           "local_size", "cross_rank", "cross_size", "is_homogeneous", "Compression",
           "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_",
           "grouped_allreduce", "grouped_allreduce_", "allgather", "broadcast", "broadcast_",
           "broadcast_object", "allgather_object", "broadcast_parameters", "mpi_built",
           "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
           "set_error_feedback"]
