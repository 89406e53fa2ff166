"""A model whose parameters are real and whose accelerator compute is modeled as time.

Each layer of a ModelSpec becomes a ModeledLayer holding that layer's
parameter tensors (the architecture's shapes, or 1-D and `byte_scale` times
smaller). Its forward pass is one autograd Function that waits the layer's
forward time; its backward waits the backward time, then produces the
layer's gradients, so autograd accumulates them layer by layer in backward
order and DDP's buckets and the DistributedOptimizer's hooks fire as they
would on an accelerator. The waits are sleeps: the CPUs stay free for the
network path, as they would beside a GPU. With `--device cuda` the
parameters live on the GPU and the waits are real GPU work (gpu.py).

The loss is a quadratic with a per-rank target: for a parameter p with
target scalar c, rank r's gradient is p - (r + 1) c, so the average over N
ranks is p - c (N + 1) / 2, which reference_step() computes in float64.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import torch

from reducerd.bench.train.config import scaled_numel
from reducerd.bench.train.specs import ModelSpec

__all__ = ["ComputeClock", "ModeledLayer", "ModeledModel", "build_model", "reference_step",
           "error_bound", "eight_bit_error_bound"]

_INIT_STD = 0.02  # BERT's initializer range; the values only need to be deterministic
_SEED = 1234


class ComputeClock:
    """Where modeled compute waits, and how long it actually waited.

    `enabled` False skips the waits (to time communication alone). The
    totals are read by the training loop between steps; `_lock` guards them
    (the waits run on the caller's thread in forward and on autograd's in
    backward).
    """

    def __init__(self) -> None:
        self.enabled = True
        self._lock = threading.Lock()
        self._waited_s = 0.0
        # How much longer than asked the waits so far took: a sleep wakes
        # late by ~0.1 ms, which over a hundred layers would add 10 ms a
        # step, so each wait is shortened by the lateness so far.
        self._late_s = 0.0
        self.backward_ends: list[float] = []  # perf_counter after each layer's backward

    def run(self, seconds: float) -> None:
        """Wait `seconds` (a layer's modeled compute)."""
        if not self.enabled or seconds <= 0:
            return
        start = time.perf_counter()
        with self._lock:
            due = seconds - self._late_s
        if due > 0:
            time.sleep(due)
        waited = time.perf_counter() - start
        with self._lock:
            self._late_s += waited - seconds
            self._waited_s += waited

    def backward_done(self) -> None:
        with self._lock:
            self.backward_ends.append(time.perf_counter())

    def take(self) -> tuple[float, list[float]]:
        """(seconds waited, backward end times) since the last take()."""
        with self._lock:
            waited, ends = self._waited_s, self.backward_ends
            self._waited_s, self.backward_ends = 0.0, []
        return waited, ends


class _Compute(torch.autograd.Function):
    """Identity on the activation token; waits, and yields the layer's gradients."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, layer: ModeledLayer, *params: torch.Tensor):
        layer.clock.run(layer.forward_cost)
        ctx.layer = layer
        return token.clone()

    @staticmethod
    def backward(ctx, grad_token: torch.Tensor):
        layer: ModeledLayer = ctx.layer
        layer.clock.run(layer.backward_cost)
        grads = layer.gradients()
        layer.clock.backward_done()
        return (grad_token, None, *grads)


class ModeledLayer(torch.nn.Module):
    """One layer: its parameters, its compute, its synthetic gradients.

    The costs are what `clock.run` takes: seconds for a ComputeClock, FLOPs
    for a GpuCompute (gpu.py).
    """

    def __init__(self, path: str, params: list[tuple[str, torch.nn.Parameter, float]],
                 forward_cost: float, backward_cost: float, clock: ComputeClock,
                 rank: int) -> None:
        super().__init__()
        self.path, self.forward_cost, self.backward_cost = path, forward_cost, backward_cost
        self.clock, self.rank = clock, rank
        self.targets: list[float] = []
        for name, param, target in params:
            self.register_parameter(name, param)
            self.targets.append(target)

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        return _Compute.apply(token, self, *self.parameters(recurse=False))

    def gradients(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [p.detach() - (self.rank + 1) * c
                    for p, c in zip(self.parameters(recurse=False), self.targets, strict=True)]


class ModeledModel(torch.nn.Module):
    """The layers in forward order; forward(token) runs them all."""

    def __init__(self, layers: list[ModeledLayer]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            token = layer(token)
        return token

    def modeled_layers(self) -> Iterator[ModeledLayer]:
        yield from self.layers  # type: ignore[misc]


def _target(index: int) -> float:
    # Distinct per tensor, so a gradient written into the wrong tensor shows.
    return 0.01 * (1 + index % 7)


def build_model(spec: ModelSpec, costs: list[tuple[float, float]], byte_scale: float,
                clock: ComputeClock, rank: int, device: str = "cpu") -> ModeledModel:
    """The spec's layers with deterministic initial values (the same on every rank).

    byte_scale 1 keeps the architecture's shapes; above 1 each tensor is 1-D
    with scaled_numel elements. `costs` are each layer's (forward, backward)
    for `clock.run`.
    """
    generator = torch.Generator().manual_seed(_SEED)
    layers, index = [], 0
    for layer_spec, (forward_cost, backward_cost) in zip(spec.layers, costs, strict=True):
        params = []
        for p in layer_spec.params:
            shape = p.shape if byte_scale == 1 else (scaled_numel(p.numel, byte_scale),)
            values = (torch.randn(shape, generator=generator) * _INIT_STD).to(device)
            # Parameter names cannot hold dots; the spec keeps the real path.
            params.append((p.name.rsplit(".", 2)[-2] + "_" + p.name.rsplit(".", 1)[-1]
                           + f"_{index}", torch.nn.Parameter(values), _target(index)))
            index += 1
        layers.append(ModeledLayer(layer_spec.path, params, forward_cost, backward_cost, clock,
                                   rank))
    return ModeledModel(layers)


def reference_step(model: ModeledModel, world_size: int, lr: float,
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(parameters after one SGD step, largest |rank gradient|) per tensor, in float64.

    Call before the step, on the initial parameters.
    """
    after, largest = [], []
    for layer in model.modeled_layers():
        for p, c in zip(layer.parameters(recurse=False), layer.targets, strict=True):
            p0 = p.detach().double().cpu().numpy().ravel()
            mean_grad = p0 - c * (world_size + 1) / 2
            after.append(p0 - lr * mean_grad)
            largest.append(np.maximum(np.abs(p0 - c), np.abs(p0 - world_size * c)))
    return after, largest


def error_bound(reference: np.ndarray, largest_grad: np.ndarray, lr: float, world_size: int,
                wire_unit_roundoff: float) -> np.ndarray:
    """Elementwise bound on |parameter after one step - float64 reference|
    for a 16- or 32-bit wire.

    The averaged gradient: each rank's gradient rounded to the wire dtype, at
    most world_size roundings of partial sums (Gloo's float16 ring adds in
    float16; reducerd adds in float32, tighter) and one of the mean: at most
    (world_size + 2) unit roundoffs of the largest rank gradient. Then the
    float32 update p - lr g: one rounding of lr g and one of the result.
    """
    return _after_update(reference, largest_grad, lr,
                         (world_size + 2) * wire_unit_roundoff * largest_grad)


# FP8's relative rounding (half an ulp of 1) and its subnormals' spacing.
_FP8_UNIT = {"fp8_e4m3": (2.0 ** -4, 2.0 ** -9), "fp8_e5m2": (2.0 ** -3, 2.0 ** -16)}


def eight_bit_error_bound(reference: np.ndarray, largest_grad: np.ndarray, lr: float,
                          world_size: int, wire: str, largest_anywhere: float) -> np.ndarray:
    """The same for an 8-bit wire: reducer_wire.quant.ERROR_BOUND_DOC's MEAN
    bound (docs/explanation/numerics.md) with every rank's gradient at most
    `largest_grad` in size here, and at most `largest_anywhere` (over every
    tensor and rank) in any int8 block, which may span tensors. Coarser than
    the per-block bound that tests/integration/test_quant_wire.py checks,
    and like it independent of the worker count but for float32's own
    rounding of the sum (g)."""
    f32 = 2.0 ** -24
    g = (world_size - 1) * f32 / (1 - (world_size - 1) * f32)
    if wire == "int8":
        e_in: np.ndarray | float = largest_anywhere / 254 * (1 + 2.0 ** -14) + 2.0 ** -142
        result_max = (largest_anywhere + e_in) * (1 + g) * (1 + f32)
        e_out: np.ndarray | float = result_max / 254 * (1 + 2.0 ** -14) + 2.0 ** -142
    elif wire in _FP8_UNIT:
        u, a = _FP8_UNIT[wire]
        e_in = u * largest_grad + a / 2
        e_out = u * (largest_grad + e_in) * (1 + g) * (1 + f32) + a / 2
    else:
        raise ValueError(f"{wire!r} is not an 8-bit wire dtype")
    mean = e_in + (g + f32 * (1 + g)) * (largest_grad + e_in) + e_out
    return _after_update(reference, largest_grad, lr, mean)


def _after_update(reference: np.ndarray, largest_grad: np.ndarray, lr: float,
                  mean_error: np.ndarray | float) -> np.ndarray:
    """The averaged gradient's error through the float32 update p - lr g."""
    f32 = 2.0 ** -24
    return (lr * mean_error
            + 2 * f32 * (np.abs(reference) + lr * (largest_grad + mean_error)) + 1e-30)
