"""Attention one segment (slice) at a time through plain autograd, on any device.

- :func:`segments_sdpa`: ``F.scaled_dot_product_attention`` per segment, ``is_causal`` or an
  ``s_i x (C_i + s_i)`` boolean mask (:func:`~.context.segment_mask`), never a ``T x S`` mask:
  CUDA without a varlen kernel (float32, dropout with ``varlen_attn``, what FlashAttention-2 does
  not take) and CPU with dropout;
- :func:`segments_math`: HF's eager formula (:func:`eager_attention`) per segment, for what the
  kernels do not implement: attention soft-capping (Gemma2's ``softcap``; flash-attn does it
  itself) and attention sinks (gpt-oss's ``s_aux``, per-query ``sinks``);
- :func:`pad_head_dims`: MLA's value heads of another size than query/key heads, zero-padded for
  the kernels that take one head size (every kernel of the backend uses it);
- :func:`global_heads_attention`: segment-level training's global heads (the store's
  ``global_heads``), recomputed over every earlier key (those before the K/V tail detached) for
  the segments the tail binds, their outputs replacing the kernel's for those heads.

Costs: both paths concatenate a segment's ``[prefix, own]`` keys through ``torch.cat``, so
autograd keeps the ``C + s`` keys of each layer until the slice's backward (``O(n^2)`` K/V over a
chain of ``n`` slices); the eager path also keeps the ``H x s_i x (C_i + s_i)`` probabilities of
each segment for backward, like HF's eager path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .context import ChunkAttentionContext, segment_mask

__all__ = ["eager_attention", "global_heads_attention", "pad_head_dims", "segments_math", "segments_sdpa",
           "sink_rows"]


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


def global_heads_attention(ctx: ChunkAttentionContext, layer: int, out: torch.Tensor, query, key, value,
                           scale: float, window: int | None, dropout: float, softcap: float | None,
                           sink: torch.Tensor | None) -> torch.Tensor:
    """``out`` ([1, T, H, Dv], the kernel's output under the K/V tail) with the global heads'
    outputs replaced, on the segments whose tail cuts earlier keys: those heads' queries against
    ``[detached keys before the tail, the keys the tail keeps (gradient as the other heads), own]``,
    causal (and a layer's sliding window), by :func:`eager_attention` (SDPA without soft-capping
    or sinks). Costs: those heads attend to every earlier key, and keep the concatenated keys
    of the global heads' K/V heads for backward."""
    store = ctx.store
    heads = list(store.global_heads)
    kv_idx, head_kv = store.head_groups(query.shape[1], key.shape[1])
    kv_idx = list(kv_idx)
    hsel = torch.tensor(heads, device=query.device)
    kmap = torch.tensor(head_kv, device=query.device)
    sink = sink_rows(sink, query.shape[1])
    pieces, changed = [], False
    base = out[:, :, hsel].transpose(1, 2)  # [1, G, T, Dv]
    for s in ctx.slices:
        lo_g = 0 if window is None else max(0, s.start - window + 1)  # the window's first key
        if max(0, s.start - store.kv_tail) <= lo_g:  # the tail cuts nothing the window reaches
            pieces.append(base[:, :, s.offset:s.offset + s.length])
            continue
        changed = True
        k, v, lo = ctx.segment_kv(s, layer, key, value, window)
        k_old, v_old = store.global_prefix(s.seq, lo_g, lo, layer)
        k = torch.cat([k_old.to(k.dtype), k[:, kv_idx]], dim=2)[:, kmap]  # [1, G, start + n - lo_g, D]
        v = torch.cat([v_old.to(v.dtype), v[:, kv_idx]], dim=2)[:, kmap]
        q = query[:, heads, s.offset:s.offset + s.length]
        m = segment_mask(s.start, s.length, lo_g, window, query.device)
        if m is None:
            m = torch.ones(s.length, s.length, dtype=torch.bool, device=query.device).tril()
        if softcap is None and sink is None:
            qp, kp, vp = pad_head_dims(q, k, v)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=m, dropout_p=dropout, scale=scale)
            o = o[..., :value.shape[-1]]
        else:
            sk = None if sink is None else sink[:, hsel]
            if sk is not None and sk.shape[2] != 1:
                sk = sk[:, :, s.offset:s.offset + s.length]
            o = eager_attention(q, k, v, scale, softcap, sk, dropout, allowed=m)
        pieces.append(o.to(base.dtype))
    if not changed:
        return out
    glob = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)  # [1, G, T, Dv]
    return out.index_copy(2, hsel, glob.transpose(1, 2))
