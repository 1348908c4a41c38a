"""Gemma 4's work between its decoder layers: per-layer inputs and K/V shared between layers.

Gemma 4's text models (:data:`PER_LAYER_TYPES`) have per-layer configs (``config.per_layer_config[i]``:
a head size, a number of K/V heads per layer) and their ``forward`` does two things outside the
decoder layers, which the stage (:class:`~concertina_hf.runtime.stage.PipelineWrapper`) reproduces:

- **per-layer inputs** (PLE, ``hidden_size_per_layer_input`` = ``D`` > 0): from the token ids and
  the embeddings, ``embed_tokens_per_layer`` and ``per_layer_model_projection`` (with
  ``per_layer_projection_norm``) give each token ``L x D`` numbers, layer ``i`` taking the ``i``-th
  ``D``. The first stage computes them with HF's own ``get_per_layer_inputs`` /
  ``project_per_layer_inputs`` (its modules stay on the first stage only) and they travel with the
  hidden states: a stage's message is ``[hidden | the per-layer inputs of the layers after it]``
  (:func:`message_width`), so that their gradients reach the first stage's modules through the
  ordinary backward messages. Cost: a boundary after layer ``b`` carries ``(L - b) x D`` more
  numbers per token (Gemma-4-E2B: ``D = 256``, ``L = 35``, hidden 1536: up to 6.8 times the
  hidden states);
- **shared K/V** (``num_kv_shared_layers`` > 0): the last ``num_kv_shared_layers`` layers read
  the K/V that the last earlier layer of their type wrote (``config.kv_sharing_modes``), through a
  ``shared_kv_states`` dict the stage passes to its layers for one chunk (:func:`kv_sources`).
  The pipeline's attention keeps K/V per layer for later slices, so a reading layer stores the
  (same) tensors under its own index as well: the carried K/V of the source layer is what HF's
  forward would use, and its gradient reaches the source layer through both. The planner's
  partition keeps a layer and its source on one stage
  (:attr:`~concertina_hf.planning.cost.CostModel.kv_share_spans`); a layout splitting them is
  refused (:func:`check_kv_sharing`).

Cost: nothing for the layers; the first stage runs the per-layer embedding and projection once
per chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PER_LAYER_MODULES", "PER_LAYER_PARAMETERS", "PER_LAYER_TYPES", "check_kv_sharing", "embed_per_layer",
           "kv_sources", "layer_heads", "message_width", "per_layer_input_size"]

#: model types whose forward computes per-layer inputs and shares K/V between layers (Gemma 4's text models)
PER_LAYER_TYPES = frozenset({"gemma4_text", "gemma4_unified_text"})
#: ``model.model`` modules of these types that compute the per-layer inputs (first stage only)
PER_LAYER_MODULES = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
#: decoder-layer parameters the stage passes for these types
PER_LAYER_PARAMETERS = frozenset({"per_layer_input", "shared_kv_states"})


def per_layer_input_size(model: nn.Module) -> int:
    """``D``, the per-layer input size of each layer (0: the model has no per-layer inputs)."""
    if getattr(model.model, "embed_tokens_per_layer", None) is None:
        return 0
    return int(getattr(model.config, "hidden_size_per_layer_input", 0) or 0)


def kv_sources(config: Any) -> tuple[int | None, ...] | None:
    """Per decoder layer, the index of the layer whose K/V it reads (``None``: its own), from
    ``config.kv_sharing_modes``; ``None`` when no layer reads another's."""
    modes = list(getattr(config, "kv_sharing_modes", None) or [])
    types = list(getattr(config, "layer_types", None) or [])
    if "reuse" not in modes:
        return None
    out: list[int | None] = []
    for i, mode in enumerate(modes):
        if mode != "reuse":
            out.append(None)
            continue
        src = [j for j in range(i) if modes[j] == "store" and types[j] == types[i]]
        out.append(src[-1] if src else i)
    if any(src == i for i, src in enumerate(out)):
        raise ValueError(f"model type {getattr(config, 'model_type', '?')!r}: a layer of config.kv_sharing_modes "
                         "reuses K/V that no earlier layer of its type stores")
    return tuple(out)


def check_kv_sharing(sources: tuple[int | None, ...] | None, layer_ranges: tuple[tuple[int, int], ...],
                     model_type: str) -> None:
    """Raise ``ValueError`` when a layer and the layer whose K/V it reads are on two stages."""
    if sources is None:
        return
    for stage, (a, b) in enumerate(layer_ranges):
        for i in range(a, b):
            j = sources[i]
            if j is not None and not a <= j < b:
                raise ValueError(
                    f"model type {model_type!r}: decoder layer {i} reads the K/V of layer {j} (KV sharing, "
                    f"config.num_kv_shared_layers), but the stage layout {list(layer_ranges)} puts them on two "
                    "stages; the pipeline does not pass shared K/V between stages. Use a layout that keeps layers "
                    f"{j}-{i} on one stage, or fewer stages (concertina_pipeline_size)")


def layer_heads(config: Any) -> list[tuple[int, int]]:
    """Per decoder layer, ``(query heads, K/V heads)`` of a per-layer config (HF's
    ``config.per_layer_config``); empty for a config without one."""
    if config.__dict__.get("_heterogeneity_spec") is None:
        return []
    out = []
    for i in range(int(config.num_hidden_layers)):
        layer = config.per_layer_config[i]
        heads = int(layer.num_attention_heads)
        out.append((heads, int(getattr(layer, "num_key_value_heads", None) or heads)))
    return out


def message_width(hidden_size: int, ple_size: int, num_layers: int, after_layer: int) -> int:
    """Numbers per token of a message between stages after ``after_layer`` layers: the hidden
    states and the per-layer inputs of the layers after it."""
    return hidden_size + ple_size * (num_layers - after_layer)


def embed_per_layer(inner: nn.Module, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The first stage's message: ``hidden`` [1, T, H] and HF's per-layer inputs of every layer,
    ``[1, T, H + L x D]`` (HF's ``get_per_layer_inputs`` then ``project_per_layer_inputs``)."""
    ple = inner.project_per_layer_inputs(hidden, inner.get_per_layer_inputs(input_ids, hidden))
    return torch.cat([hidden, ple.flatten(2).to(hidden.dtype)], dim=-1)
