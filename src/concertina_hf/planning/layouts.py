"""The layout from the data: every pipeline x sequence-parallel x data-parallel split of ``N`` GPUs
the runtime can run, each planned on a step's lengths, ranked by simulated step time.

A **layout** is ``pp x sp x dp = N``: ``pp`` pipeline stages (partitioned by
:func:`~.partition.partition_layers`), each of ``sp`` GPUs running Ulysses sequence parallelism,
and ``dp`` pipeline replicas. :func:`runnable_layouts` enumerates every factorisation and
refuses, with the reason, those the runtime cannot run:

- ``pp`` larger than the decoder layers (a stage would be empty);
- ``sp`` not dividing the attention heads (Ulysses gives each GPU whole heads), or neither
  dividing nor divided by the K/V heads (K/V heads are split over the ranks, or replicated when
  there are fewer than ``sp``): :func:`ulysses_heads_refusal`, the rule of the runtime's
  ``runtime.ulysses.check_heads`` (kept in the pure planner, :mod:`.sharding`; a test holds the two equal).

:func:`rank_layouts` plans each runnable layout with a pipeline strategy (``adaptive``) as the
trainer holds it: the cost model per GPU of a stage of ``sp``
(:meth:`~.cost.CostModel.with_parallel`), optimizer state sharded over the stage's ``dp x sp``
ranks (``concertina_shard_optimizer=True``; ``shard_optimizer=False``: whole on every rank), and
with ``dp > 1`` the step's sequences split over the replicas by
:func:`~.replicas.balance_replicas` (the step ends with the slowest replica). Layouts are planned
in increasing order of a lower bound of their step time (:func:`layout_lower_bound`: the ideal
step time of the replica's share of the work, or of the longest sequence alone); one whose bound
is above the best step time found so far cannot win and is skipped (``pruned``), which never
drops the best (the bound is below every plan's simulated time).

``shard_parameters=True`` (``concertina plan --layout auto --shard-parameters``) plans the
``pp=1`` layouts as the trainer runs them with ``concertina_shard_parameters=True`` (ZeRO-3,
torch FSDP2, :mod:`concertina_hf.runtime.param_sharding`): weights, gradients and optimizer state
over the stage's ``sp`` GPUs (the replicas run different chunks, so FSDP2's per-layer collectives
stay inside a replica) plus the gathered layers (:meth:`~.cost.CostModel.static_memory` with
``zero3``), each layer's weights all-gathered for its forward and again for its backward and its
gradients reduce-scattered, per chunk (``layer_fwd_time`` / ``layer_bwd_time``: the larger of
compute and those collectives, on the intra- or inter-node link as the ``sp`` GPUs lie). Not
modelled: the replicas' all-reduce of the gradient shards once a step. The trainer shards
parameters at ``pp=1`` only (it refuses ``pp > 1`` with the setting), so layouts with ``pp > 1``
are ``refused`` with that reason (:func:`shard_parameters_refusal`); ``pp=1 x sp=1`` layouts
hold their weights whole (nothing to shard over), as the trainer does.

The ``sp-only`` baseline (:mod:`.strategies.sp_only`: no pipeline, the GPUs in Ulysses groups,
micro-batches in rounds) is planned beside them as a **reference, never chosen**: the trainer
refuses strategies whose plans do not use the pipeline's stages (``Strategy.pipeline=False``).
It is scored with DeepSpeed's ZeRO-3 over all its GPUs; the trainer runs its layout (``pp=1 x sp
x dp``) with ``concertina_shard_parameters=True``, sharded over each replica's ``sp`` GPUs, ranked
as such with ``shard_parameters=True``.

Pure Python; no torch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .cost import CostModel
from .partition import partition_layers
from .plan import Plan
from .replicas import balance_replicas
from .sharding import ulysses_heads_refusal
from .simulate import simulate
from .strategies import PIPELINE_STRATEGIES, ideal_step_time, plan_step
from .types import PlanError, StageLayout

__all__ = ["Layout", "LayoutResult", "count_head_copy", "layout_lower_bound", "rank_layouts", "runnable_layouts",
           "shard_parameters_refusal", "ulysses_heads_refusal"]


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    """``pp`` stages of ``sp`` GPUs, ``dp`` replicas: ``pp * sp * dp`` GPUs."""

    pp: int
    sp: int
    dp: int

    @property
    def gpus(self) -> int:
        return self.pp * self.sp * self.dp

    @property
    def name(self) -> str:
        return f"pp{self.pp} x sp{self.sp} x dp{self.dp}"


@dataclass
class LayoutResult:
    """One row of the ranked table (:func:`rank_layouts`).

    ``status``: ``"ok"`` (planned, fits), ``"infeasible"`` (no plan fits the budget: ``reason``),
    ``"refused"`` (the runtime cannot run the layout: ``reason``), ``"pruned"`` (its lower bound
    is above the best step time found: it cannot win), or ``"reference"`` (``sp-only``: planned,
    not runnable by the trainer). ``peak_memory_bytes``: the largest peak of any GPU (every stage
    of every replica); ``bubble_fraction`` / ``recompute_fraction``: the slowest replica's.
    """

    layout: Layout
    strategy: str
    status: str
    runnable: bool = True
    step_time_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    ratio_to_best: float | None = None
    peak_memory_bytes: int | None = None
    memory_budget_bytes: int = 0
    bubble_fraction: float | None = None
    recompute_fraction: float | None = None
    lower_bound_s: float | None = None
    plan_time_s: float = 0.0
    reason: str = ""
    #: planned with weights and gradients sharded (``concertina_shard_parameters=True``, ``pp=1``)
    shard_parameters: bool = False
    knobs: dict = field(default_factory=dict)
    plans: tuple = ()  # the replicas' plans (not in to_dict)
    error: PlanError | None = None  # why it is infeasible (not in to_dict; a front end words it)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("plans", "layout", "error")}  # not asdict: it would copy every plan
        d["knobs"] = dict(self.knobs)
        d.update(pp=self.layout.pp, sp=self.layout.sp, dp=self.layout.dp, layout=self.layout.name)
        return d


def _model_shape(model: CostModel | Mapping[str, Any]) -> tuple[int, int, int]:
    if isinstance(model, CostModel):
        return model.num_layers, model.num_heads, model.num_kv_heads or model.num_heads
    heads = int(model["num_attention_heads"])
    return int(model["num_hidden_layers"]), heads, int(model.get("num_key_value_heads") or heads)


def runnable_layouts(model: CostModel | Mapping[str, Any], gpus: int,
                     gpus_per_node: int = 8, ulysses: bool = True) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """Every ``pp x sp x dp = gpus`` layout: ``(runnable, [(refused, reason), ...])``, each list
    in ``(pp, sp)`` order. ``model``: a cost model (its layer and head counts) or an HF config
    mapping. ``gpus_per_node`` does not restrict the layouts (a stage's GPUs may span nodes: the
    cost model prices the slower link); it is here so a caller states the cluster once.
    ``ulysses=False``: the stages run whole-doc / per-doc placements where Ulysses cannot
    (``sp_mode`` ``auto`` or ``context``, :mod:`.placement`), so no head-count refusal."""
    gpus, gpus_per_node = int(gpus), int(gpus_per_node)
    if gpus < 1:
        raise PlanError(f"the number of GPUs must be at least 1 (got {gpus})")
    if gpus_per_node < 1:
        raise PlanError(f"GPUs per node must be at least 1 (got {gpus_per_node})")
    layers, heads, kv = _model_shape(model)
    ok: list[Layout] = []
    refused: list[tuple[Layout, str]] = []
    for pp in range(1, gpus + 1):
        if gpus % pp:
            continue
        for sp in range(1, gpus // pp + 1):
            if (gpus // pp) % sp:
                continue
            lay = Layout(pp, sp, gpus // (pp * sp))
            if pp > layers:
                refused.append((lay, f"pp={pp} stages for {layers} decoder layers: a stage would be empty"))
                continue
            why = ulysses_heads_refusal(heads, kv, sp) if ulysses else None
            if why:
                refused.append((lay, why))
                continue
            ok.append(lay)
    return ok, refused


def shard_parameters_refusal(layout: Layout) -> str | None:
    """Why the trainer cannot run ``layout`` with ``concertina_shard_parameters=True`` (``None``:
    it can): parameters are sharded at ``pp=1`` only (``run_setup.resolve_run`` refuses ``pp > 1``
    at ``sp > 1``; at ``sp = 1`` the setting would shard nothing, so such a layout is no choice
    for a run that asks for it either)."""
    if layout.pp == 1:
        return None
    return (f"pp={layout.pp}: concertina_shard_parameters=True runs at concertina_pipeline_size=1 only; set "
            "concertina_shard_parameters=False for pipeline layouts (concertina_shard_optimizer=True shards the "
            "optimizer state at any pipeline size)")


def count_head_copy(cost: CostModel) -> CostModel:
    """The cost model with the last stage's copy of tied embeddings in its static memory: the
    analytic and profiled models count the shared weight once, on the embedding's stage, which
    is right for one stage; with several, the last stage holds its own copy (weight, gradient,
    optimizer state)."""
    if cost.head_params >= cost.embed_params:  # already counted (e.g. a checkpoint's layout model)
        return cost
    return dataclasses.replace(cost, head_params=cost.head_params + cost.embed_params)


def layout_cost(cost: CostModel, layout: Layout, shard_optimizer: bool = True, ulysses: bool = True,
                shard_parameters: bool = False, tied_embeddings: bool = False) -> CostModel:
    """The per-GPU cost model of ``layout`` as the trainer builds it (``run_setup``): a stage of
    ``sp`` GPUs, optimizer state over the stage's ``dp x sp`` ranks when ``shard_optimizer``;
    ``shard_parameters`` at ``pp=1``, ``sp > 1``: weights, gradients and optimizer state over the
    stage's ``sp`` ranks, gathered per layer (``zero3``; the replicas all-reduce their shards once a step);
    ``tied_embeddings`` at ``pp > 1``: the last stage's copy of the embedding (:func:`count_head_copy`)."""
    if tied_embeddings and layout.pp > 1:
        cost = count_head_copy(cost)
    zero3 = shard_parameters and layout.pp == 1 and layout.sp > 1
    shards = layout.sp if zero3 else layout.sp * layout.dp if shard_optimizer else 1
    if layout.sp > 1 or shards > 1:
        return cost.with_parallel(sp=layout.sp, state_shards=shards, ulysses=ulysses, zero3=zero3)
    return cost


