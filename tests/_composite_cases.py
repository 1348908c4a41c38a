"""The tiny composite (multimodal) models of the composite tests, and their ``Trainer`` reference.

``gemma3``: a ``Gemma3ForConditionalGeneration``, a one-layer SigLIP vision tower, the projector, a
4-layer Gemma3 text model (sliding and full attention layers, tied embeddings) on the 64-token
vocabulary of ``tests/_models.py``; ``mistral3`` the same way (a one-layer Pixtral tower, a
Mistral text model, tied embeddings); ``qwen3_5`` (a one-layer vision tower, a Qwen3.5 text model
of Gated DeltaNet and attention layers); ``llama4`` (a one-layer Llama 4 vision tower, the
projector, :data:`LLAMA4_TEXT`); ``gemma4`` (a one-layer Gemma 4 vision tower, :data:`GEMMA4_TEXT`: full
layers of twice the sliding layers' head size, per-layer inputs). The reference is ``Trainer`` on the composite object on text
(``DataCollatorWithFlattening``, eager attention), with :data:`SETTINGS`: the sequences in dataset
order, since Trainer's random order depends on what consumed the global random stream before it
(building a model may). Qwen3.5's composite class tells ``Trainer`` it takes no loss keywords
(``accepts_loss_kwargs = False``: Trainer then averages each micro-batch's mean loss); the
reference is Trainer's token-weighted loss, the one ``ConcertinaTrainer`` trains (and Trainer
trains for the text model), on one sequence per micro-batch (:func:`settings`); Llama 4's too, since
HF's forward over a flattened batch counts its attention chunks and query temperature from the
row's start, not each sequence's.
"""

from __future__ import annotations

import json
import os

import torch

from _models import NO_SAVE

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"] * 2)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4)


#: the text model of the Mistral3 composite
PLAIN_TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
#: the Trainer settings of the composite tests (:data:`_models.NO_SAVE`, the sequences in dataset order)
SETTINGS = dict(NO_SAVE, train_sampling_strategy="sequential")
#: the text model of the Llama 4 composite: chunked attention (chunks of 8 tokens, below the
#: sequences' lengths) with rotary embeddings and QK norm at layers 0 and 2, full attention without
#: rotary and with the query temperature (floor_scale 4: growing within the sequences) at 1 and 3,
#: MoE feed-forward (4 experts, top-1, a shared expert)
LLAMA4_TEXT = dict(PLAIN_TEXT, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
                   attention_chunk_size=8, no_rope_layers=[1, 0, 1, 0], floor_scale=4, attn_scale=0.5)
#: the text model of the Gemma 4 composite: a per-layer config (the full layers' head size 16, the
#: sliding layers' 8) with per-layer inputs of 4 per layer; its image, video and audio token ids keep
#: their defaults, outside the vocabulary (its forward pads such ids, which text never has)
GEMMA4_TEXT = dict(TEXT, global_head_dim=16, hidden_size_per_layer_input=4, vocab_size_per_layer_input=64)
#: the composite model types the tests train
TYPES = ("gemma3", "mistral3", "qwen3_5", "llama4", "gemma4")


def settings(model_type: str) -> dict:
    """The Trainer settings of ``model_type``'s tests: :data:`SETTINGS`; Qwen3.5's one sequence per
    micro-batch (6 micro-batches a step); Gemma 4's with SGD."""
    if model_type in ("qwen3_5", "llama4"):
        return dict(SETTINGS, per_device_train_batch_size=1, gradient_accumulation_steps=6)
    if model_type == "gemma4":  # SGD: Adam's normalised step turns float differences of near-zero gradient
        # entries into whole steps (measured: gradient norms within 2e-6 of Trainer's over the 4 steps with
        # SGD, 7e-4 by the 4th with AdamW, the first step's 3e-7 with either)
        return dict(SETTINGS, optim="sgd")
    return SETTINGS


def tiny_composite(model_type: str = "gemma3"):
    from transformers import (AutoModelForImageTextToText, Gemma3Config, Gemma4Config, Llama4Config, Mistral3Config,
                              Qwen3_5Config)

    torch.manual_seed(0)
    if model_type == "gemma4":
        cfg = Gemma4Config(text_config=GEMMA4_TEXT, vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=8, patch_size=4))
    elif model_type == "llama4":
        cfg = Llama4Config(text_config=LLAMA4_TEXT, vision_config=dict(
            VISION, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16, pixel_shuffle_ratio=0.5),
            image_token_index=63, boi_token_index=61, eoi_token_index=62)
    elif model_type == "qwen3_5":
        cfg = Qwen3_5Config()
        for k, v in dict(PLAIN_TEXT, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2).items():
            setattr(cfg.text_config, k, v)
        for k, v in dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                         patch_size=4).items():
            setattr(cfg.vision_config, k, v)
        for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            setattr(cfg, k, 60)
    elif model_type == "gemma3":
        cfg = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_id=63,
                           boi_token_id=61, eoi_token_id=62)
    else:
        cfg = Mistral3Config(text_config=dict(model_type="mistral", **PLAIN_TEXT, sliding_window=None),
                             vision_config=dict(model_type="pixtral", head_dim=8, **VISION), image_token_index=63)
    return AutoModelForImageTextToText.from_config(cfg)


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


def composite_key(view_key: str, model_type: str = "gemma3") -> str:
    """The composite module's name of a tensor of its text view (``model.X``, ``lm_head.X``)."""
    from concertina_hf.runtime.composite import COMPOSITE_TYPES

    layout = COMPOSITE_TYPES[model_type]
    if view_key.startswith("lm_head."):
        return layout.lm_head + view_key[len("lm_head"):]
    return layout.language_model + view_key[len("model"):]


def trainer_reference(source: str, out: str, model_type: str = "gemma3") -> dict:
    """``Trainer`` on the composite loaded from ``source``: losses, gradient norms, final state."""
    from transformers import AutoModelForImageTextToText, DataCollatorWithFlattening, Trainer, TrainingArguments

    from _models import losses_of, tiny_dataset

    model = AutoModelForImageTextToText.from_pretrained(source, attn_implementation="eager")
    model.accepts_loss_kwargs = True  # Trainer's token-weighted loss over the step (see the module docstring)
    ref = Trainer(model=model, args=TrainingArguments(output_dir=out, **settings(model_type)), train_dataset=tiny_dataset(),
                  data_collator=DataCollatorWithFlattening())
    ref.train()
    return {"losses": losses_of(ref), "grad_norms": [h["grad_norm"] for h in ref.state.log_history if "loss" in h],
            "state": {k: v.detach().clone() for k, v in ref.model.state_dict().items()}}
