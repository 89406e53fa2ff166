"""PyTorch shim: a Horovod-shaped API over the reducer_client core.

    import reducer_client.torch as rt
    rt.init()                                   # or rt.init(**ReducerClient keyword arguments)
    ddp_model.register_comm_hook(state=rt.client(), hook=rt.allreduce_hook)
    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op="mean")
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(opt, root_rank=0)
    t = rt.allreduce(tensor, name="x", op="mean")
    rt.rank(), rt.size(), rt.local_rank(), rt.local_size(), rt.shutdown()
    rt.set_error_feedback(False)                # on by default for the 8-bit wires

This package only converts tensors to and from NumPy and plugs into
PyTorch's hook points; chunking, streams, retries and timeouts are the core's
(reducer_client.api.Reducer is all it uses). Failures raise
reducer_client.ReducerError.
"""

from reducer_client.errors import ReducerError
from reducer_client.torch._basics import basics as _basics
from reducer_client.torch._tensors import set_error_feedback
from reducer_client.torch.functions import (
    allreduce,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from reducer_client.torch.hooks import allreduce_hook
from reducer_client.torch.optimizer import DEFAULT_BUCKET_BYTES, DistributedOptimizer

# Bound once in reducer_client.process, as Horovod binds its basics.
init = _basics.init
shutdown = _basics.shutdown
is_initialized = _basics.is_initialized
client = _basics.client
rank = _basics.rank
size = _basics.size
local_rank = _basics.local_rank
local_size = _basics.local_size

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
    "local_rank",
    "local_size",
    "rank",
    "set_error_feedback",
    "shutdown",
    "size",
]
