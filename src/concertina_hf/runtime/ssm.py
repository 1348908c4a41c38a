"""Mamba2 (SSD) layers (a state space model with a recurrent state) in a pipeline chunk.

A Mamba2 mixer (the ``mamba`` of Bamba, Granite-4.0 hybrid and Falcon-H1, Nemotron-H's ``mixer``,
:data:`MAMBA2`) projects each
token to a gate, the convolution's input ``x | B | C`` and a time step ``dt``; a depthwise causal
convolution of width ``k`` runs over ``x | B | C`` (each token reads the ``k - 1`` inputs before
it), and the SSD scan carries a state per head (``[H, head_dim, d_state]``, float32) from token to
token. HF's ``forward`` runs both over its whole input, so on a packed chunk one document's tokens
would reach the next through either, and a split slice would start from zero instead of its
sequence's earlier tokens.

The classes differ only token-wise: how the hidden states become the projection (Falcon-H1
multiplies its input by ``ssm_in_multiplier`` and the projection by its ``mup_vector``; its gated
norm is optional, ``mamba_rms_norm``) and the gated norm after the scan. One :class:`Adapter` per class
says that; the per-document convolution, scan and carry are shared, as for the Gated DeltaNet
(:mod:`.linear_attention`; the convolution is :func:`~.causal_conv.per_document_conv`). HF's
module-level functions are read from the class's own module:
``causal_conv1d_fn`` and ``mamba2_chunk_scan`` (HF's torch chunked scan, ``segment_sum`` and all,
which takes an initial state and returns the final one; a kernel HF maps there is used).

:func:`install` replaces the ``forward`` of each such module of a model (an instance attribute;
the class is untouched) with :func:`mamba2_forward`, which reads the chunk context that the
runtime sets around each decoder-layer call (:func:`~.attention.context.current_context`, or the
``concertina_ctx`` keyword). Per slice of the chunk:

- **one document map**: the input projection, the gated norm and the output projection run over
  the whole chunk (token-wise); the convolution runs once over the chunk with each slice preceded
  by its own ``k - 1`` earlier inputs (zeros at a document start), and the scan runs per slice
  from its own initial state (zero at a document start): no token of one document reaches
  another, including the first ``k - 1`` tokens through the convolution;
- **carry with gradient**: a non-final slice keeps, per layer, its final SSM state (float32,
  ``[1, H, head_dim, d_state]``) and its convolution tail (the sequence's last ``k - 1``
  pre-convolution inputs up to the slice's end; a slice shorter than ``k - 1`` takes the rest from
  the tail it received) in the chunk's :class:`~.attention.KVStore` (``KVEntry.k``: the state,
  ``KVEntry.v``: the tail; a Falcon-H1 layer, whose attention keeps its K/V under the layer's index,
  under ``-1 - index``), as a Gated DeltaNet layer does; the executor hands the gradient the
  next slice's backward leaves on them to this slice's backward, and a recomputed layer's replay
  reads the same leaves (the store is set-if-absent).

Jamba's Mamba (1) mixer (:data:`MAMBA1`) runs the same way (:func:`mamba1_forward`): the convolution
per document over its projection's ``x`` half, HF's torch selective scan (a loop over tokens,
written here with an initial state: :func:`selective_scan`) per slice, its state
``[intermediate, d_state]`` float32 carried.

Outside a chunk and outside a step (a plain ``model(...)``, ``generate``) the module's own
``forward`` runs; inside a step without a chunk context it raises. Refused here with the feature
named: sequence parallelism (a Ulysses or placed chunk's context) and segment-level training.

Cost: per slice one scan call (HF's torch scan pads each call to a multiple of its
``chunk_size``) and one convolution over the chunk; per non-final slice and layer,
``H * head_dim * d_state`` float32 plus ``(k - 1) * conv_dim`` kept until the slice's backward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from . import recurrent
from .attention.context import ChunkAttentionContext
from .causal_conv import per_document_conv

__all__ = ["Adapter", "HYBRID_TYPES", "MAMBA1", "MAMBA2", "MIXERLESS_LAYER_TYPES", "MIXERS", "SSM_REFUSED", "SSM_TYPES",
           "install", "mamba1_forward", "mamba2_forward", "mixer_class", "selective_scan"]


def _project(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mod.in_proj(x)


def _gated_norm(mod: nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return mod.norm(y, gate)


def _falcon_h1_project(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mod.in_proj(x * mod.ssm_in_multiplier) * mod.mup_vector  # its mup multipliers, per section


def _falcon_h1_gated_norm(mod: nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return mod.norm(y, gate) if mod.mamba_rms_norm else y * torch.nn.functional.silu(gate)


@dataclass(frozen=True)
class Adapter:
    """What one HF Mamba2 class does token-wise around the shared convolution and scan."""

    module: str  #: the HF modeling module (its ``causal_conv1d_fn``, ``mamba2_chunk_scan``)
    cls: str  #: the mixer class in it
    attribute: str = "mamba"  #: the attribute of a decoder layer holding the mixer
    #: ``(mod, x [1, T, hidden])`` -> ``gate | x B C | dt`` ``[1, T, intermediate + conv_dim + heads]``
    project: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _project
    #: ``(mod, scan output [1, T, intermediate], gate)`` -> the output projection's input
    gated_norm: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = _gated_norm
    #: the layer's attention keeps its K/V under the layer's index: the state goes under ``-1 - index``
    beside_attention: bool = False
    #: the Mamba version: 2 (SSD, :func:`mamba2_forward`) or 1 (Jamba's selective scan, :func:`mamba1_forward`)
    version: int = 2


_HF = "transformers.models"
#: model type -> the :class:`Adapter` of its Mamba2 mixer, the classes this module implements
MAMBA2 = {
    "bamba": Adapter(f"{_HF}.bamba.modeling_bamba", "BambaMixer"),
    "granitemoehybrid": Adapter(f"{_HF}.granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer"),
    "nemotron_h": Adapter(f"{_HF}.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer", attribute="mixer"),
    "falcon_h1": Adapter(f"{_HF}.falcon_h1.modeling_falcon_h1", "FalconH1Mixer", project=_falcon_h1_project,
                         gated_norm=_falcon_h1_gated_norm, beside_attention=True),
}
#: model type -> the :class:`Adapter` of its Mamba (1) mixer (Jamba's, with norms on ``dt``, ``B``, ``C``)
MAMBA1 = {"jamba": Adapter(f"{_HF}.jamba.modeling_jamba", "JambaMambaMixer", version=1)}
#: every mixer this module runs, by model type
MIXERS = {**MAMBA2, **MAMBA1}
#: model types whose Mamba layers (``config.layer_types`` ``linear_attention``; Falcon-H1's ``hybrid``
#: layers run one beside their attention) run here
SSM_TYPES = frozenset(MIXERS)
#: model types whose ``hybrid`` layers (``config.layer_types``) hold a Mamba2 beside their attention
HYBRID_TYPES = frozenset({"falcon_h1"})
#: model types with state space layers this module does not run, and why (the message of their refusal)
SSM_REFUSED = {
    "mamba2": "its layout is model.backbone (embeddings, layers, norm_f), not model.model: the pipeline's stages "
              "read model.model.embed_tokens / .layers / .norm (its Mamba2 mixer is the one runtime/ssm.py runs for "
              "bamba, falcon_h1, granitemoehybrid and nemotron_h)",
    "zamba2": "its hybrid layers run one shared transformer block (the same Zamba2AttentionDecoderLayer in several "
              "layers, on the layer's input concatenated with the embeddings) beside the Mamba2: a module shared "
              "across stages and a second input stream the pipeline does not carry",
    "zamba": "its hybrid layers run one shared transformer block (the same ZambaAttentionDecoderLayer in several "
             "layers, on the layer's input concatenated with the embeddings) beside Mamba (1) layers: a module "
             "shared across stages and a second input stream the pipeline does not carry",
    **{kind: "its layout is model.backbone (embeddings, layers, norm_f), not model.model, and its Mamba (1) "
             "mixer is not one runtime/ssm.py runs (Jamba's): its state would cross packed sequences and be lost "
             "between slices of a split sequence"
       for kind in ("mamba", "falcon_mamba")},
}
#: model types with layer kinds (``config.layer_types``) that mix no tokens (Nemotron-H's MLP and MoE blocks)
MIXERLESS_LAYER_TYPES = {"nemotron_h": frozenset({"mlp", "moe"})}


def mixer_class(model_type: str) -> type | None:
    """The HF class of ``model_type``'s Mamba2 mixer (``None``: not implemented here, or not in the
    installed transformers)."""
    entry = MIXERS.get(model_type)
    return None if entry is None else recurrent.hf_class(entry.module, entry.cls)


def _adapter(mod: nn.Module) -> Adapter:
    cls = type(mod)
    for entry in MIXERS.values():
        if entry.cls == cls.__name__ and entry.module == cls.__module__:
            return entry
    raise TypeError(f"{cls.__module__}.{cls.__name__} is not a Mamba class of MIXERS")


def install(model: nn.Module) -> int:
    """Route every Mamba2 module of ``model`` (of the class :func:`mixer_class` names for its model
    type) through :func:`mamba2_forward`; returns how many. Idempotent."""
    return recurrent.install(model, mixer_class(str(getattr(getattr(model, "config", None), "model_type", ""))),
                             _forward)


_forward = recurrent.routed(lambda mod, x, ctx: (mamba1_forward if _adapter(mod).version == 1 else mamba2_forward)(
    mod, x, ctx))


def _refusal(ctx: Any) -> str | None:
    return recurrent.chunk_refusal(ctx, "Mamba2 (SSD)", "the SSM state passed between them",
                                   "their SSM state carries every earlier token")


def mamba2_forward(mod: nn.Module, hidden_states: torch.Tensor, ctx: ChunkAttentionContext) -> torch.Tensor:
    """HF's Mamba2 mixer ``forward`` (no cache, its torch path) on one chunk ``[1, T, hidden]``, per
    slice (see the module docstring). ``mod``: the HF module, whose submodules and parameters are
    used as is."""
    why = _refusal(ctx)
    if why is not None:
        raise ValueError(why)
    hf = sys.modules[type(mod).__module__]  # HF's module-level functions (a kernel mapped there included)
    adapter = _adapter(mod)
    layer = -1 - mod.layer_idx if adapter.beside_attention else mod.layer_idx  # its key in the store
    x = hidden_states
    if x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
        raise ValueError(f"{type(mod).__name__} expects one packed row of {ctx.num_tokens} tokens, got "
                         f"{tuple(x.shape)}")
    dtype = x.dtype
    gate, xbc, dt = adapter.project(mod, x).split([mod.intermediate_size, mod.conv_dim, mod.num_heads], dim=-1)
    width = int(mod.conv1d.kernel_size[0]) - 1  # the earlier inputs each token's convolution reads
    doc = per_document_conv(xbc.transpose(1, 2), ctx, layer, width, lambda cols: hf.causal_conv1d_fn(
        cols, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, activation=mod.activation), state="SSM state")
    xbc = doc.out.transpose(1, 2)  # [1, T, C]
    groups = mod.n_groups * mod.ssm_state_size
    hs, b, c = torch.split(xbc, [mod.intermediate_size, groups, groups], dim=-1)
    a = -torch.exp(mod.A_log.float())
    outs = []
    for i, s in enumerate(ctx.slices):
        sl, n = slice(s.offset, s.offset + s.length), s.length
        initial = doc.carried[i].k_leaf if i in doc.carried else None
        out = hf.mamba2_chunk_scan(
            hs[:, sl].reshape(1, n, mod.num_heads, mod.head_dim), dt[:, sl], a,
            b[:, sl].reshape(1, n, mod.n_groups, mod.ssm_state_size),
            c[:, sl].reshape(1, n, mod.n_groups, mod.ssm_state_size),
            chunk_size=mod.chunk_size, D=mod.D, z=None, return_final_states=not s.final, dt_bias=mod.dt_bias,
            dt_softplus=True, initial_states=initial, dt_limit=mod.time_step_limit)
        if not s.final:
            out, state = out
            ctx.store.put_if_absent(s.seq, s.start, layer, state, doc.tails[i], ctx.requires_grad)
        outs.append(out.reshape(1, n, mod.intermediate_size))
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    y = adapter.gated_norm(mod, y, gate)
    return mod.out_proj(y.to(dtype))


def selective_scan(hs: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   d: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor | None,
                   initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's torch selective scan (``mamba_selective_scan``'s recurrent iteration, ``dt_bias`` and
    softplus on ``dt``, the ``D`` skip and the ``silu(z)`` gate) from the state ``initial``
    (``[1, I, N]``; ``None``: zeros, as HF's): ``hs``, ``dt``, ``z`` ``[1, I, n]``, ``b``, ``c``
    ``[1, n, N]``. Returns the output ``[1, I, n]`` and the final state (float32)."""
    input_dtype = hs.dtype
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)[..., None]
    dt = torch.nn.functional.softplus(dt)
    discrete_a = torch.exp(a[None, :, None, :] * dt[:, :, :, None])
    delta_b_u = dt[:, :, :, None] * b[:, None, :, :].float() * hs[:, :, :, None].float()
    state = initial if initial is not None else hs.new_zeros(hs.shape[0], hs.shape[1], a.shape[-1])
    outs = []
    for i in range(hs.shape[-1]):
        state = discrete_a[:, :, i] * state + delta_b_u[:, :, i]
        outs.append(torch.matmul(state.to(input_dtype), c[:, i, :].unsqueeze(-1))[:, :, 0])
    y = torch.stack(outs, dim=-1)
    y = y + hs * d[None, :, None]
    return y * torch.nn.functional.silu(z), state.float()