def _stage_work(n: int, cost: CostModel, stages: StageLayout, budget: int = 0) -> list[float]:
    """Per stage, the least busy time one sequence of ``n`` tokens gives a GPU of it: forward and
    backward of its layers' compute and all-to-alls (the per-token parts: no per-call overhead,
    latency), the embedding on the first stage and the head on the last (linear heads only: a
    profiled ladder of head times is left out, keeping the bound), and the recompute the memory
    ``budget`` forces. The last: every slice of a sequence keeps its activations from its forward
    until its backward, which runs in reverse slice order, so all of them are alive at once on a
    stage unless layers recompute; keeping ``act_bytes_per_token`` per saved layer and token and
    ``ckpt_bytes_per_token`` per recomputed one, at least ``(static + layers * act * n - budget) /
    (act - ckpt)`` layer-tokens recompute, each at least ``recompute_factor * alpha_tok``."""
    comp = cost.alpha_attn * n * n + cost.alpha_tok * n
    a2a = cost.a2a_time(n) - cost.a2a_time(0) if cost.sp > 1 else 0.0
    layer = (1.0 + cost.bwd_factor) * comp + 2.0 * a2a
    save = cost.act_bytes_per_token - cost.ckpt_bytes_per_token
    out = []
    for s in range(stages.num_stages):
        layers = stages.num_stage_layers(s)
        t = layers * layer
        if stages.has_embedding(s):
            t += (1.0 + cost.bwd_factor) * cost.embed_time_per_token * n
        if stages.has_head(s) and not cost.head_time_points:
            t += (1.0 + cost.bwd_factor) * cost.head_time_per_token * n
        if budget and save > 0:
            over = cost.static_memory(stages, s) + layers * cost.act_bytes_per_token * n - budget
            if over > 0:
                t += cost.recompute_factor * cost.alpha_tok * min(layers * n, over / save)
        out.append(t)
    return out


