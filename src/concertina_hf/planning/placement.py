"""Choosing each chunk's sharding mode inside a stage of ``sp`` GPUs (FlashCP-like heuristic).

A chunk runs Ulysses (all-to-all of heads), or is *placed* (:mod:`.sharding`): each whole
sequence entirely on one rank (**whole-doc**, no attention traffic) or cut into ``2 sp`` zig-zag
pieces with its K/V all-gathered within the stage (**per-doc**). ``sp_mode`` says what the
planner may use: ``ulysses`` (every chunk Ulysses: today's plans), ``context`` (whole-doc and
per-doc only, never an all-to-all) or ``auto`` (whichever the cost model predicts faster, per
chunk). Per chunk (:func:`choose_placement`), with the per-layer forward + backward time of the
busiest GPU as the score (:meth:`~.cost.CostModel.placed_layer_time`):

1. **whole-doc first**: the chunk's whole sequences go to the ranks longest-processing-time
   first (each to the least loaded rank, by predicted layer time; :func:`lpt_ranks`);
2. **per-doc for the sequences that unbalance it**: while the busiest rank's predicted time
   exceeds the mean by more than :data:`IMBALANCE` (a long sequence dominates), the longest
   whole-doc sequence becomes per-doc (at least ``2 sp`` tokens) and the rest are placed again;
   every step of that ladder is scored and the fastest kept. A rank may be left empty (a chunk
   of fewer sequences than ranks, or one sequence shorter than ``2 sp``): it costs nothing in the
   score, which is the busiest GPU's, so a chunk of a few sequences runs whole-doc on as many
   ranks when that beats cutting one per-doc (gather) or Ulysses (all-to-alls);
3. **Ulysses where cheaper** (``auto``, when ``sp`` divides the heads: :func:`ulysses_allowed`).

A split sequence's slices are placed before the chunks (:func:`place_plan`), so that each finds
its earlier slices' K/V where it attends: per-doc in ``context`` mode (or when Ulysses cannot
split the heads), in ``auto`` the cheaper of per-doc and Ulysses over its slices alone (Ulysses
when a slice is too short to cut into ``2 sp`` pieces). Placed, the slices before the first one
too short to cut are per-doc and the rest whole-doc: a lone short last slice where its chunk's
placement puts it (it reads the per-doc slices' K/V through the stage's gather, on any rank), more
than one on rank 0 (their K/V are carried on the rank holding them). A chunk holding a slice of a
sequence left to Ulysses runs Ulysses whole. ``context`` mode places every chunk (whole-doc is
always possible).

Cost: per chunk about ``k + 1`` LPT passes (``k``: sequences moved to per-doc, mostly 0-2) of
``O(n log sp)`` and as many per-rank cost evaluations; results are cached by chunk, since the
search assembles the same chunks many times. Pure Python.
"""

from __future__ import annotations

import dataclasses
import functools

from .cost import CostModel
from .lpt import lpt_ranks
from .plan import Plan
from .sharding import PER_DOC, rank_pieces, ulysses_heads_refusal
from .types import Chunk, PlanError, Remedy, Slice

__all__ = ["IMBALANCE", "SP_MODES", "choose_placement", "lpt_ranks", "place_plan", "ulysses_allowed"]

#: what ``sequence_parallel_mode`` / ``--sp-mode`` accept
SP_MODES = ("auto", "ulysses", "context")
#: how far above the mean rank time the busiest rank of a whole-doc placement may be before the
#: longest whole-doc sequence goes per-doc (FlashCP's imbalance threshold)
IMBALANCE = 0.1


def ulysses_allowed(cost: CostModel) -> bool:
    """Whether a stage of ``cost.sp`` GPUs can run Ulysses (:func:`~.sharding.ulysses_heads_refusal`)."""
    return ulysses_heads_refusal(cost.num_heads, cost.num_kv_heads, cost.sp) is None


def check_sp_mode(mode: str, cost: CostModel) -> None:
    """Refuse an unknown mode, or ``ulysses`` on a stage whose ``sp`` does not divide the heads."""
    if mode not in SP_MODES:
        raise PlanError(f"unknown sequence-parallel mode {mode!r}",
                        Remedy("sequence_parallel_mode", "set", value=" or ".join(map(repr, SP_MODES))))
    if mode == "ulysses" and cost.sp > 1 and not ulysses_allowed(cost):
        raise PlanError(f"sequence-parallel size {cost.sp} does not divide the model's {cost.num_heads} attention "
                        "heads (Ulysses gives each GPU whole heads)",
                        Remedy("sequence_parallel_mode", "set", value="'auto' or 'context' (whole-doc / per-doc "
                               "sharding, no head-count limit)"),
                        Remedy("sequence_parallel_size", "set", value=f"a divisor of {cost.num_heads}"))


def _layer_work(cost: CostModel, sl: Slice) -> float:
    """One GPU's forward compute of one layer on ``sl`` alone, without the per-call constant."""
    return cost.layer_compute_time((sl,)) - cost.beta


