"""Plans and cost models the planning tests share (``test_simulate.py``, ``test_recompute.py``):
Llama-8B's shape on an A800, long-tailed sequence lengths, and :func:`make_plan`, a deliberately
simple chunker (long sequences cut into equal slices, short ones packed first-fit-decreasing,
optionally into the tail slice).
"""

from __future__ import annotations

import math
import random

from concertina_hf.planning import Chunk, ChunkKind, CostModel, DeviceSpec, Plan, Slice, StageLayout, build_schedule

LLAMA8B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
    vocab_size=128256, num_hidden_layers=32,
)


def llama_cost(**overrides) -> CostModel:
    import dataclasses

    cost = CostModel.from_hf_config(LLAMA8B, DeviceSpec.a800())
    return dataclasses.replace(cost, **overrides) if overrides else cost


def skewed_lengths(rng: random.Random, num: int, max_len: int = 131072, scale: int = 600) -> list[int]:
    """Long-tailed lengths (Pareto), like code / web corpora: most short, a few very long."""
    return [max(1, min(max_len, int(rng.paretovariate(1.1) * scale))) for _ in range(num)]


def make_plan(seq_lens, num_stages: int, max_tokens: int, num_layers: int = 32, num_groups: int = 1,
              pack_tails: bool = True, layout: StageLayout | None = None) -> Plan:
    """A valid plan by simple rules: sequences longest first; one longer than ``max_tokens`` is
    cut into equal slices (split chunks, then a hybrid tail that short sequences may join);
    short ones are packed first-fit-decreasing under ``max_tokens``. Sequences are dealt into
    ``num_groups`` pipeline groups by position. Recompute is all zeros."""
    order = sorted(range(len(seq_lens)), key=lambda q: (-seq_lens[q], q))
    per_group = max(1, math.ceil(len(order) / num_groups))
    raw: list[tuple[ChunkKind, list[Slice]]] = []
    groups: list[tuple[int, ...]] = []
    for g0 in range(0, len(order), per_group):
        members = order[g0:g0 + per_group]
        first = len(raw)
        bins: list[list[Slice]] = []  # open bins (tails first, then packed)
        tail_bins = []
        for q in members:
            n = seq_lens[q]
            if n > max_tokens:
                k = math.ceil(n / max_tokens)
                cuts = [n * i // k for i in range(k + 1)]
                for i in range(k - 1):
                    raw.append((ChunkKind.SPLIT, [Slice(q, cuts[i], cuts[i + 1] - cuts[i])]))
                raw.append((ChunkKind.HYBRID, [Slice(q, cuts[k - 1], n - cuts[k - 1])]))
                tail_bins.append(len(raw) - 1)
            else:
                placed = False
                candidates = [raw[i][1] for i in tail_bins] if pack_tails else []
                for b in candidates + bins:
                    if sum(s.length for s in b) + n <= max_tokens:
                        b.append(Slice(q, 0, n))
                        placed = True
                        break
                if not placed:
                    bins.append([Slice(q, 0, n)])
        for b in bins:
            raw.append((ChunkKind.PACKED, b))
        groups.append(tuple(range(first, len(raw))))
    chunks = tuple(Chunk(i, k, tuple(s)) for i, (k, s) in enumerate(raw))
    lay = layout or StageLayout.even(num_layers, num_stages)
    sched = build_schedule(chunks, groups, num_stages)
    plan = Plan("test", tuple(seq_lens), lay, chunks, tuple(groups), sched,
                tuple((0,) * len(chunks) for _ in range(num_stages)))
    return plan.validate()