def layout_lower_bound(lens: Sequence[int], cost: CostModel, stages: StageLayout, dp: int, budget: int = 0) -> float:
    """No plan of ``lens`` on ``dp`` replicas of ``stages`` (``cost`` per GPU) simulates faster.
    Every stage of the slowest replica is busy at least its share of the work, which is at least
    the mean over the replicas (the whole step's work over ``dp``) and at least the longest
    sequence's (the replica holding it), each with the recompute the per-GPU memory ``budget``
    forces (0: none); the per-step gather and reduce-scatter of the sharded state come on top
    (the simulator adds them). Tighter than :func:`~.strategies.ideal_step_time` (which spreads
    all work evenly over every GPU): it counts the all-to-alls, forced recompute and the slowest
    stage (uneven layer counts, the head on the last)."""
    total = [0.0] * stages.num_stages
    for n in lens:
        for s, t in enumerate(_stage_work(int(n), cost, stages, budget)):
            total[s] += t
    longest = _stage_work(max(int(n) for n in lens), cost, stages, budget)
    work = max(max(total) / max(1, dp), max(longest))
    return work + max(cost.step_sync_time(stages, s) for s in range(stages.num_stages))


def _plan_layout(lens: list[int], cost: CostModel, stages: StageLayout, layout: Layout, budget: int,
                 strategy: str, refine_rounds: int, plan_kwargs: dict) -> tuple[list[Plan], list[float]]:
    if layout.dp == 1:
        plan = plan_step(lens, cost, stages, budget, strategy, **plan_kwargs)
        return [plan], [plan.predicted.step_time_s]
    split = balance_replicas(lens, layout.dp, cost, stages, budget, strategy=strategy, refine_rounds=refine_rounds,
                             **plan_kwargs)
    plans = [p for p in split.plans if p is not None]
    return plans, [t for p, t in zip(split.plans, split.step_times_s) if p is not None]


