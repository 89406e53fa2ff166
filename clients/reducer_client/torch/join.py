"""join(): a rank out of data keeps the others going (Horovod's hvd.join()).

    for batch in my_batches:          # ranks may have different numbers of batches
        ...; opt.step()
    last = rt.join()

While joined, the rank takes part in every collective the others still make
(reducer_client.collectives.join): an allreduce gets zeros from it and its
"mean" divides by the ranks that contributed, a DistributedOptimizer step
(from rt.DistributedOptimizer) gets zeros in every bucket, with no gradient
flagged, so each parameter's gradient is the average over the ranks that had
one. Once every rank has joined, the optimizers' parameters and state are
copied from the rank that joined last (it has taken every step), so all
ranks end with the same model, and join returns that rank.

The DDP comm hook (allreduce_hook) follows join too: a joined rank sends
zeros for every bucket the others reduce, each bucket's mean is over the
ranks that had a batch, and at the end the parameters the hook reduced are
copied from the last joiner (see hooks.py for what DDP itself needs: a
rank joins after its second step, broadcast_buffers=False for a module with
buffers). The state of a plain torch optimizer beside DDP is not copied (as
with PyTorch's Join: only the model).

The ranks still training must make a collective call (an optimizer step, an
allreduce, a DDP bucket) within the client's timeout of each other; a joined
rank waits that long for each.
"""

from __future__ import annotations

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.torch._basics import resolve
from reducer_client.torch.compat import joinable_optimizers
from reducer_client.torch.functions import broadcast_optimizer_state, broadcast_parameters
from reducer_client.torch.hooks import hook_parameters

__all__ = ["join"]


def join(device: int = -1, *, reducer: Reducer | None = None) -> int:
    """Follow the other ranks' collectives until every rank has joined; the last one.

    device: Horovod's device for its zero tensors; zeros are made on the
    host here, so it is accepted and unused.
    """
    reducer = resolve(reducer)
    last = coll.join(reducer)
    for index, optimizer in enumerate(joinable_optimizers(reducer)):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        broadcast_parameters([(f"join.{index}.{i}", p) for i, p in enumerate(params)],
                             root_rank=last, reducer=reducer)
        broadcast_optimizer_state(optimizer, root_rank=last, reducer=reducer)
    _sync_hooked(reducer, last)
    return last


def _sync_hooked(reducer: Reducer, last: int) -> None:
    """Copy the DDP hook's parameters from `last`, after checking every rank has
    the same ones (a rank that never ran the hook, or saw DDP's buckets before
    their rebuild, fails with the others, naming the ranks)."""
    hooked = hook_parameters(reducer)
    shapes = ";".join(f"{tuple(p.shape)}{p.dtype}" for p in hooked)
    call = coll.Call(coll.CHECK, "join (DDP hook parameters)", "float32", (len(hooked),), 0,
                     root_rank=last, signature=shapes)
    coll.check(coll.control_async(reducer, call).result(), call)
    broadcast_parameters([(f"join.ddp.{i}", p) for i, p in enumerate(hooked)],
                         root_rank=last, reducer=reducer)
