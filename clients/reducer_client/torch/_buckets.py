"""The DistributedOptimizer's buckets: parameters reduced together under one key."""

from __future__ import annotations

import itertools
from concurrent.futures import Future

import numpy as np
import torch
from reducer_wire import dtypes

from reducer_client.torch._tensors import flat_dtype

__all__ = ["Bucket", "plan_buckets"]

# The largest block of any wire dtype (int8's): a bucket's flags start on one.
_FLAG_ALIGN = max(dtypes.wire_block(value) for value in dtypes.WIRE_DTYPES.values())


class Bucket:
    """Parameters reduced together as one flat tensor under one key.

    The flat tensor holds the gradients, zeros up to the next whole int8
    block, then one presence flag per parameter (1 where this rank had a
    gradient). The flags start a block of their own so that int8's scale
    per block (reducer_wire.quant) never covers a flag and a gradient
    together: a flag's 1 would set the scale of the bucket's last gradients,
    often 1000 times smaller, and round them away. It is allocated at the
    first step and reduced into itself on CPU (through its key's pinned host
    buffer on CUDA), so later steps allocate nothing for the reduction.
    """

    def __init__(self, key: str, params: list[torch.Tensor], names: list[str]) -> None:
        self.key, self.params, self.names = key, params, names
        self.numels = [p.numel() for p in params]
        self.offsets = list(itertools.accumulate(self.numels, initial=0))[:-1]
        self.numel = sum(self.numels)
        self.flags_at = -(-self.numel // _FLAG_ALIGN) * _FLAG_ALIGN
        self.flat: torch.Tensor | None = None
        # Step state, guarded by _GradientReducer._lock.
        self.ready = 0
        self.launched = False
        self.future: Future[np.ndarray] | None = None

    def fill_flat(self) -> torch.Tensor:
        """Copy the gradients (zeros where missing) and presence flags into the flat tensor."""
        first = self.params[0]
        if self.flat is None:
            self.flat = torch.empty(self.flags_at + len(self.params), device=first.device,
                                    dtype=flat_dtype(first.dtype))
        # The padding up to the flags' block, every step: it shares an int8
        # block with the last gradients, and a block holding Inf or NaN comes
        # back NaN whole, so once reduced into itself it would poison every
        # later step's block (a loss scaler would then skip every step).
        self.flat[self.numel:self.flags_at].zero_()
        # Device-side fills only: a host-to-device copy of the flags would
        # wait for the stream and so for the rest of backward.
        flags = self.flat[self.flags_at:]
        flags.fill_(1.0)
        for index, (param, name, offset, numel) in enumerate(zip(
                self.params, self.names, self.offsets, self.numels, strict=True)):
            grad = param.grad
            target = self.flat[offset:offset + numel]
            if grad is None:
                target.zero_()
                flags[index].fill_(0.0)
            elif grad.is_sparse:
                raise ValueError(f"parameter {name!r} has a sparse gradient: not supported")
            else:
                target.copy_(grad.reshape(-1))
        return self.flat

    def write_back(self, result: np.ndarray) -> None:
        """Set each parameter's .grad from the reduced flat tensor (already in self.flat)."""
        assert self.flat is not None
        present = result[self.flags_at:] > 0  # read on the host: no device sync
        for param, offset, numel, had_grad in zip(self.params, self.offsets, self.numels,
                                                  present, strict=True):
            if not had_grad:
                continue  # no rank had a gradient: leave .grad alone (None)
            reduced = self.flat[offset:offset + numel].view_as(param)
            if param.grad is None:
                param.grad = reduced.to(param.dtype, copy=True)
            else:
                param.grad.copy_(reduced)


def plan_buckets(named_params: list[tuple[str, torch.Tensor]], bucket_bytes: int,
                  prefix: str) -> list[Bucket]:
    """Pack parameters, in reverse order, into buckets of one device and dtype each."""
    open_buckets: dict[tuple[torch.device, torch.dtype], tuple[list, list, int]] = {}
    closed: list[tuple[list, list]] = []
    for name, param in reversed(named_params):
        group = (param.device, param.dtype)
        params, names, nbytes = open_buckets.get(group, ([], [], 0))
        param_bytes = param.numel() * param.element_size()
        if params and nbytes + param_bytes > bucket_bytes:
            closed.append((params, names))
            params, names, nbytes = [], [], 0
        params.append(param)
        names.append(name)
        open_buckets[group] = (params, names, nbytes + param_bytes)
    closed.extend((params, names) for params, names, _ in open_buckets.values())
    return [Bucket(f"{prefix}/bucket.{i}", params, names)
            for i, (params, names) in enumerate(closed)]
