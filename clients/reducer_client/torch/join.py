"""join(): a rank out of data keeps the others going (Horovod's hvd.join()).

    for batch in my_batches:          # ranks may have different numbers of batches
        ...; opt.step()
    last = rt.join()

    with rt.Join() as joined:         # the same for DDP's comm hook (rt.allreduce_hook)
        for batch in my_batches: ...
    joined.last

While joined, the rank takes part in every collective the others still make
(reducer_client.collectives.join): an allreduce gets zeros from it and its
"mean" divides by the ranks that contributed, a DistributedOptimizer step
(from rt.DistributedOptimizer) gets zeros in every bucket, with no gradient
flagged, so each parameter's gradient is the average over the ranks that had
one. Once every rank has joined, the optimizers' parameters and state are
copied from the rank that joined last (it has taken every step), so all
ranks end with the same model, and join returns that rank.

The DDP comm hook (allreduce_hook) follows join too, for ranks that train
inside Join() (opt-in, as PyTorch's Join: outside it a bucket pays no control
round, and a rank whose inputs run out early must not join): a joined rank sends
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
from reducer_client.torch.hooks import hook_parameters, joining_block

__all__ = ["join", "Join"]

class Join:
    """Uneven inputs with the DDP comm hook, the way PyTorch's Join context is:

        with rt.Join() as joined:           # on every rank
            for batch in my_batches:        # ranks may have different numbers
                ...; loss.backward(); opt.step()
        joined.last                         # the rank that joined last

    Inside it, each DDP bucket reduced by rt.allreduce_hook goes with a
    control round, so that a rank out of data, which joins on leaving the
    block (join() below), learns of every bucket the others still reduce.
    Outside it the hook sends the bucket alone: no rank pays the control
    round where inputs are even. enable=False: a plain block (no join).
    Leaving it by an exception does not join.
    """

    def __init__(self, *, reducer: Reducer | None = None, enable: bool = True) -> None:
        self._reducer = reducer
        self.enable = enable
        self.last: int | None = None

    def __enter__(self) -> Join:
        if self.enable:
            self._resolved = resolve(self._reducer)
            joining_block(self._resolved, True)
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if not self.enable:
            return
        try:
            if exc_type is None:
                self.last = join(reducer=self._resolved)
        finally:
            joining_block(self._resolved, False)


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
