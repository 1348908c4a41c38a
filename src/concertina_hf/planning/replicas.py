"""Balanced replicas: which of a step's sequences each data-parallel replica runs.

With ``dp > 1`` pipeline replicas, the step ends when the slowest replica's pipeline drains.
Splitting the global batch by count (accelerate's sampler: each replica the next
``len / dp`` sequences) leaves the replica that drew the 128K document setting the pace, and
splitting by tokens still under-weights it: attention makes a sequence's cost superlinear in its
length. Here, jointly with each replica's chunking and recompute (the strategy's own plan):

1. **Estimate**: a sequence of ``n`` tokens costs ``(1 + bwd_factor) * (layers * (alpha_attn *
   n^2 + alpha_tok * n) + (embed + head) * n)`` (:func:`~.lpt.sequence_cost`, the ideal bound's term).
2. **LPT** (:func:`~.lpt.lpt_assign`): sequences in decreasing estimate, each to the replica with
   the least estimated load
   (longest processing time first; ties to the lower index, so the split is deterministic).
3. **Refine by simulated step time**: plan every replica with the strategy and simulate it;
   then, a few rounds: scale each replica's estimate by its measured ratio (simulated time over
   estimate: bubbles, recompute), pick the move of one sequence (or swap of two) from the slowest
   replica to another that the scaled estimates say lowers the pair's maximum most, re-plan the
   two replicas and keep the change only if the slower of them got faster than the slowest was.

The loss does not change: a replica only runs other sequences, and the trainer normalises the
summed per-token loss by the label tokens of the whole global batch (counted over replicas), so
the gradients equal those of ``Trainer`` on one process whatever the split.

:func:`balance_replicas` returns a :class:`ReplicaSplit`: per replica, the indices of its
sequences (what a sampler hands that replica) and its plan. ``method="count"`` and
``"tokens"`` give the baselines (count split in batch order; LPT by tokens) planned the same
way. Cost: one plan per replica, plus two per refinement round and one for the lower bound
(the longest sequence alone). Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .cost import CostModel
from .lpt import lpt_assign, sequence_cost
from .plan import Plan
from .strategies import plan_step
from .types import PlanError, StageLayout

__all__ = ["REPLICA_METHODS", "ReplicaSplit", "balance_replicas", "split_by_count"]

#: how :func:`balance_replicas` splits a step's sequences
REPLICA_METHODS = ("balanced", "tokens", "count")


def split_by_count(num_seqs: int, num_bins: int) -> list[list[int]]:
    """Accelerate's split: consecutive blocks in batch order, sizes differing by at most one.

    >>> split_by_count(5, 2)
    [[0, 1, 2], [3, 4]]
    """
    base, extra = divmod(num_seqs, num_bins)
    out, start = [], 0
    for r in range(num_bins):
        n = base + (1 if r < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


@dataclass(frozen=True)
class ReplicaSplit:
    """A step's sequences over replicas, each replica's plan and simulated step time.

    ``assignment[r]``: indices into the step's ``lens`` that replica ``r`` runs (ascending);
    ``plans[r]``: its plan (sequence ``i`` of the plan is ``lens[assignment[r][i]]``; ``None``
    for a replica without sequences). ``lower_bound_s``: no split can make the slowest replica
    faster than the mean of this split's replica times, nor than a replica running the longest
    sequence alone (both simulated with the same strategy).
    """

    method: str
    assignment: tuple[tuple[int, ...], ...]
    plans: tuple[Plan | None, ...]
    step_times_s: tuple[float, ...]
    lower_bound_s: float
    refinements: int = 0

    @property
    def step_time_s(self) -> float:
        """The step's time: the slowest replica's."""
        return max(self.step_times_s)

    @property
    def idle_fraction(self) -> float:
        """Share of the replicas' time spent waiting for the slowest one."""
        t = self.step_time_s
        return 1.0 - sum(self.step_times_s) / (len(self.step_times_s) * t) if t > 0 else 0.0

    @property
    def slowest_idle_s(self) -> float:
        """How long the fastest replica waits for the slowest one."""
        return self.step_time_s - min(self.step_times_s)


