"""The attention-interface function: :func:`concertina_attention_forward`.

Per layer, with the chunk's context (:mod:`.context`): check the keywords (:mod:`.keywords`),
store the non-final slices' own K/V, then run the kernel :func:`~.kernels.choose_kernel` picks (a
chunked-attention layer on the context's pieces, a position-free Llama 4 layer with its queries'
temperature at each token's own position: :mod:`.chunked`).
Within a step it also raises on an ``attention_mask`` (the context defines the mask) and on
``is_causal=False``.

Under autocast (``torch.autocast``, e.g. ``bf16=True``), query, key and value are first cast to the
autocast dtype, as SDPA (an autocast op) would cast them in HF's own path: post-rotary query and
key are often float32 (rotary tables in the parameters' dtype) while value is already bfloat16.
Casting before the own K/V are stored gives stored K/V, later slices' leaves and every attention
path one dtype (and halves the stored K/V of float32 models); the replay of a checkpointed layer
runs under the same autocast state (``torch.utils.checkpoint`` restores it).

Without a context and outside a step (a plain ``model(...)`` call on a model set to
``"concertina"``) the function falls back to HF's SDPA path (the eager formula when the layer
passes ``softcap`` or sinks, which HF's SDPA does not implement), and the mask function
registered under the same name is HF's SDPA mask, so ``generate`` and ordinary evaluation work.
"""

from __future__ import annotations

from typing import Any

import torch

from . import kernels
from .chunked import attention_chunk, temperature_fix, tempers_queries
from .context import ChunkAttentionContext, current_context, step_running
from .cpu import SegmentsCPU, cpu_segments
from .indexed import UNMASKED, Selection, indexed_attention, mask_with_indices
from .keywords import check_keywords, model_type_of
from .segments import eager_attention, global_heads_attention, segments_math, segments_sdpa, sink_rows
from .varlen import varlen_path

__all__ = ["autocast_dtype", "concertina_attention_forward"]


