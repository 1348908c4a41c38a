"""What every strategy shares: the request it plans, the baselines' chunking ladders (adaptive
searches them too), and turning a chunking into a plan and a plan into a result.

Bounded planning: every ``plan_step`` call ends in a plan that passes ``validate()`` and fits its
budgets in simulation, or in a ``PlanError`` naming the setting to change. The refusals that need
no search run first (:func:`check_step`, microseconds); a token cap the user set is refused
rather than raised, naming the smallest cap that works. Every pipeline strategy plans under the
largest chunk a profiled cost model measured (:func:`fitted_token_cap`: chunk times beyond it
would be extrapolated). The search is counted, not timed: at most :data:`SEARCH_EFFORT` simulated
chunk-stages after the first evaluation, never a chunking over :func:`max_chunks` chunks or
:data:`MAX_SLICES` slices, nor one equal to a chunking already evaluated, so the same inputs give
the same plan."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..chunking import Chunking, SequenceBatch
from ..cost import CostModel
from ..placement import place_plan
from ..plan import Plan, PlanStats
from ..recompute import InfeasiblePlanError
from ..schedule import build_schedule
from ..types import Chunk, ChunkKind, PlanError, Remedy, Slice, StageLayout

__all__ = [
    "ASSIGN_COST", "GIB", "fitted_token_cap", "MAX_CHUNKS", "MAX_CHUNK_STAGES", "MAX_SLICES", "MORE_MEMORY",
    "MORE_STAGES", "N_CANDIDATES", "SEARCH_EFFORT", "USE_ADAPTIVE", "PlanRequest", "SettingTally",
    "check_step", "describe_longest", "finish", "larger_cap", "max_chunks", "min_chunks", "overshoot", "placed", "plan_of",
    "token_budget_candidates", "too_many_chunks", "worst_stage",
]

GIB = 2**30
# split baseline: slices of the longest
N_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: The largest plan a strategy builds, in chunk-stages (chunks times pipeline stages) and in
#: chunks: planning time grows with both (a simulation costs about 30 us per chunk-stage in pure
#: Python, a greedy recompute assignment about four simulations, and the recompute model
#: lists what is in flight at every action), so a chunking with more is never evaluated and a
#: token cap that forces more is refused before any search (:func:`check_step`).
MAX_CHUNK_STAGES = 8192
MAX_CHUNKS = 2048
#: The most slices a sequence is cut into: all of a sequence's slices are in flight at once, and
#: the recompute model's work grows with chunks times what is in flight.
MAX_SLICES = 256
#: Chunk-stages one ``plan_step`` call may simulate (a recompute assignment counts
#: :data:`ASSIGN_COST` simulations) once it has a plan, or while it looks for one that fits:
#: counted, not timed, so planning stays deterministic; about 1 s on a free core.
SEARCH_EFFORT = 40960
#: simulations a recompute assignment counts as, for :data:`SEARCH_EFFORT` (its memory model,
#: up to three simulations, and the greedy over every moment's chunks in flight)
ASSIGN_COST = 8


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
    budget / slice size tried), lowered to the cost model's fitted range
    (:func:`fitted_token_cap`); ``None``: uncapped."""
    user_capped: bool = False
    """Whether the caller set ``max_tokens_per_chunk`` below the cost model's fitted range (the
    search adds capped variants of its leaders only when not: a cap the caller chose is final)."""
    solver: str
    """Recompute solver, one of :data:`~..recompute.SOLVERS` (adaptive only)."""
    time_limit_s: float
    """The ILP solver's time limit."""
    knobs: Mapping[str, Any]
    """The strategy's fixed settings (only names its record lists); the others are searched."""
    sp_mode: str = "ulysses"
    """How chunks are sharded over a stage's ``cost.sp`` GPUs (:mod:`..placement`): ``ulysses``,
    ``context`` (whole-doc / per-doc only) or ``auto`` (per chunk, the cheaper)."""


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


def plan_of(strategy: str, chunking: Chunking, layout: StageLayout, cuts: Sequence[int] = (),
            extra_warmup: int = 0) -> Plan:
    """The plan of ``chunking`` grouped at ``cuts``: the 1F1B schedule with prefetch (and
    ``extra_warmup`` more forwards ahead on every stage but the last), no recompute, no prediction."""
    chunks, groups = chunking.assemble(cuts)
    p = layout.num_stages
    seg = chunking.segment  # segment-level training: simulated under its options
    return Plan(
        strategy=strategy,
        seq_lens=chunking.seq_lens,
        layout=layout,
        chunks=chunks,
        groups=groups,
        schedule=build_schedule(chunks, groups, p, prefetch=True, extra_warmup=extra_warmup,
                                chained=seg is None or seg.chained),
        recompute=tuple((0,) * len(chunks) for _ in range(p)),
        knobs=() if seg is None else seg.knobs(),
    )