def balance_replicas(
    lens: Sequence[int],
    num_replicas: int,
    cost: CostModel,
    layout: StageLayout,
    memory_budget_bytes: int | Sequence[int],
    *,
    method: str = "balanced",
    strategy: str = "adaptive",
    refine_rounds: int = 8,
    **plan_kwargs: Any,
) -> ReplicaSplit:
    """Split a step's sequences over ``num_replicas`` pipeline replicas and plan each (module
    docstring). ``plan_kwargs`` go to :func:`~.strategies.plan_step` (``solver``,
    ``time_limit_s``, ``max_tokens_per_chunk``, knobs). Raises
    :class:`~.recompute.InfeasiblePlanError` when a replica's sequences fit no plan."""
    if method not in REPLICA_METHODS:
        raise PlanError(f"unknown replica split {method!r}; use one of {REPLICA_METHODS}")
    lens = [int(n) for n in lens]
    if not lens:
        raise PlanError("a step needs at least one sequence")
    R = int(num_replicas)
    if method == "count":
        groups = split_by_count(len(lens), R)
    elif method == "tokens":
        groups = lpt_assign([float(n) for n in lens], R)
    else:
        groups = lpt_assign([sequence_cost(n, cost) for n in lens], R)

    memo: dict[tuple[int, ...], tuple[Plan | None, float]] = {}

    def run(group: Sequence[int]) -> tuple[Plan | None, float]:
        key = tuple(sorted(group))
        if key not in memo:
            if not key:
                memo[key] = (None, 0.0)
            else:
                plan = plan_step([lens[i] for i in key], cost, layout, memory_budget_bytes, strategy, **plan_kwargs)
                memo[key] = (plan, plan.predicted.step_time_s)
        return memo[key]

    times = [run(g)[1] for g in groups]
    refinements = 0
    if method == "balanced" and R > 1:
        est = [sequence_cost(n, cost) for n in lens]
        tried: set[tuple] = set()
        for _ in range(refine_rounds):
            improved = _refine_once(groups, times, est, run, tried)
            if not improved:
                break
            refinements += 1
    longest = max(range(len(lens)), key=lambda q: (lens[q], -q))
    alone = run([longest])[1]
    lower = max(sum(times) / R, alone)
    return ReplicaSplit(
        method=method,
        assignment=tuple(tuple(sorted(g)) for g in groups),
        plans=tuple(run(g)[0] for g in groups),
        step_times_s=tuple(times),
        lower_bound_s=lower,
        refinements=refinements,
    )


def _refine_once(groups: list[list[int]], times: list[float], est: list[float], run, tried: set) -> bool:
    """One refinement round (module docstring, step 3); ``groups`` and ``times`` updated in place.
    Tries the candidate changes in order of predicted gain until one really helps."""
    R = len(groups)
    s = max(range(R), key=lambda r: (times[r], -r))
    load = [sum(est[i] for i in g) for g in groups]
    rate = [times[r] / load[r] if load[r] > 0 else 0.0 for r in range(R)]
    fallback = sum(times) / max(sum(load), 1e-300)
    rate = [x or fallback for x in rate]
    cands = []
    for f in sorted(range(R), key=lambda r: (times[r], r))[: max(1, min(R - 1, 3))]:
        if f == s:
            continue
        for i in groups[s]:
            if len(groups[s]) > 1:
                new = max(rate[s] * (load[s] - est[i]), rate[f] * (load[f] + est[i]))
                cands.append((new, (s, f, i, None)))
            for j in groups[f]:
                if est[j] < est[i]:
                    new = max(rate[s] * (load[s] - est[i] + est[j]), rate[f] * (load[f] + est[i] - est[j]))
                    cands.append((new, (s, f, i, j)))
    cands.sort(key=lambda c: (c[0], c[1][1], c[1][2], -1 if c[1][3] is None else c[1][3]))
    for new, move in cands[:6]:
        if new >= times[s]:
            break
        key = (tuple(groups[move[0]]), tuple(groups[move[1]]), move)
        if key in tried:
            continue
        tried.add(key)
        s_, f, i, j = move
        gs = [q for q in groups[s_] if q != i] + ([j] if j is not None else [])
        gf = [q for q in groups[f] if q != j] + [i]
        try:
            ts, tf = run(gs)[1], run(gf)[1]
        except PlanError:  # the change fits no plan (InfeasiblePlanError is a PlanError)
            continue
        if max(ts, tf) < times[s_] * (1 - 1e-9):
            groups[s_], groups[f] = sorted(gs), sorted(gf)
            times[s_], times[f] = ts, tf
            return True
    return False