@functools.lru_cache(maxsize=8192)
def choose_placement(chunk: Chunk, cost: CostModel, mode: str, fixed: tuple[tuple[int, int], ...] = ()
                     ) -> tuple[int, ...]:
    """The placement of ``chunk`` on a stage of ``cost.sp`` GPUs (module docstring): a tuple for
    :attr:`Chunk.placement` (``()``: Ulysses; ranks may be left empty). ``fixed``: ``(slice
    index, entry)`` pairs decided per split sequence."""
    sp = cost.sp
    if sp <= 1 or mode == "ulysses":
        return ()
    base = cost.rank_model()
    pinned = dict(fixed)
    free = [i for i in range(len(chunk.slices)) if i not in pinned]
    work = {i: _layer_work(base, chunk.slices[i]) for i in free}
    order = sorted(free, key=lambda i: (-work[i], i))
    best: tuple[float, tuple[int, ...]] | None = None
    per_doc: set[int] = set()
    for k in range(len(order) + 1):
        if k:
            nxt = order[k - 1]
            if chunk.slices[nxt].length < 2 * sp:
                break  # the longest left cannot be cut into 2 sp pieces, nor can the shorter ones
            per_doc.add(nxt)
        entries = dict(pinned)
        entries.update((i, PER_DOC) for i in per_doc)
        placed = Chunk(chunk.index, chunk.kind, chunk.slices, tuple(entries.get(i, 0) for i in range(len(chunk.slices))))
        # the ranks' load from the per-doc and pinned slices, then LPT of the whole-doc ones
        load = [0.0] * sp
        if entries:
            part = Chunk(chunk.index, chunk.kind, tuple(chunk.slices[i] for i in sorted(entries)),
                         tuple(entries[i] for i in sorted(entries)))
            load = _rank_work(part, base, sp)
        rest = [i for i in free if i not in per_doc]
        ranks = lpt_ranks([work[i] for i in rest], sp, load)
        entries.update(zip(rest, ranks))
        placed = dataclasses.replace(placed, placement=tuple(entries[i] for i in range(len(chunk.slices))))
        t = cost.placed_layer_time(placed)  # every step is a valid placement (empty ranks allowed)
        if best is None or t < best[0]:
            best = (t, placed.placement)
        busy = _rank_work(placed, base, sp)
        if max(busy) <= (1.0 + IMBALANCE) * sum(busy) / sp:
            break
    if mode == "auto" and ulysses_allowed(cost) and not any(w == PER_DOC for w in pinned.values()):
        t = cost.placed_layer_time(dataclasses.replace(chunk, placement=()))
        if best is None or t <= best[0]:
            return ()
    return () if best is None else best[1]


def _rank_work(chunk: Chunk, base: CostModel, sp: int) -> list[float]:
    """Each rank's forward compute of one layer on its pieces of a placed ``chunk``."""
    out = []
    for r in range(sp):
        pieces = rank_pieces(chunk, sp, r)
        out.append(sum(_layer_work(base, Slice(p.seq, p.start, p.length)) for p in pieces if p.length))
    return out


def _split_places(plan: Plan, cost: CostModel, mode: str, seq: int) -> dict[int, int] | None:
    """How a split sequence's slices are placed, by slice start: :data:`PER_DOC` or a rank (a
    start left out: the chunk's placement puts that slice whole-doc); ``None``: Ulysses, all of them
    (see the module docstring)."""
    slices = [sl for _, sl in plan.slices_of(seq)]
    short = next((j for j, sl in enumerate(slices) if sl.length < 2 * cost.sp), None)
    context = mode == "context" or not ulysses_allowed(cost)
    if not context:
        if short is not None:
            return None
        t_pd = sum(cost.placed_layer_time(Chunk(0, plan.chunks[0].kind, (sl,), (PER_DOC,))) for sl in slices)
        t_u = sum(cost.placed_layer_time(Chunk(0, plan.chunks[0].kind, (sl,))) for sl in slices)
        if t_pd >= t_u:
            return None
    places = {sl.start: PER_DOC for sl in slices[:short]}
    tail = slices[short:] if short is not None else []
    if len(tail) > 1 or short == 0:  # whole-doc from the first slice too short to cut on: one rank
        places.update((sl.start, 0) for sl in tail)
    return places  # a lone short last slice: whole-doc where its chunk's placement puts it


def place_plan(plan: Plan, cost: CostModel, mode: str) -> Plan:
    """``plan`` with each chunk's placement chosen for a stage of ``cost.sp`` GPUs under
    ``mode`` (module docstring); unchanged at ``sp = 1`` or in ``ulysses`` mode."""
    if cost.sp <= 1 or mode == "ulysses":
        return plan
    counts: dict[int, int] = {}
    for c in plan.chunks:
        for sl in c.slices:
            counts[sl.seq] = counts.get(sl.seq, 0) + 1
    split = {q: _split_places(plan, cost, mode, q) for q, n in counts.items() if n > 1}
    chunks = []
    for c in plan.chunks:
        if any(sl.seq in split and split[sl.seq] is None for sl in c.slices):
            chunks.append(c)  # a slice of a sequence left to Ulysses: the chunk runs Ulysses
            continue
        pins = [(i, split[sl.seq][sl.start]) for i, sl in enumerate(c.slices)
                if sl.seq in split and sl.start in split[sl.seq]]
        where = choose_placement(dataclasses.replace(c, placement=()), cost, mode, tuple(pins))
        chunks.append(dataclasses.replace(c, placement=where))
    return dataclasses.replace(plan, chunks=tuple(chunks))