def concertina_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    is_causal: bool | None = None,
    concertina_ctx: ChunkAttentionContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function. ``query`` [1, H, T, D], ``key``/``value`` [1, K, T, D] /
    [1, K, T, Dv] (post-rotary); returns ``([1, T, H, Dv], None)``. See the module docstring."""
    ctx = concertina_ctx if concertina_ctx is not None else current_context()
    selection = kwargs.pop("indices") if isinstance(kwargs.get("indices"), Selection) else None  # .indexed
    check_keywords(kwargs, module, ctx is not None)
    if s_aux is not None and sinks is not None:
        raise ValueError(f"{type(module).__name__} (model type {model_type_of(module)!r}) passes both s_aux and sinks")
    sink = s_aux if s_aux is not None else sinks
    if ctx is None:
        if step_running():
            raise RuntimeError(
                f"{type(module).__name__} (model type {model_type_of(module)!r}, layer "
                f"{getattr(module, 'layer_idx', '?')}) called the concertina attention without a chunk context while "
                "a pipeline step runs: it would attend across packed sequences and lose earlier slices' K/V")
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                         sink, is_causal, kwargs), None
    sp_attention = getattr(ctx, "sequence_parallel_attention", None)
    if sp_attention is not None and tempers_queries(module):
        raise ValueError(f"{type(module).__name__} (model type {model_type_of(module)!r}) scales its queries by the "
                         "row index (attn_temperature_tuning), which a token shard of sequence parallelism does not "
                         "reproduce; set concertina_sequence_parallel_size=1")
    if sp_attention is not None:  # Ulysses (runtime/ulysses.py): back here on all tokens of this rank's heads
        return sp_attention(concertina_attention_forward, module, query, key, value, attention_mask=attention_mask,
                            dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                            sink=sink, is_causal=is_causal, **kwargs)
    if attention_mask is not None and not (selection is not None and attention_mask is UNMASKED):
        raise ValueError(
            f"{type(module).__name__} (model type {model_type_of(module)!r}) passes an attention_mask inside a "
            "concertina chunk, whose mask the chunk context defines; refusing to ignore it")
    if is_causal is False:
        raise ValueError(
            f"{type(module).__name__} (model type {model_type_of(module)!r}) asks for non-causal attention "
            "(is_causal=False); the concertina backend is causal only")
    if query.shape[0] != 1 or query.shape[2] != ctx.num_tokens:
        raise ValueError(
            f"concertina attention expects one packed row of {ctx.num_tokens} tokens, got query {tuple(query.shape)}"
        )
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx; the concertina backend needs it to key K/V")
    amp = autocast_dtype(query.device.type)
    if amp is not None:
        # Under autocast, SDPA would run in the autocast dtype whatever its inputs are (post-rotary
        # query/key are often float32, value already bfloat16). Cast here, before the own K/V are
        # stored, so that stored K/V, later slices and every attention path share one dtype.
        query, key, value = (_autocast_cast(t, amp) for t in (query, key, value))
    if tempers_queries(module):  # HF scaled by the row index; the scale of each token's own position
        query = temperature_fix(module, query, ctx.position_ids)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window is not None and sliding_window > 0 else None
    chunk = attention_chunk(module, layer)
    if chunk is not None and window is not None:
        raise ValueError(f"{type(module).__name__} (model type {model_type_of(module)!r}) layer {layer} is a "
                         "chunked_attention layer and passes a sliding window; the backend does one or the other")
    kernel = kernels.choose_kernel(query.device, query.dtype, dropout, softcap, sink is not None, window,
                                   max(query.shape[-1], value.shape[-1]))  # the head dim after pad_head_dims
    kernels.note_kernel(kernel, query.device)
    ctx.store_own(layer, key, value)
    if selection is not None:  # top-k indexed attention: the indexer's selection is the mask (.indexed)
        return indexed_attention(ctx, layer, query, key, value, scale, dropout, selection), None
    if chunk is not None:  # each slice's pieces within one chunk of its document (.chunked)
        if getattr(ctx.store, "global_heads", ()):
            raise ValueError("concertina_segment_global_heads reads keys outside the attention chunk of a "
                             f"chunked_attention layer (layer {layer}); leave it empty for this model")
        ctx = ctx.chunked(chunk)
    if kernel in ("flash-attn", "torch-varlen"):
        out = varlen_path(kernel, ctx, layer, query, key, value, scale, window, dropout, softcap)
    else:
        if kernel == "sdpa-cpu-flash":
            segs, pk, pv = cpu_segments(ctx, layer, window, key.dtype)
            out = SegmentsCPU.apply(query, key, value, scale, window, segs, len(pk), *pk, *pv)
        elif kernel == "sdpa-per-segment":
            out = segments_sdpa(ctx, layer, query, key, value, scale, window, dropout)
        else:
            out = segments_math(ctx, layer, query, key, value, scale, window, dropout, softcap, sink)
        out = out.transpose(1, 2).contiguous()
    if getattr(getattr(ctx, "store", None), "global_heads", ()) and ctx.has_context:  # segment-level training's global heads
        out = global_heads_attention(ctx, layer, out, query, key, value, scale, window, dropout, softcap, sink)
    return out, None


def _fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, sink,
              is_causal, kwargs) -> torch.Tensor:
    """No chunk context, no step: HF's SDPA path; the eager formula with HF's mask when the
    layer passes soft-capping or sinks (HF's SDPA refuses the first and ignores the second); HF's
    top-k ``indices`` of an indexed layer masked as HF's eager path does."""
    indices = kwargs.pop("indices", None)
    if indices is not None:
        attention_mask = mask_with_indices(attention_mask, indices, key.shape[2], query.dtype)
    if softcap is None and sink is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)[0]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    allowed = additive = None
    if attention_mask is None:
        if is_causal is not False and query.shape[2] > 1:  # bottom-right: queries are the last tokens
            qn, kn = query.shape[2], key.shape[2]
            allowed = torch.ones(qn, kn, dtype=torch.bool, device=query.device).tril(kn - qn)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        additive = attention_mask
    out = eager_attention(query, key, value, scale, softcap, sink_rows(sink, query.shape[1]), dropout, allowed,
                          additive)
    return out.transpose(1, 2).contiguous()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for ``device_type`` (``None`` when autocast is off)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _autocast_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # autocast's own rule for its lower-precision ops: floating tensors except float64
    if t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype:
        return t.to(dtype)
    return t
