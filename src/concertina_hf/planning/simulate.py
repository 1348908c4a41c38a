"""Discrete-event simulation of a plan: predicted step time, bubbles, recompute and memory.

Execution model (the one the runtime follows): every stage runs its action list in order, one
action at a time. An action starts when its stage is free and its inputs are there:

- ``F(s, c)`` needs ``F(s-1, c)`` finished plus one hidden-state message (``cost.p2p_time``);
- ``B(s, c)`` needs ``F(s, c)`` done on the same stage and ``B(s+1, c)`` finished plus one
  gradient message (the last stage starts the backward right after its own forward).

Durations are ``cost.fwd_time`` and ``cost.bwd_time(..., recompute_layers=plan.recompute[s][c])``.
Order of slices within a stage is the schedule's business (``Plan.validate`` checks it); the
simulator only follows the lists. If no stage can start its next action while some remain, the
plan deadlocks and :class:`PlanError` lists the blocked actions.

Memory of stage ``s`` over time (only its own action order matters, not timing)::

    static  +  sum act_memory(c)  over chunks forwarded but not yet backwarded on s
            +  transient_memory(c) during B(s, c)
            +  K/V gradient buffers of split sequences: the buffer of a slice's K/V is
               allocated when the sequence's last slice starts backward and freed when that
               slice's own backward ends

It peaks right after a forward (activations are counted from the forward's start) or during a
backward. :func:`memory_moments` exposes those moments, as linear functions of the recompute
decision, for :mod:`concertina_hf.planning.recompute`; :func:`simulate` evaluates them with the
same code, so the planner's constraints and the simulator's peaks cannot disagree.

Cost: every action is started exactly once; stages are swept alternately top-down and
bottom-up, so a 1F1B plan of ``N`` chunks on ``p`` stages needs about ``N`` sweeps of ``p``
stages. Each chunk's time and memory terms come from the cost model once per stage shape
(layer count, embedding, head: three shapes for an even layout, whatever the pipeline size). A
512-sequence plan of ~100 chunks on 4 stages simulates in ~3 ms in pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .cost import CostModel
from .types import Action, ActionKind, Plan, PlanError, PlanStats

__all__ = ["MemoryMoment", "SimResult", "memory_moments", "simulate", "split_sequences"]


@dataclass(frozen=True)
class SimResult:
    """What one simulated step looks like. Times in seconds from the step's start, bytes."""

    step_time_s: float
    stage_busy_s: tuple[float, ...]  # compute time per stage (fwd + bwd + recompute)
    stage_bubble_s: tuple[float, ...]  # step_time - busy, per stage
    recompute_time_s: float  # total over stages
    peak_memory_bytes: tuple[int, ...]  # per stage, static included
    memory_timeline: tuple[tuple[tuple[float, int], ...], ...]  # per stage: (time, bytes) points
    action_times: dict  # Action -> (start_s, end_s)
    bubble_fraction: float  # sum(bubble) / (p * step_time)
    recompute_fraction: float  # recompute_time / sum(busy)

    def stats(self) -> PlanStats:
        return PlanStats(
            step_time_s=self.step_time_s,
            bubble_fraction=self.bubble_fraction,
            recompute_fraction=self.recompute_fraction,
            peak_memory_bytes=self.peak_memory_bytes,
        )


@dataclass(frozen=True)
class MemoryMoment:
    """One local memory maximum of a stage, as a function of that stage's recompute row.

    ``bytes(r) = const + sum(act[c](r[c]) for c in in_flight) + transient[b](r[b])`` where
    ``b = backward`` (``None`` right after a forward). ``const`` holds static memory and the
    K/V gradient buffers alive at that moment. ``action`` is the action whose start (forward)
    or run (backward) the moment belongs to.
    """

    stage: int
    action: Action
    in_flight: tuple[int, ...]  # chunks whose activations are held (the backward one included)
    backward: int | None
    const: float


def split_sequences(plan: Plan) -> frozenset[int]:
    """Sequences cut into more than one slice in this plan."""
    count: dict[int, int] = {}
    for c in plan.chunks:
        for s in c.slices:
            count[s.seq] = count.get(s.seq, 0) + 1
    return frozenset(q for q, n in count.items() if n > 1)


