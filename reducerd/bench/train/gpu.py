"""Real accelerator compute for `reducerd bench --train MODEL --device cuda`.

Each layer's forward and backward run matrix products on the GPU whose FLOPs
are the layer's (the spec's FLOPs per sample x batch; backward twice the
forward), in bfloat16 on the tensor cores, on the current CUDA stream and
without waiting for them: autograd, DDP's buckets and the optimizer's hooks
run ahead of the GPU as they do in real training, so every reduction starts
with its gradients' kernels still queued, and the shims' staging copies must
be ordered after them. The parameters and gradients live on the GPU; the
gradients' values stay the synthetic ones of modeled.py, so the first step is
still checked against the float64 reference.

The time the GPU spent on these products is read from CUDA events between
steps (take()), when the step's work has been queued; waiting for those
events there does not delay the next step's compute.
"""

from __future__ import annotations

import torch

from reducerd.bench.train.modeled import ComputeClock

__all__ = ["GpuCompute", "WIDTH"]

# Products of (rows x WIDTH) by (WIDTH x WIDTH): 2 WIDTH^2 FLOPs per row, large
# enough to run near the tensor cores' peak, small enough to hit a layer's FLOPs
# within one row (33.6 MFLOP).
WIDTH = 4096
_MAX_ROWS = 8192  # rows per product: the workspace is 64 MiB + 32 MiB of bfloat16


class GpuCompute(ComputeClock):
    """Runs a layer's FLOPs on the GPU instead of waiting its modeled time.

    `enabled` False skips the work (communication alone); the backward end
    times are ComputeClock's. `_lock` (ComputeClock's) also guards the events
    (forward runs on the caller's thread, backward on autograd's).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        generator = torch.Generator(device).manual_seed(0)
        self._weight = torch.randn(WIDTH, WIDTH, device=device, dtype=torch.bfloat16,
                                   generator=generator) / WIDTH ** 0.5
        self._input = torch.randn(_MAX_ROWS, WIDTH, device=device, dtype=torch.bfloat16,
                                  generator=generator)
        self._output = torch.empty_like(self._input)

    def run(self, flops: float) -> None:
        """Queue `flops` of matrix products on the current stream."""
        rows = round(flops / (2 * WIDTH * WIDTH))
        if not self.enabled or rows <= 0:
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while rows > 0:
            take = min(rows, _MAX_ROWS)
            torch.mm(self._input[:take], self._weight, out=self._output[:take])
            rows -= take
        end.record()
        with self._lock:
            self._events.append((start, end))

    def take(self) -> tuple[float, list[float]]:
        """(seconds the GPU computed, backward end times) since the last take()."""
        _, ends = super().take()
        with self._lock:
            events, self._events = self._events, []
        if events:
            events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in events) / 1e3, ends
