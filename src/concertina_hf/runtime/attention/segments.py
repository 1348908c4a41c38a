"""Attention one segment (slice) at a time through plain autograd, on any device.

- :func:`segments_sdpa`: ``F.scaled_dot_product_attention`` per segment, ``is_causal`` or an
  ``s_i x (C_i + s_i)`` boolean mask (:func:`~.context.segment_mask`), never a ``T x S`` mask:
  CUDA without a varlen kernel (float32, dropout with ``varlen_attn``, what FlashAttention-2 does
  not take) and CPU with dropout;
- :func:`segments_math`: HF's eager formula (:func:`eager_attention`) per segment, for what the
  kernels do not implement: attention soft-capping (Gemma2's ``softcap``; flash-attn does it
  itself) and attention sinks (gpt-oss's ``s_aux``, per-query ``sinks``);
- :func:`pad_head_dims`: MLA's value heads of another size than query/key heads, zero-padded for
  the kernels that take one head size (every kernel of the backend uses it).

Costs: both paths concatenate a segment's ``[prefix, own]`` keys through ``torch.cat``, so
autograd keeps the ``C + s`` keys of each layer until the slice's backward (``O(n^2)`` K/V over a
chain of ``n`` slices); the eager path also keeps the ``H x s_i x (C_i + s_i)`` probabilities of
each segment for backward, like HF's eager path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .context import ChunkAttentionContext, segment_mask

__all__ = ["eager_attention", "pad_head_dims", "segments_math", "segments_sdpa", "sink_rows"]


def pad_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA (value heads of another size than query/key heads) for kernels that need one head
    size: zero-pad the smaller side (zero value columns give zero output columns, cut later;
    zero query/key columns leave the scores unchanged under an explicit scale)."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    return q, k, v


def segments_sdpa(ctx: ChunkAttentionContext, layer: int, query, key, value, scale: float,
                  window: int | None, dropout: float) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` once per segment (``is_causal`` or an ``s x kc``
    boolean mask): SDPA on CUDA without a varlen kernel, and CPU with dropout. -> [1, H, T, Dv]."""
    gqa = query.shape[1] != key.shape[1]
    dv = value.shape[-1]
    outs = []
    for s in ctx.slices:
        k, v, lo = ctx.segment_kv(s, layer, key, value, window)
        q = query[:, :, s.offset:s.offset + s.length]
        q, k, v = pad_head_dims(q, k, v)
        m = segment_mask(s.start, s.length, lo, window, query.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout, is_causal=m is None,
                                           scale=scale, enable_gqa=gqa)
        outs.append(o[..., :dv])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None,
                    sink: torch.Tensor | None, dropout: float, allowed: torch.Tensor | None = None,
                    additive: torch.Tensor | None = None) -> torch.Tensor:
    """HF's eager attention formula (``q`` [B, H, q, D], ``k``/``v`` [B, K, kv, D]) with soft-capping
    (Gemma2: ``cap * tanh(scores / cap)`` before the mask) and sinks (gpt-oss: one more logit per
    head, or per head and query, with a zero value), softmax in float32. -> [B, H, q, Dv]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if additive is not None:
        w = w + additive
    if allowed is not None:
        w = w.masked_fill(~allowed, torch.finfo(w.dtype).min)
    if sink is not None:
        sink = sink.to(w.dtype).expand(w.shape[0], w.shape[1], w.shape[2], 1)
        p = F.softmax(torch.cat([w, sink], dim=-1).float(), dim=-1)[..., :-1]
    else:
        p = F.softmax(w.float(), dim=-1)
    p = p.to(v.dtype)
    if dropout:
        p = F.dropout(p, p=dropout, training=True)
    return torch.matmul(p, v)


def sink_rows(sink: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """Sinks as [B, H, q or 1, 1]: ``s_aux`` is one logit per head ([H]); per-query sinks come as
    [B, H, q, 1]."""
    if sink is None or sink.dim() == 4:
        return sink
    if sink.numel() != heads:
        raise ValueError(f"attention sinks of shape {tuple(sink.shape)} for {heads} heads: expected [H] or [B, H, q, 1]")
    return sink.reshape(1, heads, 1, 1)


def segments_math(ctx: ChunkAttentionContext, layer: int, query, key, value, scale: float,
                  window: int | None, dropout: float, softcap: float | None,
                  sink: torch.Tensor | None) -> torch.Tensor:
    """:func:`eager_attention` once per segment (``s x kc`` mask). -> [1, H, T, Dv]."""
    sink = sink_rows(sink, query.shape[1])
    outs = []
    for s in ctx.slices:
        k, v, lo = ctx.segment_kv(s, layer, key, value, window)
        q = query[:, :, s.offset:s.offset + s.length]
        m = segment_mask(s.start, s.length, lo, window, query.device)
        if m is None:
            m = torch.ones(s.length, s.length, dtype=torch.bool, device=query.device).tril()
        sk = sink if sink is None or sink.shape[2] == 1 else sink[:, :, s.offset:s.offset + s.length]
        outs.append(eager_attention(q, k, v, scale, softcap, sk, dropout, allowed=m))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
