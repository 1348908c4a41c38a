"""The tiny composite (multimodal) model of the composite tests, and its ``Trainer`` reference.

A ``Gemma3ForConditionalGeneration``: a one-layer SigLIP vision tower, the projector, a 4-layer
Gemma3 text model (sliding and full attention layers, tied embeddings) on the 64-token vocabulary
of ``tests/_models.py``. The reference is ``Trainer`` on the composite object on text
(``DataCollatorWithFlattening``, eager attention), with the settings of :data:`_models.NO_SAVE`.
"""

from __future__ import annotations

import json
import os

import torch

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"] * 2)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4)


def tiny_composite():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_id=63,
                       boi_token_id=61, eoi_token_id=62)
    return Gemma3ForConditionalGeneration(cfg)


def saved_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (single file or shards), under its name in the files."""
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(os.path.join(directory, f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def composite_key(view_key: str) -> str:
    """The composite module's name of a tensor of its text view (``model.X``, ``lm_head.X``)."""
    return view_key if view_key.startswith("lm_head.") else "model.language_model." + view_key[len("model."):]


def trainer_reference(source: str, out: str) -> dict:
    """``Trainer`` on the composite loaded from ``source``: losses, gradient norms, final state."""
    from transformers import DataCollatorWithFlattening, Gemma3ForConditionalGeneration, Trainer, TrainingArguments

    from _models import NO_SAVE, losses_of, tiny_dataset

    model = Gemma3ForConditionalGeneration.from_pretrained(source, attn_implementation="eager")
    ref = Trainer(model=model, args=TrainingArguments(output_dir=out, **NO_SAVE), train_dataset=tiny_dataset(),
                  data_collator=DataCollatorWithFlattening())
    ref.train()
    return {"losses": losses_of(ref), "grad_norms": [h["grad_norm"] for h in ref.state.log_history if "loss" in h],
            "state": {k: v.detach().clone() for k, v in ref.model.state_dict().items()}}
