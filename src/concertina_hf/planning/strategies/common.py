"""What every strategy shares: the request it plans, the baselines' chunking ladders (adaptive
searches them too), and turning a chunking into a plan and a plan into a result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..chunking import Chunking, SequenceBatch
from ..cost import CostModel
from ..schedule import build_schedule
from ..types import Plan, PlanStats, StageLayout

__all__ = [
    "GIB", "N_CANDIDATES", "PlanRequest", "describe_longest", "finish", "overshoot", "plan_of",
    "token_budget_candidates", "worst_stage",
]

GIB = 2**30
# split baseline: slices of the longest
N_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRequest:
    """One step to plan, checked and normalised by :func:`~.plan_step`: what a strategy's
    ``run`` receives."""

    lens: list[int]
    """Tokens per sequence, in batch order (at least one positive)."""
    batch: SequenceBatch
    """``lens`` prepared once for chunking them many ways (balanced on ``layout``)."""
    cost: CostModel
    """The cost model every candidate is simulated with."""
    layout: StageLayout
    """Decoder layers per pipeline stage."""
    budgets: tuple[int, ...]
    """Memory budget per stage in bytes, static memory included; 0: unconstrained."""
    token_cap: int | None
    """``max_tokens_per_chunk``: the token cap of a chunk (for the baselines, the largest token
    budget / slice size tried); ``None``: uncapped."""
    solver: str
    """Recompute solver, one of :data:`~..recompute.SOLVERS` (adaptive only)."""
    time_limit_s: float
    """The ILP solver's time limit."""
    knobs: Mapping[str, Any]
    """The strategy's fixed settings (only names its record lists); the others are searched."""


def token_budget_candidates(longest: int, cap: int | None) -> list[int]:
    """Powers of two and 1.5x between, from the smallest one covering the longest sequence
    down to 1/64 of it; only budgets up to ``cap`` (or ``cap`` itself if none is)."""
    floor = max(1, longest // 64)
    x = 1
    while x < longest:
        x *= 2
    vals: set[int] = set()
    while x >= floor:
        vals.add(x)
        if 3 * x // 4 >= floor:
            vals.add(3 * x // 4)
        x //= 2
    ordered = sorted(vals, reverse=True)
    # larger budgets than the smallest covering one only merge more short sequences together
    covering = [v for v in ordered if v >= longest]
    ordered = covering[-1:] + [v for v in ordered if v < longest]
    if cap is not None:
        ordered = [v for v in ordered if v <= cap] or [cap]
    return ordered


def plan_of(strategy: str, chunking: Chunking, layout: StageLayout, cuts: Sequence[int] = ()) -> Plan:
    """The plan of ``chunking`` grouped at ``cuts``: the 1F1B schedule with prefetch, no
    recompute, no prediction."""
    chunks, groups = chunking.assemble(cuts)
    p = layout.num_stages
    return Plan(
        strategy=strategy,
        seq_lens=chunking.seq_lens,
        layout=layout,
        chunks=chunks,
        groups=groups,
        schedule=build_schedule(chunks, groups, p, prefetch=True),
        recompute=tuple((0,) * len(chunks) for _ in range(p)),
    )


def finish(plan: Plan, stats: PlanStats, budgets: tuple[int, ...], knobs: dict[str, Any]) -> Plan:
    """``plan`` as a strategy returns it: with its budgets, chosen settings and prediction."""
    # no validate() here: it costs more than planning (tests check every strategy's plans)
    return dataclasses.replace(plan, memory_budget_bytes=budgets, knobs=tuple(knobs.items()), predicted=stats)


def describe_longest(lens: Sequence[int]) -> str:
    """The longest sequence (the first of equals) for error messages."""
    i = max(range(len(lens)), key=lambda q: (lens[q], -q))
    return f"sequence {i} ({lens[i]} tokens)"


def overshoot(peaks: Sequence[int], budgets: Sequence[int]) -> float:
    """The largest peak-to-budget ratio over the constrained stages."""
    return max(pk / b for pk, b in zip(peaks, budgets) if b)


def worst_stage(peaks: Sequence[int], budgets: Sequence[int]) -> int:
    """The stage furthest over its budget (the first of equals)."""
    return max(range(len(budgets)), key=lambda q: peaks[q] / budgets[q] if budgets[q] else 0)
