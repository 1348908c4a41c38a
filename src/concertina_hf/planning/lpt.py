"""Longest processing time first (LPT): spreading a step's sequences over parallel workers.

:func:`lpt_assign` puts items in decreasing weight, each on the least loaded bin (Graham's
4/3-approximation of the balanced makespan; ``n log n`` plus ``n x bins``). The weight of a
sequence is :func:`sequence_cost`, its compute through the whole model, superlinear in its
length (attention), so a long document weighs more than its tokens. Used by the replica split
(:mod:`.replicas`) and the ``sp-only`` baseline's Ulysses groups (:mod:`.strategies.sp_only`).
Pure Python; no torch.
"""

from __future__ import annotations

from typing import Sequence

from .cost import CostModel
from .types import PlanError

__all__ = ["lpt_assign", "sequence_cost"]


def sequence_cost(n: int, cost: CostModel) -> float:
    """Forward and backward compute of one ``n``-token sequence through the whole model (the
    ideal bound's term: no recompute, overhead or bubble); superlinear in ``n``."""
    layer = cost.alpha_attn * n * n + cost.alpha_tok * n
    ends = (cost.embed_time_per_token + cost.head_time_per_token) * n
    return (1.0 + cost.bwd_factor) * (cost.num_layers * layer + ends)


def lpt_assign(weights: Sequence[float], num_bins: int) -> list[list[int]]:
    """Longest processing time first: indices in decreasing weight, each to the bin with the least
    load (the lower index on ties); each bin's indices ascending.

    >>> lpt_assign([5, 1, 4, 3, 3], 2)
    [[0, 4], [1, 2, 3]]
    """
    if num_bins < 1:
        raise PlanError(f"need at least one replica, got {num_bins}")
    loads = [0.0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(weights)), key=lambda q: (-weights[q], q)):
        b = min(range(num_bins), key=lambda r: (loads[r], r))
        bins[b].append(i)
        loads[b] += weights[i]
    return [sorted(b) for b in bins]