def placed(plan: Plan, req: PlanRequest) -> Plan:
    """``plan`` with its chunks' placements inside a stage under ``req.sp_mode``
    (:func:`~..placement.place_plan`; unchanged at ``sp = 1`` and in ``ulysses`` mode)."""
    return place_plan(plan, req.cost, req.sp_mode)


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


class SettingTally:
    """Over a baseline's tries of its settings: the fastest that fits (``best``: step time, plan,
    simulation, knobs with ``recompute_layers``) and the least over its budgets (``closest``:
    overshoot, setting, simulation), each the first of equals."""

    def __init__(self, budgets: Sequence[int]) -> None:
        self.budgets = budgets
        self.best: tuple[float, Plan, Any, dict[str, Any]] | None = None
        self.closest: tuple[float, dict[str, Any], Any] | None = None

    def add(self, setting: dict[str, Any], recompute_layers: int | None, plan: Plan, sim: Any) -> None:
        """One try: ``setting`` planned with ``recompute_layers`` uniform recompute (``None``:
        no recompute fits) into ``plan``, simulated as ``sim``."""
        if recompute_layers is None:
            over = overshoot(sim.peak_memory_bytes, self.budgets)
            if self.closest is None or over < self.closest[0]:
                self.closest = (over, setting, sim)
        elif self.best is None or sim.step_time_s < self.best[0]:
            self.best = (sim.step_time_s, plan, sim, {**setting, "recompute_layers": recompute_layers})


def worst_stage(peaks: Sequence[int], budgets: Sequence[int]) -> int:
    """The stage furthest over its budget (the first of equals)."""
    return max(range(len(budgets)), key=lambda q: peaks[q] / budgets[q] if budgets[q] else 0)