def mamba1_forward(mod: nn.Module, hidden_states: torch.Tensor, ctx: ChunkAttentionContext) -> torch.Tensor:
    """HF's Jamba Mamba (1) mixer ``forward`` (no cache, its torch path) on one chunk ``[1, T, hidden]``,
    per slice as :func:`mamba2_forward`: the convolution per document over the projection's ``x``
    half, ``x_proj`` and the norms on ``dt``, ``B``, ``C`` token-wise, :func:`selective_scan` per slice
    from the carried state ``[1, intermediate, d_state]`` (float32). HF's scan is a loop over tokens:
    one step per token and slice."""
    why = _refusal(ctx)
    if why is not None:
        raise ValueError(why)
    hf = sys.modules[type(mod).__module__]
    layer = mod.layer_idx
    x = hidden_states
    if x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
        raise ValueError(f"{type(mod).__name__} expects one packed row of {ctx.num_tokens} tokens, got "
                         f"{tuple(x.shape)}")
    dtype = x.dtype
    xs, gate = mod.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # [1, I, T] each
    width = int(mod.conv1d.kernel_size[0]) - 1
    doc = per_document_conv(xs, ctx, layer, width, lambda cols: hf.causal_conv1d_fn(
        cols, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, activation=mod.activation), state="SSM state")
    xs = doc.out  # [1, I, T]
    time_step, b, c = torch.split(mod.x_proj(xs.transpose(1, 2)),
                                  [mod.time_step_rank, mod.ssm_state_size, mod.ssm_state_size], dim=-1)
    time_step, b, c = mod.dt_layernorm(time_step), mod.b_layernorm(b), mod.c_layernorm(c)
    time_step = mod.dt_proj.weight @ time_step.transpose(1, 2)  # [1, I, T]
    a = -torch.exp(mod.A_log.float())
    dt_bias = mod.dt_proj.bias.float() if mod.dt_proj.bias is not None else None
    outs = []
    for i, s in enumerate(ctx.slices):
        sl = slice(s.offset, s.offset + s.length)
        initial = doc.carried[i].k_leaf if i in doc.carried else None
        y, state = selective_scan(xs[:, :, sl], time_step[:, :, sl], a, b[:, sl], c[:, sl], mod.D.float(),
                                  gate[:, :, sl], dt_bias, initial)
        if not s.final:
            ctx.store.put_if_absent(s.seq, s.start, layer, state, doc.tails[i], ctx.requires_grad)
        outs.append(y)
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return mod.out_proj(y.transpose(1, 2).to(dtype))
