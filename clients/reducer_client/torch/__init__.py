"""PyTorch shim: a Horovod-shaped API over the reducer_client core.

    import reducer_client.torch as rt
    rt.init()                                   # or rt.init(**ReducerClient keyword arguments)
    ddp_model.register_comm_hook(state=rt.client(), hook=rt.allreduce_hook)
    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op="mean")
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(opt, root_rank=0)
    t = rt.allreduce(tensor, name="x", op="mean")

This package only converts tensors to and from NumPy and plugs into
PyTorch's hook points; chunking, streams, retries and timeouts are the core's
(reducer_client.api.Reducer is all it uses). Failures raise
reducer_client.ReducerError.
"""

from reducer_client.errors import ReducerError
from reducer_client.torch._process import client, init, is_initialized, rank, shutdown, size
from reducer_client.torch.functions import (
    allreduce,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from reducer_client.torch.hooks import allreduce_hook
from reducer_client.torch.optimizer import DEFAULT_BUCKET_BYTES, DistributedOptimizer

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DistributedOptimizer",
    "ReducerError",
    "allreduce",
    "allreduce_hook",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "client",
    "init",
    "is_initialized",
    "rank",
    "shutdown",
    "size",
]
