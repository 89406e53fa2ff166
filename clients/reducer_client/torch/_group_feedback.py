"""Error feedback of a "reducer" process group on an 8-bit wire (reducer_client.feedback).

A c10d all_reduce names no bucket, so a tensor is its own key: the tensor
that the group reduces again (DDP's bucket buffers, reduced every step into
the same tensor) has what the wire dropped from its last contribution added
to this one, so over the steps the rounding does not add up (EF-SGD, as the
DDP hook and the DistributedOptimizer do it). A tensor's first all_reduce
goes out as it is. A residual lives as long as its tensor (weakly keyed:
when DDP rebuilds its buckets after the first step, the old buffers' residuals
go with them), so the memory is one float32 copy of each live tensor
reduced on the wire, and for a tensor the shim cannot reduce in its own
memory (bfloat16, CUDA, not contiguous) one float32 host copy more, which
is what goes on the wire and is copied back. Several tensors in one call
(grouped into one flat float32 array) go out without feedback. Under
node-local aggregation the node's slice senders round, not this worker, so
the group leaves feedback off there.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from reducer_client.api import Reducer
from reducer_client.feedback import FEEDBACK_WIRES, ErrorFeedback
from reducer_client.torch._tensors import numpy_view

__all__ = ["GroupFeedback", "group_feedback"]


@dataclass
class _Entry:
    key: str  # the residual's key in the ErrorFeedback
    host: torch.Tensor | None = None  # the float32 host copy, for a tensor staged through one


class GroupFeedback:
    """Residuals per tensor for one process group's wire dtype."""

    def __init__(self, wire_dtype: str) -> None:
        self.wire_dtype = wire_dtype
        self._feedback = ErrorFeedback(wire_dtype)
        # _lock guards _tensors and tensors_seen; taken by whoever calls all_reduce (the training
        # thread, DDP's autograd threads).
        self._lock = threading.Lock()
        self._tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> _Entry
        self.tensors_seen = 0  # how many tensors have had a residual, ever

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor to send in tensor's place, with its residual added; the
        residual of what the wire will drop from it now is kept.

        `tensor` itself (changed in place) where the shim reduces in its own
        memory: a contiguous CPU float16 / float32 / float64 tensor. Otherwise
        (bfloat16, CUDA, not contiguous) a float32 host copy, kept per tensor,
        which the caller reduces and copies back into the tensor.
        """
        view = numpy_view(tensor)
        with self._lock:
            entry = self._tensors.get(tensor)
            if entry is None:
                entry = self._tensors[tensor] = _Entry(f"tensor/{self.tensors_seen}")
                self.tensors_seen += 1
                weakref.finalize(tensor, self._feedback.forget, entry.key)
        host = None
        if view is None:
            if entry.host is None or entry.host.numel() != tensor.numel():
                entry.host = torch.empty(tensor.numel(), dtype=torch.float32)
            host = entry.host
            host.copy_(tensor.detach().reshape(-1))
            view = host.numpy()
        self._feedback.apply(entry.key, view.reshape(-1))
        return tensor if host is None else host

    def __len__(self) -> int:
        """How many tensors have a residual now."""
        with self._lock:
            return len(self._tensors)


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
