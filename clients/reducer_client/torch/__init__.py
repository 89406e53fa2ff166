"""PyTorch shim: a Horovod-shaped API over the reducer_client core.

    import reducer_client.torch as rt
    rt.init()                                   # or rt.init(**ReducerClient keyword arguments)
    ddp_model.register_comm_hook(state=rt.client(), hook=rt.allreduce_hook)
    # several DDP models on one client: state=rt.HookState() for each (hooks.py)
    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op="mean")
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(opt, root_rank=0)
    t = rt.allreduce(tensor, name="x", op="mean")
    rt.rank(), rt.size(), rt.local_rank(), rt.local_size(), rt.shutdown()
    rt.set_error_feedback(False)                # on by default for the 8-bit wires

Importing this package also registers the torch.distributed backend
"reducer" (backend.py): dist.init_process_group("reducer") under torchrun,
then DDP, dist.all_reduce, ... through the daemons, with no other change.

Horovod's names, with Horovod's meaning (porting is an import change):
Compression, Average / Sum (Adasum, Min, Max, Product refused), allreduce
(differentiable; average=, compression=, prescale / postscale), allreduce_,
allreduce_async(_), grouped_allreduce(_/_async/_async_), allgather(_async),
allgather_object, broadcast(_/_async/_async_), poll, synchronize, barrier,
join, cross_rank, cross_size, the *_built / *_enabled queries,
DistributedOptimizer(compression=, gradient_predivide_factor=, ...) and
elastic (run, TorchState, ObjectState).

This package only converts tensors to and from NumPy and plugs into
PyTorch's hook points; chunking, streams, retries and timeouts are the core's
(reducer_client.api.Reducer is all it uses). Failures raise
reducer_client.ReducerError.
"""

from reducer_client.errors import ReducerError
from reducer_client.horovod import (
    NOT_SUPPORTED,
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
    not_supported,
    rocm_built,
)
from reducer_client.process import shim_basics
from reducer_client.torch import (
    _distributed,  # noqa: F401 - registers the "reducer" backend
    elastic,
)
from reducer_client.torch._basics import basics as _basics
from reducer_client.torch._tensors import set_error_feedback
from reducer_client.torch.broadcasts import (
    allgather,
    allgather_async,
    allgather_object,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
)
from reducer_client.torch.collectives import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    global_process_set,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    synchronize,
)
from reducer_client.torch.compat import (
    Compression,
    DistributedOptimizer,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from reducer_client.torch.hooks import HookState, allreduce_hook
from reducer_client.torch.join import Join, join
from reducer_client.torch.optimizer import DEFAULT_BUCKET_BYTES

# Bound once in reducer_client.process, as Horovod binds its basics into each
# framework module; init also says (once, on rank 0) where the default wire
# differs from Horovod's.
(init, shutdown, is_initialized, client, rank, size, local_rank, local_size,
 cross_rank, cross_size, is_homogeneous) = shim_basics(_basics)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Max",
    "Min",
    "Product",
    "ReducerError",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "grouped_allgather",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "allreduce_hook",
    "HookState",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "client",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "Join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "rocm_built",
    "set_error_feedback",
    "shutdown",
    "size",
    "synchronize",
]

# Horovod's alltoall, reducescatter and process sets: NotImplementedError saying why.
globals().update({_name: not_supported(_name) for _name in NOT_SUPPORTED})
__all__ += list(NOT_SUPPORTED)
