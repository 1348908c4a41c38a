"""Adaptive activation recomputation: how many layers of each (stage, chunk) recompute.

Problem. Chunks, groups and schedule are fixed. Choose ``r[s][c]`` in ``0 .. layers of stage
s`` minimizing the step time recomputation adds, with the memory of every stage under its
budget at every moment of the schedule.

Memory. A stage's memory only depends on its own action order (see
:mod:`concertina_hf.planning.simulate`), and it is linear in the recompute row: a chunk in
flight holds ``A0[c] - r[c] * D[c]`` bytes (``D``: a layer's saved activations minus what a
recomputed layer keeps: its input, plus K/V for split chunks), and during its own backward a
chunk that recomputes *every* layer of the stage re-materializes one layer (``X[c]``, the step of
``transient_memory`` from 0 to ``n`` recomputed layers; with fewer, the runtime recomputes the
first layers, which run backward after the saved ones have freed more than that). A profiled
model's per-chunk term ``ckpt_chunk_bytes_per_token`` (kept once by any recomputed chunk) adds a
step at ``r = 1`` to the line; ``D`` is taken from ``r = 0`` and ``1``, so the model
over-approximates a chunk at ``r > 1`` by ``(r - 1)`` times that term (a few bytes per token;
conservative: plans it accepts fit in simulation). The local maxima are right after each
forward and during each backward (:func:`~concertina_hf.planning.simulate.memory_moments`);
only moments that can exceed the budget at all are kept, and a forward's moment is dropped when
the backward after it holds a superset (the 1F1B steady state), so the model has about one
constraint per over-budget backward.

Time. In 1F1B the backward at position ``i`` of stage ``s``'s backward order runs on diagonal
``d = i + (p - 1 - s)`` (per pipeline group): the backwards of a diagonal run side
by side and each waits for the previous diagonal, so recompute on one cell delays the whole
diagonal and what follows, and the step-time cost is ``sum_d max_{cells on d} delay``. With
heterogeneous chunks many backwards have slack (a short chunk behind a long one, fill and
drain), so a cell's delay is ``max(0, t[c] * r - slack[s][c])``, ``t[c]`` one layer's forward
on the chunk and ``slack`` the backward's total float in the zero-recompute simulation (latest
minus earliest start). Without the slack term the ILP optimum was up to 3x slower in simulation
than the greedy below on skewed 512-sequence batches; with it, it matched the exhaustive optimum
on all 30 tiny random instances we enumerated. ``1e-3`` times the total recompute time breaks
ties towards less work.

Variables. One integer per cell (only cells that appear in a kept constraint and whose recompute
saves memory), one continuous max per diagonal, and a binary "recomputes every layer" per cell
whose own backward is constrained (the ``X`` term; ``y >= r - (n - 1)``, the convex hull). We
chose per-cell integers over one integer per diagonal scaled by layer counts: memory pressure differs per stage (stage ``s`` holds
``p - s - 1 + n`` chunks in flight) and per chunk (long slices carry K/V), and slack differs per
cell, so one integer per diagonal would recompute on cells that neither need it nor can hide it.
The per-diagonal max keeps the diagonal structure in the objective. For ~100 chunks on 4 stages
the model has a few hundred variables; CBC (2% gap, node cap, warm start from greedy) takes
30-100 ms, a few hundred ms at worst, bounded by ``time_limit_s``.

Solvers. ``"greedy"``: per stage (stage 0 first), walk the moments in schedule order; while one
is over budget, add recompute to the in-flight cell that buys the most bytes per second of added
delay (layers hidden by slack or by the diagonal's current delay are free), with just enough
layers to cover the excess. Adding recompute to a chunk never raises an earlier moment, so one
pass suffices; if no cell can help, the stage falls back to full recompute, which is feasible
whenever any plan is (checked up front: if even full recompute does not fit,
:class:`InfeasiblePlanError` says where and what to change). Cost ``O(moments x in-flight)``,
~1 ms; with model building and three simulations ``assign_recompute`` takes ~10-15 ms for ~100
chunks on 4 stages. ``"ilp"``: the model above, warm-started from the greedy solution; if CBC
fails or finds nothing in time, the greedy solution is used. The objective is a first-order
model of the step time, so both solutions are simulated and the faster one is returned.

A budget of 0 for a stage means unconstrained (the :class:`Plan` convention).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

from .budgets import stage_budgets, within_budgets
from .cost import CostModel
from .plan import Plan
from .simulate import backward_slack, memory_moments, simulate, stage_representatives
from .types import Action, ActionKind, PlanError, Remedy

__all__ = [
    "SOLVERS", "InfeasiblePlanError", "assign_recompute", "fits", "min_uniform_recompute", "uniform_recompute",
]

#: the recompute solvers (``solver`` of :func:`~.strategies.plan_step`, ``method`` here,
#: ``concertina_solver`` of the trainer)
SOLVERS = ("ilp", "greedy")

logger = logging.getLogger(__name__)

_EPS_TOTAL = 1e-3  # weight of total recompute time in the objective (tie-break only)
# CBC: stop within 2% of the bound; few cut passes, no strong branching and a node cap keep a
# solve in tens of ms, and the node cap (unlike the time limit) keeps results reproducible
_ILP_GAP = 0.02
_CBC_OPTIONS = ("passC 5", "strong 0", "maxN 200")
_GIB = 2**30
_MORE_STAGES = Remedy("pipeline_size", "raise", note="(fewer layers per stage)")


class InfeasiblePlanError(PlanError):
    """No recompute decision fits the memory budget, not even recomputing every layer."""


# ---------------------------------------------------------------------------- public helpers
def uniform_recompute(plan: Plan, layers_per_stage: int | Sequence[int]) -> Plan:
    """The plan with ``r[s][c] = min(n, layers of stage s)`` for every chunk, ``n`` one number or
    one per stage (predictions dropped: they no longer apply)."""
    p = plan.num_stages
    if isinstance(layers_per_stage, int):
        per = [layers_per_stage] * p
    else:
        per = list(layers_per_stage)
        if len(per) != p:
            raise PlanError(f"uniform_recompute needs one layer count per stage ({p}), got {len(per)}")
    if any(n < 0 for n in per):
        raise PlanError(f"recompute layer counts must be non-negative, got {per}")
    rows = tuple((min(per[s], plan.layout.num_stage_layers(s)),) * plan.num_chunks for s in range(p))
    return dataclasses.replace(plan, recompute=rows, predicted=None)


def fits(plan: Plan, cost: CostModel, budgets: Sequence[int]) -> bool:
    """Whether the simulated peak of every stage is within its budget (0 = unconstrained)."""
    budgets = stage_budgets(budgets, plan.num_stages)
    return within_budgets(simulate(plan, cost).peak_memory_bytes, budgets)


# ---------------------------------------------------------------------------- the model
@dataclass
class _Moment:
    action: Action
    in_flight: tuple[int, ...]
    backward: int  # -1 after a forward
    base0: float  # bytes with no recompute at all
    sum_d: float = 0.0  # sum of D over in_flight (what one recomputed layer on every chunk saves)
    sum_f: float = 0.0  # sum of F over in_flight (what full recompute of every chunk saves)


@dataclass
class _Model:
    """Per-stage linear memory model and per-cell times (see the module docstring)."""

    p: int
    layers: list[int]
    budgets: list[int]
    A0: list[list[float]]
    D: list[list[float]]
    X: list[list[float]]
    t: list[float]  # one recomputed layer's time per chunk (same on every stage)
    diag: list[list[int]]  # diagonal id of each cell
    num_diags: int
    moments: list[list[_Moment]]
    slack: list[list[float]]  # seconds B(s, c) can slip without delaying the step
    F: list[list[float]] = dataclasses.field(default_factory=list)  # exact saving of full recompute

    def delay(self, s: int, c: int, r: int) -> float:
        """First-order step-time cost of ``r`` recomputed layers on cell (s, c)."""
        v = r * self.t[c] - self.slack[s][c]
        return v if v > 0 else 0.0

    def value(self, s: int, m: _Moment, row: Sequence[int]) -> float:
        D = self.D[s]
        v = m.base0
        for c in m.in_flight:
            if row[c]:
                v -= row[c] * D[c]
        b = m.backward
        if b >= 0 and row[b] >= self.layers[s]:
            v += self.X[s][b]
        return v

    def value_full(self, s: int, m: _Moment) -> float:
        """The moment with every layer of the stage recomputed, exactly (the linear model may
        over-approximate it, see the module docstring)."""
        v = m.base0 - m.sum_f  # (the sum of F over in_flight, kept as a running sum)
        return v + (self.X[s][m.backward] if m.backward >= 0 else 0.0)


def _build_model(plan: Plan, cost: CostModel, budgets: Sequence[int]) -> _Model:
    p, n = plan.num_stages, plan.num_chunks
    lay = plan.layout
    layers = [lay.num_stage_layers(s) for s in range(p)]
    A0, D, X, T0, F = [], [], [], [], []
    rep = stage_representatives(plan, cost)
    for s in range(p):
        if rep[s] != s:  # same shape as an earlier stage: same terms (lists are read-only)
            for lst in (A0, D, X, T0, F):
                lst.append(lst[rep[s]])
            continue
        a0, d, x, t0, f = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        for c in plan.chunks:
            i = c.index
            a0[i] = cost.act_memory(lay, s, c, 0)
            d[i] = a0[i] - cost.act_memory(lay, s, c, 1)
            f[i] = a0[i] - cost.act_memory(lay, s, c, layers[s])
            t0[i] = cost.transient_memory(lay, s, c, 0)
            x[i] = cost.transient_memory(lay, s, c, layers[s]) - t0[i]
        A0.append(a0)
        D.append(d)
        F.append(f)
        X.append(x)
        T0.append(t0)
    t = [cost.recompute_time(c, 1) for c in plan.chunks]
    # diagonals, per pipeline group: backward position i on stage s -> i + (p - 1 - s)
    group_of = [0] * n
    for g, members in enumerate(plan.groups):
        for ci in members:
            group_of[ci] = g
    diag_id: dict[tuple[int, int], int] = {}
    diag = [[0] * n for _ in range(p)]
    for s in range(p):
        pos: dict[int, int] = {}
        for a in plan.schedule[s]:
            if a.kind is ActionKind.BACKWARD:
                g = group_of[a.chunk]
                i = pos.get(g, 0)
                pos[g] = i + 1
                diag[s][a.chunk] = diag_id.setdefault((g, i + p - 1 - s), len(diag_id))
    moments = []
    for s in range(p):
        row = []
        a0 = A0[s]
        # the activations in flight as a running sum, in the simulator's order of operations (at
        # r = 0 the two agree to the bit)
        d, f = D[s], F[s]
        acts, sd, sf, held = 0.0, 0.0, 0.0, 0
        for mo in memory_moments(plan, cost, s):
            if mo.backward is None and mo.action.kind is not ActionKind.FORWARD:
                # the embedding's backward: the chunk is gone from the running sum already
                row.append(_Moment(mo.action, mo.in_flight, -1, mo.const + acts, sd, sf))
            elif mo.backward is None:
                c = mo.action.chunk
                acts += a0[c]
                sd += d[c]
                sf += f[c]
                held += 1
                row.append(_Moment(mo.action, mo.in_flight, -1, mo.const + acts, sd, sf))
            else:
                b = mo.backward
                row.append(_Moment(mo.action, mo.in_flight, b, mo.const + acts + T0[s][b], sd, sf))
                held -= 1
                acts, sd, sf = (acts - a0[b], sd - d[b], sf - f[b]) if held else (0.0, 0.0, 0.0)
        moments.append(row)
    slack = [[0.0] * n for _ in range(p)]
    return _Model(p, layers, list(budgets), A0, D, X, t, diag, len(diag_id), moments, slack, F)


def _over(model: _Model, s: int, m: _Moment) -> bool:
    """Can this moment exceed its stage's budget for some recompute row?"""
    b = model.budgets[s]
    if b == 0:
        return False
    # recompute lowers a moment (by D per layer) except for the re-materialized layer X of its
    # own backward chunk, so base0 + X bounds it from above over all rows the planner makes
    # (it only recomputes cells with D > 0)
    worst = m.base0 + (model.X[s][m.backward] if m.backward >= 0 and model.X[s][m.backward] > 0 else 0.0)
    return worst > b


