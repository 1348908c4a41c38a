"""Chunked attention and the query temperature of position-free layers (Llama 4).

**Chunked attention** (``config.layer_types`` ``"chunked_attention"``, chunk size
``config.attention_chunk_size`` ``c``): the query at position ``p`` of its document sees the keys
at ``p'`` with ``p' <= p`` and ``p' // c == p // c``, HF's ``create_chunked_causal_mask`` on a
sequence alone (positions counted from the document's first token). HF passes the mask only as
``attention_mask``, so the backend reads the layer's kind from its module
(:func:`attention_chunk`) and runs the layer on the chunk context's
:meth:`~.context.ChunkAttentionContext.chunked` view: every slice cut at the chunk edges into
pieces, each an ordinary causal segment whose keys start at its chunk's edge. A slice of a split
sequence that starts inside a chunk reads, of the carried K/V, only the keys from that chunk's
edge on; one that starts on an edge reads none. Cost: ``sum(s_i * min(C_i, p_i mod c) + s_i^2/2)``
pairs at most, linear in the tokens for a fixed ``c``.

**Temperature** (Llama 4's NoPE layers: ``attn_temperature_tuning`` and no rotary, ``use_rope``
false): HF multiplies the queries by ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))``
before calling the attention function, with ``i`` the row index of the call (``arange`` over its
tokens), which is the token's position in its document only for a sequence alone (HF's reference)
and not over a packed chunk or a later slice. :func:`temperature_fix` multiplies the queries by the
ratio of the scale at each token's position in its own document (the context's ``position_ids``)
to the scale HF applied, so the queries are HF's on each sequence alone (within float32 rounding).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CHUNKED_ATTENTION", "attention_chunk", "sequence_parallel_refusal", "temperature_fix", "tempers_queries"]

#: the ``config.layer_types`` entry of chunked attention
CHUNKED_ATTENTION = "chunked_attention"


def attention_chunk(module: Any, layer: int) -> int | None:
    """The chunk size of ``module``'s layer (index ``layer``) when its config names it a
    chunked-attention layer; ``None`` otherwise."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or layer >= len(types) or str(types[layer]) != CHUNKED_ATTENTION:
        return None
    chunk = getattr(config, "attention_chunk_size", None)
    if not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"layer {layer} is a chunked_attention layer but config.attention_chunk_size is {chunk!r}")
    return chunk


def tempers_queries(module: Any) -> bool:
    """Whether HF's attention module scales its queries by the row index (Llama 4's NoPE layers)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def _scale(module: Any, positions: torch.Tensor) -> torch.Tensor:
    # HF's formula (Llama4TextAttention.forward), float32
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def temperature_fix(module: Any, query: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``query`` [1, H, t, D] as HF scaled it (row index ``0 .. t-1``), rescaled to the scale at
    ``position_ids`` [1, t] (each token's position in its document): a ratio of exactly 1 where both agree."""
    rows = torch.arange(query.shape[2], device=query.device)
    pos = position_ids.reshape(-1).to(query.device)
    ratio = _scale(module, pos) / _scale(module, rows)
    return (query * ratio.view(1, 1, -1, 1)).to(query.dtype)


def sequence_parallel_refusal(config: Any, sp: int) -> str | None:
    """Why a model of ``config`` cannot run on a stage of ``sp > 1`` sequence-parallel ranks
    (``None``: it can): chunked-attention layers and row-index query temperature are implemented
    for whole chunks on one rank (a token shard's row indices are not the document's positions,
    and placed chunks cut pieces that are not the chunks' pieces)."""
    types = getattr(config, "layer_types", None) or ()
    what = []
    if CHUNKED_ATTENTION in [str(t) for t in types]:
        what.append("chunked_attention layers")
    if getattr(config, "attn_temperature_tuning", False) and 0 in list(getattr(config, "no_rope_layers", None) or ()):
        what.append("attn_temperature_tuning on its layers without rotary embeddings")
    if not what:
        return None
    return (f"model type {getattr(config, 'model_type', '?')!r} has {' and '.join(what)}, which run with sequence "
            f"parallel size 1 only (not on a stage of {sp} ranks); set concertina_sequence_parallel_size=1")
