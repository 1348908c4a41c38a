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
"""

from __future__ import annotations

import torch


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