def _infeasible(plan: Plan, model: _Model, cost: CostModel) -> None:
    """Raise :class:`InfeasiblePlanError` if full recompute does not fit some stage."""
    worst = None
    for s in range(model.p):
        budget = model.budgets[s]
        if budget == 0:
            continue
        static = cost.static_memory(plan.layout, s)
        if static > budget:
            raise InfeasiblePlanError(
                f"stage {s}'s parameters, gradients and optimizer state alone need {math.ceil(static)} bytes "
                f"({static / _GIB:.2f} GiB), over its memory budget of {budget} bytes ({budget / _GIB:.2f} GiB)",
                Remedy("memory_budget", "raise"), _MORE_STAGES,
            )
        for m in model.moments[s]:
            if not _over(model, s, m):
                continue
            v = model.value_full(s, m)
            if v > budget and (worst is None or v - budget > worst[0] - model.budgets[worst[1]]):
                worst = (v, s, m)
    if worst is None:
        return
    v, s, m = worst
    budget = model.budgets[s]
    a = m.action
    c = plan.chunks[a.chunk]
    what = "during the backward" if a.kind is ActionKind.BACKWARD else "after the forward"
    if m.backward < 0 and a.kind is ActionKind.BACKWARD:
        what = "during the embedding's backward (its vocab x hidden weight gradient before it is added into .grad)"
    desc = " ".join(f"{sl.seq}[{sl.start}:{sl.end}]" for sl in c.slices[:4]) + (" ..." if len(c.slices) > 4 else "")
    per_seq: dict[int, int] = {}
    for ci in m.in_flight:
        for sl in plan.chunks[ci].slices:
            per_seq[sl.seq] = per_seq.get(sl.seq, 0) + sl.length
    if not per_seq:  # nothing else in flight: the constant terms alone are over
        raise InfeasiblePlanError(
            f"no recompute plan fits stage {s}'s memory budget of {budget} bytes ({budget / _GIB:.2f} GiB): it "
            f"needs {math.ceil(v)} bytes ({v / _GIB:.2f} GiB) {what} of chunk {c.index} with no other chunk in "
            "flight", Remedy("memory_budget", "raise"), _MORE_STAGES)
    q = max(sorted(per_seq), key=lambda k: per_seq[k])
    n_slices = len(plan.slices_of(q))
    tok = sum(per_seq.values())
    raise InfeasiblePlanError(
        f"no recompute plan fits stage {s}'s memory budget of {budget} bytes ({budget / _GIB:.2f} GiB): even "
        f"recomputing all {model.layers[s]} layers of every chunk it needs {math.ceil(v)} bytes "
        f"({v / _GIB:.2f} GiB) {what} of chunk {c.index} ({c.kind.value}, {c.num_tokens} tokens: {desc}), "
        f"with {len(m.in_flight)} chunks ({tok} tokens) in flight, the most from sequence {q} "
        f"({plan.seq_lens[q]} tokens in {n_slices} slice{'s' if n_slices > 1 else ''}, {per_seq[q]} in flight)",
        Remedy("memory_budget", "raise"), Remedy("max_tokens_per_chunk", "lower", note="(smaller chunks and slices)"),
        _MORE_STAGES,
    )


