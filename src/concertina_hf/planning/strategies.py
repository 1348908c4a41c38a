"""Step planning strategies: the adaptive method and the baselines it is compared with.

Every strategy turns a step's sequence lengths into a :class:`~.types.Plan` scored by the same
simulator (:func:`~.simulate.simulate`), so comparisons are like for like:

- ``adaptive`` (the method, DESIGN.md 4). Candidates are workload-balanced chunkings
  (:mod:`.chunking`) for ``K`` slices of the longest sequence (0.25, 0.5, 1, 2, 3, 4, 6, 8,
  ..., 64; below 1: chunks of up to ``1/K`` times its work), searched coarse to fine with the
  analytic proxy :meth:`~.chunking.Chunking.estimate`; when memory binds, token-capped variants
  (at the longest slice, and at the largest chunk needing no recompute); on small steps, the
  baselines' chunkings too. The grouping DP refines the best. Then the simulator decides: the
  proxy's pick of each family gets a greedy recompute assignment and a simulation, then the
  next picks, then a hill climb along each family's ladder from its fastest member, within a
  budget of simulated chunk-stages (600, or 1200 with the ILP; 2400 on small steps). When the
  winner recomputes anything and ``solver="ilp"``, the ILP re-solves its recompute (kept if it
  simulates faster). Cost for 512 sequences on 4 stages with roomy memory: about ten
  chunkings (0.5 ms each), their proxies (0.1 ms each) and one or two simulations (4 ms per
  150 chunks): 15-30 ms; when memory binds, the recompute assignment adds tens of ms, the
  ILP up to ``time_limit_s``.
- ``packed`` (batch-level PP): whole sequences best-fit decreasing into micro-batches of a fixed
  token budget (a longer sequence gets a micro-batch of its own; tokens are never dropped),
  uniform recompute (the same number of layers on every stage and chunk). Tuned: the budget
  over powers of two and 1.5x between, from the longest sequence down to 1/64 of it, and for
  each the fewest uniform recompute layers that fit (binary search; time grows with recompute).
- ``split`` (token-level PP, Seq1F1B-like): sequences longer than ``S = ceil(longest / N)``
  tokens cut into ``ceil(len / S)`` equal-length slices (the longest into ``N``), short ones
  packed up to ``S`` tokens; uniform recompute. Tuned: ``N`` (1 .. 64) and recompute as above.
- ``no-recompute`` / ``full-recompute``: the adaptive chunking search with recompute fixed at
  none / every layer, every candidate simulated (ablations of adaptive checkpointing).

All strategies use the same order (longest first, packed chunks spread behind the split chains)
and the same 1F1B schedule (:func:`~.schedule.build_schedule` with ``prefetch=True``). A
strategy that finds nothing fitting raises :class:`~.recompute.InfeasiblePlanError` naming the
budget, the offending sequence and the setting to change. Planning is deterministic, except
that the ILP's result can depend on where CBC's time limit cuts it off.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from .chunking import Chunking, _Batch
from .cost import CostModel
from .recompute import InfeasiblePlanError, assign_recompute, uniform_recompute
from .schedule import build_schedule
from .simulate import SimResult, simulate
from .types import Plan, PlanError, PlanStats, StageLayout

__all__ = ["STRATEGIES", "ideal_step_time", "plan_step"]

STRATEGIES = ("adaptive", "packed", "split", "no-recompute", "full-recompute")

_GIB = 2**30
# K candidates of the adaptive search (slices of the longest sequence), clipped to its length;
# below 1: chunks of up to 1/K times the longest sequence's work (see Chunking / _Batch)
_K_CANDIDATES = (0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# chunk-stages under which a step counts as small (see _adaptive_candidates)
_SMALL_STEP = 320
# chunk-stages the adaptive search may simulate on a small step (about 40 ms)
_SMALL_STEP_SIM_BUDGET = 2400
# split baseline: slices of the longest
_N_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# knobs each strategy accepts (beyond the explicit arguments of plan_step)
_KNOBS = {
    "adaptive": ("num_slices_longest", "k_candidates", "max_groups", "split_threshold", "time_target",
                 "num_finalists"),
    "no-recompute": ("num_slices_longest", "k_candidates", "max_groups", "split_threshold", "time_target"),
    "full-recompute": ("num_slices_longest", "k_candidates", "max_groups", "split_threshold", "time_target"),
    "packed": ("token_budget", "recompute_layers"),
    "split": ("num_slices", "recompute_layers"),
}


def ideal_step_time(seq_lens: Sequence[int], cost: CostModel, layout: StageLayout) -> float:
    """A lower bound of the step time: forward and backward of every token through every layer,
    the embedding and the head, with no recompute, no per-chunk overhead (``beta``), no bubble
    and no communication, spread evenly over the stages."""
    per_token = cost.embed_time_per_token + cost.head_time_per_token
    total = 0.0
    for n in seq_lens:
        total += cost.num_layers * (cost.alpha_attn * n * n + cost.alpha_tok * n) + per_token * n
    return (1.0 + cost.bwd_factor) * total / layout.num_stages


# ---------------------------------------------------------------------------------- helpers
def _stage_budgets(memory_budget_bytes: int | Sequence[int], p: int) -> tuple[int, ...]:
    if isinstance(memory_budget_bytes, (int, float)):
        vals = (int(memory_budget_bytes),) * p
    else:
        vals = tuple(int(x) for x in memory_budget_bytes)
        if len(vals) != p:
            raise PlanError(f"memory_budget_bytes has {len(vals)} entries for {p} pipeline stages; "
                            "give one size per stage or a single size")
    if any(v < 0 for v in vals):
        raise PlanError(f"memory budgets must be >= 0 bytes (0 = unconstrained), got {list(vals)}")
    return vals


def _proxy_budgets(budgets: tuple[int, ...]) -> tuple[float, ...] | None:
    if not any(budgets):
        return None
    return tuple(float(b) if b else math.inf for b in budgets)


def _fits(sim: SimResult, budgets: tuple[int, ...]) -> bool:
    return all(b == 0 or pk <= b for pk, b in zip(sim.peak_memory_bytes, budgets))


def _plan(strategy: str, chunking: Chunking, layout: StageLayout, cuts: Sequence[int] = ()) -> Plan:
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


def _finish(plan: Plan, stats: PlanStats, budgets: tuple[int, ...], knobs: dict[str, Any]) -> Plan:
    # no validate() here: it costs more than planning (tests check every strategy's plans)
    return dataclasses.replace(plan, memory_budget_bytes=budgets, knobs=tuple(knobs.items()), predicted=stats)


def _k_candidates(longest: int, knobs: dict[str, Any]) -> list[float]:
    if "num_slices_longest" in knobs:
        k = knobs["num_slices_longest"]
        if not 0 < k <= longest:
            raise PlanError(f"num_slices_longest={k} must be within (0, {longest}] (the longest sequence's length)")
        return [k]
    cands = knobs.get("k_candidates", _K_CANDIDATES)
    out = sorted({min(k, longest) if k >= 1 else k for k in cands if k > 0})
    if not out:
        raise PlanError(f"k_candidates {cands!r} holds no positive slice count")
    return out


def _describe_longest(lens: Sequence[int]) -> str:
    i = max(range(len(lens)), key=lambda q: (lens[q], -q))
    return f"sequence {i} ({lens[i]} tokens)"


# ---------------------------------------------------------------------------------- adaptive
@dataclasses.dataclass
class _Cand:
    """One chunking of the adaptive search: ``slicing`` is ``"work"`` (workload-balanced,
    :meth:`_Batch.balanced`), ``"tokens"`` (token-equal slices) or ``"whole"`` (whole
    sequences under a token budget); ``key`` identifies it."""

    key: tuple[float, int, str]
    est: float
    chunking: Chunking
    cuts: tuple[int, ...] = ()

    @property
    def k(self) -> float:
        return self.key[0]

    @property
    def slicing(self) -> str:
        return self.key[2]

    def order(self) -> tuple:
        """Best estimate first; candidates the proxy deems infeasible last, smallest chunks first."""
        if math.isinf(self.est):
            return (1, -self.k, self.chunking.token_cap, self.slicing)
        return (0, self.est, self.k, self.slicing)


class _Search:
    """The adaptive search space: chunkings by ``(K, token cap, slicing)``, scored by the proxy
    :meth:`Chunking.estimate` (see :meth:`initial`)."""

    def __init__(self, strategy: str, batch: _Batch, cost: CostModel, layout: StageLayout,
                 budgets: tuple[int, ...], token_cap: int | None, knobs: dict[str, Any]):
        self.strategy, self.batch, self.cost, self.layout, self.knobs = strategy, batch, cost, layout, knobs
        self.budgets = budgets
        # fixed recompute strategies are scored by simulation: rank them unconstrained
        self.proxy = _proxy_budgets(budgets) if strategy == "adaptive" else None
        self.max_groups = int(knobs.get("max_groups", 2))
        if self.max_groups < 1:
            raise PlanError(f"max_groups must be at least 1 (got {self.max_groups})")
        self.ks = _k_candidates(batch.longest, knobs)
        if knobs.get("time_target") is not None:
            self.ks = self.ks[:1]  # K only matters through the time target
        self.token_cap = token_cap
        self.uncapped = token_cap if token_cap is not None else sum(batch.lens)
        self.cands: dict[tuple[float, int, str], _Cand] = {}

    def get(self, k: float, cap: int, slicing: str = "work") -> _Cand:
        key = (k, cap, slicing)
        if key not in self.cands:
            if slicing == "work":
                ch = self.batch.balanced(num_slices_longest=k, token_cap=cap, time_target=self.knobs.get("time_target"),
                                         split_threshold=self.knobs.get("split_threshold"))
            else:
                ch = self.batch.by_tokens(cap, split=(slicing == "tokens"))
            self.cands[key] = _Cand(key, ch.estimate(self.cost, self.layout, self.proxy), ch)
        return self.cands[key]

    def group(self, c: _Cand) -> _Cand:
        """The candidate with the grouping DP's cuts, when it lowers the estimate."""
        if self.strategy == "adaptive" and self.max_groups > 1 and not math.isinf(c.est) and not c.cuts:
            cuts, est = c.chunking.best_group_cuts(self.cost, self.layout, self.proxy, max_groups=self.max_groups)
            if est < c.est:
                c.cuts, c.est = cuts, est
        return c

    def initial(self) -> list[_Cand]:
        """Candidates, best first.

        ``K`` is searched coarse to fine: every other candidate first (0.25, 1, 3, 6, 12, ...),
        then the skipped neighbours of the best (the proxy is close to unimodal in ``K``).
        Without a user token cap, chunks are bounded by time only; when memory binds, the
        leaders and every ``K`` the proxy rejects (its memory view is rough) also get variants
        capped at their longest slice and at the largest chunk that needs no recompute (packed
        chunks of cheap short sequences otherwise hold more tokens, hence activations, than
        any slice). Small steps (few chunks), where discrete fill and drain effects escape the
        proxy and simulating is cheap, also get the baselines' chunkings: token-equal slices
        (Seq1F1B-like) and whole sequences under a token budget (a taper of ever smaller chunks
        at the end can beat equal chunks when there are only a few). The grouping DP runs for
        the best candidate and the climb's, and only when a single group needs recompute.
        """
        ks, uncapped = self.ks, self.uncapped
        for k in ks[::2]:
            self.get(k, uncapped)
        finite = [c for c in self.cands.values() if not math.isinf(c.est)]
        if finite:
            at = ks.index(min(finite, key=_Cand.order).k)
            for nb in (at - 1, at + 1):
                if 0 <= nb < len(ks):
                    self.get(ks[nb], uncapped)
        else:
            for k in ks[1::2]:
                self.get(k, uncapped)
        if self.token_cap is None and (self.strategy != "adaptive" or self.proxy is not None):
            ranked = sorted(self.cands.values(), key=_Cand.order)
            lead = ranked[:3] if not math.isinf(ranked[0].est) else ranked
            if self.strategy != "adaptive" or any(c.chunking.needs_recompute(self.cost, self.layout, self.proxy)
                                                  for c in lead):
                no_rc = _no_recompute_cap(self.cost, self.layout, self.budgets)
                for c in [c for c in ranked if c in lead or math.isinf(c.est)]:
                    first = c.chunking.chains[0][0].tokens if c.chunking.chains else self.batch.longest
                    for cap in sorted({first, no_rc}):
                        if 1 <= cap < c.key[1]:
                            self.get(c.k, cap)
        fixed = "num_slices_longest" in self.knobs or self.knobs.get("time_target") is not None
        if self.strategy == "adaptive" and not fixed:
            leader = min(self.cands.values(), key=_Cand.order).chunking
            if leader.num_chunks * self.layout.num_stages <= _SMALL_STEP:
                self.baseline_candidates()
        ranked = sorted(self.cands.values(), key=_Cand.order)
        for c in ranked[:1]:
            self.group(c)
        return sorted(self.cands.values(), key=_Cand.order)

    def baseline_candidates(self) -> list[_Cand]:
        """The baselines' chunkings (token-equal slices of the longest, Seq1F1B-like; whole
        sequences under a token budget), best estimate first: adaptive can always emulate them."""
        longest, uncapped = self.batch.longest, self.uncapped
        out = [self.get(n, -(-longest // n), "tokens") for n in _N_CANDIDATES
               if n <= longest and -(-longest // n) <= uncapped]
        if longest <= uncapped:  # a whole sequence must fit the user's cap
            out += [self.get(1, size, "whole") for size in _token_budget_candidates(longest, self.token_cap)]
        return sorted(out, key=_Cand.order)

    def neighbours(self, c: _Cand) -> list[_Cand]:
        """The candidates next to ``c`` on its own ladder (``K`` for balanced chunkings, ``N``
        for token-equal ones, the token budget for whole sequences), same cap otherwise: the
        simulator's hill climb from the proxy's pick."""
        k, cap, slicing = c.key
        if slicing == "work":
            ladder = self.ks
            if k not in ladder:
                return []
            at = ladder.index(k)
            return [self.group(self.get(ladder[i], cap)) for i in (at - 1, at + 1) if 0 <= i < len(ladder)]
        if slicing == "tokens":
            longest = self.batch.longest
            ns = [n for n in _N_CANDIDATES if n <= longest and -(-longest // n) <= self.uncapped]
            if k not in ns:
                return []
            at = ns.index(k)
            return [self.get(ns[i], -(-longest // ns[i]), "tokens") for i in (at - 1, at + 1) if 0 <= i < len(ns)]
        sizes = _token_budget_candidates(self.batch.longest, self.token_cap)
        if cap not in sizes:
            return []
        at = sizes.index(cap)
        return [self.get(1, sizes[i], "whole") for i in (at - 1, at + 1) if 0 <= i < len(sizes)]


def _no_recompute_cap(cost: CostModel, layout: StageLayout, budgets: tuple[int, ...]) -> int:
    """Tokens per chunk at which 1F1B's ``p - s`` chunks in flight on stage ``s`` (plus the
    backward's transient gradients) fit every budget without recompute: the largest chunks
    that never need any (0 if even one token does not fit)."""
    p = layout.num_stages
    cap = math.inf
    for s in range(p):
        if not budgets[s]:
            continue
        per_tok = layout.num_stage_layers(s) * cost.act_bytes_per_token + \
            (cost.logits_bytes_per_token if layout.has_head(s) else 0.0)
        room = budgets[s] - cost.static_memory(layout, s)
        cap = min(cap, room / ((p - s) * per_tok + 2 * cost.hidden_bytes_per_token))
    return 0 if cap <= 0 else (10**12 if math.isinf(cap) else int(cap))


def _knobs_of(c: _Cand, extra: dict[str, Any]) -> dict[str, Any]:
    ch = c.chunking
    if c.slicing == "work":
        out = {"slicing": "work", "num_slices_longest": c.k, "token_cap": ch.token_cap, "time_target_s": ch.time_target}
    else:  # a baseline's chunking, found better on a small step
        out = {"slicing": c.slicing, "num_slices_longest": c.k, "token_budget": ch.token_cap}
    return {**out, "num_groups": len(c.cuts) + 1, **extra}


def _with_recompute(plan: Plan, cost: CostModel, budgets: tuple[int, ...], likely_fits: bool) -> Plan:
    """``plan`` with greedy recompute and ``predicted``. When the proxy expects no recompute, a
    plain simulation first: the greedy would only confirm it, at twice the cost."""
    if likely_fits:
        sim = simulate(plan, cost)
        if _fits(sim, budgets):
            return plan.with_predicted(sim.stats())
    return assign_recompute(plan, cost, budgets, method="greedy")


def _search(search: _Search, evaluate: Callable[[_Cand], Plan | None],
            phases: Sequence[tuple[int, float]]) -> tuple[_Cand, Plan] | None:
    """Simulate candidates and return the fastest ``(candidate, plan)`` (``None`` when nothing
    fits). Per phase ``(num_finalists, sim_budget)``: the proxy's pick of each family (they
    differ in what the proxy misses), then the next picks in the proxy's order until
    ``num_finalists`` fit and half the budget of simulated chunk-stages is spent, then a hill
    climb along each family's ladder from its fastest member while the budget lasts. A later
    phase continues where the previous one stopped, so it can only find a faster plan."""
    p = search.layout.num_stages
    done: dict[tuple, tuple[float, int, _Cand, Plan] | None] = {}
    spent = 0.0

    def run(c: _Cand) -> None:
        nonlocal spent
        spent += c.chunking.num_chunks * p
        plan = evaluate(c)
        done[c.key] = None if plan is None else (plan.predicted.step_time_s, len(done), c, plan)

    ranked = search.initial()
    small = ranked[0].chunking.num_chunks * p <= _SMALL_STEP
    leaders: dict[str, _Cand] = {}
    for c in ranked:
        leaders.setdefault(c.slicing, c)
    for c in leaders.values():
        if not math.isinf(c.est) or c is ranked[0]:
            run(c)
    for num_finalists, sim_budget in phases:
        if small:
            sim_budget = max(sim_budget, _SMALL_STEP_SIM_BUDGET)  # each simulation is cheap there
        for c in ranked:
            if c.key in done:
                continue
            if sum(1 for v in done.values() if v) >= num_finalists and spent + c.chunking.num_chunks * p > sim_budget / 2:
                break
            run(c)
        while True:
            ok = [v for v in done.values() if v]
            fresh: list[_Cand] = []
            for family in ("work", "tokens", "whole"):  # K, N and token-budget ladders
                members = [v for v in ok if v[2].slicing == family]
                if members:
                    best = min(members, key=lambda v: (v[0], v[1]))
                    fresh += [nb for nb in search.neighbours(best[2])
                              if nb.key not in done and spent + nb.chunking.num_chunks * p <= sim_budget]
            if not fresh:
                break
            for nb in fresh:
                if nb.key not in done:
                    run(nb)
    ok = [v for v in done.values() if v]
    if not ok:
        return None
    best = min(ok, key=lambda v: (v[0], v[1]))
    return best[2], best[3]


def _plan_adaptive(lens, batch, cost, layout, budgets, token_cap, solver, time_limit_s, knobs) -> Plan:
    search = _Search("adaptive", batch, cost, layout, budgets, token_cap, knobs)
    proxy = search.proxy
    # The greedy solver is the fast path: one finalist and 600 simulated chunk-stages (about
    # 12 ms; the proxy is within ~1% of the simulator on many balanced chunks); the ILP path
    # continues that search with a second finalist and twice the budget, so it never ends
    # slower. Small steps, where the proxy's smooth fill/drain view is least exact, simulate
    # more (see _search).
    phases = [(1, 600.0)]
    if solver == "ilp":
        phases.append((2, 1200.0))
    if "num_finalists" in knobs:
        phases = [(max(1, int(knobs["num_finalists"])), 600.0 * max(1, int(knobs["num_finalists"])))]
    errors: list[InfeasiblePlanError] = []

    def evaluate(c: _Cand) -> Plan | None:
        likely_fits = proxy is None or (not c.cuts and not math.isinf(c.est)
                                        and not c.chunking.needs_recompute(cost, layout, proxy))
        try:
            return _with_recompute(_plan("adaptive", c.chunking, layout, c.cuts), cost, budgets, likely_fits)
        except InfeasiblePlanError as e:
            errors.append(e)  # candidates the proxy rejects come smallest chunks first
            return None

    found = _search(search, evaluate, phases)
    if found is None and "num_slices_longest" not in knobs:
        # Splitting keeps every slice of a sequence in flight (plus its K/V), so when memory is
        # tight a baseline's chunking can fit where no balanced one does: the fastest that fits.
        fitting = [(plan.predicted.step_time_s, i, c, plan) for i, c in enumerate(search.baseline_candidates())
                   if (plan := evaluate(c)) is not None]
        if fitting:
            found = min(fitting, key=lambda v: v[:2])[2:]
    if found is None:
        tried = sorted({c.k for c in search.cands.values()})
        raise InfeasiblePlanError(
            f"adaptive: no chunking of this step fits the memory budgets {_fmt_budgets(budgets)} (tried "
            f"K = {tried} slices of the longest, {_describe_longest(lens)}); the closest attempt: {errors[0]}"
        ) from errors[0]
    cand, best = found
    used = "greedy" if any(any(row) for row in best.recompute) else "none"
    if solver == "ilp" and used == "greedy":
        try:
            ilp = assign_recompute(dataclasses.replace(best, predicted=None), cost, budgets, method="ilp",
                                   time_limit_s=time_limit_s)
            if ilp.predicted.step_time_s < best.predicted.step_time_s:
                best, used = ilp, "ilp"
        except InfeasiblePlanError:  # pragma: no cover - greedy found a plan, so one exists
            pass
    return _finish(best, best.predicted, budgets, _knobs_of(cand, {"recompute_solver": used}))


def _plan_fixed_recompute(strategy, lens, batch, cost, layout, budgets, token_cap, knobs) -> Plan:
    search = _Search(strategy, batch, cost, layout, budgets, token_cap, knobs)
    full = max(layout.num_stage_layers(s) for s in range(layout.num_stages))
    closest: list[tuple[float, _Cand, SimResult]] = []  # the least over-budget attempt, for the error

    def evaluate(c: _Cand) -> Plan | None:
        plan = _plan(strategy, c.chunking, layout, c.cuts)
        if strategy == "full-recompute":
            plan = uniform_recompute(plan, full)
        sim = simulate(plan, cost)
        if _fits(sim, budgets):
            return plan.with_predicted(sim.stats())
        closest.append((max(pk / b for pk, b in zip(sim.peak_memory_bytes, budgets) if b), c, sim))
        return None

    # every candidate is simulated: there is no recompute to assign, only a fit to check
    found = _search(search, evaluate, [(1, math.inf)])
    if found is None:
        _, c, sim = min(closest, key=lambda x: (x[0], x[1].order()))
        s = max(range(layout.num_stages), key=lambda q: sim.peak_memory_bytes[q] / budgets[q] if budgets[q] else 0)
        raise InfeasiblePlanError(
            f"{strategy}: no chunking fits stage {s}'s memory budget of {budgets[s]} bytes "
            f"({budgets[s] / _GIB:.2f} GiB); the closest (K={c.k} slices of the longest, {_describe_longest(lens)}) "
            f"peaks at {sim.peak_memory_bytes[s]} bytes ({sim.peak_memory_bytes[s] / _GIB:.2f} GiB). Raise "
            "memory_budget_bytes (concertina_memory_budget), lower max_tokens_per_chunk, or use the 'adaptive' strategy"
        )
    cand, plan = found
    return _finish(plan, plan.predicted, budgets, _knobs_of(cand, {}))


# ---------------------------------------------------------------------------------- baselines
def _token_budget_candidates(longest: int, cap: int | None) -> list[int]:
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


def _uniform_search(plan: Plan, cost: CostModel, budgets: tuple[int, ...],
                    fixed: int | None) -> tuple[int, Plan, SimResult] | tuple[None, Plan, SimResult]:
    """The fewest uniform recompute layers that fit (time grows with recompute, memory falls),
    or ``fixed``; ``(None, plan, sim)`` at full recompute when nothing fits."""
    max_layers = max(plan.layout.num_stage_layers(s) for s in range(plan.num_stages))
    if fixed is not None:
        if not 0 <= fixed <= max_layers:
            raise PlanError(f"recompute_layers={fixed} must be within 0..{max_layers}")
        cand = uniform_recompute(plan, fixed)
        sim = simulate(cand, cost)
        return (fixed if _fits(sim, budgets) else None), cand, sim
    sims: dict[int, tuple[Plan, SimResult]] = {}

    def at(r: int) -> tuple[Plan, SimResult]:
        if r not in sims:
            cand = uniform_recompute(plan, r)
            sims[r] = (cand, simulate(cand, cost))
        return sims[r]

    if _fits(at(0)[1], budgets):
        return (0, *at(0))
    if not _fits(at(max_layers)[1], budgets):
        return (None, *at(max_layers))
    lo, hi = 0, max_layers  # lo does not fit, hi fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(at(mid)[1], budgets):
            hi = mid
        else:
            lo = mid
    return (hi, *at(hi))


def _plan_baseline(strategy, lens, batch, cost, layout, budgets, max_tokens, knobs) -> Plan:
    longest = max(lens)
    fixed_r = knobs.get("recompute_layers")
    fixed_r = None if fixed_r is None else int(fixed_r)
    settings: list[tuple[str, int, int]] = []  # (knob name, knob value, token budget)
    if strategy == "packed":
        if "token_budget" in knobs:
            settings = [("token_budget", int(knobs["token_budget"]), int(knobs["token_budget"]))]
        else:
            settings = [("token_budget", b, b) for b in _token_budget_candidates(longest, max_tokens)]
    else:
        ns = [int(knobs["num_slices"])] if "num_slices" in knobs else [n for n in _N_CANDIDATES if n <= longest]
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
    best = None
    closest = None
    for name, value, size in settings:
        ch = batch.by_tokens(size, split=(strategy == "split"))
        r, plan, sim = _uniform_search(_plan(strategy, ch, layout), cost, budgets, fixed_r)
        if r is None:
            over = max(pk / b for pk, b in zip(sim.peak_memory_bytes, budgets) if b)
            if closest is None or over < closest[0]:
                closest = (over, name, value, sim)
            continue
        if best is None or sim.step_time_s < best[0]:
            knob = {name: value, "token_budget": size} if name != "token_budget" else {name: value}
            best = (sim.step_time_s, plan, sim, {**knob, "recompute_layers": r})
    if best is None:
        over, name, value, sim = closest
        s = max(range(layout.num_stages), key=lambda q: sim.peak_memory_bytes[q] / budgets[q] if budgets[q] else 0)
        rc = "the given recompute_layers" if fixed_r is not None else "full recompute"
        raise InfeasiblePlanError(
            f"{strategy}: no setting fits stage {s}'s memory budget of {budgets[s]} bytes ({budgets[s] / _GIB:.2f} GiB): "
            f"the closest ({name}={value}, {rc}) peaks at {sim.peak_memory_bytes[s]} bytes "
            f"({sim.peak_memory_bytes[s] / _GIB:.2f} GiB); the longest is {_describe_longest(lens)}. Raise "
            "memory_budget_bytes (concertina_memory_budget), use more pipeline stages, or the 'adaptive' strategy"
        )
    _, plan, sim, kn = best
    return _finish(plan, sim.stats(), budgets, kn)


def _fmt_budgets(budgets: Sequence[int]) -> str:
    if len(set(budgets)) == 1:
        return f"{budgets[0]} bytes ({budgets[0] / _GIB:.2f} GiB) per stage"
    return "[" + ", ".join(f"{b / _GIB:.2f}" for b in budgets) + "] GiB"


# ---------------------------------------------------------------------------------- entry point
def plan_step(
    seq_lens: Sequence[int],
    cost: CostModel,
    layout: StageLayout,
    memory_budget_bytes: int | Sequence[int],
    strategy: str = "adaptive",
    *,
    max_tokens_per_chunk: int | None = None,
    solver: str = "ilp",
    time_limit_s: float = 1.0,
    **knobs: Any,
) -> Plan:
    """Plan one step: chunks, groups, schedule and recompute, with ``predicted`` filled in.

    ``memory_budget_bytes``: per stage (static memory included), one size for all or one per
    stage; 0 means unconstrained. ``max_tokens_per_chunk``: the token cap of a chunk (adaptive;
    for the baselines, the largest token budget / slice size tried). ``solver``: ``"ilp"`` or
    ``"greedy"`` recompute assignment (adaptive). ``knobs`` fix a strategy's searched settings:
    adaptive ``num_slices_longest``, ``k_candidates``, ``max_groups``, ``split_threshold``,
    ``time_target``, ``num_finalists``; packed ``token_budget``, ``recompute_layers``; split
    ``num_slices``, ``recompute_layers``. The chosen settings are in ``plan.knobs``.

    Raises :class:`~.recompute.InfeasiblePlanError` when nothing fits the budget.
    """
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown planning strategy {strategy!r}; use one of {STRATEGIES} (concertina_strategy)")
    if solver not in ("ilp", "greedy"):
        raise PlanError(f"unknown recompute solver {solver!r}; use 'ilp' or 'greedy' (concertina_solver)")
    bad = sorted(set(knobs) - set(_KNOBS[strategy]))
    if bad:
        raise PlanError(f"strategy {strategy!r} has no knob(s) {bad}; it accepts {list(_KNOBS[strategy])}")
    if max_tokens_per_chunk is not None and max_tokens_per_chunk < 1:
        raise PlanError(f"max_tokens_per_chunk must be positive (got {max_tokens_per_chunk})")
    lens = [int(n) for n in seq_lens]
    if not lens or max(lens) <= 0:
        raise PlanError("a step needs at least one non-empty sequence")
    if layout.num_layers != cost.num_layers:
        raise PlanError(f"the stage layout has {layout.num_layers} layers but the cost model {cost.num_layers}; "
                        "build both from the same model config")
    budgets = _stage_budgets(memory_budget_bytes, layout.num_stages)
    token_cap = int(max_tokens_per_chunk) if max_tokens_per_chunk is not None else None
    batch = _Batch(lens, cost, layout)
    runners: dict[str, Callable[[], Plan]] = {
        "adaptive": lambda: _plan_adaptive(lens, batch, cost, layout, budgets, token_cap, solver, time_limit_s, knobs),
        "no-recompute": lambda: _plan_fixed_recompute("no-recompute", lens, batch, cost, layout, budgets, token_cap,
                                                      knobs),
        "full-recompute": lambda: _plan_fixed_recompute("full-recompute", lens, batch, cost, layout, budgets,
                                                        token_cap, knobs),
        "packed": lambda: _plan_baseline("packed", lens, batch, cost, layout, budgets, max_tokens_per_chunk, knobs),
        "split": lambda: _plan_baseline("split", lens, batch, cost, layout, budgets, max_tokens_per_chunk, knobs),
    }
    return runners[strategy]()
