"""Gated DeltaNet layers (linear attention with a recurrent state) in a pipeline chunk.

A Gated DeltaNet layer (the ``linear_attn`` of Qwen3-Next, Qwen3.5 and its MoE, OLMo Hybrid,
Lara-Mini) mixes tokens through two states: a
depthwise causal convolution of width ``k`` over the projected ``q, k, v`` (it reads the
``k - 1`` inputs before each token) and a recurrent state per value head (``[H, Dk, Dv]``,
float32) that the gated delta rule updates token by token. HF's ``forward`` runs both over its
whole input, so on a packed chunk one document's tokens would reach the next through either,
and a split slice would start from zero instead of its sequence's earlier tokens.

The classes differ only token-wise: how the hidden states are projected to the convolution's input
``q | k | v``, the output gate, ``beta`` and the decay's input ``a`` (Qwen3-Next's fused ``qkvz`` /
``ba`` projections in key-head groups, Qwen3.5's separate ``qkv``, ``z``, ``b``, ``a``, OLMo
Hybrid's ``q``, ``k``, ``v``, ``g`` projections and ``beta`` doubled under
``linear_allow_neg_eigval``), and the names of the gated norm and the output projection. One
:class:`Adapter` per class (:data:`GATED_DELTANET`) says that; the per-document convolution, scan
and carry are shared. HF's module-level functions are read from the class's own module.

:func:`install` replaces the ``forward`` of each such module of a model (an instance attribute;
the class is untouched) with :func:`gated_deltanet_forward`, which reads the chunk context that
the runtime sets around each decoder-layer call (:func:`~.attention.context.current_context`, or
the ``concertina_ctx`` keyword), exactly as the attention backend does. Per slice of the chunk:

- **one document map**: the projections, the gated norm and the output projection run over the
  whole chunk (token-wise); the convolution runs once over the chunk with each slice preceded by
  its own ``k - 1`` earlier inputs (zeros at a document start), and the scan
  (``torch_chunk_gated_delta_rule``, HF's module-level function, so a kernel HF maps there is
  used) runs per slice with its own initial state (none at a document start): no token of one
  document reaches another, including the first ``k - 1`` tokens through the convolution;
- **carry with gradient**: a non-final slice keeps, per layer, its final recurrent state
  (float32) and its convolution tail (the sequence's last ``k - 1`` pre-convolution inputs up to
  the slice's end; a slice shorter than ``k - 1`` takes the rest from the tail it received) in the
  chunk's :class:`~.attention.KVStore`, as an attention layer keeps its K/V: the tensors attached
  to the slice's graph and detached leaves the next slice starts from (``KVEntry.k``: the state,
  ``KVEntry.v``: the tail). The gradient the next slice's backward leaves on those leaves is handed
  to this slice's backward by the executor with the K/V's, and a recomputed layer's replay reads
  the same leaves (the store is set-if-absent).

Outside a chunk and outside a step (a plain ``model(...)``, ``generate``) the module's own
``forward`` runs; inside a step without a chunk context it raises.

**Ulysses** (a stage of ``sp`` ranks, each holding ``t`` local tokens): the projections run on the
local tokens; one all-to-all gives each rank all the chunk's tokens of its heads (key heads
``[r Hk / sp, (r + 1) Hk / sp)`` and the value heads reading them: their convolution channels,
``beta`` and the decay's input), the convolution and the scan run per slice as above with the
rank's own carried states and tails, and the inverse all-to-all returns the scan's output of all
heads to the local tokens for the gated norm and the output projection. ``sp`` must divide the key
heads (:func:`sequence_parallel_refusal`, checked at construction). Not implemented, and refused
with the feature named: whole-doc / per-doc placed chunks (the state would pass between ranks),
and segment-level training (a store that reads earlier slices detached or within a tail). The cost
model prices these layers by kind (``concertina_hf.planning.mixers``: linear in tokens, a cost per
slice, a state per split slice).

Cost: per slice one scan call (a packed chunk of many short documents makes many small calls) and
one convolution over the chunk; per non-final slice and layer, ``H * Dk * Dv`` float32 plus
``(k - 1) * conv channels`` kept until the slice's backward (divided by ``sp`` under Ulysses, which
adds two all-to-alls per layer forward and two backward: the convolution's input with ``beta`` and
``a``, and the scan's output).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import recurrent
from .attention.context import ChunkAttentionContext
from .causal_conv import per_document_conv
from .ulysses import UlyssesContext

__all__ = ["Adapter", "GATED_DELTANET", "LINEAR_ATTENTION_TYPES", "gated_deltanet_forward", "install",
           "mixer_class", "sequence_parallel_refusal"]

Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Adapter:
    """What one HF Gated DeltaNet class does token-wise around the shared convolution and scan."""

    module: str  #: the HF modeling module (its ``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``)
    cls: str  #: the mixer class in it
    #: ``(mod, x [1, T, hidden])`` -> the convolution's input ``q | k | v`` ``[1, T, 2 key_dim + value_dim]``,
    #: the output gate (``value_dim`` per token), ``beta`` ``[1, T, Hv]`` and the decay's input ``a`` ``[1, T, Hv]``
    project: Callable[[nn.Module, torch.Tensor], Projected]
    norm: str = "norm"  #: the gated RMS norm, ``norm(core [N, Dv], gate [N, Dv])``
    out: str = "out_proj"  #: the output projection


def _qwen3_next(mod: nn.Module, x: torch.Tensor) -> Projected:
    query, key, value, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(x), mod.in_proj_ba(x))
    qkv = torch.cat([t.reshape(1, x.shape[1], -1) for t in (query, key, value)], dim=-1)
    return qkv, z, b.sigmoid(), a


def _qwen3_5(mod: nn.Module, x: torch.Tensor) -> Projected:
    return mod.in_proj_qkv(x), mod.in_proj_z(x), mod.in_proj_b(x).sigmoid(), mod.in_proj_a(x)


def _olmo_hybrid(mod: nn.Module, x: torch.Tensor) -> Projected:
    beta = mod.b_proj(x).sigmoid()
    if mod.allow_neg_eigval:
        beta = beta * 2.0
    return torch.cat([mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)], dim=-1), mod.g_proj(x), beta, mod.a_proj(x)


_HF = "transformers.models"
#: model type -> the :class:`Adapter` of its Gated DeltaNet mixer, the classes this module implements
GATED_DELTANET = {
    "qwen3_next": Adapter(f"{_HF}.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet", _qwen3_next),
    "qwen3_5_text": Adapter(f"{_HF}.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet", _qwen3_5),
    "qwen3_5_moe_text": Adapter(f"{_HF}.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", _qwen3_5),
    "lara_mini": Adapter(f"{_HF}.lara_mini.modeling_lara_mini", "LaraMiniGatedDeltaNet", _qwen3_5),
    "olmo_hybrid": Adapter(f"{_HF}.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet", _olmo_hybrid,
                           norm="o_norm", out="o_proj"),
}
#: model types whose ``linear_attention`` layers run here
LINEAR_ATTENTION_TYPES = frozenset(GATED_DELTANET)
#: the attribute of a decoder layer holding the mixer
MIXER_ATTRIBUTE = "linear_attn"


def mixer_class(model_type: str) -> type | None:
    """The HF class of ``model_type``'s Gated DeltaNet mixer (``None``: not implemented here, or not
    in the installed transformers)."""
    entry = GATED_DELTANET.get(model_type)
    return None if entry is None else recurrent.hf_class(entry.module, entry.cls)


def _adapter(mod: nn.Module) -> Adapter:
    cls = type(mod)
    for entry in GATED_DELTANET.values():
        if entry.cls == cls.__name__ and entry.module == cls.__module__:
            return entry
    raise TypeError(f"{cls.__module__}.{cls.__name__} is not a Gated DeltaNet class of GATED_DELTANET")


def install(model: nn.Module) -> int:
    """Route every Gated DeltaNet module of ``model`` (of the class :func:`mixer_class` names for
    its model type) through :func:`gated_deltanet_forward`; returns how many. Idempotent."""
    return recurrent.install(model, mixer_class(str(getattr(getattr(model, "config", None), "model_type", ""))),
                             _forward)


_forward = recurrent.routed(lambda mod, x, ctx: gated_deltanet_forward(mod, x, ctx))


def _refusal(ctx: Any) -> str | None:
    inner = getattr(ctx, "inner", None) if type(ctx) is UlyssesContext else ctx
    if type(inner) is not ChunkAttentionContext:
        return ("linear-attention (Gated DeltaNet) layers run under Ulysses sequence parallelism or none: a "
                "whole-doc / per-doc placed chunk would need the recurrent state passed between a stage's ranks; "
                "set concertina_sequence_parallel_mode='ulysses' (or concertina_sequence_parallel_size=1)")
    return recurrent.chunk_refusal(inner, "linear-attention (Gated DeltaNet)")


def sequence_parallel_refusal(config: Any, sp: int, mode: str = "ulysses") -> str | None:
    """Why a stage of ``sp`` ranks cannot run the Gated DeltaNet layers of ``config`` under
    ``concertina_sequence_parallel_mode`` ``mode`` (``None``: it can, or it has none). Ulysses splits their heads:
    ``sp`` must divide ``linear_num_key_heads`` (each rank then holds whole key heads and the value
    heads that read them); the whole-doc / per-doc placements are not implemented for them."""
    kind = getattr(config, "model_type", "?")
    types = getattr(config, "layer_types", None) or ()
    if sp <= 1 or kind not in GATED_DELTANET or "linear_attention" not in types:
        return None
    if mode != "ulysses":
        return (f"model type {kind!r}: linear-attention (Gated DeltaNet) layers run under Ulysses sequence "
                f"parallelism only (concertina_sequence_parallel_mode={mode!r} may place chunks whole-doc / per-doc, "
                "which would need the recurrent state passed between a stage's ranks); set "
                "concertina_sequence_parallel_mode='ulysses'")
    hk = int(getattr(config, "linear_num_key_heads", None) or 16)
    hv = int(getattr(config, "linear_num_value_heads", None) or 32)
    if hk % sp or hv % sp:
        return (f"model type {kind!r}: Ulysses splits the linear-attention (Gated DeltaNet) heads over the stage's "
                f"ranks, but linear_num_key_heads={hk} (value heads {hv}) is not a multiple of "
                f"concertina_sequence_parallel_size={sp}: choose a sequence parallel size dividing {hk}")
    return None


def gated_deltanet_forward(mod: nn.Module, hidden_states: torch.Tensor, ctx: Any) -> torch.Tensor:
    """HF's Gated DeltaNet ``forward`` (no cache) on one chunk ``[1, T, hidden]`` (a
    :class:`~.attention.ChunkAttentionContext`), per slice, or on a rank's local tokens under
    Ulysses (a :class:`~.ulysses.UlyssesContext`: :func:`_ulysses_core`); see the module docstring.
    ``mod``: the HF module, whose submodules and parameters are used as is."""
    why = _refusal(ctx)
    if why is not None:
        raise ValueError(why)
    x = hidden_states
    tokens = ctx.local_tokens if type(ctx) is UlyssesContext else ctx.num_tokens
    if x.shape[0] != 1 or x.shape[1] != tokens:
        raise ValueError(f"{type(mod).__name__} expects one packed row of {tokens} tokens, got {tuple(x.shape)}")
    adapter = _adapter(mod)
    qkv, z, beta, a = adapter.project(mod, x)
    if type(ctx) is UlyssesContext:
        core = _ulysses_core(mod, qkv, beta, a, ctx)
    else:
        core = _core(mod, qkv, beta, a, ctx, slice(None), (slice(None), slice(None)))
    core = getattr(mod, adapter.norm)(core.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim))
    return getattr(mod, adapter.out)(core.reshape(1, tokens, -1))


def _core(mod: nn.Module, qkv: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, ctx: ChunkAttentionContext,
          channels: torch.Tensor | slice, heads: tuple[slice, slice]) -> torch.Tensor:
    """The convolution and the scan per slice of ``ctx`` over the channels ``channels`` of the
    convolution (``qkv`` ``[1, T, C]`` holds those only) and the value heads ``heads[1]`` (``beta``,
    ``a`` ``[1, T, h]``; ``heads[0]``: the key heads, for nothing but the shapes) -> the scan's
    output ``[1, T, h, Dv]``. Carried states and tails are those of these heads and channels."""
    hf = sys.modules[type(mod).__module__]  # HF's module-level functions (a kernel mapped there included)
    layer, tokens = mod.layer_idx, qkv.shape[1]
    width = int(mod.conv1d.kernel_size[0]) - 1  # the earlier inputs each token's convolution reads
    weight = mod.conv1d.weight.squeeze(1)[channels]
    bias = None if mod.conv1d.bias is None else mod.conv1d.bias[channels]
    conv = per_document_conv(qkv.transpose(1, 2), ctx, layer, width, lambda t: hf.causal_conv1d_fn(
        t, weight, bias, activation=mod.activation), "recurrent state")
    mixed = conv.out.transpose(1, 2)  # [1, T, C]
    key_dim = (mixed.shape[-1] - beta.shape[-1] * mod.head_v_dim) // 2
    query, key, value = torch.split(mixed, [key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    query = query.reshape(1, tokens, -1, mod.head_k_dim)
    key = key.reshape(1, tokens, -1, mod.head_k_dim)
    value = value.reshape(1, tokens, -1, mod.head_v_dim)
    g = -mod.A_log[heads[1]].float().exp() * F.softplus(a.float() + mod.dt_bias[heads[1]])
    outs = []
    for i, s in enumerate(ctx.slices):
        sl = slice(s.offset, s.offset + s.length)
        initial = conv.carried[i].k_leaf if i in conv.carried else None
        out, state = hf.torch_chunk_gated_delta_rule(
            query[:, sl], key[:, sl], value[:, sl], g=g[:, sl], beta=beta[:, sl], initial_state=initial,
            output_final_state=not s.final, use_qk_l2norm_in_kernel=True)
        outs.append(out)
        if not s.final:
            ctx.store.put_if_absent(s.seq, s.start, layer, state, conv.tails[i], ctx.requires_grad)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _ulysses_core(mod: nn.Module, qkv: torch.Tensor, beta: torch.Tensor, a: torch.Tensor,
                  ctx: UlyssesContext) -> torch.Tensor:
    """Ulysses around :func:`_core`: ``qkv``, ``beta``, ``a`` of the rank's ``t`` local tokens and
    every head go through one all-to-all to all ``T`` tokens of the rank's heads (key heads
    ``[r Hk / sp, (r + 1) Hk / sp)`` and the value heads reading them: their convolution channels
    of ``q``, ``k`` and ``v``, and their ``beta``, ``a``); the convolution and the scan run per
    slice on those, with this rank's carried states and tails (its heads' only); the scan's output
    goes back by the inverse all-to-all -> ``[1, t, Hv, Dv]`` of the local tokens."""
    from .ulysses import all_to_all

    sp, rank, group = ctx.sp.size, ctx.sp.rank, ctx.sp.group
    hk, hv = mod.key_dim // mod.head_k_dim, mod.value_dim // mod.head_v_dim
    kr, vr = hk // sp, hv // sp
    t, n = ctx.local_tokens, ctx.num_tokens

    def channels(j: int) -> torch.Tensor:
        kd, vd = kr * mod.head_k_dim, vr * mod.head_v_dim
        return torch.cat([torch.arange(j * kd, (j + 1) * kd), torch.arange(mod.key_dim + j * kd, mod.key_dim + (j + 1) * kd),
                          torch.arange(2 * mod.key_dim + j * vd, 2 * mod.key_dim + (j + 1) * vd)])

    send = torch.stack([torch.cat([qkv[0][:, channels(j)], beta[0, :, j * vr:(j + 1) * vr],
                                   a[0, :, j * vr:(j + 1) * vr].to(qkv.dtype)], dim=-1) for j in range(sp)])
    got = all_to_all(send, group).reshape(1, sp * t, -1)[:, :n]  # [1, T, C_r + 2 vr]: all tokens, my heads
    c = got.shape[-1] - 2 * vr
    mine = slice(rank * vr, (rank + 1) * vr)
    core = _core(mod, got[..., :c], got[..., c:c + vr], got[..., c + vr:], ctx.inner, channels(rank),
                 (slice(rank * kr, (rank + 1) * kr), mine))  # [1, T, vr, Dv]
    core = F.pad(core, (0, 0, 0, 0, 0, sp * t - n)).reshape(sp, t, vr, mod.head_v_dim)
    back = all_to_all(core.contiguous(), group)  # block j: my tokens of rank j's heads
    return back.permute(1, 0, 2, 3).reshape(1, t, hv, mod.head_v_dim)