# ---------------------------------------------------------------------------- uniform recompute
def min_uniform_recompute(plan: Plan, cost: CostModel, budgets: Sequence[int]) -> int | None:
    """The fewest layers ``r`` that :func:`uniform_recompute` (``min(r, layers)`` on every stage
    and chunk) needs for every stage to fit its budget, from the memory model alone (no
    simulation); ``None`` when even full recompute does not fit.

    A chunk's activations are linear in its recomputed layers between 1 and all of them (the
    per-chunk closure term is a step at 1), so at each memory moment the bytes for ``r`` layers
    are ``base0`` at 0, ``base0 - sum_F (+ X)`` at all, and a line between 1 and all; each moment
    bounds ``r`` from one side, so every stage's fitting ``r`` are ``{0}``, an interval and ``{L}``
    (not always monotone: a split chunk's K/V can make recompute cost memory), found in
    ``O(moments)``. Float rounding aside, it agrees with :func:`simulate` (the caller checks)."""
    p = plan.num_stages
    budgets = list(stage_budgets(budgets, p))
    model = _build_model(plan, cost.for_plan(plan), budgets)  # (as simulate runs it)
    allowed: list[Callable[[int], bool]] = []
    for s in range(p):
        b, L = budgets[s], model.layers[s]
        if b == 0:
            allowed.append(lambda r: True)
            continue
        X = model.X[s]
        ok0 = okL = True
        lo, hi = 1, L - 1  # the interval of 1 .. L-1 that fits
        for m in model.moments[s]:
            if m.base0 > b:
                ok0 = False
            if m.base0 - m.sum_f + (X[m.backward] if m.backward >= 0 else 0.0) > b:
                okL = False
            if L > 1:
                # r in 1..L-1: base0 - sum_d - (r - 1) * g, g the slope per layer beyond the first
                v1, g = m.base0 - m.sum_d, (m.sum_f - m.sum_d) / (L - 1)
                if v1 <= b and v1 - (L - 2) * g <= b:
                    continue
                if g > 0:
                    lo = max(lo, 1 + math.ceil((v1 - b) / g))
                elif g < 0:
                    hi = min(hi, 1 + math.floor((b - v1) / -g))
                else:
                    hi = 0
        allowed.append(lambda r, ok0=ok0, okL=okL, lo=lo, hi=hi, L=L:
                       (ok0 if r == 0 else okL if r >= L else lo <= r <= hi))
    for r in range(max(model.layers) + 1):
        if all(allowed[s](min(r, model.layers[s])) for s in range(p)):
            return r
    return None