def _kv_grad_plan(plan: Plan, split: frozenset[int]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """For each split sequence: which chunk's backward allocates the K/V gradient buffers
    (its last slice) and how many tokens each earlier slice's buffer holds.

    Returns ``(alloc, free)``: ``alloc[chunk]`` = token counts of the buffers allocated when
    that chunk's backward starts; ``free[chunk]`` = tokens freed when its backward ends.
    """
    alloc: dict[int, list[int]] = {}
    free: dict[int, int] = {}
    chains: dict[int, list[tuple[int, int, int]]] = {}
    for c in plan.chunks:
        for s in c.slices:
            if s.seq in split:
                chains.setdefault(s.seq, []).append((s.start, c.index, s.length))
    for seq in sorted(chains):
        chain = sorted(chains[seq])
        *earlier, (_, last_chunk, _) = chain
        alloc.setdefault(last_chunk, []).extend(length for _, _, length in earlier)
        for _, ci, length in earlier:
            free[ci] = free.get(ci, 0) + length
    return alloc, free


def memory_moments(plan: Plan, cost: CostModel, stage: int) -> list[MemoryMoment]:
    """The memory maxima of ``stage`` in its action order (see the module docstring).

    Right after each forward and during each backward; the K/V gradient terms are constants
    (they do not depend on recompute).
    """
    lay = plan.layout
    split = split_sequences(plan)
    alloc, free = _kv_grad_plan(plan, split)
    const = float(cost.static_memory(lay, stage))
    in_flight: dict[int, None] = {}  # insertion-ordered set
    out: list[MemoryMoment] = []
    for a in plan.schedule[stage]:
        if a.kind is ActionKind.FORWARD:
            in_flight[a.chunk] = None
            out.append(MemoryMoment(stage, a, tuple(in_flight), None, const))
        else:
            for tok in alloc.get(a.chunk, ()):
                const += cost.kv_grad_memory(lay, stage, tok)
            out.append(MemoryMoment(stage, a, tuple(in_flight), a.chunk, const))
            in_flight.pop(a.chunk, None)
            if a.chunk in free:
                const -= cost.kv_grad_memory(lay, stage, free[a.chunk])
    return out


def _stage_representatives(plan: Plan, cost: CostModel) -> list[int]:
    """For each stage, the first stage of the same shape (layer count, embedding, head).

    :class:`CostModel` sees a stage only through that shape, so per-chunk terms are computed
    once per shape (3 shapes for an even layout, whatever the pipeline size). A subclass may
    depend on the stage index itself: then every stage is its own representative.
    """
    lay = plan.layout
    if type(cost) is not CostModel:
        return list(range(plan.num_stages))
    first: dict[tuple[int, bool, bool], int] = {}
    return [first.setdefault((lay.num_stage_layers(s), lay.has_embedding(s), lay.has_head(s)), s)
            for s in range(plan.num_stages)]


def _deadlock(plan: Plan, ptr: Sequence[int], fend, bend) -> PlanError:
    p = plan.num_stages
    blocked = []
    for s in range(p):
        if ptr[s] >= len(plan.schedule[s]):
            continue
        a = plan.schedule[s][ptr[s]]
        c = a.chunk
        if a.kind is ActionKind.FORWARD:
            why = f"waits for {s - 1}F{c}"
        elif fend[s][c] is None:
            why = f"waits for its own forward {s}F{c}"
        else:
            why = f"waits for {s + 1}B{c}"
        blocked.append(f"{a} ({why})")
    left = sum(len(plan.schedule[s]) - ptr[s] for s in range(p))
    return PlanError(
        f"deadlock: {left} actions cannot run; blocked: " + ", ".join(blocked)
        + ". Every stage must order its actions so that the chunk a stage waits for is "
        "forwarded (or backwarded) by its neighbour first."
    )


def simulate(plan: Plan, cost: CostModel) -> SimResult:
    """Run ``plan.schedule`` under ``cost`` (see the module docstring); raise :class:`PlanError`
    on deadlock."""
    p = plan.num_stages
    n = plan.num_chunks
    lay = plan.layout
    chunks = plan.chunks
    if len(plan.schedule) != p:
        raise PlanError(f"schedule has {len(plan.schedule)} stages, layout has {p}")
    rec = plan.recompute
    if len(rec) != p or any(len(row) != n for row in rec):
        raise PlanError("plan.recompute must be [stage][chunk]; fill it (e.g. with zeros) before simulating")

    p2p = [cost.p2p_time(c) for c in chunks]
    rep = _stage_representatives(plan, cost)
    fdur = [[0.0] * n for _ in range(p)]
    bdur = [[0.0] * n for _ in range(p)]
    rec_total = 0.0
    for c in chunks:
        i = c.index
        memo: dict[tuple[str, int, int], float] = {}
        for s in range(p):
            r = rec[s][i]
            s0 = rep[s]
            kf, kb = ("f", s0, 0), ("b", s0, r)
            if kf not in memo:
                memo[kf] = cost.fwd_time(lay, s0, c)
            if kb not in memo:
                memo[kb] = cost.bwd_time(lay, s0, c, recompute_layers=r)
            fdur[s][i] = memo[kf]
            bdur[s][i] = memo[kb]
            if r:
                kr = ("r", 0, r)
                if kr not in memo:
                    memo[kr] = cost.recompute_time(c, r)
                rec_total += memo[kr]
    busy = [sum(fdur[s]) + sum(bdur[s]) for s in range(p)]

    # ---------------------------------------------------------------- timing
    fend: list[list[float | None]] = [[None] * n for _ in range(p)]
    bend: list[list[float | None]] = [[None] * n for _ in range(p)]
    fstart = [[0.0] * n for _ in range(p)]
    bstart = [[0.0] * n for _ in range(p)]
    free_at = [0.0] * p
    ptr = [0] * p
    remaining = sum(len(a) for a in plan.schedule)
    FWD = ActionKind.FORWARD
    last = p - 1
    sweep = 0
    while remaining:
        progressed = False
        order = range(p) if sweep % 2 == 0 else range(p - 1, -1, -1)
        sweep += 1
        for s in order:
            acts = plan.schedule[s]
            k = ptr[s]
            t_free = free_at[s]
            fe, be = fend[s], bend[s]
            while k < len(acts):
                a = acts[k]
                c = a.chunk
                if a.kind is FWD:
                    if s == 0:
                        ready = 0.0
                    else:
                        up = fend[s - 1][c]
                        if up is None:
                            break
                        ready = up + p2p[c]
                    start = t_free if t_free > ready else ready
                    t_free = start + fdur[s][c]
                    fstart[s][c] = start
                    fe[c] = t_free
                else:
                    if fe[c] is None:
                        break
                    if s == last:
                        ready = fe[c]
                    else:
                        down = bend[s + 1][c]
                        if down is None:
                            break
                        ready = down + p2p[c]
                    start = t_free if t_free > ready else ready
                    t_free = start + bdur[s][c]
                    bstart[s][c] = start
                    be[c] = t_free
                k += 1
            if k != ptr[s]:
                remaining -= k - ptr[s]
                ptr[s] = k
                free_at[s] = t_free
                progressed = True
        if not progressed:
            raise _deadlock(plan, ptr, fend, bend)

    step = max(free_at) if p else 0.0
    # clamp float noise: a stage never works longer than the step
    bubble = tuple(max(0.0, step - b) for b in busy)
    sum_busy = sum(busy)

    # ---------------------------------------------------------------- memory
    split = split_sequences(plan)
    alloc, free = _kv_grad_plan(plan, split)
    peaks: list[int] = []
    timelines: list[tuple[tuple[float, int], ...]] = []
    action_times: dict[Action, tuple[float, float]] = {}
    act_memo: dict[tuple[int, int, int], float] = {}
    tr_memo: dict[tuple[int, int, int], float] = {}
    for s in range(p):
        rs = rec[s]
        s0 = rep[s]
        act = [0.0] * n
        tr = [0.0] * n
        for c in chunks:
            i = c.index
            key = (s0, i, rs[i])
            if key not in act_memo:
                act_memo[key] = cost.act_memory(lay, s0, c, rs[i], split)
                tr_memo[key] = cost.transient_memory(lay, s0, c, rs[i])
            act[i] = act_memo[key]
            tr[i] = tr_memo[key]
        static = float(cost.static_memory(lay, s))
        mem = static
        peak = mem
        points: list[tuple[float, int]] = [(0.0, math.ceil(mem))]
        for a in plan.schedule[s]:
            c = a.chunk
            if a.kind is FWD:
                t0, t1 = fstart[s][c], fend[s][c]
                mem += act[c]
                points.append((t0, math.ceil(mem)))
                if mem > peak:
                    peak = mem
            else:
                t0, t1 = bstart[s][c], bend[s][c]
                extra = tr[c]
                for tok in alloc.get(c, ()):
                    extra += cost.kv_grad_memory(lay, s, tok)
                mem += extra
                points.append((t0, math.ceil(mem)))
                if mem > peak:
                    peak = mem
                # transient buffers, this chunk's activations and its own K/V gradient go
                mem -= tr[c] + act[c]
                if c in free:
                    mem -= cost.kv_grad_memory(lay, s, free[c])
                points.append((t1, math.ceil(mem)))
            action_times[a] = (t0, t1)
        peaks.append(math.ceil(peak))
        timelines.append(tuple(points))

    return SimResult(
        step_time_s=step,
        stage_busy_s=tuple(busy),
        stage_bubble_s=bubble,
        recompute_time_s=rec_total,
        peak_memory_bytes=tuple(peaks),
        memory_timeline=tuple(timelines),
        action_times=action_times,
        bubble_fraction=(sum(bubble) / (p * step)) if step > 0 else 0.0,
        recompute_fraction=(rec_total / sum_busy) if sum_busy > 0 else 0.0,
    )
