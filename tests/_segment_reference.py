"""The plain-HF reference of segment-level training, shared by the runtime and trainer tests.

:func:`segment_logits` runs one sequence segment by segment through an HF causal LM with
``past_key_values`` (a :class:`~transformers.DynamicCache` built from the earlier segments' K/V, as
HF's own cache keeps them: post-rotary), cut to the K/V tail (keys at positions ``>= start - W``) and
detached beyond the immediately preceding segment under ``gradient="previous"`` (all of it under
``"none"``); positions are
continued through ``position_ids`` and HF builds its mask from the cache (``cache_position``).

With ``global_heads`` (query heads) the cache holds every earlier token, those before the tail
detached, and the model gets a per-head 4D additive mask (HF passes a 4D mask through as it is): the
global heads see every earlier token, the others only the tail.

:func:`segment_plan` cuts a batch at segments by hand (split chunks, a hybrid last segment);
:func:`segment_reference` is the loss and gradients of a batch through :func:`segment_logits`; the
tolerances of the comparisons (:data:`LOSS_TOL`, :data:`GRAD_TOL`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from concertina_hf.planning.segments import SegmentOptions, segment_cuts


def segment_logits(model, ids: torch.Tensor, tokens: int, gradient: str = "full", kv_tail: int | None = None,
                   position_offset: int = 0, global_heads=()) -> torch.Tensor:
    """Logits ([n, V]) of the 1-D sequence ``ids`` under the segment semantics (module docstring)."""
    from transformers import DynamicCache

    n = ids.shape[0]
    num_layers = model.config.num_hidden_layers
    kept = []  # per earlier segment: (start, [(k, v) per layer]), attached to the graph
    logits = []
    for k, start in enumerate(range(0, n, tokens)):
        length = min(tokens, n - start)
        lo = 0 if kv_tail is None else max(0, start - kv_tail)
        if global_heads:  # every earlier token in the cache, a per-head mask cuts the others' to the tail
            lo, tail_lo = 0, lo
        cache = DynamicCache()
        past = 0
        for layer in range(num_layers):
            ks, vs = [], []
            for j, (s0, kvs) in enumerate(kept):
                kk, vv = kvs[layer]
                a = max(0, lo - s0)
                if a >= kk.shape[2]:
                    continue
                kk, vv = kk[:, :, a:], vv[:, :, a:]
                if gradient == "none" or (gradient == "previous" and j < k - 1):
                    kk, vv = kk.detach(), vv.detach()
                if global_heads and s0 < tail_lo:  # before the tail: read detached (global heads only)
                    cut = min(tail_lo - s0, kk.shape[2])
                    kk = torch.cat([kk[:, :, :cut].detach(), kk[:, :, cut:]], dim=2)
                    vv = torch.cat([vv[:, :, :cut].detach(), vv[:, :, cut:]], dim=2)
                ks.append(kk)
                vs.append(vv)
            if ks:
                cache.update(torch.cat(ks, dim=2), torch.cat(vs, dim=2), layer)
                past = cache.get_seq_length()
        mask = None
        if global_heads:
            heads = model.config.num_attention_heads
            qp = torch.arange(start, start + length)[:, None]
            kp = torch.arange(0, start + length)[None, :]
            allowed = (kp <= qp)[None].repeat(heads, 1, 1)
            others = [h for h in range(heads) if h not in set(global_heads)]
            allowed[others] &= (kp >= tail_lo)
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None]
            mask = mask.to(ids.device)
        out = model(input_ids=ids[None, start:start + length],
                    position_ids=torch.arange(start, start + length, device=ids.device)[None] + position_offset,
                    cache_position=torch.arange(past, past + length, device=ids.device),
                    past_key_values=cache, use_cache=True, attention_mask=mask)
        kept.append((start, [(out.past_key_values.layers[l].keys[:, :, -length:],
                              out.past_key_values.layers[l].values[:, :, -length:]) for l in range(num_layers)]))
        logits.append(out.logits[0])
    return torch.cat(logits)


#: loss (relative) and gradient tolerances of a run against the segment reference
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
#: the segment length of the runtime tests
S = 8


def segment_chunks(seq_lens, tokens: int):
    """Hand-made chunks: each split sequence's segments as split chunks, its last segment packed with
    one unsplit sequence (a hybrid chunk), the other short sequences packed together."""
    chunks, short = [], [i for i, n in enumerate(seq_lens) if n <= tokens]
    for i, n in enumerate(seq_lens):
        if n <= tokens:
            continue
        start, cuts = 0, segment_cuts(n, tokens)
        for length in cuts[:-1]:
            chunks.append([(i, start, length)])
            start += length
        last = [(i, start, cuts[-1])]
        if short:
            q = short.pop()
            last.append((q, 0, seq_lens[q]))
        chunks.append(last)
    if short:
        chunks.append([(q, 0, seq_lens[q]) for q in short])
    return chunks


def segment_plan(layout, opts: SegmentOptions, recompute="none", seq_lens=None):
    """A plan of the batch (``_runtime_cases.SEQ_LENS`` by default) cut at its segments by hand."""
    import dataclasses

    from _runtime_cases import SEQ_LENS, make_plan

    seq_lens = SEQ_LENS if seq_lens is None else seq_lens
    plan = make_plan(seq_lens, segment_chunks(seq_lens, opts.tokens), layout, recompute)
    return dataclasses.replace(plan, knobs=plan.knobs + opts.knobs())


def segment_reference(model, ids, labels, opts: SegmentOptions):
    """Plain HF, segment by segment with a DynamicCache cut to the tail (:func:`segment_logits`):
    loss (token-weighted over the batch) and gradients."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    n_items = int(sum(int((lab[1:] != -100).sum()) for lab in labels))
    total = 0.0
    for t, lab in zip(ids, labels):
        logit = segment_logits(ref, t, opts.tokens, opts.gradient, opts.kv_tail, global_heads=opts.global_heads)
        loss = F.cross_entropy(logit[:-1].float(), lab[1:], ignore_index=-100, reduction="sum") / n_items
        loss.backward()
        total += float(loss.detach())
    grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}
    return total, grads