# ---------------------------------------------------------------------------- greedy
def _greedy(model: _Model, start: list[list[int]] | None = None) -> list[list[int]]:
    """Greedy fill (see the module docstring); ``start``: rows to extend (e.g. a repair)."""
    p = model.p
    n = len(model.t)
    rows = [list(r) for r in start] if start is not None else [[0] * n for _ in range(p)]
    zmax = [0.0] * model.num_diags  # step-time delay already paid on each diagonal
    for s in range(p):
        for c in range(n):
            d = model.diag[s][c]
            zmax[d] = max(zmax[d], model.delay(s, c, rows[s][c]))
    for s in range(p):  # stage 0 first: it needs the most, later stages align with its diagonals
        budget = model.budgets[s]
        if budget == 0:
            continue
        row, D, X, diag, t, L = rows[s], model.D[s], model.X[s], model.diag[s], model.t, model.layers[s]
        slack = model.slack[s]
        for m in model.moments[s]:
            if not _over(model, s, m):
                continue
            v = model.value(s, m, row)
            while v > budget:
                excess = v - budget
                best = None
                for c in m.in_flight:
                    rc = row[c]
                    if rc >= L or D[c] <= 0:
                        continue
                    # recomputing every layer re-materializes X during the chunk's own backward
                    own = c == m.backward
                    k_need = min(L - rc, math.ceil(excess / D[c]))
                    ks = [k_need]
                    if own and rc + k_need >= L and L - 1 - rc > 0:
                        ks.append(L - 1 - rc)  # all but one layer: no X
                    if t[c] > 0:  # layers hidden by slack or by the diagonal's delay: free
                        k_free = min(L - rc, int((zmax[diag[c]] + slack[c]) / t[c] + 1e-9) - rc)
                        if 0 < k_free < k_need:
                            ks.append(k_free)
                    for k in ks:
                        saving = k * D[c] - (X[c] if own and rc + k >= L else 0.0)
                        if saving <= 0:
                            continue
                        added = max(0.0, model.delay(s, c, rc + k) - zmax[diag[c]]) + _EPS_TOTAL * k * t[c]
                        rate = saving / added if added > 0 else math.inf
                        key = (-rate, c, k)
                        if best is None or key < best[0]:
                            best = (key, c, k, saving)
                if best is None:
                    # nothing left that helps here: full recompute of the stage fits (checked)
                    row[:] = [L] * n
                    for c in range(n):
                        zmax[diag[c]] = max(zmax[diag[c]], model.delay(s, c, L))
                    break
                _, c, k, saving = best
                row[c] += k
                zmax[diag[c]] = max(zmax[diag[c]], model.delay(s, c, row[c]))
                v -= saving
    return rows


