"""MiniMax's lightning attention (``linear_attention`` in ``config.layer_types``) in a pipeline chunk.

A lightning-attention layer (``MiniMaxLightningAttention``, the ``self_attn`` of MiniMax's
``linear_attention`` layers) is linear attention with a per-head exponential decay ``s``: token
``t`` reads ``q_t . sum_{j <= t} exp(-s (t - j)) k_j v_j^T``, through a ``[H, D, D]`` state that HF's
``forward`` (no cache) updates block by block (``config.block_size`` tokens: the intra-block part as
a decayed ``(Q K^T) V``, the earlier blocks' through the state). It runs over its whole input, so on a
packed chunk one document's state would reach the next, and a split slice would start from zeros
instead of its sequence's earlier tokens.

:func:`install` replaces the ``forward`` of each such module (an instance attribute; the class is
untouched) with :func:`lightning_forward`, which reads the chunk context the runtime sets around each
decoder-layer call (as the attention backend does). The projections, the norm and the output gate run
over the whole chunk (token-wise); the block recurrence (:func:`lightning_scan`, HF's loop with an
initial state) runs per slice: from zeros at a document start, and for a later slice of a split
sequence from the state its previous slice kept in the chunk's :class:`~.attention.KVStore`
(``KVEntry.k``; ``KVEntry.v`` is empty), with its gradient handed back by the executor, as
:mod:`.linear_attention` does. Blocks start at each slice's first token (HF's at the sequence's):
the decays are exact powers, so the outputs agree to rounding.

Outside a chunk and outside a step the module's own ``forward`` runs; inside a step without a chunk
context it raises. Refused here with the feature named: sequence parallelism, segment-level
training. The layers' attention (``full_attention``) layers run on the runtime's backend as any
model's. The cost model prices these layers by kind (``concertina_hf.planning.mixers``).

Cost: per slice ``ceil(s / block_size)`` block steps (a packed chunk of many short documents makes
many small ones); per non-final slice and layer an ``H x D x D`` state kept until its backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import recurrent
from .attention.context import ChunkAttentionContext

__all__ = ["LIGHTNING", "LIGHTNING_TYPES", "install", "lightning_forward", "lightning_scan", "mixer_class"]

#: model type -> (HF modeling module, the lightning-attention class in it): the classes this module implements
LIGHTNING = {"minimax": ("transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention")}
#: model types whose ``linear_attention`` layers run here
LIGHTNING_TYPES = frozenset(LIGHTNING)
#: the attribute of a decoder layer holding the mixer (the attention layers' too)
MIXER_ATTRIBUTE = "self_attn"


def mixer_class(model_type: str) -> type | None:
    """The HF class of ``model_type``'s lightning attention (``None``: not implemented here, or not in
    the installed transformers)."""
    entry = LIGHTNING.get(model_type)
    return None if entry is None else recurrent.hf_class(*entry)


def install(model: nn.Module) -> int:
    """Route every lightning-attention module of ``model`` through :func:`lightning_forward`; returns
    how many. Idempotent."""
    return recurrent.install(model, mixer_class(str(getattr(getattr(model, "config", None), "model_type", ""))),
                             _forward)


_forward = recurrent.routed(lambda mod, x, ctx: (lightning_forward(mod, x, ctx), None))


def _refusal(ctx: Any) -> str | None:
    return recurrent.chunk_refusal(ctx, "lightning-attention (MiniMax linear attention)")


def lightning_scan(mod: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's block recurrence of ``mod`` (its ``forward`` without a cache) on one slice ``q, k, v``
    ``[1, H, n, D]`` from ``state`` ``[1, H, D, D]`` (``None``: zeros): ``(output [1, H, n, D], final state)``."""
    n, block = q.shape[2], mod.block_size
    if state is None:
        state = v.new_zeros(1, q.shape[1], q.shape[3], v.shape[3])
    outs = []
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        size = hi - lo
        qb, kb, vb = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * mod.diagonal_decay[:, :, :size, :size], vb)
        inter = torch.matmul(qb * mod.query_decay[:, :size], state)
        outs.append(inter + intra)
        state = state * torch.exp(-mod.slope_rate * size) + torch.matmul(
            (kb * mod.key_decay[:, -size:]).transpose(-1, -2), vb)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)), state


def lightning_forward(mod: nn.Module, hidden_states: torch.Tensor, ctx: ChunkAttentionContext) -> torch.Tensor:
    """HF's lightning-attention ``forward`` (no cache) on one chunk ``[1, T, hidden]``, per slice (see
    the module docstring). ``mod``: the HF module, whose submodules, parameters and buffers are used as is."""
    why = _refusal(ctx)
    if why is not None:
        raise ValueError(why)
    layer = mod.layer_idx
    x = hidden_states
    if x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
        raise ValueError(f"{type(mod).__name__} expects one packed row of {ctx.num_tokens} tokens, got "
                         f"{tuple(x.shape)}")
    tokens, heads, dim = x.shape[1], mod.num_attention_heads, mod.head_dim
    qkv = mod.act_fn(mod.qkv_proj(x)).reshape(1, tokens, heads, 3 * dim)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, dim, dim=3))  # [1, H, T, D]
    store, grad = ctx.store, ctx.requires_grad
    empty = x.new_zeros(0)  # no convolution tail: the entry's V
    outs = []
    for s in ctx.slices:
        sl = slice(s.offset, s.offset + s.length)
        state = None
        if s.start > 0:
            prev = store.previous(s.seq, s.start, layer)
            if prev is None:
                raise RuntimeError(f"the recurrent state of sequence {s.seq} before token {s.start} on layer {layer} "
                                   "is missing: an earlier slice did not run forward on this stage first")
            state = prev.k_leaf.to(v.dtype)
        out, state = lightning_scan(mod, q[:, :, sl], k[:, :, sl], v[:, :, sl], state)
        outs.append(out)
        if not s.final:
            store.put_if_absent(s.seq, s.start, layer, state, empty, grad)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    out = mod.norm(out.transpose(1, 2).reshape(1, tokens, heads * dim))
    out = F.sigmoid(mod.output_gate(x)) * out
    return mod.out_proj(out)