def _fill(row: LayoutResult, lens: list[int], cost: CostModel, plans: list[Plan], times: list[float]) -> None:
    slow = max(range(len(plans)), key=lambda i: times[i])
    stats = plans[slow].predicted
    row.status = "ok"
    row.step_time_s = max(times)
    row.tokens_per_s_per_gpu = sum(lens) / row.step_time_s / row.layout.gpus if row.step_time_s > 0 else None
    row.peak_memory_bytes = max(max(p.predicted.peak_memory_bytes) for p in plans)
    row.bubble_fraction = stats.bubble_fraction
    row.recompute_fraction = stats.recompute_fraction
    row.knobs = dict(plans[slow].knobs)
    row.plans = tuple(plans)


def rank_layouts(
    lens: Sequence[int],
    cost: CostModel,
    gpus: int,
    memory_budget_bytes: int,
    *,
    gpus_per_node: int | None = None,
    strategy: str = "adaptive",
    shard_optimizer: bool = True,
    shard_parameters: bool = False,
    tied_embeddings: bool = False,
    prune: bool = True,
    sp_only: bool = True,
    refine_rounds: int = 0,
    **plan_kwargs: Any,
) -> list[LayoutResult]:
    """Plan ``lens`` on every layout of ``gpus`` GPUs (module docstring) and rank them.

    ``cost``: the model on one GPU (``sp = 1``, no sharding: an analytic or profiled model);
    ``gpus_per_node`` replaces its own when given. ``memory_budget_bytes``: per GPU (0:
    unconstrained). ``strategy``: a pipeline strategy (the trainer runs it). ``prune``: skip a
    layout whose lower bound exceeds the best step time found (``False``: plan every layout).
    ``sp_only``: add the ``sp-only`` reference row. ``shard_parameters``: as the trainer runs
    ``concertina_shard_parameters=True`` (module docstring; ``pp > 1`` refused). ``tied_embeddings``:
    the model ties its input and output embeddings (the last of several stages holds a copy). ``refine_rounds``: of
    :func:`~.replicas.balance_replicas` with ``dp > 1`` (0: its LPT split on estimated costs, each
    replica planned once; the refinement gained under 0.1% at 32 GPUs and cost 3x the time).
    ``plan_kwargs`` go to
    :func:`~.strategies.plan_step` (``solver``, ``time_limit_s``, ``max_tokens_per_chunk``).

    Returns the rows best first: the fitting runnable layouts by step time (ties: fewer stages,
    then smaller ``sp``), then the ``sp-only`` reference, the pruned, the infeasible and the
    refused layouts. ``ratio_to_best`` is to the fastest runnable layout (also on the reference).
    """
    if strategy not in PIPELINE_STRATEGIES:
        raise PlanError(f"rank_layouts plans with a strategy the trainer runs ({', '.join(PIPELINE_STRATEGIES)}); "
                        f"got {strategy!r}")
    lens = [int(n) for n in lens]
    if not lens or max(lens) <= 0:
        raise PlanError("a step needs at least one non-empty sequence")
    if cost.sp != 1 or cost.state_shards != 1:
        raise PlanError("rank_layouts takes the cost model of one GPU (sp=1, unsharded state); "
                        f"got sp={cost.sp}, state_shards={cost.state_shards}")
    if gpus_per_node is not None:
        cost = dataclasses.replace(cost, gpus_per_node=int(gpus_per_node))
    budget = int(memory_budget_bytes or 0)
    # plan_kwargs' sp_mode (auto / context: whole-doc / per-doc where Ulysses cannot run, no head-count
    # rule; the lower bound counts the all-to-alls, so it prunes under Ulysses only)
    uly = plan_kwargs.get("sp_mode", "ulysses") == "ulysses"
    prune = prune and uly
    ok, refused = runnable_layouts(cost, gpus, cost.gpus_per_node, ulysses=uly)
    if shard_parameters:  # the trainer shards parameters at pp=1 only (run_setup refuses pp > 1)
        refused = sorted(refused + [(lay, shard_parameters_refusal(lay)) for lay in ok if lay.pp > 1])
        ok = [lay for lay in ok if lay.pp == 1]
    rows: list[LayoutResult] = [LayoutResult(lay, strategy, "refused", runnable=False, reason=why,
                                             memory_budget_bytes=budget) for lay, why in refused]
    todo = []
    for lay in ok:
        row = LayoutResult(lay, strategy, "pending", memory_budget_bytes=budget)
        rows.append(row)
        try:
            lcost = layout_cost(cost, lay, shard_optimizer, ulysses=uly, shard_parameters=shard_parameters,
                                tied_embeddings=tied_embeddings)
            stages = partition_layers(lcost, lay.pp)
        except PlanError as e:
            row.status, row.runnable, row.reason = "refused", False, e.reason
            continue
        row.shard_parameters = lcost.zero3
        row.lower_bound_s = layout_lower_bound(lens, lcost, stages, lay.dp, budget)
        todo.append((row.lower_bound_s, lay, row, lcost, stages))
    best = float("inf")
    # one-replica layouts first (one plan each: a good incumbent early, so more are pruned), then by bound;
    # the order changes what is pruned, never the best
    for bound, lay, row, lcost, stages in sorted(todo, key=lambda t: (t[1].dp > 1, t[0], t[1])):
        if prune and bound > best:
            row.status = "pruned"
            row.reason = f"lower bound {bound:.4g} s above the best step time found, {best:.4g} s"
            continue
        t0 = time.perf_counter()
        try:
            plans, times = _plan_layout(lens, lcost, stages, lay, budget, strategy, refine_rounds, plan_kwargs)
        except PlanError as e:  # InfeasiblePlanError too
            row.status, row.reason, row.error = "infeasible", e.reason, e
            row.plan_time_s = time.perf_counter() - t0
            continue
        row.plan_time_s = time.perf_counter() - t0
        _fill(row, lens, lcost, plans, times)
        best = min(best, row.step_time_s)
    if sp_only:
        rows.append(_sp_only_row(lens, cost, gpus, budget, plan_kwargs))
    best_time = min((r.step_time_s for r in rows if r.status == "ok"), default=None)
    for r in rows:
        if r.step_time_s is not None and best_time:
            r.ratio_to_best = r.step_time_s / best_time
    order = {"ok": 0, "reference": 1, "pruned": 2, "infeasible": 3, "refused": 4}
    rows.sort(key=lambda r: (order[r.status], r.step_time_s if r.step_time_s is not None else float("inf"),
                             r.lower_bound_s if r.lower_bound_s is not None else float("inf"), r.layout))
    return rows