# ---------------------------------------------------------------------------- ILP
@functools.lru_cache(maxsize=1)
def _pulp4(pulp) -> bool:
    """PuLP >= 4 (a Rust core; Python >= 3.12): expressions from ``lpSum_vars_coefs``, CBC from
    the ``pulp[cbc]`` extra through ``COIN_CMD``, and ``solve`` returns its statistics."""
    return int(pulp.__version__.split(".")[0]) >= 4


def _sum(terms):
    """``sum(coef * var)`` of ``(var, coef)`` pairs, built directly (PuLP's operators make several
    temporaries)."""
    import pulp

    return pulp.lpSum_vars_coefs(terms) if _pulp4(pulp) else pulp.LpAffineExpression(terms)


def _le(terms, rhs: float, name: str):
    """``sum(coef * var) <= rhs`` named ``name``, for ``problem += ...``."""
    import pulp

    if _pulp4(pulp):
        return _sum(terms) <= rhs, name
    return pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, name, rhs)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def _ilp(model: _Model, time_limit_s: float, start: list[list[int]] | None = None) -> list[list[int]] | None:
    """Solve the ILP of the module docstring (``start``: a feasible solution CBC starts from);
    ``None`` when CBC gives no solution."""
    import pulp

    t_start = time.perf_counter()
    p, n = model.p, len(model.t)
    kept: list[tuple[int, _Moment]] = []
    for s in range(p):
        ms = [m for m in model.moments[s] if _over(model, s, m)]
        for i, m in enumerate(ms):
            nxt = ms[i + 1] if i + 1 < len(ms) else None
            # after a forward, dominated by the next backward when it holds a superset
            if (m.backward < 0 and m.action.kind is ActionKind.FORWARD and nxt is not None and nxt.backward >= 0 and nxt.base0 >= m.base0
                    and set(m.in_flight) <= set(nxt.in_flight)):
                continue
            kept.append((s, m))
    if not kept:
        return [[0] * n for _ in range(p)]
    prob = pulp.LpProblem("concertina_recompute", pulp.LpMinimize)
    r: dict[tuple[int, int], pulp.LpVariable] = {}
    y: dict[tuple[int, int], pulp.LpVariable] = {}
    # PuLP >= 3.3 attaches variables to the problem; older versions construct them directly
    new_var = getattr(prob, "add_variable", None) or pulp.LpVariable

    def rv(s: int, c: int) -> pulp.LpVariable:
        key = (s, c)
        if key not in r:
            r[key] = new_var(f"r_{s}_{c}", 0, model.layers[s], cat="Integer")
        return r[key]

    for k, (s, m) in enumerate(kept):
        D = model.D[s]
        # bytes in GiB and times in ms keep coefficients near 1 for CBC's tolerances
        terms = [(rv(s, c), -D[c] / _GIB) for c in m.in_flight if D[c] > 0]
        b = m.backward
        if b >= 0 and D[b] > 0 and model.X[s][b] > 0:
            if (s, b) not in y:
                yb = y[(s, b)] = new_var(f"y_{s}_{b}", 0, 1, cat="Integer")
                rb = rv(s, b)
                # y >= [r == L]: r - y <= L - 1 is the convex hull's facet; y only tightens the
                # memory rows, so the solver keeps it at 0 whenever r < L
                prob += _le([(rb, 1.0), (yb, -1.0)], float(model.layers[s] - 1), f"link_{s}_{b}")
            terms.append((y[(s, b)], model.X[s][b] / _GIB))
        prob += _le(terms, (model.budgets[s] - m.base0) / _GIB, f"mem_{k}")
    z: dict[int, pulp.LpVariable] = {}
    for (s, c), var in r.items():
        d = model.diag[s][c]
        if d not in z:
            z[d] = new_var(f"z_{d}", 0)
        # z_d >= t r - slack, in ms
        prob += _le([(var, 1e3 * model.t[c]), (z[d], -1.0)], 1e3 * model.slack[s][c], f"diag_{s}_{c}")
    prob += _sum([(zd, 1.0) for zd in z.values()] + [(var, 1e3 * _EPS_TOTAL * model.t[c]) for (s, c), var in r.items()])
    if start is not None:
        zs: dict[int, float] = {}
        for (s, c), var in r.items():
            var.setInitialValue(start[s][c])
            d = model.diag[s][c]
            zs[d] = max(zs.get(d, 0.0), 1e3 * model.delay(s, c, start[s][c]))
        for (s, b), var in y.items():
            var.setInitialValue(1 if start[s][b] >= model.layers[s] else 0)
        for d, var in z.items():
            var.setInitialValue(zs.get(d, 0.0))
    pulp4 = _pulp4(pulp)
    try:
        with warnings.catch_warnings():
            # PuLP 3.3 announces PULP_CBC_CMD's removal in 4.0; it is the CBC that ships with
            # PuLP < 4 (PuLP 4's COIN_CMD runs the one of the `pulp[cbc]` extra)
            warnings.simplefilter("ignore", DeprecationWarning)
            # the time limit covers building the model too
            left = max(0.05, time_limit_s - (time.perf_counter() - t_start))
            solver = (pulp.COIN_CMD if pulp4 else pulp.PULP_CBC_CMD)(
                msg=False, timeLimit=left, gapRel=_ILP_GAP, warmStart=start is not None, options=list(_CBC_OPTIONS))
            stats = prob.solve(solver)
    except Exception as e:  # noqa: BLE001 - a solver crash must not stop training; greedy takes over
        hint = " (PuLP >= 4 runs CBC from its extra: pip install 'pulp[cbc]')" if pulp4 else ""
        _warn_once(f"CBC failed ({e}){hint}; using the greedy recompute planner")
        return None
    if not (stats.has_solution if pulp4 else prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)):
        logger.info("CBC found no solution within %.2fs (%s); using the greedy recompute planner",
                    time_limit_s, stats.status_str if pulp4 else pulp.LpStatus.get(prob.status))
        return None
    rows = [[0] * n for _ in range(p)]
    for (s, c), var in r.items():
        rows[s][c] = int(round(var.value() or 0))
    return rows


