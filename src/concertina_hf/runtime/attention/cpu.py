"""The CPU kernel: SDPA's flash kernel per segment, with no mask but a binding window's.

:class:`SegmentsCPU` runs ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (and its
backward) once or twice per segment: a segment with no context runs ``is_causal``; one with
context runs twice, its queries against the earlier slices' keys (no mask) and against its own
(``is_causal``), merged by logsumexp; only a binding sliding window gets an explicit mask (``s_i
x`` the keys within the window), built in forward and again in backward and never kept. No ``T x
S`` mask exists and no masked pair beyond a window is computed: cost follows the attended pairs
``sum(s_i * C_i + s_i^2 / 2)``.

Memory: it saves ``q, k, v, out, logsumexp`` and the earlier slices' leaves (alive in the store
anyway), not the concatenated keys of a segment with context, which it rebuilds in backward one
segment at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .context import ChunkAttentionContext, segment_mask
from .segments import pad_head_dims

__all__ = ["SegmentsCPU", "cpu_segments"]


def cpu_segments(ctx: ChunkAttentionContext, layer: int, window: int | None, dtype: torch.dtype
                 ) -> tuple[tuple, list[torch.Tensor], list[torch.Tensor]]:
    """Per slice ``(offset, length, start, lo, prefix indices, cut)`` plus the flat prefix leaves."""
    segs, pk, pv = [], [], []
    for s in ctx.slices:
        parts, cut, lo = ctx.prefix(s, layer, window, dtype)
        idx = tuple(range(len(pk), len(pk) + len(parts)))
        pk += [p[0] for p in parts]
        pv += [p[1] for p in parts]
        segs.append((s.offset, s.length, s.start, lo, idx, cut))
    return tuple(segs), pk, pv


def _cpu_seg_parts(query, key, value, pk, pv, seg, window):
    """The kernel calls of one segment: ``[(q, k, v, mask, causal)]``.

    A slice with context and no binding window: two calls, queries against the earlier slices'
    keys (no mask: all visible) and against their own keys (``is_causal``: square), merged by
    their logsumexp; no mask at all, no masked pair computed. Otherwise one call against
    ``[prefix, own]`` keys, ``is_causal`` (a whole sequence) or with an ``s x kc`` additive mask
    (a binding window)."""
    off, n, start, lo, idx, cut = seg
    q = query[:, :, off:off + n]
    k, v = key[:, :, off:off + n], value[:, :, off:off + n]
    if idx and (window is None or window >= start + n):
        kp = pk[idx[0]] if len(idx) == 1 else torch.cat([pk[i] for i in idx], dim=2)
        vp = pv[idx[0]] if len(idx) == 1 else torch.cat([pv[i] for i in idx], dim=2)
        if cut:  # a K/V tail (segment-level training) starts inside the first earlier slice
            kp, vp = kp[:, :, cut:], vp[:, :, cut:]
        return [(q, kp, vp, None, False), (q, k, v, None, True)]
    if idx:
        k = torch.cat([pk[i] for i in idx] + [k], dim=2)[:, :, cut:]
        v = torch.cat([pv[i] for i in idx] + [v], dim=2)[:, :, cut:]
    m = segment_mask(start, n, lo, window, query.device)
    mask = None
    if m is not None:
        mask = torch.zeros(m.shape, dtype=query.dtype, device=query.device).masked_fill_(~m, float("-inf"))
    return [(q, k, v, mask, mask is None)]


class SegmentsCPU(torch.autograd.Function):
    """SDPA's CPU flash kernel per segment (a slice's queries against ``[prefix, own]`` keys,
    :func:`_cpu_seg_parts`), saving the pieces (queries, own keys, earlier slices' leaves, output,
    logsumexp) rather than any concatenated copy; masks and concatenations are rebuilt in
    backward, one segment at a time. Two calls of one segment are merged by their logsumexp, and
    each call's backward with the merged output and logsumexp gives that call's exact share of
    the gradients. The key gradient is split back into the pieces (the leaves' share accumulates
    in their ``.grad``, which the runtime hands to the earlier slices' backward)."""

    @staticmethod
    def forward(fctx, query, key, value, scale, window, segs, n_prefix, *prefix):
        pk, pv = prefix[:n_prefix], prefix[n_prefix:]
        dv = value.shape[-1]
        # [1, H, T, Dv] laid out as [1, T, H, Dv], as the kernel lays out its own output: the
        # caller's transpose(1, 2).contiguous() is then free, and the one output saved here is
        # the one the next projection reads
        out = query.new_empty((1, query.shape[2], query.shape[1], dv)).transpose(1, 2)
        lses = []
        for seg in segs:
            off, n = seg[0], seg[1]
            res = []
            for q, k, v, mask, causal in _cpu_seg_parts(query, key, value, pk, pv, seg, window):
                q, k, v = pad_head_dims(q, k, v)
                res.append(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, causal, attn_mask=mask, scale=scale))
            if len(res) == 1:
                o, lse = res[0]
            else:
                (o1, l1), (o2, l2) = res
                lse = torch.logaddexp(l1, l2)
                o = o1.float() * torch.exp(l1 - lse)[..., None] + o2.float() * torch.exp(l2 - lse)[..., None]
            out[:, :, off:off + n] = o[..., :dv]
            lses.append(lse)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
        fctx.save_for_backward(query, key, value, out, lse, *prefix)
        fctx.scale, fctx.window, fctx.segs, fctx.n_prefix = scale, window, segs, n_prefix
        return out

    @staticmethod
    def backward(fctx, grad_out):
        query, key, value, out, lse, *prefix = fctx.saved_tensors
        n_prefix, window = fctx.n_prefix, fctx.window
        pk, pv = prefix[:n_prefix], prefix[n_prefix:]
        d, dv = query.shape[-1], value.shape[-1]
        # every token's gradient is written by its segment when the segments tile the chunk (the
        # runtime's always do): no zero fill needed
        new = torch.empty_like if _tiles(fctx.segs, query.shape[2]) else torch.zeros_like
        dquery, dkey, dvalue = new(query), new(key), new(value)
        dpk: list = [None] * n_prefix
        dpv: list = [None] * n_prefix
        for seg in fctx.segs:
            off, n, start, lo, idx, cut = seg
            o, go = out[:, :, off:off + n], grad_out[:, :, off:off + n]
            if dv < d:
                o, go = F.pad(o, (0, d - dv)), F.pad(go, (0, d - dv))
            o, go, l = o.contiguous(), go.contiguous(), lse[:, :, off:off + n].contiguous()
            dq, dks, dvs = 0, [], []
            for q, k, v, mask, causal in _cpu_seg_parts(query, key, value, pk, pv, seg, window):
                q, k, v = pad_head_dims(q, k, v)
                dq_i, dk_i, dv_i = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    go, q, k, v, o, l, 0.0, causal, attn_mask=mask, scale=fctx.scale)
                dq = dq + dq_i
                dks.append(dk_i)
                dvs.append(dv_i)
            dk = dks[0] if len(dks) == 1 else torch.cat(dks, dim=2)  # keys [prefix, own] from lo
            dvv = dvs[0] if len(dvs) == 1 else torch.cat(dvs, dim=2)
            dq, dk, dvv = dq[..., :d], dk[..., :d], dvv[..., :dv]
            dquery[:, :, off:off + n] = dq
            dkey[:, :, off:off + n] = dk[:, :, -n:]
            dvalue[:, :, off:off + n] = dvv[:, :, -n:]
            pos = -cut  # position of the current piece's first token in dk (negative: cut away)
            for i in idx:
                length = pk[i].shape[2]
                a, b = max(pos, 0), pos + length
                gk, gv = torch.empty_like(pk[i]), torch.empty_like(pv[i])
                if a > pos:  # tokens cut by the window get no gradient
                    gk[:, :, :a - pos].zero_()
                    gv[:, :, :a - pos].zero_()
                gk[:, :, a - pos:] = dk[:, :, a:b]
                gv[:, :, a - pos:] = dvv[:, :, a:b]
                dpk[i] = gk if dpk[i] is None else dpk[i] + gk
                dpv[i] = gv if dpv[i] is None else dpv[i] + gv
                pos = b
        return (dquery, dkey, dvalue, None, None, None, None, *dpk, *dpv)


def _tiles(segs, tokens: int) -> bool:
    """Whether the segments ``(offset, length, ...)`` cover ``[0, tokens)`` exactly, in order."""
    t = 0
    for seg in segs:
        if seg[0] != t:
            return False
        t += seg[1]
    return t == tokens
