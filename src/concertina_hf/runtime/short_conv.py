"""LFM2's short-convolution layers (``conv`` in ``config.layer_types``) in a pipeline chunk.

An LFM2 short convolution (``Lfm2ShortConv`` and its copies in LFM2-MoE and LFM3) gates a depthwise
causal convolution of width ``k = config.conv_L_cache``: ``in_proj`` gives ``B, C, x`` per token,
``B * x`` goes through the convolution (each token reads the ``k - 1`` inputs before it), ``C``
gates its output and ``out_proj`` projects it. HF's ``forward`` runs the convolution over its
whole input, so on a packed chunk one document's last ``k - 1`` inputs would reach the next
document's first tokens, and a split slice would start from zeros instead of its sequence's
earlier inputs.

:func:`install` replaces the ``forward`` of each such module (an instance attribute; the class is
untouched) with :func:`short_conv_forward`, which reads the chunk context the runtime sets around
each decoder-layer call (:func:`~.attention.context.current_context`, or the ``concertina_ctx``
keyword), as the attention backend does. The projections and the gate run over the whole chunk
(token-wise); the convolution is :func:`~.causal_conv.per_document_conv`: zeros before each
document, and for a later slice of a split sequence the tail (the sequence's last ``k - 1``
inputs) its previous slice kept in the chunk's :class:`~.attention.KVStore` (``KVEntry.v``; the
layer has no recurrent state: ``KVEntry.k`` is empty), with its gradient handed back by the
executor, as :mod:`.linear_attention` does. HF's module-level ``causal_conv1d_fn`` (of the class's
own module, so a kernel HF maps there is used) computes it.

Outside a chunk and outside a step the module's own ``forward`` runs; inside a step without a
chunk context it raises. Refused here with the feature named: sequence parallelism, and
segment-level training (as :mod:`.linear_attention`). The cost model prices these layers by kind
(``concertina_hf.planning.mixers``).

Cost: one convolution call over the chunk (``k - 1`` more columns per slice); per non-final slice
and layer, ``(k - 1) * hidden`` values kept until the slice's backward.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from . import recurrent
from .attention.context import ChunkAttentionContext
from .causal_conv import per_document_conv

__all__ = ["MIXER_ATTRIBUTE", "SHORT_CONV", "SHORT_CONV_LAYER_TYPE", "SHORT_CONV_TYPES", "install", "mixer_class",
           "short_conv_forward"]

_HF = "transformers.models"
#: model type -> (HF modeling module, the short-convolution class in it): the classes this module implements
SHORT_CONV = {
    "lfm2": (f"{_HF}.lfm2.modeling_lfm2", "Lfm2ShortConv"),
    "lfm2_moe": (f"{_HF}.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeShortConv"),
    "lfm3": (f"{_HF}.lfm3.modeling_lfm3", "Lfm3ShortConv"),
}
#: model types whose ``conv`` layers run here
SHORT_CONV_TYPES = frozenset(SHORT_CONV)
#: the ``config.layer_types`` entry of these layers
SHORT_CONV_LAYER_TYPE = "conv"
#: the attribute of a decoder layer holding the mixer
MIXER_ATTRIBUTE = "conv"


def mixer_class(model_type: str) -> type | None:
    """The HF class of ``model_type``'s short convolution (``None``: not implemented here, or not in
    the installed transformers)."""
    entry = SHORT_CONV.get(model_type)
    return None if entry is None else recurrent.hf_class(*entry)


def install(model: nn.Module) -> int:
    """Route every short-convolution module of ``model`` (of the class :func:`mixer_class` names for
    its model type) through :func:`short_conv_forward`; returns how many. Idempotent."""
    return recurrent.install(model, mixer_class(str(getattr(getattr(model, "config", None), "model_type", ""))),
                             _forward)


_forward = recurrent.routed(lambda mod, x, ctx: short_conv_forward(mod, x, ctx), "its convolution")


def _refusal(ctx: Any) -> str | None:
    return recurrent.chunk_refusal(ctx, "short-convolution (LFM2 conv)", "each rank's convolution tail passed to the next",
                                   "their convolution tail carries gradient to the previous slice")


def short_conv_forward(mod: nn.Module, hidden_states: torch.Tensor, ctx: ChunkAttentionContext) -> torch.Tensor:
    """HF's short-convolution ``forward`` (no cache) on one chunk ``[1, T, hidden]``, per slice (see
    the module docstring). ``mod``: the HF module, whose submodules and parameters are used as is."""
    why = _refusal(ctx)
    if why is not None:
        raise ValueError(why)
    hf = sys.modules[type(mod).__module__]  # HF's module-level functions (a kernel mapped there included)
    layer = mod.layer_idx
    x = hidden_states
    if x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
        raise ValueError(f"{type(mod).__name__} expects one packed row of {ctx.num_tokens} tokens, got "
                         f"{tuple(x.shape)}")
    b, c, xs = mod.in_proj(x).transpose(-1, -2).chunk(3, dim=-2)  # [1, hidden, T] each
    width = int(mod.conv.kernel_size[0]) - 1  # the earlier inputs each token's convolution reads
    conv = per_document_conv(b * xs, ctx, layer, width, lambda t: hf.causal_conv1d_fn(
        t, mod.conv.weight.squeeze(1), mod.conv.bias), "convolution tail")
    empty = x.new_zeros(0)  # no recurrent state: the entry's K
    for i, s in enumerate(ctx.slices):
        if not s.final:
            ctx.store.put_if_absent(s.seq, s.start, layer, empty, conv.tails[i], ctx.requires_grad)
    y = (c * conv.out).transpose(-1, -2).contiguous()
    return mod.out_proj(y)