def _sp_only_row(lens: list[int], cost: CostModel, gpus: int, budget: int, plan_kwargs: dict) -> LayoutResult:
    """The ``sp-only`` reference on all ``gpus`` GPUs as one replica, weights, gradients and
    optimizer state sharded over them (ZeRO-3): what the runtime holds on its layout with
    ``concertina_shard_parameters=True``."""
    _, heads, _ = _model_shape(cost)
    # the replica's GPUs as stages of the largest Ulysses degree the heads allow (plan_sp_only
    # searches every degree dividing them); its stages only count the GPUs
    u = max(s for s in range(1, gpus + 1) if gpus % s == 0 and ulysses_heads_refusal(heads, cost.num_kv_heads, s) is None)
    row = LayoutResult(Layout(1, u, gpus // u), "sp-only", "reference", runnable=False, memory_budget_bytes=budget)
    kwargs = {k: v for k, v in plan_kwargs.items() if k in ("max_tokens_per_chunk", "solver", "time_limit_s")}
    t0 = time.perf_counter()
    try:
        lcost = cost.with_parallel(sp=u, state_shards=u)  # one replica: sp-only shards over its GPUs
        stages = StageLayout.even(cost.num_layers, gpus // u)
        plan = plan_step(lens, lcost, stages, budget, "sp-only", zero3=True, **kwargs)
    except PlanError as e:
        row.plan_time_s = time.perf_counter() - t0
        row.error = e
        row.reason = f"no plan fits ({e.reason}); a reference, not a strategy the trainer runs"
        return row
    row.plan_time_s = time.perf_counter() - t0
    sim = simulate(plan, lcost)
    _fill(row, lens, lcost, [plan], [sim.step_time_s])
    row.status = "reference"
    knobs = dict(plan.knobs)
    row.layout = Layout(1, int(knobs["sp"]), gpus // int(knobs["sp"]))
    row.shard_parameters = True
    row.reason = ("a reference (ZeRO-3 over all GPUs): the trainer runs this layout as pp=1 with "
                  "concertina_shard_parameters=True (sharded over each replica's sp GPUs) and the adaptive strategy, "
                  "not sp-only's rounds")
    return row
