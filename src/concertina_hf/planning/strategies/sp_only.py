"""``sp-only``: the baseline an HF user runs today for long contexts (DeepSpeed ALST, accelerate's
sequence-parallel config): no pipeline, the replica's GPUs in Ulysses groups, ZeRO-3.

The replica is the request's ``pp x sp`` GPUs (``layout.num_stages`` stages of ``cost.sp``
GPUs). They run as one stage holding every layer:

- **Ulysses degree** ``u``: the largest divisor of the replica's GPU count that divides the
  attention heads (Ulysses gives each GPU whole heads): every GPU of the replica when the heads
  allow (LLaMA-13B's 40 heads on 32 GPUs do not: ``u = 8``); the ``d = GPUs / u`` Ulysses groups
  are data parallel inside the replica. Searched over the valid degrees (knob ``sp``); fewer
  GPUs per group means fewer and cheaper all-to-alls but more memory per GPU.
- **ZeRO-3**: weights, gradients and optimizer state sharded over every GPU of the run
  (``cost.state_shards / cost.sp`` replicas of the replica's GPUs), each layer's weights gathered
  per micro-batch forward and backward and its gradients reduce-scattered, overlapped with
  compute (:class:`~..cost.CostModel` ``zero3``).
- **Micro-batches**: the step's sequences are spread over the ``d`` groups by LPT on their
  estimated cost (:func:`~..lpt.lpt_assign`: the best case for the baseline; accelerate
  splits by count), packed whole (never split: Ulysses shards a sequence over the group's GPUs
  instead) best-fit decreasing under a token budget, a longer sequence alone; the groups run
  their micro-batches in rounds, longest first (ZeRO-3's per-layer collectives keep them in
  step), so a round lasts as long as its slowest micro-batch. Uniform recompute. Tuned: the
  token budget (the ladder of :func:`~.common.token_budget_candidates`) and for each the fewest
  recomputed layers that fit (binary search), for every valid ``u``.

Knob ``zero3=False`` (not searched; default ``True``) shards the optimizer state only (ZeRO-1:
weights and gradients whole on every GPU, gathered once per step), as this project's runtime
holds state: how :func:`~..layouts.rank_layouts` scores its ``sp-only`` reference.

The plan has one stage and records its layout in its knobs (``sp``, ``state_shards``,
``zero3``, ``data_parallel``): :func:`~..simulate.simulate` runs it under
``cost.for_plan(plan)``, the same simulator and cost coefficients as the pipeline strategies.
The trainer does not run it (:data:`~.REGISTRY`'s ``pipeline=False``): it is what
``concertina plan`` compares the method with.
"""

from __future__ import annotations

from ..budgets import within_budgets
from ..cost import CostModel
from ..plan import Plan
from ..recompute import InfeasiblePlanError
from ..lpt import lpt_assign, sequence_cost
from ..schedule import build_schedule
from ..types import Chunk, ChunkKind, PlanError, Slice, StageLayout
from .baselines import uniform_search
from .common import (
    GIB, MORE_MEMORY, USE_ADAPTIVE, PlanRequest, SettingTally, describe_longest, finish, token_budget_candidates,
)

__all__ = ["SP_ONLY_KNOBS", "plan_sp_only", "ulysses_degrees"]

#: sp-only's settings (searched unless given; ``zero3`` is not searched: ``True``, the default, shards
#: weights and gradients too, DeepSpeed's ZeRO-3; ``False`` shards the optimizer state only, ZeRO-1,
#: as this project's runtime does, see :mod:`..layouts`)
SP_ONLY_KNOBS = ("sp", "token_budget", "recompute_layers", "zero3")


def ulysses_degrees(num_gpus: int, num_heads: int) -> list[int]:
    """The Ulysses degrees a replica of ``num_gpus`` GPUs can run, largest first: divisors of
    ``num_gpus`` that divide the heads (any divisor when the heads are unknown, 0).

    >>> ulysses_degrees(32, 40), ulysses_degrees(32, 52), ulysses_degrees(4, 0)
    ([8, 4, 2, 1], [4, 2, 1], [4, 2, 1])
    """
    return [u for u in range(num_gpus, 0, -1) if num_gpus % u == 0 and (not num_heads or num_heads % u == 0)]


