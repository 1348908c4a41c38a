"""The adaptive strategy (the method) and its ablations with recompute fixed.

``adaptive``: the chunking search of :mod:`.search`, each candidate evaluated with a greedy
recompute assignment (:func:`~..recompute.assign_recompute`) and a simulation, within a
budget of simulated chunk-stages (600, or 1200 with the ILP; 2400 on small steps). The winner
then runs forwards further ahead (``extra_warmup``); on a stage of ``sp > 1`` GPUs that may run
chunks whole-doc, its short sequences are packed into per-GPU bins instead
(:func:`_whole_doc_packing`: a few lengths, about 7 more simulations); on small steps it gets its
first backward made lighter (:meth:`~..chunking.SequenceBatch.tapered`); each kept when it
simulates faster. When the plan recomputes anything and ``solver="ilp"``, the ILP re-solves its
recompute (kept if it simulates faster). When no balanced chunking fits, or one the proxy deemed
to fit does not (its memory view misjudged the step), the baselines' chunkings are tried too (a
split sequence keeps every slice in flight, plus its K/V, so packing whole sequences can fit where
no balanced chunking does). Cost for 512 sequences on 4 stages with roomy memory: about ten
chunkings (0.5 ms each), their proxies (0.1 ms each) and one or two simulations (4 ms per 150
chunks): 15-30 ms; when memory binds, the recompute assignment adds tens of ms, the ILP up to
``time_limit_s``.

``no-recompute`` / ``full-recompute``: the same chunking search with recompute fixed at none /
every layer, every candidate simulated within the search effort (ablations of adaptive
checkpointing; :data:`~.common.SEARCH_EFFORT`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from ..budgets import within_budgets
from ..cost import CostModel
from ..plan import Plan
from ..recompute import InfeasiblePlanError, assign_recompute, uniform_recompute
from ..simulate import SimResult, simulate
from ..types import PlanError, Remedy
from .common import (
    GIB, MORE_MEMORY, USE_ADAPTIVE, PlanRequest, describe_longest, finish, overshoot, placed, plan_of, worst_stage,
)
from .search import Candidate, ChunkingSearch, candidate_knobs, run_search

__all__ = ["ADAPTIVE_KNOBS", "CHUNKING_KNOBS", "plan_adaptive", "plan_full_recompute", "plan_no_recompute"]

#: settings of the chunking search (searched unless given)
CHUNKING_KNOBS = ("num_slices_longest", "k_candidates", "max_groups", "split_threshold", "time_target")
#: adaptive's settings: the chunking search's, and how many finalists it simulates
ADAPTIVE_KNOBS = CHUNKING_KNOBS + ("num_finalists", "extra_warmup", "taper", "whole_doc_tokens")
#: the most forwards ``adaptive`` runs ahead of 1F1B on a stage (it stops at the first that is not faster)
MAX_EXTRA_WARMUP = 3
#: plans of more chunk-stages keep the greedy recompute assignment with ``solver="ilp"`` (at 1600
#: chunk-stages building and solving the ILP takes about 0.2 s on a free core, and grows faster)
ILP_MAX_CHUNK_STAGES = 2048
#: whole-doc packing (_whole_doc_packing): the longest short sequence packed into per-GPU bins
#: takes up to this many times a chunk's time target on one GPU
WHOLE_DOC_BINS = (1, 1.5, 2, 3)
#: work fractions of the tapered chunk's lighter piece (SequenceBatch.tapered)
TAPER_FRACTIONS = (0.5,)
#: plans of more chunk-stages are not tapered (one chunk's wait is then a small part of the step)
TAPER_MAX_CHUNK_STAGES = 320


def _with_recompute(plan: Plan, cost: CostModel, budgets: tuple[int, ...], likely_fits: bool) -> Plan:
    """``plan`` with greedy recompute and ``predicted``. When the proxy expects no recompute, a
    plain simulation first: the greedy would only confirm it, at twice the cost."""
    if likely_fits:
        sim = simulate(plan, cost)
        if within_budgets(sim.peak_memory_bytes, budgets):
            return plan.with_predicted(sim.stats())
    return assign_recompute(plan, cost, budgets, method="greedy")


def _fmt_budgets(budgets: Sequence[int]) -> str:
    if len(set(budgets)) == 1:
        return f"{budgets[0]} bytes ({budgets[0] / GIB:.2f} GiB) per stage"
    return "[" + ", ".join(f"{b / GIB:.2f}" for b in budgets) + "] GiB"


def plan_adaptive(req: PlanRequest) -> Plan:
    """Adaptive chunking, grouping and recompute (see the module docstring)."""
    cost, layout, budgets, knobs = req.cost, req.layout, req.budgets, req.knobs
    search = ChunkingSearch("adaptive", req)
    proxy = search.proxy
    # The greedy solver is the fast path: one finalist and 600 simulated chunk-stages (about
    # 12 ms; the proxy is within ~1% of the simulator on many balanced chunks); the ILP path
    # continues that search with a second finalist and twice the budget, so it never ends
    # slower. Small steps, where the proxy's smooth fill/drain view is least exact, simulate
    # more (see run_search).
    phases = [(1, 600.0)]
    if req.solver == "ilp":
        phases.append((2, 1200.0))
    if "num_finalists" in knobs:
        phases = [(max(1, int(knobs["num_finalists"])), 600.0 * max(1, int(knobs["num_finalists"])))]
    errors: list[InfeasiblePlanError] = []
    misjudged = False  # a candidate the proxy deemed feasible did not fit

    def evaluate(c: Candidate, warmup: int = 0) -> Plan | None:
        nonlocal misjudged
        likely_fits = proxy is None or (not c.cuts and not math.isinf(c.est)
                                        and not c.chunking.needs_recompute(cost, layout, proxy))
        try:
            return _with_recompute(placed(plan_of("adaptive", c.chunking, layout, c.cuts, warmup), req), cost,
                                   budgets, likely_fits)
        except InfeasiblePlanError as e:
            errors.append(e)  # candidates the proxy rejects come smallest chunks first
            misjudged = misjudged or not math.isinf(c.est)
            return None

    found = run_search(search, evaluate, phases)
    if (found is None or misjudged) and "num_slices_longest" not in knobs:
        # Splitting keeps every slice of a sequence in flight (plus its K/V), so when memory is
        # tight a baseline's chunking can fit where no balanced one does: the fastest that fits
        # (within the search's effort: the cheapest first, so a few large ones do not spend it all).
        # Also when the search found a plan but the proxy misjudged memory on the way (what it
        # found is then whatever fitted first, not the proxy's pick).
        ranked = list(enumerate(search.baseline_candidates()))
        ranked.sort(key=lambda ic: search.charge(ic[1]))
        fitting = [(plan.predicted.step_time_s, i, c, plan) for i, c in ranked
                   if (plan := search.evaluate_once(c, evaluate)) is not None]
        if fitting:
            best_fit = min(fitting, key=lambda v: v[:2])
            if found is None or best_fit[0] < found[1].predicted.step_time_s:
                found = best_fit[2:]
    if found is None:
        if not errors:  # nothing was evaluated: every candidate had too many chunks
            raise search.nothing_evaluated_error() or PlanError("adaptive: no candidate chunking was evaluated")
        tried = sorted({c.k for c in search.cands.values()})
        closest = errors[0]
        raise InfeasiblePlanError(
            f"adaptive: no chunking of this step fits the memory budgets {_fmt_budgets(budgets)} (tried "
            f"K = {tried} slices of the longest, {describe_longest(req.lens)}); the closest attempt: {closest.reason}",
            *closest.remedies, others=closest.others,
        ) from closest
    cand, best = found
    best, warmup = _deeper_warmup(cand.chunking, cand.cuts, best, 0, req)
    cand, best, warmup, whole_doc = _whole_doc_packing(search, cand, best, warmup, req, evaluate)
    # the first backward of each group lighter (SequenceBatch.tapered): the wait of the stages
    # before the slowest one for it shrinks; on small steps (one chunk is a sizeable part of the
    # step), with its own warm-up climb from 1F1B (a shorter wait needs fewer forwards ahead to
    # fill it); kept when it simulates faster (knob taper: that fraction, 0 = none)
    taper = 0.0
    fixed = "taper" in knobs
    if layout.num_stages > 1 and cand.chunking.chains and (
            fixed or best.num_chunks * layout.num_stages <= TAPER_MAX_CHUNK_STAGES):
        w0 = max(0, int(knobs.get("extra_warmup", 0)))
        for f in [float(knobs["taper"])] if fixed else TAPER_FRACTIONS:
            ch = search.batch.tapered(cand.chunking, f, cand.cuts) if f > 0 else None
            if ch is None:
                continue
            try:
                plan = _with_recompute(placed(plan_of("adaptive", ch, layout, cand.cuts, w0), req), cost, budgets,
                                       not any(any(row) for row in best.recompute))
            except InfeasiblePlanError:
                continue
            plan, k = _deeper_warmup(ch, cand.cuts, plan, w0, req)
            if fixed or plan.predicted.step_time_s < best.predicted.step_time_s:
                best, warmup, taper = plan, k, f
    used = "greedy" if any(any(row) for row in best.recompute) else "none"
    # the ILP's model grows with chunk-stages and PuLP builds it in Python beyond CBC's time
    # limit: large plans keep the greedy assignment
    if req.solver == "ilp" and used == "greedy" and best.num_chunks * layout.num_stages <= ILP_MAX_CHUNK_STAGES:
        try:
            ilp = assign_recompute(dataclasses.replace(best, predicted=None), cost, budgets, method="ilp",
                                   time_limit_s=req.time_limit_s)
            if ilp.predicted.step_time_s < best.predicted.step_time_s:
                best, used = ilp, "ilp"
        except InfeasiblePlanError:  # pragma: no cover - greedy found a plan, so one exists
            pass
    return finish(best, best.predicted, budgets, candidate_knobs(cand, {"recompute_solver": used,
                                                                         "extra_warmup": warmup, "taper": taper,
                                                                         "whole_doc_tokens": whole_doc}))


def _whole_doc_packing(search: ChunkingSearch, cand: Candidate, best: Plan, warmup: int, req: PlanRequest,
                       evaluate: Callable[[Candidate, int], Plan | None]) -> tuple[Candidate, Plan, int, int]:
    """On a stage of ``sp > 1`` GPUs that may run chunks whole-doc (``sp_mode`` ``auto`` or
    ``context``): the search's chunking with its short sequences packed into chunks of ``sp``
    balanced per-GPU bins instead (:meth:`~..chunking.SequenceBatch.balanced`'s ``whole_doc``).
    The search packs for Ulysses (chunks of equal total work), and such chunks often cannot balance
    over ``sp`` GPUs (4 or 5 sequences for 8 GPUs), so they ran Ulysses.

    Packed are the uncut sequences of at most ``L`` tokens, ``L`` such that one sequence alone takes
    ``m`` times a chunk's time target on one GPU, ``m`` in :data:`WHOLE_DOC_BINS` (larger: more
    sequences whole-doc, in larger chunks; up the ladder until one is not faster), at the search's
    ``K`` and the next smaller one (a larger time target: longer sequences fit a bin; when a
    baseline's chunking won, the ``K`` of the proxy's best balanced chunking). Each is
    simulated one forward further ahead than ``best`` (its larger chunks leave the next stage
    waiting longer); the fastest climbs on (:func:`_deeper_warmup`) and is kept when then faster
    than ``best`` (the search's pick at its own ``warmup``): never slower, ties keep ``best``. Knob
    ``whole_doc_tokens``: that ``L`` at the search's ``K``, kept whatever its time (0: none).
    Returns the candidate, its plan, its warm-up and ``L`` (0: unchanged)."""
    cost, batch, sp = req.cost, search.batch, req.cost.sp
    if sp <= 1 or req.sp_mode == "ulysses" or batch.segment_tokens is not None \
            or "whole_doc_tokens" in req.knobs and not req.knobs["whole_doc_tokens"]:
        return cand, best, warmup, 0
    base = cand
    if cand.slicing != "work":  # a baseline's chunking won (a small step): the proxy's best balanced one
        balanced = [c for c in search.cands.values() if c.slicing == "work" and not math.isinf(c.est)]
        if not balanced:
            return cand, best, warmup, 0
        base = min(balanced, key=Candidate.order)
    k, cap, _ = base.key
    fixed = req.knobs.get("whole_doc_tokens")
    ks = [k]
    if fixed is None and k in search.ks and search.ks.index(k) > 0 and search.knobs.get("time_target") is None:
        ks.append(search.ks[search.ks.index(k) - 1])  # larger chunks: longer sequences fit a bin
    # each packing simulated with a forward further ahead than the search's pick (their larger chunks
    # leave the next stage waiting longer), the fastest then climbing on (_deeper_warmup)
    ahead = min(MAX_EXTRA_WARMUP, warmup + 1) if search.layout.num_stages > 1 and "extra_warmup" not in req.knobs \
        else int(req.knobs.get("extra_warmup", 0))
    lead: tuple[float, Candidate, Plan, int] | None = None  # the fastest packing before its own climb
    for kk in ks:
        ch0 = base.chunking if kk == k else search.get(kk, cap).chunking
        target = ch0.time_target - batch.beta
        lengths = [int(fixed)] if fixed is not None else \
            sorted({batch.tokens_of_work(m * target / sp) for m in WHOLE_DOC_BINS})
        last = math.inf
        for length in lengths:
            ch = batch.balanced(num_slices_longest=kk, token_cap=cap, time_target=search.knobs.get("time_target"),
                                split_threshold=search.knobs.get("split_threshold"), whole_doc=(sp, length))
            if ch.packed == ch0.packed or ch.num_chunks > search.max_chunks:
                continue  # no short sequence to re-pack (or more chunks than a plan may have)
            c = Candidate((kk, cap, "work"), ch.estimate(cost, search.layout, search.proxy), ch,
                          base.cuts if kk == k else ())
            plan = evaluate(c, ahead)
            t = math.inf if plan is None else plan.predicted.step_time_s
            if plan is not None and (lead is None or t < lead[0]):
                lead = (t, c, plan, length)
            if t >= last:
                break  # longer sequences whole-doc make larger chunks: slower from here on
            last = t
    if lead is None:
        return cand, best, warmup, 0
    _, c, plan, length = lead
    plan, w = _deeper_warmup(c.chunking, c.cuts, plan, ahead, req)
    if fixed is not None or plan.predicted.step_time_s < best.predicted.step_time_s:
        return c, plan, w, length
    return cand, best, warmup, 0


def _deeper_warmup(chunking, cuts: tuple[int, ...], best: Plan, warmup: int, req: PlanRequest) -> tuple[Plan, int]:
    """Forwards further ahead on every stage but the last (schedule.build_schedule): fill the wait
    for the first backward and keep the stage below fed, for more chunks in flight; one more at a
    time while it simulates faster within the budgets (knob extra_warmup: exactly that many, 0 =
    1F1B). ``best``: the plan of ``chunking`` at ``warmup``; returns the plan kept and its warm-up."""
    knobs, layout = req.knobs, req.layout
    tries = [int(knobs["extra_warmup"])] if "extra_warmup" in knobs else \
        list(range(warmup + 1, MAX_EXTRA_WARMUP + 1))
    for k in tries if layout.num_stages > 1 else ():
        if k <= 0 or k == warmup:
            break
        try:
            deeper = _with_recompute(placed(plan_of("adaptive", chunking, layout, cuts, k), req), req.cost, req.budgets,
                                     not any(any(row) for row in best.recompute))
        except InfeasiblePlanError:
            break
        if "extra_warmup" not in knobs and deeper.predicted.step_time_s >= best.predicted.step_time_s:
            break
        best, warmup = deeper, k
    return best, warmup


def _plan_fixed_recompute(strategy: str, req: PlanRequest) -> Plan:
    cost, layout, budgets = req.cost, req.layout, req.budgets
    search = ChunkingSearch(strategy, req)
    full = max(layout.num_stage_layers(s) for s in range(layout.num_stages))
    closest: list[tuple[float, Candidate, SimResult]] = []  # the least over-budget attempt, for the error

    def evaluate(c: Candidate) -> Plan | None:
        plan = placed(plan_of(strategy, c.chunking, layout, c.cuts), req)
        if strategy == "full-recompute":
            plan = uniform_recompute(plan, full)
        sim = simulate(plan, cost)
        if within_budgets(sim.peak_memory_bytes, budgets):
            return plan.with_predicted(sim.stats())
        closest.append((overshoot(sim.peak_memory_bytes, budgets), c, sim))
        return None

    # every candidate is simulated (within the effort): no recompute to assign, only a fit to check
    found = run_search(search, evaluate, [(1, math.inf)])
    if found is None:
        if not closest:  # nothing was evaluated: every candidate had too many chunks
            raise search.nothing_evaluated_error() or PlanError(f"{strategy}: no candidate chunking was evaluated")
        _, c, sim = min(closest, key=lambda x: (x[0], x[1].order()))
        s = worst_stage(sim.peak_memory_bytes, budgets)
        raise InfeasiblePlanError(
            f"{strategy}: no chunking fits stage {s}'s memory budget of {budgets[s]} bytes "
            f"({budgets[s] / GIB:.2f} GiB); the closest (K={c.k} slices of the longest, {describe_longest(req.lens)}) "
            f"peaks at {sim.peak_memory_bytes[s]} bytes ({sim.peak_memory_bytes[s] / GIB:.2f} GiB)",
            MORE_MEMORY, Remedy("max_tokens_per_chunk", "lower"), USE_ADAPTIVE,
        )
    cand, plan = found
    return finish(plan, plan.predicted, budgets, candidate_knobs(cand, {}))


def plan_no_recompute(req: PlanRequest) -> Plan:
    """The adaptive chunking search with no recompute at all."""
    return _plan_fixed_recompute("no-recompute", req)


def plan_full_recompute(req: PlanRequest) -> Plan:
    """The adaptive chunking search with every layer recomputed."""
    return _plan_fixed_recompute("full-recompute", req)
