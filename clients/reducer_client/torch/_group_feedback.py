"""Error feedback of a "reducer" process group on an 8-bit wire (reducer_client.feedback).

A c10d all_reduce names no bucket, so a tensor is its own key: the tensor
that the group reduces again (DDP's bucket buffers, reduced every step into
the same tensor) has what the wire dropped from its last contribution added
to this one, so over the steps the rounding does not add up (EF-SGD, as the
DDP hook and the DistributedOptimizer do it). A tensor's first all_reduce
goes out as it is. A residual lives as long as its tensor (weakly keyed:
when DDP rebuilds its buckets after the first step, the old buffers' residuals
go with them), so the memory is one float32 copy of each live tensor
reduced on the wire.

Only what the shim reduces in place from the tensor's own memory is fed
back: a contiguous CPU float16, float32 or float64 tensor, alone in its
all_reduce. bfloat16 and CUDA tensors, and several tensors in one call, go
out without it. Under node-local aggregation the node's slice senders
round, not this worker, so the group leaves feedback off there.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from reducer_client.api import Reducer
from reducer_client.feedback import FEEDBACK_WIRES, ErrorFeedback
from reducer_client.torch._tensors import numpy_view

__all__ = ["GroupFeedback", "group_feedback"]


class GroupFeedback:
    """Residuals per tensor for one process group's wire dtype."""

    def __init__(self, wire_dtype: str) -> None:
        self.wire_dtype = wire_dtype
        self._feedback = ErrorFeedback(wire_dtype)
        # _lock guards _keys; taken by whoever calls all_reduce (the training
        # thread, DDP's autograd threads).
        self._lock = threading.Lock()
        self._keys: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.tensors_seen = 0  # how many tensors have had a residual, ever

    def compensate(self, tensor: torch.Tensor) -> None:
        """Add the tensor's residual to it, in place, and keep what the wire
        will drop from it now (nothing for a tensor outside the module doc's)."""
        view = numpy_view(tensor)
        if view is None:
            return
        with self._lock:
            key = self._keys.get(tensor)
            if key is None:
                key = self._keys[tensor] = f"tensor/{self.tensors_seen}"
                self.tensors_seen += 1
                weakref.finalize(tensor, self._feedback.forget, key)
        self._feedback.apply(key, view.reshape(-1))

    def __len__(self) -> int:
        """How many tensors have a residual now."""
        with self._lock:
            return len(self._keys)


def group_feedback(reducer: Reducer, wire_dtype: str | None,
                   enabled: bool | None) -> GroupFeedback | None:
    """The group's feedback: `enabled` None is on for an 8-bit wire; True on an
    8-bit wire only; off (None) under node-local aggregation (module doc)."""
    wire = wire_dtype or getattr(reducer, "wire_dtype", None)
    inner = getattr(reducer, "inner", reducer)  # a dist.new_group's keys: its client's
    if enabled is False or wire not in FEEDBACK_WIRES:
        if enabled and wire not in FEEDBACK_WIRES:
            eight_bit = ", ".join(sorted(FEEDBACK_WIRES))
            raise ValueError(f"ReducerOptions(error_feedback=True) on the {wire} wire: error "
                             f"feedback is for the 8-bit wires ({eight_bit})")
        return None
    if getattr(inner, "_node", None) is not None:
        if enabled:
            raise ValueError("ReducerOptions(error_feedback=True) under node-local aggregation: "
                             "the node's slice senders round, not this worker; use the DDP "
                             "hook (rt.allreduce_hook), whose feedback follows them")
        return None
    return GroupFeedback(wire)
