"""Kimi Delta Attention (Kimi Linear's ``linear_attention`` layers) in a pipeline chunk.

A KDA layer (``KimiLinearDeltaAttention``, the ``self_attn`` of Kimi Linear's ``linear_attention``
layers) is a Gated DeltaNet whose decay is per channel: ``q, k, v`` projections through one
depthwise causal convolution of width ``k`` (each token reads the ``k - 1`` inputs before it), a
per-channel forget gate ``g`` and a ``beta`` per head, the gated delta rule over a ``[H, D, D]``
float32 state (HF's ``chunk_kimi_delta_attention``: the torch reference on CPU, flash-linear-attention's
``chunk_kda`` where HF maps it), a gated RMS norm and ``o_proj``. HF's ``forward`` runs the
convolution and the scan over its whole input, so on a packed chunk one document's tokens would reach
the next through either, and a split slice would start from zero.

:func:`install` replaces the ``forward`` of each such module (an instance attribute; the class is
untouched) with :func:`kda_forward`, which reads the chunk context the runtime sets around each
decoder-layer call, as :mod:`.linear_attention` does for the Gated DeltaNet: the projections, the
gates and the norm run over the whole chunk; the convolution is
:func:`~.causal_conv.per_document_conv` (zeros before each document, a split slice's tail carried);
the scan runs per slice from its own initial state (none at a document start, the previous slice's
final state otherwise). A non-final slice keeps its final state (``KVEntry.k``) and convolution tail
(``KVEntry.v``) in the chunk's :class:`~.attention.KVStore`, with their gradients handed back by the
executor. HF's module-level functions are read from the class's own module (a kernel HF maps there
is used).

Outside a chunk and outside a step the module's own ``forward`` runs; inside a step without a chunk
context it raises. Refused here with the feature named: sequence parallelism, segment-level
training. The cost model prices these layers by kind (``concertina_hf.planning.mixers``).

Cost: per slice one scan call; one convolution over the chunk; per non-final slice and layer
``H x D x D`` float32 plus ``(k - 1) x 3 H D`` kept until the slice's backward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from . import recurrent
from .attention.context import ChunkAttentionContext
from .causal_conv import per_document_conv

__all__ = ["KDA", "KDA_TYPES", "install", "kda_forward", "mixer_class"]

#: model type -> (HF modeling module, the KDA class in it): the classes this module implements
KDA = {"kimi_linear": ("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention")}
#: model types whose ``linear_attention`` layers run here
KDA_TYPES = frozenset(KDA)


def mixer_class(model_type: str) -> type | None:
    """The HF class of ``model_type``'s KDA mixer (``None``: not implemented here, or not in the
    installed transformers)."""
    entry = KDA.get(model_type)
    return None if entry is None else recurrent.hf_class(*entry)


def install(model: nn.Module) -> int:
    """Route every KDA module of ``model`` through :func:`kda_forward`; returns how many. Idempotent."""
    return recurrent.install(model, mixer_class(str(getattr(getattr(model, "config", None), "model_type", ""))),
                             _forward)


_forward = recurrent.routed(lambda mod, x, ctx: kda_forward(mod, x, ctx))


def _refusal(ctx: Any) -> str | None:
    return recurrent.chunk_refusal(ctx, "Kimi Delta Attention (KDA)")


def kda_forward(mod: nn.Module, hidden_states: torch.Tensor, ctx: ChunkAttentionContext) -> torch.Tensor:
    """HF's KDA ``forward`` (no cache) on one chunk ``[1, T, hidden]``, per slice (see the module
    docstring). ``mod``: the HF module, whose submodules and parameters are used as is."""
    why = _refusal(ctx)
    if why is not None:
        raise ValueError(why)
    hf = sys.modules[type(mod).__module__]  # HF's module-level functions (a kernel mapped there included)
    layer = mod.layer_idx
    x = hidden_states
    if x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
        raise ValueError(f"{type(mod).__name__} expects one packed row of {ctx.num_tokens} tokens, got "
                         f"{tuple(x.shape)}")
    tokens = x.shape[1]
    shape = (1, tokens, -1, mod.head_dim)
    mixed = torch.cat([mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)], dim=-1).transpose(1, 2)  # [1, 3 H D, T]
    width = int(mod.conv1d.kernel_size[0]) - 1
    conv = per_document_conv(mixed, ctx, layer, width, lambda t: hf.causal_conv1d_fn(
        t, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, activation=mod.activation), "recurrent state")
    query, key, value = (t.reshape(shape) for t in torch.split(conv.out.transpose(1, 2), [mod.qkv_dim] * 3, dim=-1))
    g = mod.forget_gate(x)
    beta = torch.sigmoid(mod.b_proj(x))
    store, grad = ctx.store, ctx.requires_grad
    outs = []
    for i, s in enumerate(ctx.slices):
        sl = slice(s.offset, s.offset + s.length)
        initial = conv.carried[i].k_leaf if i in conv.carried else None
        out, state = hf.chunk_kimi_delta_attention(
            query[:, sl], key[:, sl], value[:, sl], g=g[:, sl], beta=beta[:, sl], initial_state=initial,
            output_final_state=not s.final, use_qk_l2norm_in_kernel=True)
        outs.append(out)
        if not s.final:
            store.put_if_absent(s.seq, s.start, layer, state.to(torch.float32), conv.tails[i], grad)
    core = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    gate = mod.g_b_proj(mod.g_a_proj(x)).reshape(shape)
    return mod.o_proj(mod.o_norm(core, gate).reshape(1, tokens, -1))
