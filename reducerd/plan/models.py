"""Models the planner knows by name: their trainable parameter counts.

Counts are exact for the reference architectures, derived from their shapes
(every weight and bias, tied weights once):
- resnet50: torchvision's ResNet-50 (ImageNet, 1000 classes), 25,557,032.
- resnet101: torchvision's ResNet-101, 44,549,160.
- vgg16: torchvision's VGG-16, 138,357,544.
- bert-base / bert-large: BERT pre-training models (BertForPreTraining:
  encoder, pooler, the masked-LM head with its decoder tied to the word
  embeddings, the next-sentence head), vocabulary 30,522, 512 positions.
  bert-large (24 layers, hidden 1024, FFN 4096): 335,141,888 in the encoder
  with pooler plus 1,084,220 in the heads = 336,226,108 (about 336M; "340M"
  in the BERT paper), 672.5 MB of float16 gradient per step.
- gpt2: GPT-2 small (12 layers, hidden 768, 1,024 positions, LM head tied),
  124,439,808.
"""

from __future__ import annotations

from typing import NamedTuple

from reducerd.plan.units import parse_params

__all__ = ["MODELS", "Model", "resolve_model"]


class Model(NamedTuple):
    name: str
    params: int


MODELS: dict[str, int] = {
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "vgg16": 138_357_544,
    "bert-base": 110_106_428,
    "bert-large": 336_226_108,
    "gpt2": 124_439_808,
}


def resolve_model(text: str) -> Model:
    """A known name (case and '_' vs '-' ignored) or a size -> Model; ValueError otherwise."""
    name = text.strip().lower().replace("_", "-")
    if name in MODELS:
        return Model(name, MODELS[name])
    params = parse_params(text)
    if params is None:
        raise ValueError(f"model {text!r}: not a known name ({', '.join(MODELS)}) nor a "
                         "size (e.g. '340M params', or 1.3G bytes of float32 gradient)")
    return Model(text.strip(), params)
