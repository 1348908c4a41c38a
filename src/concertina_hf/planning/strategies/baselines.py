"""The baselines users have today, tuned the way a user would tune them.

``packed`` (batch-level PP): whole sequences best-fit decreasing into micro-batches of a fixed
token budget (a longer sequence gets a micro-batch of its own; tokens are never dropped),
uniform recompute (the same number of layers on every stage and chunk). Tuned: the budget over
powers of two and 1.5x between, from the longest sequence down to 1/64 of it, and for each the
fewest uniform recompute layers that fit (from the recompute planner's memory model,
:func:`~..recompute.min_uniform_recompute`, checked by a simulation; time grows with recompute).

``split`` (token-level PP, Seq1F1B-like): sequences longer than ``S = ceil(longest / N)``
tokens cut into ``ceil(len / S)`` equal-length slices (the longest into ``N``), short ones
packed up to ``S`` tokens; uniform recompute. Tuned: ``N`` (1 .. 64) and recompute as above.

Each setting costs a chunking and a simulation, when recompute is needed the memory model and
another. Settings of more chunks than
a plan may have (:func:`~.common.max_chunks`) are skipped, and once the effort spent passes
:data:`~.common.SEARCH_EFFORT` (counted in simulated chunk-stages) the rest are.
"""

from __future__ import annotations

from ..budgets import within_budgets
from ..cost import CostModel
from ..plan import Plan
from ..recompute import InfeasiblePlanError, min_uniform_recompute, uniform_recompute
from ..simulate import SimResult, simulate
from ..types import PlanError
from .common import (
    GIB, MORE_MEMORY, MORE_STAGES, N_CANDIDATES, SEARCH_EFFORT, USE_ADAPTIVE, PlanRequest, SettingTally,
    describe_longest, finish, max_chunks, placed, plan_of, token_budget_candidates, too_many_chunks, worst_stage,
)

__all__ = ["PACKED_KNOBS", "SPLIT_KNOBS", "plan_packed", "plan_split", "uniform_search"]

#: packed's settings (searched unless given)
PACKED_KNOBS = ("token_budget", "recompute_layers")
#: split's settings (searched unless given)
SPLIT_KNOBS = ("num_slices", "recompute_layers")


def uniform_search(plan: Plan, cost: CostModel, budgets: tuple[int, ...], fixed: int | None,
                   effort: list[int] | None = None) -> tuple[int, Plan, SimResult] | tuple[None, Plan, SimResult]:
    """The fewest uniform recompute layers that fit (time grows with recompute, memory falls),
    or ``fixed``; ``(None, plan, sim)`` at full recompute when nothing fits. ``effort[0]``, if
    given, counts the chunk-stages simulated (the memory model counts as a simulation)."""
    effort = [0] if effort is None else effort
    max_layers = max(plan.layout.num_stage_layers(s) for s in range(plan.num_stages))
    size = plan.num_chunks * plan.num_stages
    if fixed is not None:
        if not 0 <= fixed <= max_layers:
            raise PlanError(f"recompute_layers={fixed} must be within 0..{max_layers}")
        cand = uniform_recompute(plan, fixed)
        sim = simulate(cand, cost)
        effort[0] += size
        return (fixed if within_budgets(sim.peak_memory_bytes, budgets) else None), cand, sim
    sims: dict[int, tuple[Plan, SimResult]] = {}

    def at(r: int) -> tuple[Plan, SimResult]:
        if r not in sims:
            cand = uniform_recompute(plan, r)
            sims[r] = (cand, simulate(cand, cost))
            effort[0] += size
        return sims[r]

    def fits_at(r: int) -> bool:
        return within_budgets(at(r)[1].peak_memory_bytes, budgets)

    if fits_at(0):
        return (0, *at(0))
    # the memory model's answer, checked by one simulation (a binary search of simulations if
    # float rounding makes them disagree)
    r = min_uniform_recompute(plan, cost, budgets)
    effort[0] += size
    if r is not None and fits_at(r):
        return (r, *at(r))
    if not fits_at(max_layers):
        return (None, *at(max_layers))
    lo, hi = 0, max_layers  # lo does not fit, hi fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits_at(mid):
            hi = mid
        else:
            lo = mid
    return (hi, *at(hi))


def _plan_baseline(strategy: str, req: PlanRequest) -> Plan:
    lens, batch, cost, layout, budgets = req.lens, req.batch, req.cost, req.layout, req.budgets
    max_tokens, knobs = req.token_cap, req.knobs
    longest = max(lens)
    fixed_r = knobs.get("recompute_layers")
    fixed_r = None if fixed_r is None else int(fixed_r)
    settings: list[tuple[str, int, int]] = []  # (knob name, knob value, token budget)
    if strategy == "packed":
        if "token_budget" in knobs:
            settings = [("token_budget", int(knobs["token_budget"]), int(knobs["token_budget"]))]
        else:
            settings = [("token_budget", b, b) for b in token_budget_candidates(longest, max_tokens)]
    else:
        ns = [int(knobs["num_slices"])] if "num_slices" in knobs else [n for n in N_CANDIDATES if n <= longest]
        seen = set()
        for n in ns:
            if not 1 <= n <= longest:
                raise PlanError(f"num_slices={n} must be within 1..{longest} (the longest sequence's length)")
            size = -(-longest // n)
            if max_tokens is not None and size > max_tokens:
                continue
            if size not in seen:
                seen.add(size)
                settings.append(("num_slices", n, size))
        if not settings:
            n = -(-longest // max_tokens)
            settings = [("num_slices", n, -(-longest // n))]
    tally = SettingTally(budgets)
    limit, effort, smallest = max_chunks(layout), [0], None
    for name, value, size in settings:
        ch = batch.by_tokens(size, split=(strategy == "split"))
        if ch.num_chunks > limit:
            smallest = ch.num_chunks if smallest is None else min(smallest, ch.num_chunks)
            continue
        # a setting costs one to three simulations (or the memory model); within the effort
        if effort[0] and effort[0] + ch.num_chunks * layout.num_stages > SEARCH_EFFORT:
            continue
        r, plan, sim = uniform_search(placed(plan_of(strategy, ch, layout), req), cost, budgets, fixed_r, effort)
        tally.add({name: value, "token_budget": size} if name != "token_budget" else {name: value}, r, plan, sim)
    best, closest = tally.best, tally.closest
    if best is None and closest is None:
        raise too_many_chunks(strategy, lens, layout, smallest, max_tokens)
    if best is None:
        _, setting, sim = closest
        name, value = next(iter(setting.items()))
        s = worst_stage(sim.peak_memory_bytes, budgets)
        rc = "the given recompute_layers" if fixed_r is not None else "full recompute"
        raise InfeasiblePlanError(
            f"{strategy}: no setting fits stage {s}'s memory budget of {budgets[s]} bytes ({budgets[s] / GIB:.2f} GiB): "
            f"the closest ({name}={value}, {rc}) peaks at {sim.peak_memory_bytes[s]} bytes "
            f"({sim.peak_memory_bytes[s] / GIB:.2f} GiB); the longest is {describe_longest(lens)}",
            MORE_MEMORY, MORE_STAGES, USE_ADAPTIVE,
        )
    _, plan, sim, kn = best
    return finish(plan, sim.stats(), budgets, kn)


def plan_packed(req: PlanRequest) -> Plan:
    """Whole sequences under a token budget, uniform recompute (see the module docstring)."""
    return _plan_baseline("packed", req)


def plan_split(req: PlanRequest) -> Plan:
    """Equal-length slices of long sequences, Seq1F1B-like, uniform recompute."""
    return _plan_baseline("split", req)
