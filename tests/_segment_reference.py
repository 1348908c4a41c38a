"""The plain-HF reference of segment-level training (issue 24), shared by the runtime and trainer tests.

:func:`segment_logits` runs one sequence segment by segment through an HF causal LM with
``past_key_values`` (a :class:`~transformers.DynamicCache` built from the earlier segments' K/V, as
HF's own cache keeps them: post-rotary), cut to the K/V tail (keys at positions ``>= start - W``) and
detached beyond the immediately preceding segment under ``gradient="previous"``; positions are
continued through ``position_ids`` and HF builds its mask from the cache (``cache_position``).
"""

from __future__ import annotations

import torch


def segment_logits(model, ids: torch.Tensor, tokens: int, gradient: str = "full", kv_tail: int | None = None,
                   position_offset: int = 0) -> torch.Tensor:
    """Logits ([n, V]) of the 1-D sequence ``ids`` under the segment semantics (module docstring)."""
    from transformers import DynamicCache

    n = ids.shape[0]
    num_layers = model.config.num_hidden_layers
    kept = []  # per earlier segment: (start, [(k, v) per layer]), attached to the graph
    logits = []
    for k, start in enumerate(range(0, n, tokens)):
        length = min(tokens, n - start)
        lo = 0 if kv_tail is None else max(0, start - kv_tail)
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
                if gradient == "previous" and j < k - 1:
                    kk, vv = kk.detach(), vv.detach()
                ks.append(kk)
                vs.append(vv)
            if ks:
                cache.update(torch.cat(ks, dim=2), torch.cat(vs, dim=2), layer)
                past = cache.get_seq_length()
        out = model(input_ids=ids[None, start:start + length],
                    position_ids=torch.arange(start, start + length, device=ids.device)[None] + position_offset,
                    cache_position=torch.arange(past, past + length, device=ids.device),
                    past_key_values=cache, use_cache=True)
        kept.append((start, [(out.past_key_values.layers[l].keys[:, :, -length:],
                              out.past_key_values.layers[l].values[:, :, -length:]) for l in range(num_layers)]))
        logits.append(out.logits[0])
    return torch.cat(logits)
