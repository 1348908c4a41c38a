"""Step planning strategies: the adaptive method and the baselines it is compared with.

Every strategy turns a step's sequence lengths into a :class:`~.types.Plan` scored by the same
simulator (:func:`~.simulate.simulate`), so comparisons are like for like:

- ``adaptive`` (the method, DESIGN.md 4): workload-balanced chunking (:mod:`.chunking`) for
  each candidate ``K`` (slices of the longest sequence: 1, 2, 3, 4, 6, 8, 12, ...), grouping
  by the chunking's dynamic program, all scored by the analytic proxy
  :meth:`~.chunking.Chunking.estimate`; the best ``num_finalists`` candidates get a real
  recompute assignment (greedy) and a simulation; when the winner recomputes anything and
  ``solver="ilp"``, the ILP refines it (kept only if it simulates faster). Cost for 512
  sequences on 4 stages: about 1 ms of chunking and a fraction of a ms of proxy per candidate,
  then a few ms per finalist (greedy and simulation) and the ILP when recompute is needed.
- ``packed`` (batch-level PP): whole sequences best-fit decreasing into micro-batches of a fixed
  token budget (a longer sequence gets a micro-batch of its own; tokens are never dropped),
  uniform recompute (the same number of layers on every stage and chunk). Tuned: the budget
  over powers of two and 1.5x between, from the longest sequence down, and for each the fewest
  uniform recompute layers that fit (binary search; step time grows with recompute).
- ``split`` (token-level PP, Seq1F1B-like): sequences longer than ``S = ceil(longest / N)``
  tokens cut into ``ceil(len / S)`` equal-length slices (the longest into ``N``), short ones
  packed up to ``S`` tokens; uniform recompute. Tuned: ``N`` and recompute as for packed.
- ``no-recompute`` / ``full-recompute``: the adaptive chunking and grouping search with
  recompute fixed at none / every layer (ablations of adaptive checkpointing).

All strategies use the same order (longest first, packed chunks spread behind the split chains)
and the same 1F1B schedule (:func:`~.schedule.build_schedule` with ``prefetch=True``). A
strategy that finds nothing fitting raises :class:`~.recompute.InfeasiblePlanError` naming the
budget, the offending sequence and the setting to change.
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
_SMALL_STEP = 160
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
def _adaptive_candidates(strategy: str, batch: _Batch, cost: CostModel, layout: StageLayout,
                         budgets: tuple[int, ...], token_cap: int | None, knobs: dict[str, Any]):
    """Chunking candidates ``(estimate, K, chunking, cuts, slicing)``, best estimate first (those
    the proxy deems infeasible last, smallest chunks first).

    ``K`` is searched coarse to fine: every other candidate first (0.25, 1, 3, 6, 12, ...), then
    the skipped neighbours of the best (the proxy is close to unimodal in ``K``). Without a
    user token cap, chunks are bounded by time only; when memory binds, every ``K`` also gets
    variants capped at its longest slice and at the largest chunk that needs no recompute
    (packed chunks of cheap short sequences otherwise hold more tokens, hence activations,
    than any slice). Small steps (few chunks), where discrete fill and drain effects escape
    the proxy and simulating is cheap, also get token-equal (Seq1F1B-like) slicings:
    ``slicing`` is ``"work"`` or ``"tokens"``. The grouping DP runs for the two best
    candidates only, and only when their single group needs recompute.
    """
    proxy = _proxy_budgets(budgets) if strategy == "adaptive" else None
    max_groups = int(knobs.get("max_groups", 3))
    if max_groups < 1:
        raise PlanError(f"max_groups must be at least 1 (got {max_groups})")
    ks = _k_candidates(batch.longest, knobs)
    if knobs.get("time_target") is not None:
        ks = ks[:1]  # K only matters through the time target
    uncapped = token_cap if token_cap is not None else sum(batch.lens)
    scored: dict[tuple[float, int, str], tuple[float, Chunking]] = {}

    def score(k: float, cap: int, slicing: str = "work") -> None:
        if (k, cap, slicing) not in scored:
            if slicing == "work":
                ch = batch.balanced(num_slices_longest=k, token_cap=cap, time_target=knobs.get("time_target"),
                                    split_threshold=knobs.get("split_threshold"))
            else:
                ch = batch.by_tokens(cap, split=True)
            # fixed recompute strategies are scored by simulation later: rank them unconstrained
            scored[(k, cap, slicing)] = (ch.estimate(cost, layout, proxy), ch)

    for k in ks[::2]:
        score(k, uncapped)
    finite = [key for key, (est, _) in scored.items() if not math.isinf(est)]
    if finite:
        best = min(finite, key=lambda key: (scored[key][0], key[0]))
        at = ks.index(best[0])
        for nb in (at - 1, at + 1):
            if 0 <= nb < len(ks):
                score(ks[nb], uncapped)
    else:
        for k in ks[1::2]:
            score(k, uncapped)
    if token_cap is None and (strategy != "adaptive" or proxy is not None):
        ranked = sorted(scored, key=lambda key: (scored[key][0], key[0]))
        lead = ranked[: 3 if not math.isinf(scored[ranked[0]][0]) else len(ranked)]
        if strategy != "adaptive" or any(scored[key][1].needs_recompute(cost, layout, proxy) for key in lead):
            no_rc = _no_recompute_cap(cost, layout, budgets)
            # memory binds: the leaders and every K the proxy rejects (its memory view is
            # rough) get capped variants
            for k, cap, _ in [key for key in scored if key in lead or math.isinf(scored[key][0])]:
                ch = scored[(k, cap, "work")][1]
                first = ch.chains[0][0].tokens if ch.chains else batch.longest
                for c in sorted({first, no_rc}):
                    if 1 <= c < cap:
                        score(k, c)
    if strategy == "adaptive" and "num_slices_longest" not in knobs and knobs.get("time_target") is None:
        leader = min(scored.values(), key=lambda v: v[0])[1]
        if leader.num_chunks * layout.num_stages <= _SMALL_STEP:
            for n in _N_CANDIDATES:
                size = -(-batch.longest // n)
                if n <= batch.longest and size <= uncapped:
                    score(n, size, "tokens")
    out = [(est, k, ch, (), slicing) for (k, _, slicing), (est, ch) in scored.items()]

    def order(c):
        return (math.isinf(c[0]), (-c[1], c[2].token_cap) if math.isinf(c[0]) else (c[0], c[1]), c[4])

    out.sort(key=order)
    if strategy == "adaptive" and max_groups > 1:
        for idx in range(min(2, len(out))):
            est, k, ch, _, slicing = out[idx]
            if not math.isinf(est):
                cuts, est2 = ch.best_group_cuts(cost, layout, proxy, max_groups=max_groups)
                out[idx] = (min(est, est2), k, ch, cuts if est2 < est else (), slicing)
        out.sort(key=order)
    return out


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


def _knobs_of(k: float, ch: Chunking, cuts: Sequence[int], slicing: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"num_slices_longest": k, "slicing": slicing, "token_cap": ch.token_cap, "time_target_s": ch.time_target,
            "num_groups": len(cuts) + 1, **extra}


def _with_recompute(plan: Plan, cost: CostModel, budgets: tuple[int, ...], likely_fits: bool) -> Plan:
    """``plan`` with greedy recompute and ``predicted``. When the proxy expects no recompute, a
    plain simulation first: the greedy would only confirm it, at twice the cost."""
    if likely_fits:
        sim = simulate(plan, cost)
        if _fits(sim, budgets):
            return plan.with_predicted(sim.stats())
    return assign_recompute(plan, cost, budgets, method="greedy")


def _plan_adaptive(lens, batch, cost, layout, budgets, token_cap, solver, time_limit_s, knobs) -> Plan:
    cands = _adaptive_candidates("adaptive", batch, cost, layout, budgets, token_cap, knobs)
    proxy = _proxy_budgets(budgets)
    # The greedy solver is the fast path: one simulated finalist (the proxy is within ~1% of
    # the simulator on many balanced chunks); the ILP path affords a second opinion. Small
    # steps, where the proxy's smooth fill/drain term is least exact, simulate more candidates
    # as long as the simulated chunks stay within a budget (simulation is linear in chunks).
    num_finalists = max(1, int(knobs.get("num_finalists", 2 if solver == "ilp" else 1)))
    sim_budget = 600 * num_finalists  # chunk-stages, about 2 ms of simulation each 100
    scored: list[tuple[float, int, Plan, tuple]] = []
    last_error: InfeasiblePlanError | None = None
    simulated = 0
    for rank, (est, k, ch, cuts, slicing) in enumerate(cands):
        cells = ch.num_chunks * layout.num_stages
        if len(scored) >= num_finalists and simulated + cells > sim_budget:
            break
        simulated += cells
        likely_fits = proxy is None or (not cuts and not math.isinf(est) and not ch.needs_recompute(cost, layout, proxy))
        try:
            plan = _with_recompute(_plan("adaptive", ch, layout, cuts), cost, budgets, likely_fits)
        except InfeasiblePlanError as e:
            # candidates the proxy rejects come smallest chunks first: the first error is the
            # one closest to fitting
            last_error = last_error or e
            continue
        scored.append((plan.predicted.step_time_s, rank, plan, (k, ch, cuts, slicing)))
    scored.sort(key=lambda x: (x[0], x[1]))
    if not scored:
        raise InfeasiblePlanError(
            f"adaptive: no chunking of this step fits the memory budgets {_fmt_budgets(budgets)} (tried "
            f"K = {sorted({c[1] for c in cands})} slices of the longest, {_describe_longest(lens)}); "
            f"the tightest attempt: {last_error}"
        ) from last_error
    best_time, _, best, (k, ch, cuts, slicing) = scored[0]
    used = "greedy" if any(any(row) for row in best.recompute) else "none"
    if solver == "ilp" and used == "greedy":
        try:
            ilp = assign_recompute(dataclasses.replace(best, predicted=None), cost, budgets, method="ilp",
                                   time_limit_s=time_limit_s)
            if ilp.predicted.step_time_s < best_time:
                best, used = ilp, "ilp"
        except InfeasiblePlanError:  # pragma: no cover - greedy found a plan, so one exists
            pass
    return _finish(best, best.predicted, budgets, _knobs_of(k, ch, cuts, slicing, {"recompute_solver": used}))


def _plan_fixed_recompute(strategy, lens, batch, cost, layout, budgets, token_cap, knobs) -> Plan:
    cands = _adaptive_candidates(strategy, batch, cost, layout, budgets, token_cap, knobs)
    best: tuple[float, int, Plan, SimResult, dict] | None = None
    lowest: tuple[float, int, Any] | None = None  # the least over-budget attempt, for the error
    for est, k, ch, cuts, slicing in cands:
        plan = _plan(strategy, ch, layout, cuts)
        if strategy == "full-recompute":
            plan = uniform_recompute(plan, max(layout.num_stage_layers(s) for s in range(layout.num_stages)))
        sim = simulate(plan, cost)
        if not _fits(sim, budgets):
            over = max(pk / b for pk, b in zip(sim.peak_memory_bytes, budgets) if b)
            if lowest is None or over < lowest[0]:
                lowest = (over, k, sim)
            continue
        if best is None or sim.step_time_s < best[0]:
            best = (sim.step_time_s, k, plan, sim, _knobs_of(k, ch, cuts, slicing, {}))
    if best is None:
        over, k, sim = lowest
        s = max(range(layout.num_stages), key=lambda q: sim.peak_memory_bytes[q] / budgets[q] if budgets[q] else 0)
        raise InfeasiblePlanError(
            f"{strategy}: no chunking fits stage {s}'s memory budget of {budgets[s]} bytes "
            f"({budgets[s] / _GIB:.2f} GiB); the closest (K={k} slices of the longest, {_describe_longest(lens)}) "
            f"peaks at {sim.peak_memory_bytes[s]} bytes ({sim.peak_memory_bytes[s] / _GIB:.2f} GiB). Raise "
            "memory_budget_bytes (concertina_memory_budget), lower max_tokens_per_chunk, or use the 'adaptive' strategy"
        )
    _, _, plan, sim, kn = best
    return _finish(plan, sim.stats(), budgets, kn)


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
