"""Step planning strategies: the adaptive method and the baselines it is compared with.

Every strategy turns a step's sequence lengths into a :class:`~..plan.Plan` scored by the same
simulator (:func:`~..simulate.simulate`), so comparisons are like for like. A strategy is one
:class:`Strategy` record in :data:`REGISTRY`: its name, the settings it accepts, its ``run``
(a :class:`PlanRequest` in, a plan out) and a line of description. Adding one is a module with
its ``run`` and a line here.

- ``adaptive`` (the method: :mod:`.adaptive`, searching with :mod:`.search`);
- ``packed`` and ``split``, the tuned baselines (:mod:`.baselines`);
- ``no-recompute`` / ``full-recompute``, adaptive's chunking search with recompute fixed
  (:mod:`.adaptive`);
- ``sp-only``, what users run today without a pipeline: the replica's GPUs in Ulysses groups
  with ZeRO-3 (:mod:`.sp_only`); simulated only, the trainer refuses it.

All strategies use the same order (longest first, packed chunks spread behind the split chains)
and the same 1F1B schedule (:func:`~..schedule.build_schedule` with ``prefetch=True``). A
strategy that finds nothing fitting raises :class:`~..recompute.InfeasiblePlanError` naming the
budget, the offending sequence and the setting to change. Planning is deterministic, except
that the ILP's result can depend on where CBC's time limit cuts it off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..budgets import stage_budgets
from ..chunking import SequenceBatch
from ..cost import CostModel
from ..placement import check_sp_mode
from ..plan import Plan
from ..recompute import SOLVERS
from ..segments import SegmentOptions, check_segment_plan
from ..types import PlanError, Remedy, StageLayout
from .adaptive import ADAPTIVE_KNOBS, CHUNKING_KNOBS, plan_adaptive, plan_full_recompute, plan_no_recompute
from .baselines import PACKED_KNOBS, SPLIT_KNOBS, plan_packed, plan_split
from .common import PlanRequest, check_step, fitted_token_cap
from .sp_only import SP_ONLY_KNOBS, plan_sp_only

__all__ = ["PIPELINE_STRATEGIES", "REGISTRY", "STRATEGIES", "PlanRequest", "Strategy", "ideal_step_time", "plan_step"]


@dataclass(frozen=True, slots=True)
class Strategy:
    """A planning strategy: what :func:`plan_step` dispatches to."""

    name: str
    """What ``strategy=`` / ``concertina_strategy`` / ``--strategy`` call it."""
    knobs: tuple[str, ...]
    """The settings it accepts as ``plan_step`` keywords; each is searched unless given."""
    run: Callable[[PlanRequest], Plan]
    """Plans one checked request; raises :class:`~..recompute.InfeasiblePlanError`."""
    description: str
    """One line for help texts."""
    pipeline: bool = True
    """Its plans run on the request's pipeline stages (the trainer can execute them); ``False``:
    a baseline simulated on another layout of the same GPUs (recorded in the plan's knobs),
    which checks its own static memory and which the trainer refuses."""
    splits_sequences: bool = True
    """Whether a sequence longer than ``max_tokens_per_chunk`` is cut (``packed`` keeps it whole,
    in a chunk of its own): how many chunks a token cap forces (:func:`~.common.check_step`)."""


REGISTRY: tuple[Strategy, ...] = (
    Strategy("adaptive", ADAPTIVE_KNOBS, plan_adaptive,
             "workload-balanced chunks, pipeline groups and adaptive recompute (the method)"),
    Strategy("packed", PACKED_KNOBS, plan_packed, "whole sequences under a token budget, uniform recompute",
             splits_sequences=False),
    Strategy("split", SPLIT_KNOBS, plan_split, "long sequences in N equal slices (Seq1F1B-like), uniform recompute"),
    Strategy("no-recompute", CHUNKING_KNOBS, plan_no_recompute, "adaptive's chunking with no recompute"),
    Strategy("full-recompute", CHUNKING_KNOBS, plan_full_recompute, "adaptive's chunking, every layer recomputed"),
    Strategy("sp-only", SP_ONLY_KNOBS, plan_sp_only,
             "no pipeline: the replica's GPUs in Ulysses groups with ZeRO-3 (DeepSpeed ALST; simulated only)",
             pipeline=False, splits_sequences=False),
)
#: the strategies' names, the method first
STRATEGIES = tuple(s.name for s in REGISTRY)
#: the strategies the trainer runs (their plans use the pipeline's stages)
PIPELINE_STRATEGIES = tuple(s.name for s in REGISTRY if s.pipeline)
_BY_NAME = {s.name: s for s in REGISTRY}


def ideal_step_time(seq_lens: Sequence[int], cost: CostModel, layout: StageLayout) -> float:
    """A lower bound of the step time: forward and backward of every token through every layer,
    the embedding and the head, with no recompute, no per-chunk overhead (``beta``), no bubble
    and no communication, spread evenly over the stages (and, the coefficients being per GPU,
    over each stage's ``cost.sp`` GPUs). Linear-attention layers (``cost.layer_kinds``) at their own rate."""
    per_token = cost.embed_time_per_token + cost.head_time_per_token
    n_lin = sum(k == "linear" for k in cost.layer_kinds)
    total = 0.0
    for n in seq_lens:
        total += (cost.num_layers - n_lin) * (cost.alpha_attn * n * n + cost.alpha_tok * n) + per_token * n
        if n_lin:
            total += n_lin * cost.lin_alpha_tok * n
    return (1.0 + cost.bwd_factor) * total / layout.num_stages


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
    segment: SegmentOptions | None = None,
    sp_mode: str = "ulysses",
    **knobs: Any,
) -> Plan:
    """Plan one step: chunks, groups, schedule and recompute, with ``predicted`` filled in.

    ``memory_budget_bytes``: per stage (static memory included), one size for all or one per
    stage; 0 means unconstrained. ``max_tokens_per_chunk``: the token cap of a chunk (adaptive;
    for the baselines, the largest token budget / slice size tried); a profiled cost model's
    ``max_chunk_tokens`` (the largest chunk its times were fitted on) caps it too, unless the
    step needs larger chunks (:func:`~.common.fitted_token_cap`; ``packed`` keeps a longer
    sequence whole, and knobs fixed by the caller are taken as given). ``solver``: ``"ilp"`` or
    ``"greedy"`` recompute assignment (adaptive). ``knobs`` fix a strategy's searched settings:
    adaptive ``num_slices_longest``, ``k_candidates``, ``max_groups``, ``split_threshold``,
    ``time_target``, ``num_finalists``, ``extra_warmup`` (forwards ahead beyond 1F1B; default: one more at a
    time, up to 3, while it simulates faster), ``taper`` (the work fraction the first backward's tail
    slice keeps, cut off in a chunk of its own; default: 0.5 on small steps when it simulates faster,
    0 = none), ``whole_doc_tokens`` (at ``sp > 1`` outside ``ulysses`` mode, the uncut sequences of
    at most that many tokens packed into chunks of ``sp`` balanced per-GPU bins for whole-doc;
    default: a few lengths tried, kept when it simulates faster, 0 = none); packed
    ``token_budget``, ``recompute_layers``; split
    ``num_slices``, ``recompute_layers`` (see :data:`REGISTRY`). The chosen settings are in
    ``plan.knobs``. ``segment``: segment-level training (:mod:`~..segments`, opt-in): every
    sequence longer than ``segment.tokens`` is cut into its segments whatever the strategy, and
    the options are recorded in ``plan.knobs`` for the executor; the pipeline strategies plan and
    predict under them (the K/V tail's time and memory, the gradient buffers, under
    ``gradient="none"`` segments backwarded in forward order).
    ``sp_mode``: how a stage of ``cost.sp > 1`` GPUs shards each chunk (:mod:`~..placement`):
    ``"ulysses"`` (the default here: every chunk Ulysses, as plans were before), ``"context"``
    (whole-doc / per-doc only, no head-count limit) or ``"auto"`` (per chunk, the cheaper; the
    trainer's and ``concertina plan``'s default); the pipeline strategies record it in each
    chunk's ``placement``; ``sp-only`` ignores it.

    Raises :class:`~..recompute.InfeasiblePlanError` when nothing fits the budget (at once, from
    a lower bound, when a stage cannot hold its static memory plus the longest sequence even
    fully recomputed), :class:`~..types.PlanError` when ``max_tokens_per_chunk`` would cut the
    step into more chunks than a plan may have (:func:`~.common.max_chunks`: 2048, 1024 on 8
    stages; see :func:`~.common.check_step`). Every search is bounded by counted work, not time
    (:data:`~.common.SEARCH_EFFORT`): a call takes well under 2 s and plans deterministically.
    """
    if strategy not in _BY_NAME:
        raise PlanError(f"unknown planning strategy {strategy!r}",
                        Remedy("strategy", "set", value=f"one of {', '.join(map(repr, STRATEGIES))}"))
    if solver not in SOLVERS:
        raise PlanError(f"unknown recompute solver {solver!r}",
                        Remedy("solver", "set", value=" or ".join(map(repr, SOLVERS))))
    record = _BY_NAME[strategy]
    bad = sorted(set(knobs) - set(record.knobs))
    if bad:
        raise PlanError(f"strategy {strategy!r} has no knob(s) {bad}; it accepts {list(record.knobs)}")
    if max_tokens_per_chunk is not None and max_tokens_per_chunk < 1:
        raise PlanError(f"a token cap per chunk must be at least 1 token (got {max_tokens_per_chunk})",
                        Remedy("max_tokens_per_chunk", "raise", 1, "tokens", note="or leave it unset"))
    lens = [int(n) for n in seq_lens]
    if not lens or max(lens) <= 0:
        raise PlanError("a step needs at least one non-empty sequence")
    if layout.num_layers != cost.num_layers:
        raise PlanError(f"the stage layout has {layout.num_layers} layers but the cost model {cost.num_layers}; "
                        "build both from the same model config")
    if record.pipeline:
        check_sp_mode(sp_mode, cost)
    budgets = stage_budgets(memory_budget_bytes, layout.num_stages)
    token_cap = int(max_tokens_per_chunk) if max_tokens_per_chunk is not None else None
    check_step(record, lens, cost, layout, budgets, token_cap,  # the refusals that need no search
               chained=segment is None or segment.chained)
    user_cap = token_cap
    token_cap = fitted_token_cap(record, lens, cost, layout, token_cap)  # no larger chunk than profiled
    batch = SequenceBatch(lens, cost, layout, segment=segment)  # its plans simulate under the options
    plan = record.run(PlanRequest(lens=lens, batch=batch, cost=cost, layout=layout,
                                  budgets=budgets, token_cap=token_cap, solver=solver, time_limit_s=time_limit_s,
                                  knobs=knobs, user_capped=user_cap is not None and user_cap == token_cap,
                                  sp_mode=sp_mode if record.pipeline else "ulysses"))
    if segment is not None:
        plan = dataclasses.replace(plan, knobs=plan.knobs + segment.knobs())
        check_segment_plan(plan)
    return plan
