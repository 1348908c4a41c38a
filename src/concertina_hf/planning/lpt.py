"""Longest processing time first (LPT): spreading a step's sequences over parallel workers.

:func:`lpt_ranks` / :func:`lpt_assign` put items in decreasing weight, each on the least loaded bin (Graham's
4/3-approximation of the balanced makespan; ``n log n`` plus ``n x bins``). The weight of a
sequence is :func:`sequence_cost`, its compute through the whole model, superlinear in its
length (attention), so a long document weighs more than its tokens. Used by the replica split
(:mod:`.replicas`) and the ``sp-only`` baseline's Ulysses groups (:mod:`.strategies.sp_only`).
Pure Python; no torch.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from .cost import CostModel
from .types import PlanError

__all__ = ["lpt_assign", "lpt_ranks", "sequence_cost"]


def sequence_cost(n: int, cost: CostModel) -> float:
    """Forward and backward compute of one ``n``-token sequence through the whole model (the
    ideal bound's term: no recompute, overhead or bubble); superlinear in ``n``."""
    layer = cost.alpha_attn * n * n + cost.alpha_tok * n
    ends = (cost.embed_time_per_token + cost.head_time_per_token) * n
    return (1.0 + cost.bwd_factor) * (cost.num_layers * layer + ends)


def lpt_ranks(work: Sequence[float], sp: int, load: Sequence[float] | None = None) -> list[int]:
    """Longest processing time first: each item (largest ``work`` first, the first of equals
    first) to the least loaded of ``sp`` ranks (the lowest of equals), starting from ``load``.

    >>> lpt_ranks([5, 1, 4, 3], 2)
    [0, 0, 1, 1]
    """
    heap = [(float(load[r]) if load else 0.0, r) for r in range(sp)]
    heapq.heapify(heap)
    out = [0] * len(work)
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        t, r = heapq.heappop(heap)
        out[i] = r
        heapq.heappush(heap, (t + work[i], r))
    return out


def lpt_assign(weights: Sequence[float], num_bins: int) -> list[list[int]]:
    """:func:`lpt_ranks` as bins: each bin's indices ascending.

    >>> lpt_assign([5, 1, 4, 3, 3], 2)
    [[0, 4], [1, 2, 3]]
    """
    if num_bins < 1:
        raise PlanError(f"need at least one replica, got {num_bins}")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i, b in enumerate(lpt_ranks(weights, num_bins)):
        bins[b].append(i)
    return bins