def _pack(lens: list[int], members: list[int], budget: int) -> list[list[int]]:
    """Whole sequences best-fit decreasing into micro-batches of at most ``budget`` tokens (a
    longer one alone), longest first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for q in sorted(members, key=lambda i: (-lens[i], i)):
        n = lens[q]
        if n <= 0:  # an empty sequence holds no tokens: no slice (Plan.validate refuses empty ones)
            continue
        best = min((b for b in range(len(bins)) if room[b] >= n), key=lambda b: (room[b], b), default=None)
        if best is None:
            bins.append([q])
            room.append(budget - n)
        else:
            bins[best].append(q)
            room[best] -= n
    return bins


def _plan_rounds(lens: list[int], lanes: list[list[int]], budget: int, num_layers: int,
                 knobs: dict) -> Plan:
    """The one-stage plan of ``lanes`` (sequence indices per Ulysses group) packed under
    ``budget`` and run in rounds; no recompute yet."""
    per_lane = [_pack(lens, lane, budget) for lane in lanes]
    chunks: list[Chunk] = []
    groups: list[tuple[int, ...]] = []
    for m in range(max((len(b) for b in per_lane), default=0)):
        members = []
        for bins in per_lane:
            if m < len(bins):
                members.append(len(chunks))
                chunks.append(Chunk(len(chunks), ChunkKind.PACKED, tuple(Slice(q, 0, lens[q]) for q in bins[m])))
        groups.append(tuple(members))
    layout = StageLayout(num_layers, ((0, num_layers),))
    return Plan(strategy="sp-only", seq_lens=tuple(lens), layout=layout, chunks=tuple(chunks), groups=tuple(groups),
                schedule=build_schedule(chunks, groups, 1, prefetch=True), recompute=((0,) * len(chunks),),
                knobs=tuple(knobs.items()))


def plan_sp_only(req: PlanRequest) -> Plan:
    """Every GPU of the replica in Ulysses groups with ZeRO-3, no pipeline (module docstring)."""
    lens, cost, layout = req.lens, req.cost, req.layout
    gpus = layout.num_stages * cost.sp
    replicas = max(1, cost.state_shards // cost.sp)
    degrees = ulysses_degrees(gpus, cost.num_heads)
    if "sp" in req.knobs:
        u = int(req.knobs["sp"])
        if u not in degrees:
            raise PlanError(f"sp-only: sp={u} must divide the replica's {gpus} GPUs and the model's "
                            f"{cost.num_heads} attention heads; valid: {degrees}")
        degrees = [u]
    budgets = [b for b in req.budgets if b]
    budget = (min(budgets),) if budgets else (0,)  # one GPU kind: the tightest per-GPU budget
    zero3 = bool(req.knobs.get("zero3", True))
    fixed_r = req.knobs.get("recompute_layers")
    fixed_r = None if fixed_r is None else int(fixed_r)
    if "token_budget" in req.knobs:
        token_budgets = [int(req.knobs["token_budget"])]
    else:
        token_budgets = token_budget_candidates(max(lens), req.token_cap)
    tally, static_refusal = SettingTally(budget), None
    for u in degrees:
        knobs = {"sp": u, "state_shards": replicas * gpus, "zero3": zero3, "data_parallel": gpus // u}
        one = StageLayout(cost.num_layers, ((0, cost.num_layers),))
        ucost: CostModel = cost.with_parallel(sp=u, state_shards=replicas * gpus, zero3=zero3)
        static = ucost.static_memory(one, 0)
        if budget[0] and static >= budget[0]:
            static_refusal = static
            continue
        lanes = lpt_assign([sequence_cost(n, ucost) for n in lens], gpus // u)
        for tb in token_budgets:
            plan = _plan_rounds(lens, lanes, tb, cost.num_layers, knobs)
            r, plan, sim = uniform_search(plan, cost, budget, fixed_r)
            tally.add({**knobs, "token_budget": tb}, r, plan, sim)
    best, closest = tally.best, tally.closest
    if best is None:
        if closest is None:
            raise InfeasiblePlanError(
                f"sp-only: stage 0's memory budget of {budget[0]} bytes ({budget[0] / GIB:.3g} GiB) per GPU is below "
                f"its static memory alone ({static_refusal / GIB:.3g} GiB of "
                + ("ZeRO-3 shards and gathered weights)" if zero3 else "whole weights and gradients, ZeRO-1 shards)"),
                MORE_MEMORY, others=("use more GPUs",))
        _, setting, sim = closest
        u, tb = setting["sp"], setting["token_budget"]
        raise InfeasiblePlanError(
            f"sp-only: no setting fits the memory budget of {budget[0]} bytes ({budget[0] / GIB:.2f} GiB) per GPU: "
            f"the closest (sp={u}, token_budget={tb}, full recompute) peaks at {sim.peak_memory_bytes[0]} bytes "
            f"({sim.peak_memory_bytes[0] / GIB:.2f} GiB); the longest is {describe_longest(lens)}", MORE_MEMORY,
            USE_ADAPTIVE, others=("use more GPUs",))
    _, plan, sim, knobs = best
    assert within_budgets(sim.peak_memory_bytes, budget)
    return finish(plan, sim.stats(), budget, knobs)
