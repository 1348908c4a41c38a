"""PEFT models (LoRA and the other layer tuners) through the pipeline.

A ``peft.PeftModel`` wraps an HF causal LM: ``peft_model.base_model`` is the tuner (``LoraModel``)
and ``peft_model.base_model.model`` the HF model, whose layers PEFT replaced in place by adapter
layers (``q_proj`` becomes a ``lora.Linear`` holding the frozen ``base_layer`` and the trainable
``lora_A`` / ``lora_B``) and whose ``modules_to_save`` are wrapped with a trainable copy. So the
HF model keeps its layout (``model.embed_tokens / .layers / .norm``, ``lm_head``) and
:class:`~concertina_hf.runtime.stage.PipelineWrapper` prunes it like any other; the pruned modules
of other stages take their adapters with them. Only parameters with ``requires_grad`` get
gradients, optimizer state and a share of the global norm, as in ``Trainer`` + PEFT.

Saving (:func:`save_adapter`) writes what ``PeftModel.save_pretrained`` writes on one process:
``adapter_config.json`` and ``adapter_model.safetensors`` with EVERY stage's adapter weights
(each stage takes its own with ``peft.get_peft_model_state_dict`` on its pruned model, pipeline
rank 0 merges them), so ``PeftModel.from_pretrained(base, directory)`` loads it without this
package. :func:`load_stage_adapter` reads a stage's share back (resume, best model).

Refused, naming the setting: prompt-learning methods (prefix / prompt tuning add virtual tokens
outside the decoder layers) and, with several stages, tied input/output embeddings that an adapter
or ``modules_to_save`` touches (the two stages' copies would no longer be one matrix).

Cost: saving moves only the adapter weights (and any ``modules_to_save``) to pipeline rank 0.
``peft`` is imported only when a ``PeftModel`` is given (it is an optional dependency).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
from torch import nn

__all__ = [
    "ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "base_model_of", "check_peft_model", "is_peft_model",
    "load_stage_adapter", "save_adapter", "stage_adapter_state_dicts",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def is_peft_model(model: Any) -> bool:
    """``model`` is a ``peft.PeftModel`` (without importing peft when nothing imported it yet)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model_of(model: nn.Module) -> nn.Module:
    """The HF model inside a ``PeftModel`` (adapter layers in place); ``model`` itself otherwise."""
    return model.base_model.model if is_peft_model(model) else model


def check_peft_model(peft_model: nn.Module, num_stages: int) -> None:
    """Refuse what the pipeline cannot run or save like ``Trainer`` + PEFT on one process."""
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    for name, config in peft_model.peft_config.items():
        if config.is_prompt_learning or not isinstance(peft_model.base_model, BaseTuner):
            raise NotImplementedError(
                f"PEFT adapter {name!r} is {config.peft_type}: prompt-learning methods add virtual tokens outside the "
                "decoder layers, which the pipeline does not run; use a layer tuner (LoraConfig, IA3Config, ...)")
    hf = base_model_of(peft_model)
    text = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    if num_stages > 1 and getattr(text, "tie_word_embeddings", False):
        adapted = [label for label, mod in (("embed_tokens", hf.get_input_embeddings()),
                                            ("lm_head", hf.get_output_embeddings()))
                   if isinstance(mod, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
        if adapted:
            raise NotImplementedError(
                f"the model ties its input and output embeddings and the PEFT config adapts {adapted} (target_modules "
                "or modules_to_save): over several pipeline stages the first and the last stage each hold a copy, "
                "which an adapter would make differ. Remove them from target_modules / modules_to_save, or set "
                "concertina_pipeline_size=1")


def stage_adapter_state_dicts(peft_model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{adapter name: state dict}`` of this stage's share of every adapter, in the names
    ``PeftModel.save_pretrained`` writes (adapter name stripped), as CPU copies."""
    from peft import get_peft_model_state_dict

    out = {}
    for name in peft_model.peft_config:
        sd = get_peft_model_state_dict(peft_model, adapter_name=name, save_embedding_layers="auto")
        out[name] = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}
    return out


def save_adapter(peft_model: nn.Module, output_dir: str, *, gather: Callable[[Any], list | None],
                 is_main: bool) -> list[str]:
    """Write a standard PEFT adapter directory holding every stage's adapter weights.

    ``gather(obj)``: every stage's object in stage order on the writer, ``None`` elsewhere (a
    collective over the pipeline); ``is_main``: this rank writes (it must be the one ``gather``
    returns the list on). Returns the files written (relative to ``output_dir``)."""
    parts = gather(stage_adapter_state_dicts(peft_model))
    if not is_main:
        return []
    from safetensors.torch import save_file

    if parts is None:
        raise RuntimeError("save_adapter: the main process must be pipeline rank 0 of replica 0")
    os.makedirs(output_dir, exist_ok=True)
    peft_model.create_or_update_model_card(output_dir)
    written = ["README.md"]
    for name, config in peft_model.peft_config.items():
        merged: dict[str, torch.Tensor] = {}
        for stage, part in enumerate(parts):
            for key, tensor in part[name].items():
                if key in merged and not torch.equal(merged[key], tensor):
                    raise RuntimeError(f"adapter {name!r}: {key} differs between stages (stage {stage} and an earlier "
                                       "one)")
                merged[key] = tensor
        sub = output_dir if name == "default" else os.path.join(output_dir, name)
        os.makedirs(sub, exist_ok=True)
        save_file(merged, os.path.join(sub, ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        # the config as PeftModel.save_pretrained writes it (inference mode, base model, auto mapping)
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = base_model_of(peft_model).__dict__.get("name_or_path", None) or None
        auto_mapping = None
        if config.task_type is None:
            cls = base_model_of(peft_model).__class__
            auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
        inference_mode, config.inference_mode = config.inference_mode, True
        try:
            config.save_pretrained(sub, auto_mapping_dict=auto_mapping)
        finally:
            config.inference_mode = inference_mode
        rel = "" if sub == output_dir else name + "/"
        written += [rel + ADAPTER_WEIGHTS_NAME, rel + ADAPTER_CONFIG_NAME]
    return written


def load_stage_adapter(peft_model: nn.Module, checkpoint_dir: str, stage: int) -> None:
    """This stage's share of every adapter from a PEFT adapter directory; a missing file or key is
    an error naming it."""
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError, safe_open

    for name, wanted in stage_adapter_state_dicts(peft_model).items():
        sub = checkpoint_dir if name == "default" else os.path.join(checkpoint_dir, name)
        path = os.path.join(sub, ADAPTER_WEIGHTS_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"{path} is missing: not a PEFT adapter directory of adapter {name!r}")
        try:
            with safe_open(path, framework="pt", device="cpu") as fh:
                have = set(fh.keys())
                missing = sorted(k for k in wanted if k not in have)
                if missing:
                    raise ValueError(f"{path} lacks {len(missing)} adapter weights of pipeline stage {stage}, e.g. "
                                     f"{missing[:3]}")
                loaded = {k: fh.get_tensor(k) for k in wanted}
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path} is unreadable (truncated or damaged?): {e}") from e
        result = set_peft_model_state_dict(peft_model, loaded, adapter_name=name)
        # keys of this stage that were given but not taken would be a silent non-load
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if not k.startswith("_")]
        if unexpected:
            raise ValueError(f"{path}: weights {unexpected[:3]} did not load into pipeline stage {stage}")
