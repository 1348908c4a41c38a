"""concertina_hf: data-centric adaptive pipeline parallelism for Hugging Face models.

Public names are imported lazily, so ``import concertina_hf.planning`` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "ConcertinaTrainingArguments": "concertina_hf.training.args",
    "LengthAwareCollator": "concertina_hf.training.collator",
    "ConcertinaTrainer": "concertina_hf.training.trainer",
    "ConcertinaSFTTrainer": "concertina_hf.integrations.trl",  # needs trl (extra [trl])
    "ConcertinaSFTConfig": "concertina_hf.integrations.trl",
    "Plan": "concertina_hf.planning",
    "CostModel": "concertina_hf.planning",
    "DeviceSpec": "concertina_hf.planning",
    "plan_step": "concertina_hf.planning",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'concertina_hf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
