"""Named settings for `reducerd plan --preset`, with what their original reported.

bert-large-256 is the setting the project's design card names: BERT-large
pre-training on 256 nodes of 8 V100 GPUs (2,048 GPUs), 100 Gbit/s links,
float16 gradients, reported as 62 minutes to train at 85 % scaling
efficiency. The original gives no step count or step time, so the compute
per step is derived, and says how: LAMB's schedule for BERT-large at 64K/32K
batches (You et al., 2019: 7,038 steps at sequence 128, then 1,561 at 512,
8,599 in all) over 62 minutes is 0.433 s per step; at 85 % efficiency 0.85
of that, 0.368 s, is the compute a step would take without communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Preset", "PRESETS"]

_BERT_STEPS = 7_038 + 1_561
_BERT_MINUTES = 62.0
_BERT_EFFICIENCY = 0.85


@dataclass(frozen=True)
class Preset:
    description: str
    flags: dict[str, Any]  # argparse destinations -> values; explicit flags win
    reported: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "bert-large-256": Preset(
        description="BERT-large pre-training, 256 nodes x 8 V100, 100 Gbit/s, float16",
        flags={"model": "bert-large", "workers": 256, "gpus_per_node": 8,
               "link": "100gbit", "wire_dtype": "float16", "daemon_cores": "fill",
               "steps": _BERT_STEPS,
               "compute_time": round(_BERT_MINUTES * 60 / _BERT_STEPS * _BERT_EFFICIENCY, 4)},
        reported={"gpus": 2048, "minutes_to_train": _BERT_MINUTES,
                  "scaling_efficiency": _BERT_EFFICIENCY,
                  "steps_assumed": _BERT_STEPS,
                  "compute_time_derivation": "62 min / 8,599 LAMB steps x 0.85"}),
}