def max_chunks(layout: StageLayout) -> int:
    """The most chunks a plan on ``layout`` may have: :data:`MAX_CHUNKS`, or
    :data:`MAX_CHUNK_STAGES` over the stages if fewer (2048 on 1-4 stages, 1024 on 8)."""
    return max(1, min(MAX_CHUNKS, MAX_CHUNK_STAGES // layout.num_stages))


#: the remedies of a stage whose memory budget holds no plan
MORE_MEMORY = Remedy("memory_budget", "raise")
MORE_STAGES = Remedy("pipeline_size", "raise", note="(fewer layers per stage)")
#: the method, for a baseline that finds nothing fitting
USE_ADAPTIVE = Remedy("strategy", "set", value="'adaptive'")


def larger_cap(smallest: int) -> Remedy:
    """Raising the token cap per chunk to at least ``smallest`` tokens (or dropping it)."""
    return Remedy("max_tokens_per_chunk", "raise", smallest, "tokens",
                  note="or leave it unset (the planner sizes chunks itself)")


def too_many_chunks(strategy: str, lens: Sequence[int], layout: StageLayout, chunks: int,
                    token_cap: int | None) -> PlanError:
    """The error of a step whose every chunking the strategy tried was too large (more than
    :func:`max_chunks` chunks, or a sequence in more than :data:`MAX_SLICES` slices)."""
    limit = max_chunks(layout)
    total = sum(lens)
    smallest = max(-(-total // limit), -(-max(lens) // MAX_SLICES))
    capped = f" under a token cap of {token_cap} per chunk" if token_cap is not None else ""
    reason = (f"{strategy}: every chunking of this step tried has more than {limit} chunks or a sequence in more "
              f"than {MAX_SLICES} slices (the smallest: {chunks} chunks; {total} tokens on {layout.num_stages} "
              f"stage(s){capped}; the limits keep planning under a second)")
    if token_cap is not None:
        return PlanError(reason, larger_cap(smallest))
    return PlanError(reason, others=("plan fewer tokens per optimizer step",))


def min_chunks(lens: Sequence[int], token_cap: int, splits_sequences: bool = True) -> int:
    """The fewest chunks a token cap allows: ``ceil(tokens / cap)``; without splitting, each
    longer sequence alone plus the others at ``cap`` tokens a chunk.

    >>> min_chunks([5, 3, 1], 2), min_chunks([5, 3, 1], 2, splits_sequences=False)
    (5, 3)
    """
    if splits_sequences:
        return -(-sum(lens) // token_cap)
    short = sum(n for n in lens if n <= token_cap)
    return sum(1 for n in lens if n > token_cap) + -(-short // token_cap)


def check_step(record: Any, lens: Sequence[int], cost: CostModel, layout: StageLayout,
               budgets: Sequence[int], token_cap: int | None, chained: bool = True) -> None:
    """The refusals that need no search, each in microseconds (``plan_step`` runs them first;
    ``record``: the strategy's :class:`~.Strategy`; the memory checks only for the strategies
    whose plans run on ``layout``):

    - a stage whose static memory alone (weights, gradients, optimizer state) reaches its budget;
    - a stage that cannot hold the longest sequence even recomputing every layer: all its
      tokens are in flight at once on every stage (its slices run forward in order and backward
      in reverse order, so the last slice's backward comes after every forward), each holding
      at least a recomputed layer's input per layer (or its saved activations, if smaller) and
      its logits (last stage) or output (the others), as :meth:`CostModel.act_memory` counts them
      (not with ``chained=False``: segment-level training with ``gradient="none"``, whose slices
      run backward in forward order);
    - a token cap that cuts the step into more than :func:`max_chunks` chunks
      (:func:`min_chunks` at least) or its longest sequence into more than :data:`MAX_SLICES`
      slices, naming the smallest cap that would do.
    """
    strategy = record.name
    # (a strategy whose plans run on another layout, sp-only, checks its own memory)
    for s, b in enumerate(budgets if record.pipeline else ()):
        if b and cost.static_memory(layout, s) >= b:
            raise InfeasiblePlanError(
                f"{strategy}: stage {s}'s memory budget of {b} bytes ({b / GIB:.3g} GiB) is below its static "
                f"memory alone ({cost.static_memory(layout, s) / GIB:.3g} GiB of weights, gradients and optimizer "
                "state)", MORE_MEMORY, MORE_STAGES)
    q = max(range(len(lens)), key=lambda i: (lens[i], -i))
    whole = Chunk(0, ChunkKind.PACKED, (Slice(q, 0, lens[q]),))
    for s, b in enumerate(budgets if record.pipeline and chained else ()):
        if not b:
            continue
        n = layout.num_stage_layers(s)
        act = min(cost.act_memory(layout, s, whole, 0), cost.act_memory(layout, s, whole, n))
        static = cost.static_memory(layout, s)
        if static + act > b:
            raise InfeasiblePlanError(
                f"{strategy}: {describe_longest(lens)} cannot fit stage {s}'s memory budget of {b} bytes "
                f"({b / GIB:.3g} GiB): every token of a sequence is in flight at once on each stage (its slices "
                f"run backward in reverse order, after all their forwards), which needs at least "
                f"{static + act:.0f} bytes ({(static + act) / GIB:.3g} GiB) there even recomputing every layer "
                f"({static / GIB:.3g} GiB static, {act / GIB:.3g} GiB of activations)", MORE_MEMORY, MORE_STAGES,
                others=("train on shorter sequences",))
    if token_cap is not None:
        total, longest = sum(lens), max(lens)
        need = min_chunks(lens, token_cap, record.splits_sequences)
        limit = max_chunks(layout)
        slices = -(-longest // token_cap) if record.splits_sequences else 1
        if need > limit or slices > MAX_SLICES:
            smallest = _smallest_cap(lens, limit, record.splits_sequences)
            if record.splits_sequences:
                smallest = max(smallest, -(-longest // MAX_SLICES))
            what = (f"this step's {total} tokens into at least {need} chunks, more than the {limit} the planner "
                    f"builds on {layout.num_stages} stage(s)" if need > limit else
                    f"{describe_longest(lens)} into {slices} slices, more than the {MAX_SLICES} the planner cuts a "
                    "sequence into")
            raise PlanError(
                f"{strategy}: a token cap of {token_cap} per chunk cuts {what} (the limit keeps planning under a "
                "second; a chunk of a few tokens costs mostly its per-call overhead anyway)", larger_cap(smallest))


def _smallest_cap(lens: Sequence[int], limit: int, splits_sequences: bool) -> int:
    """The smallest token cap with :func:`min_chunks` within ``limit`` (it falls as the cap grows)."""
    lo, hi = 1, max(1, sum(lens))  # min_chunks(hi) is 1
    while lo < hi:
        mid = (lo + hi) // 2
        if min_chunks(lens, mid, splits_sequences) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo


def fitted_token_cap(record: Any, lens: Sequence[int], cost: CostModel, layout: StageLayout,
                     token_cap: int | None) -> int | None:
    """The token cap a step is planned under: ``token_cap`` (``max_tokens_per_chunk``), lowered
    to the largest chunk the cost model's times were fitted on (``cost.max_chunk_tokens``, 0:
    none), so no plan relies on an extrapolated chunk time. The model's cap is raised as far as
    the chunk and slice limits need, with room for uneven chunks (twice the smallest cap within
    :func:`max_chunks` and :data:`MAX_SLICES`): a step too large for it is planned with larger
    chunks rather than refused. ``sp-only`` (another layout, its chunks sharded over a group of
    its own choosing) is not capped by the model.
    """
    fitted = int(cost.max_chunk_tokens)
    if fitted <= 0 or not record.pipeline:
        return token_cap
    need = _smallest_cap(lens, max_chunks(layout), record.splits_sequences)
    if record.splits_sequences:
        need = max(need, -(-max(lens) // MAX_SLICES))
    fitted = max(fitted, 2 * need)
    return fitted if token_cap is None else min(token_cap, fitted)