# ---------------------------------------------------------------------------- entry point
def assign_recompute(plan: Plan, cost: CostModel, budgets: Sequence[int], method: str = "ilp",
                     time_limit_s: float = 1.0) -> Plan:
    """``plan`` with ``recompute`` chosen to minimize the step time recomputation adds, with
    every stage under ``budgets`` (bytes per stage, static memory included; 0 = unconstrained)
    at every moment of the schedule.

    ``method``: ``"ilp"`` (CBC within ``time_limit_s``, warm-started from the greedy solution;
    the faster of the two in simulation is returned) or ``"greedy"``. The input's ``recompute``
    is ignored. Raises :class:`InfeasiblePlanError` when even full recompute does not fit. The
    result carries ``predicted`` (its simulation) and ``memory_budget_bytes``.
    """
    if method not in SOLVERS:
        raise PlanError(f"unknown recompute method {method!r}",
                        Remedy("solver", "set", value=" or ".join(map(repr, SOLVERS))))
    p, n = plan.num_stages, plan.num_chunks
    budgets = list(stage_budgets(budgets, p))
    model = _build_model(plan, cost, budgets)
    _infeasible(plan, model, cost)
    zero_rows = tuple((0,) * n for _ in range(p))
    zero = dataclasses.replace(plan, recompute=zero_rows, memory_budget_bytes=tuple(budgets))
    res0 = simulate(zero, cost)
    if within_budgets(res0.peak_memory_bytes, budgets):
        return zero.with_predicted(res0.stats())
    model.slack = backward_slack(zero, cost, res0)
    candidates = [_greedy(model)]
    if method == "ilp":
        rows = _ilp(model, time_limit_s, start=candidates[0])
        if rows is not None:
            # CBC works in floating point: repair any hair-width violation greedily
            candidates.insert(0, _greedy(model, rows))
    best = None
    for rows in candidates:
        out = dataclasses.replace(zero, recompute=tuple(tuple(r) for r in rows))
        res = simulate(out, cost)
        bad = [s for s in range(p) if budgets[s] and res.peak_memory_bytes[s] > budgets[s]]
        if bad:  # the linear model disagrees with the cost model: a bug, not a user error
            s = bad[0]
            raise PlanError(f"internal: recompute plan exceeds stage {s}'s budget in simulation "
                            f"({res.peak_memory_bytes[s]} > {budgets[s]} bytes); is the cost model's memory "
                            "linear in recompute layers?")
        # the ILP's objective is a first-order model of the step time: keep whichever of the
        # ILP and greedy solutions the simulator finds faster (ties: less recompute, then ILP)
        key = (res.step_time_s, res.recompute_time_s)
        if best is None or key < best[0]:
            best = (key, out, res)
    _, out, res = best
    return out.with_predicted(res.stats())
