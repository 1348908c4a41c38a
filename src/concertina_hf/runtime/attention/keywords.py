"""The keyword policy: what the backend does with each keyword HF attention modules pass.

The attention function implements ``dropout``, ``scaling``, per-layer ``sliding_window``,
``softcap``, ``s_aux`` / ``sinks`` and value heads of another size than query/key heads (its own
parameters). Any other keyword raises (:func:`check_keywords`), naming the keyword and
``module.config.model_type``, unless :data:`IGNORED_KEYWORDS` lists it as harmless, or
:data:`NEUTRAL_KEYWORDS` as harmless at a neutral value (``None``, ``False``) that it has: the
backend refuses rather than train a different model than HF's.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["IGNORED_KEYWORDS", "NEUTRAL_KEYWORDS", "check_keywords", "model_type_of"]


#: Keywords HF layers pass to the attention function that carry nothing the attention needs
#: (ignored at any value), with the reason.
IGNORED_KEYWORDS: dict[str, str] = {
    "position_ids": "the chunk's positions come from the context; rotary embeddings are applied before the call",
    "position_embeddings": "rotary (cos, sin), already applied to query and key",
    "cache_position": "positions in a KV cache; the runtime runs without one",
    "use_cache": "the runtime runs without a KV cache (use_cache=False); no cached keys reach the attention",
    "output_router_logits": "a flag of MoE blocks, passed down through the layer; not an attention setting",
}


#: Keywords that are harmless only at a neutral value (``None`` or ``False``): any other value
#: asks for something the backend does not do, and raises.
NEUTRAL_KEYWORDS: dict[str, str] = {
    "output_attentions": "attention probabilities are never materialized",
    "past_key_values": "no KV cache",
    "past_key_value": "no KV cache",
    "encoder_hidden_states": "no cross-attention",
    "position_bias": "no additive position bias (T5-style relative attention)",
    "indices": "no sparse (top-k indexed) attention",
    "block_indices": "no block-sparse attention",
    "cu_seq_lens_q": "the chunk context defines the varlen layout",
    "cu_seq_lens_k": "the chunk context defines the varlen layout",
    "max_length_q": "the chunk context defines the varlen layout",
    "max_length_k": "the chunk context defines the varlen layout",
}


def model_type_of(module: torch.nn.Module) -> str:
    """``module.config.model_type`` (the class name without one), for messages."""
    return str(getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__)


def check_keywords(kwargs: dict, module: torch.nn.Module, in_chunk: bool) -> None:
    """Raise on a keyword of ``kwargs`` the backend does not implement (see the module docstring);
    ``in_chunk``: the call has a chunk context (the neutral-value rule applies only then)."""
    for name, val in kwargs.items():
        if name in IGNORED_KEYWORDS:
            continue
        if name in NEUTRAL_KEYWORDS:
            if not in_chunk or val is None or val is False:
                continue
            raise ValueError(
                f"the concertina attention backend got {name}={_short(val)} from {type(module).__name__} "
                f"(model type {model_type_of(module)!r}); it supports only {name}=None/False here "
                f"({NEUTRAL_KEYWORDS[name]})")
        raise ValueError(
            f"the concertina attention backend does not implement the keyword {name!r} that "
            f"{type(module).__name__} (model type {model_type_of(module)!r}) passes ({_short(val)}); refusing "
            "rather than training a different model")


def _short(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"a tensor of shape {tuple(val.shape)}"
    r = repr(val)
    return r if len(r) < 60 else r[:57] + "..."
