"""What every rank of a test launch imports, imported once by the fork server that starts the ranks
(:func:`_helpers.start_ranks`): torch, transformers' models and Trainer, datasets, accelerate, peft
and the package. A rank forked from it starts in ~0.1 s instead of paying ~5 CPU-seconds of
imports on a 2-core machine.
"""

import accelerate  # noqa: F401
import datasets  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import transformers  # noqa: F401
from transformers import (  # noqa: F401
    AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, Qwen2Config, Trainer, TrainingArguments,
)

import concertina_hf  # noqa: F401
from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments  # noqa: F401

try:
    import peft  # noqa: F401
except ImportError:
    pass
