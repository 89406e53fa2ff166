"""Model shapes for the training bench: real parameter tensors and FLOPs per layer.

Pure Python (no torch): the architectures' parameter shapes in registration
order (which is forward order; backward produces gradients in reverse), and
for each layer the floating-point operations of its forward pass per sample.

Counted: the multiply-adds of convolutions and linear layers (2 FLOPs each),
and BERT's two attention matmuls (scores and context). Not counted:
elementwise work (batch norm, layer norm, activations, residual adds,
softmax), pooling, embedding lookups, the loss; their cost is folded into the
accelerator's utilisation (accelerator.py). Backward is taken as twice the
forward FLOPs of each layer (gradients with respect to inputs and weights).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["ParamSpec", "LayerSpec", "ModelSpec", "resnet50", "bert_large", "tiny",
           "MODELS", "model_spec"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name in the architecture and its shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LayerSpec:
    """A unit of modeled compute: its parameters and its forward FLOPs per sample."""

    path: str
    params: tuple[ParamSpec, ...]
    forward_flop_per_sample: float


@dataclass(frozen=True)
class ModelSpec:
    """A model's layers in forward order, with what a sample is and defaults."""

    name: str
    layers: tuple[LayerSpec, ...]
    sample: str  # "images", "sequences"
    default_batch: int  # per accelerator
    default_utilisation: float  # of the accelerator's peak (accelerator.py)
    description: str

    @property
    def params(self) -> list[ParamSpec]:
        return [p for layer in self.layers for p in layer.params]

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def forward_flop_per_sample(self) -> float:
        return sum(layer.forward_flop_per_sample for layer in self.layers)


# -- ResNet-50 (torchvision's resnet50: v1.5, stride on the 3x3 conv) ---------


def _conv_bn(path: str, bn: str, cin: int, cout: int, k: int, out_hw: int) -> LayerSpec:
    """A bias-free k x k convolution and its batch norm, one layer of compute."""
    params = (ParamSpec(f"{path}.weight", (cout, cin, k, k)),
              ParamSpec(f"{bn}.weight", (cout,)), ParamSpec(f"{bn}.bias", (cout,)))
    return LayerSpec(path, params, 2.0 * k * k * cin * cout * out_hw * out_hw)


def _resnet50_layers() -> Iterator[LayerSpec]:
    yield _conv_bn("conv1", "bn1", 3, 64, 7, 112)  # 224 -> 112, then max-pool -> 56
    inplanes, hw = 64, 56
    for stage, (planes, blocks, stride) in enumerate(
            ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), start=1):
        for block in range(blocks):
            s = stride if block == 0 else 1
            out_hw = hw // s
            p = f"layer{stage}.{block}"
            yield _conv_bn(f"{p}.conv1", f"{p}.bn1", inplanes, planes, 1, hw)
            yield _conv_bn(f"{p}.conv2", f"{p}.bn2", planes, planes, 3, out_hw)
            yield _conv_bn(f"{p}.conv3", f"{p}.bn3", planes, planes * 4, 1, out_hw)
            if block == 0:
                yield _conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", inplanes,
                               planes * 4, 1, out_hw)
            inplanes, hw = planes * 4, out_hw
    yield LayerSpec("fc", (ParamSpec("fc.weight", (1000, 2048)), ParamSpec("fc.bias", (1000,))),
                    2.0 * 2048 * 1000)


def resnet50() -> ModelSpec:
    """ResNet-50 on 224 x 224 images: 25,557,032 parameters, 8.2 GFLOP forward."""
    return ModelSpec(
        "resnet50", tuple(_resnet50_layers()), "images", default_batch=64,
        default_utilisation=0.25,
        description="torchvision resnet50 (v1.5) parameters, 224x224 images; "
                    "batch-norm running statistics are buffers, not gradients, and left out")


# -- BERT-large (24 layers, hidden 1024, 16 heads, intermediate 4096) ----------

_VOCAB, _MAX_POSITIONS, _TYPES = 30522, 512, 2


def _linear(name: str, cin: int, cout: int) -> tuple[ParamSpec, ParamSpec]:
    return ParamSpec(f"{name}.weight", (cout, cin)), ParamSpec(f"{name}.bias", (cout,))


def _layer_norm(name: str, width: int) -> tuple[ParamSpec, ParamSpec]:
    return ParamSpec(f"{name}.weight", (width,)), ParamSpec(f"{name}.bias", (width,))


def _bert_layers(layers: int, hidden: int, intermediate: int, seq_len: int,
                 ) -> Iterator[LayerSpec]:
    h, f, s = hidden, intermediate, seq_len
    yield LayerSpec("embeddings", (
        ParamSpec("embeddings.word_embeddings.weight", (_VOCAB, h)),
        ParamSpec("embeddings.position_embeddings.weight", (_MAX_POSITIONS, h)),
        ParamSpec("embeddings.token_type_embeddings.weight", (_TYPES, h)),
        *_layer_norm("embeddings.LayerNorm", h)), 0.0)  # lookups: no FLOPs counted
    for i in range(layers):
        p = f"encoder.layer.{i}"
        qkv = (*_linear(f"{p}.attention.self.query", h, h),
               *_linear(f"{p}.attention.self.key", h, h),
               *_linear(f"{p}.attention.self.value", h, h))
        # Per sequence: Q, K, V projections, then scores (s x s x h) and context.
        yield LayerSpec(f"{p}.attention.self", qkv, 2.0 * s * 3 * h * h + 2 * 2.0 * s * s * h)
        yield LayerSpec(f"{p}.attention.output",
                        (*_linear(f"{p}.attention.output.dense", h, h),
                         *_layer_norm(f"{p}.attention.output.LayerNorm", h)), 2.0 * s * h * h)
        yield LayerSpec(f"{p}.intermediate", _linear(f"{p}.intermediate.dense", h, f),
                        2.0 * s * h * f)
        yield LayerSpec(f"{p}.output", (*_linear(f"{p}.output.dense", f, h),
                                        *_layer_norm(f"{p}.output.LayerNorm", h)),
                        2.0 * s * f * h)
    yield LayerSpec("pooler", _linear("pooler.dense", h, h), 2.0 * h * h)  # [CLS] only


def bert_large(seq_len: int = 128) -> ModelSpec:
    """BERT-large (embeddings, 24 encoder layers, pooler): 335,141,888 parameters."""
    return ModelSpec(
        "bert-large", tuple(_bert_layers(24, 1024, 4096, seq_len)), "sequences",
        default_batch=64, default_utilisation=0.40,
        description=f"BERT-large (uncased vocabulary) embeddings, encoder and pooler, "
                    f"sequences of {seq_len} tokens; the pre-training heads (tied "
                    "decoder, NSP) are left out")


def tiny() -> ModelSpec:
    """Four small linear layers, for tests: 2,720 parameters."""
    layers = tuple(LayerSpec(f"fc{i}", _linear(f"fc{i}", 16, 32 if i % 2 == 0 else 48),
                             2.0e9) for i in range(4))
    return ModelSpec("tiny", layers, "samples", default_batch=8, default_utilisation=0.40,
                     description="four linear layers (tests)")


MODELS = {"resnet50": resnet50, "bert-large": bert_large, "tiny": tiny}


def model_spec(name: str) -> ModelSpec:
    """The spec of a model by name; ValueError naming the choices otherwise."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"model {name!r}: one of {', '.join(MODELS)}") from None
