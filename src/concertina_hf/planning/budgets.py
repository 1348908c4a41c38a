"""Memory budgets per pipeline stage: the one normaliser every planner entry point and the trainer
use, and the two ways the planner reads a normalised budget (a simulated peak within it; the
analytic proxy's view, with 0 as infinite room).

A budget is in bytes per stage, static memory (weights, gradients, optimizer state) included;
0 means unconstrained (the :class:`~.plan.Plan` convention).
"""

from __future__ import annotations

import math
from typing import Sequence

from .types import PlanError, Remedy

__all__ = ["proxy_budgets", "stage_budgets", "within_budgets"]


def stage_budgets(budget: int | float | Sequence[int], num_stages: int) -> tuple[int, ...]:
    """One budget in bytes per stage (0: unconstrained) from a single size or one size per stage
    (a sequence of one size counts as a single size).

    >>> stage_budgets(10, 3), stage_budgets([5], 2), stage_budgets((1, 2), 2)
    ((10, 10, 10), (5, 5), (1, 2))
    """
    if isinstance(budget, (int, float)):
        vals = (int(budget),) * num_stages
    else:
        vals = tuple(int(x) for x in budget)
        if len(vals) == 1:
            vals *= num_stages
        elif len(vals) != num_stages:
            raise PlanError(f"need one memory budget per pipeline stage ({num_stages}), got {len(vals)}",
                            Remedy("memory_budget", "set", value="one size per stage or a single size"))
    if any(v < 0 for v in vals):
        raise PlanError(f"memory budgets must be >= 0 bytes (0 = unconstrained), got {list(vals)}",
                        Remedy("memory_budget", "set", value="sizes of at least 0 bytes"))
    return vals


def within_budgets(peaks: Sequence[float], budgets: Sequence[int]) -> bool:
    """Whether every stage's peak is within its budget (0 = unconstrained).

    >>> within_budgets([5, 9], [5, 0]), within_budgets([6, 9], [5, 0])
    (True, False)
    """
    return all(b == 0 or pk <= b for pk, b in zip(peaks, budgets))


def proxy_budgets(budgets: Sequence[int]) -> tuple[float, ...] | None:
    """The budgets as the analytic proxy (:meth:`~.chunking.Chunking.estimate`) reads them: 0 is
    infinite room, and ``None`` when no stage is constrained.

    >>> proxy_budgets([0, 0]), proxy_budgets([0, 7])
    (None, (inf, 7.0))
    """
    if not any(budgets):
        return None
    return tuple(float(b) if b else math.inf for b in budgets)
