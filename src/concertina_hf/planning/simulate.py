"""Discrete-event simulation of a plan: predicted step time, bubbles, recompute and memory.

Execution model (the one the runtime follows): the plan is lowered
(:func:`~concertina_hf.planning.lower.lower`) and every stage runs its program in order, one step
at a time. A compute step starts when its stage is free; a step of messages is posted when its
stage reaches it (its sends leave then) and is done when its receives have arrived, one
``cost.p2p_time`` after the matching send left. So:

- ``F(s, c)`` needs ``F(s-1, c)`` finished plus one hidden-state message;
- ``B(s, c)`` needs ``F(s, c)`` done on the same stage and ``B(s+1, c)`` finished plus one
  gradient message (the last stage starts the backward right after its own forward).

Durations are ``cost.fwd_time`` and ``cost.bwd_time(..., recompute_layers=plan.recompute[s][c])``.
Order of slices within a stage is the schedule's business (``Plan.validate`` checks it); the
simulator only follows the program.

Communication runs as in the dry run, on its engine (:mod:`.dry_run`: each direction between two
neighbours a channel of its own, messages matched in issue order): a program that cannot run to
the end raises :class:`PlanError` naming the actions.

Memory of stage ``s`` over time (only its own action order matters, not timing)::

    static  +  sum act_memory(c)  over chunks forwarded but not yet backwarded on s
            +  transient_memory(c) during B(s, c)
            +  K/V gradient buffers of split sequences: the buffer of a slice's K/V is
               allocated when the sequence's last slice starts backward and freed when that
               slice's own backward ends
            +  on stage 0, at the end of B(0, c): the embedding's backward, once the chunk's
               layers have freed their activations (``cost.embed_bwd_memory``: its dense
               weight gradient before it is added into ``.grad``)
            +  on s > 0, the input gradient a backward sends to stage s - 1
               (``hidden_bytes_per_token`` per token of its chunk), from the end of that
               backward until the end of the stage's next backward (an upper bound): a send's
               buffer lives until stage s - 1 has posted its receive, which it does just before
               its own backward of the chunk, and the executor drops it at its first exchange
               that tells it so (``runtime.p2p``: on gloo, a message stage s - 1 sent with or
               after that receive; on NCCL, the work's completion); the last one at the step's
               end, which waits for every send. A forward's send (the stage output) goes the
               same way, before the chunk's backward ends: counted with the chunk

It peaks right after a forward (activations are counted from the forward's start) or during a
backward. :func:`memory_moments` lists those moments, as linear functions of the recompute
decision; :mod:`concertina_hf.planning.recompute` constrains them and :func:`simulate` evaluates
them, so the planner's constraints and the simulator's peaks cannot disagree.

:func:`backward_slack` sweeps a simulated step backwards: how long each backward can slip
without delaying the step (the recompute planner hides recomputation there).

A stage of ``sp`` GPUs (:meth:`CostModel.with_parallel`) needs nothing else here: durations and
bytes are per GPU and include the all-to-alls (``SimResult.comm_time_s`` adds them up, the Gantt
chart draws them); with sharded state, the once-per-step gather of the weights and
reduce-scatter of the gradients (``CostModel.step_sync_time``, the slowest stage's) is added to
the step time. A plan recording its own stage size (the ``sp-only`` baseline's knobs ``sp``,
``state_shards``, ``zero3``) runs under ``cost.for_plan(plan)``. Its knob ``data_parallel = d``
(one stage only) makes the pipeline groups *rounds*: each group's chunks (at most ``d``) run at
once on ``d`` groups of GPUs, every forward of a round starting together and every backward
after the round's slowest forward (ZeRO-3's per-layer collectives keep the groups in step);
``stage_busy_s`` is then the mean over the ``d`` groups, so the bubble is their idle time.

Cost: the dry run's (every step started exactly once, about ``N`` sweeps of the ``p`` stages for
a 1F1B plan of ``N`` chunks). Each chunk's time and memory terms come from the cost model once per stage shape (layer count,
embedding, head: three shapes for an even layout, whatever the pipeline size); memory costs
``O(actions)`` (a running sum of what is in flight). A 512-sequence plan of ~100 chunks on 4
stages simulates in ~7 ms in pure Python, ~2 ms of it lowering the plan and matching its messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostModel
from .dry_run import compile_program, run_program
from .lower import lower
from .plan import Plan, PlanStats, Program
from .segments import segment_options
from .types import Action, ActionKind, PlanError

__all__ = [
    "MemoryMoment", "SimResult", "backward_slack", "memory_moments", "simulate", "split_sequence_ids",
    "stage_representatives",
]


@dataclass(frozen=True)
class SimResult:
    """What one simulated step looks like. Times in seconds from the step's start, bytes."""

    step_time_s: float
    stage_busy_s: tuple[float, ...]  # compute time per stage (fwd + bwd + recompute)
    stage_bubble_s: tuple[float, ...]  # step_time - busy, per stage
    recompute_time_s: float  # total over stages
    peak_memory_bytes: tuple[int, ...]  # per stage, static included
    memory_timeline: tuple[tuple[tuple[float, int], ...], ...]  # per stage: (time, bytes) points
    action_times: dict  # compute Action -> (start_s, end_s)
    bubble_fraction: float  # sum(bubble) / (p * step_time)
    recompute_fraction: float  # recompute_time / sum(busy)
    comm_time_s: float = 0.0  # all-to-alls inside the stages (sp > 1), summed over stages
    sync_time_s: float = 0.0  # once-per-step weight gather + gradient reduce-scatter (in step_time_s)
    #: bytes the GPUs of each stage send one another per step (all-to-alls, K/V all-gathers and
    #: reduce-scatters: ``CostModel.stage_comm_bytes``), summed over stages and their GPUs
    stage_comm_bytes: float = 0.0

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
    ``b = backward`` (``None`` right after a forward, and at the embedding's backward: a
    backward ``action`` with ``backward=None``, the chunk no longer in ``in_flight`` and the
    embedding's weight gradient in ``const``). ``const`` holds static memory and the
    K/V gradient buffers and the input gradient waiting to be sent alive at that moment.
    ``action`` is the action whose start (forward) or run (backward) the moment belongs to.
    ``kv_freed``: the bytes of ``const`` the backward frees when it ends (0 after a forward): its
    K/V gradient buffers and the previous backward's pending input gradient, less its own
    (negative when that is the larger).
    """

    stage: int
    action: Action
    in_flight: tuple[int, ...]  # chunks whose activations are held (the backward one included)
    backward: int | None
    const: float
    kv_freed: float = 0.0


def split_sequence_ids(plan: Plan) -> frozenset[int]:
    """Sequences cut into more than one slice in this plan."""
    count: dict[int, int] = {}
    for c in plan.chunks:
        for s in c.slices:
            count[s.seq] = count.get(s.seq, 0) + 1
    return frozenset(q for q, n in count.items() if n > 1)


def _kv_grad_plan(plan: Plan, split: frozenset[int],
                  cost: CostModel | None = None) -> tuple[dict[int, list[float]], dict[int, float]]:
    """For each split sequence: which chunk's backward allocates the K/V gradient buffers
    (its last slice) and how many tokens each earlier slice's buffer holds.

    Returns ``(alloc, free)``: ``alloc[chunk]`` = token counts of the buffers allocated when
    that chunk's backward starts; ``free[chunk]`` = tokens freed when its backward ends. With
    ``cost``, a placed slice's tokens count ``cost.kv_grad_scale`` times (a GPU's own tokens of
    it at every head, not its heads' share: a per-doc slice's shard; none on a GPU not holding a
    whole-doc slice, ``cost.at_rank``).
    """
    alloc: dict[int, list[float]] = {}
    free: dict[int, float] = {}
    chains: dict[int, list[tuple[int, int, int]]] = {}
    scale: dict[tuple[int, int], float] = {}  # (chunk, start) of placed slices: the others count as they are
    for c in plan.chunks:
        for i, s in enumerate(c.slices):
            if s.seq in split:
                chains.setdefault(s.seq, []).append((s.start, c.index, s.length))
                if cost is not None and c.placement:
                    scale[(c.index, s.start)] = cost.kv_grad_scale(c, i)
    seg = segment_options(plan)
    if seg is not None and seg.gradient == "none":  # no gradient crosses a segment boundary: no buffers
        return alloc, free
    if seg is not None and (seg.gradient == "previous" or seg.kv_tail is not None):
        # segment-level training: a slice's buffer is allocated by the backward of the last slice
        # whose attention gives it gradient (the next one under "previous"; under a K/V tail W the
        # last one starting less than W tokens after it ends), none when no slice does (W = 0)
        for seq in sorted(chains):
            chain = sorted(chains[seq])
            for j, (start, ci, length) in enumerate(chain[:-1]):
                later = chain[j + 1:j + 2] if seg.gradient == "previous" else chain[j + 1:]
                reach = [c for s0, c, _ in later if seg.kv_tail is None or s0 - seg.kv_tail < start + length]
                if reach:
                    alloc.setdefault(reach[-1], []).append(length * scale.get((ci, start), 1))
                    free[ci] = free.get(ci, 0) + length * scale.get((ci, start), 1)
        return alloc, free
    for seq in sorted(chains):
        chain = sorted(chains[seq])
        *earlier, (_, last_chunk, _) = chain
        alloc.setdefault(last_chunk, []).extend(length * scale.get((ci, start), 1) for start, ci, length in earlier)
        for start, ci, length in earlier:
            free[ci] = free.get(ci, 0) + length * scale.get((ci, start), 1)
    return alloc, free


def memory_moments(plan: Plan, cost: CostModel, stage: int) -> list[MemoryMoment]:
    """The memory maxima of ``stage`` in its action order (see the module docstring).

    Right after each forward and during each backward; the K/V gradient terms are constants
    (they do not depend on recompute).
    """
    cost = cost.for_plan(plan)
    kv = _kv_grad_plan(plan, split_sequence_ids(plan), cost)
    return [MemoryMoment(stage, *row) for row in _moments(plan, cost, stage, *kv)]


def _moments(plan: Plan, cost: CostModel, stage: int, alloc: dict[int, list[int]], free: dict[int, int],
             in_flight_sets: bool = True):
    """:func:`memory_moments` as plain tuples ``(action, in_flight, backward, const, kv_freed)``
    (the simulator reads them for every action); ``in_flight_sets=False``: ``in_flight`` is
    ``None`` (a caller that keeps a running sum needs no copy of the set at every action)."""
    lay = plan.layout
    const = float(cost.static_memory(lay, stage))
    in_flight: dict[int, None] = {}  # insertion-ordered set
    out: list[tuple] = []
    FWD = ActionKind.FORWARD
    sends_grad = stage > 0
    pending = 0.0  # the previous backward's input gradient, not yet received by stage - 1
    last_b = max((i for i, a in enumerate(plan.schedule[stage]) if a.kind is not FWD), default=-1)
    embed = lay.has_embedding(stage)
    for i, a in enumerate(plan.schedule[stage]):
        c = a.chunk
        if a.kind is FWD:
            in_flight[c] = None
            out.append((a, tuple(in_flight) if in_flight_sets else None, None, const, 0.0))
        else:
            for tok in alloc.get(c, ()):
                const += cost.kv_grad_memory(lay, stage, tok)
            freed = cost.kv_grad_memory(lay, stage, free[c]) if c in free else 0.0
            if sends_grad:
                # the step ends waiting for its sends: the last one is gone then
                mine = cost.hidden_bytes_per_token * plan.chunks[c].num_tokens if i != last_b else 0.0
                freed += pending - mine
                pending = mine
            out.append((a, tuple(in_flight) if in_flight_sets else None, c, const, freed))
            in_flight.pop(c, None)
            if embed:
                # the embedding's backward ends the chunk's: its layers' activations are gone,
                # its K/V gradient buffers and pending sends not yet
                e = cost.embed_bwd_memory(lay, stage, plan.chunks[c])
                if e:
                    out.append((a, tuple(in_flight) if in_flight_sets else None, None, const + e, 0.0))
            const -= freed
    return out


def stage_representatives(plan: Plan, cost: CostModel) -> list[int]:
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


# ---------------------------------------------------------------------------- simulation
def simulate(plan: Plan, cost: CostModel, *, program: Program | None = None) -> SimResult:
    """Run ``plan`` under ``cost`` (see the module docstring); raise :class:`PlanError` if its
    program cannot run. ``program``: the lowered program to run instead of ``lower(plan)``
    (the same compute actions; a test passes a hand-edited one)."""
    cost = cost.for_plan(plan)
    p = plan.num_stages
    n = plan.num_chunks
    lay = plan.layout
    chunks = plan.chunks
    lanes = int(plan.knob("data_parallel", 1))
    if lanes > 1 and p != 1:
        raise PlanError(f"knob data_parallel={lanes} needs a plan of one stage, not {p}")
    if len(plan.schedule) != p:
        raise PlanError(f"schedule has {len(plan.schedule)} stages, layout has {p}")
    rec = plan.recompute
    if len(rec) != p or any(len(row) != n for row in rec):
        raise PlanError("plan.recompute must be [stage][chunk]; fill it (e.g. with zeros) before simulating")
    if program is None:
        program = lower(plan)
    elif program.plan != plan or not program.train or any(
            [a for step in steps for a in step if a.kind.is_compute] != list(acts)
            for steps, acts in zip(program.steps, plan.schedule)):
        raise PlanError("the program does not run this plan's schedule (lower(plan) does)")

    p2p = [cost.p2p_time(c) for c in chunks]
    rep = stage_representatives(plan, cost)
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
    comm = 0.0
    moved = 0.0
    if cost.sp > 1:
        for c in chunks:
            for s in range(p):
                comm += cost.comm_time(lay, s, c, False) + cost.comm_time(lay, s, c, True, rec[s][c.index])
                moved += cost.stage_comm_bytes(lay, s, c, rec[s][c.index])

    # ---------------------------------------------------------------- timing
    if lanes > 1:
        fstart, fend, bstart, bend, free_at = _run_rounds(plan, lanes, fdur[0], bdur[0])
        busy = [busy[0] / lanes]
        rec_total /= lanes
        comm /= lanes
    else:
        fstart, fend, bstart, bend, free_at = run_program(program, compile_program(program), fdur, bdur, p2p)
    sync = max((cost.step_sync_time(lay, s) for s in range(p)), default=0.0)
    step = (max(free_at) if p else 0.0) + sync
    # clamp float noise: a stage never works longer than the step
    bubble = tuple(max(0.0, step - b) for b in busy)
    sum_busy = sum(busy)

    # ---------------------------------------------------------------- memory
    peaks: list[int] = []
    timelines: list[tuple[tuple[float, int], ...]] = []
    action_times: dict[Action, tuple[float, float]] = {}
    act_memo: dict[tuple[int, int, int], float] = {}
    tr_memo: dict[tuple[int, int, int], float] = {}
    alloc, free = _kv_grad_plan(plan, split_sequence_ids(plan), cost)
    for s in range(p):
        rs = rec[s]
        s0 = rep[s]
        act = [0.0] * n
        tr = [0.0] * n
        for c in chunks:
            i = c.index
            key = (s0, i, rs[i])
            if key not in act_memo:
                act_memo[key] = cost.act_memory(lay, s0, c, rs[i])
                tr_memo[key] = cost.transient_memory(lay, s0, c, rs[i])
            act[i] = act_memo[key]
            tr[i] = tr_memo[key]
        static = float(cost.static_memory(lay, s))
        peak = static
        points: list[tuple[float, int]] = [(0.0, math.ceil(static))]
        # activations held, as a running sum (linear in the actions, whatever is in flight)
        acts, held_chunks = 0.0, 0
        for a, _, backward, const, kv_freed in _moments(plan, cost, s, alloc, free, in_flight_sets=False):
            c = a.chunk
            if backward is None and a.kind is not ActionKind.FORWARD:
                # the embedding's backward, at the end of the chunk's (the point before its end)
                held = const + acts
                t0, t1 = bstart[s][c], bend[s][c]
                points.insert(len(points) - 1, (t1, math.ceil(held)))
            elif backward is None:
                acts += act[c]
                held_chunks += 1
                held = const + acts
                t0, t1 = fstart[s][c], fend[s][c]
                points.append((t0, math.ceil(held)))
            else:
                held = const + acts + tr[c]
                t0, t1 = bstart[s][c], bend[s][c]
                points.append((t0, math.ceil(held)))
                # transient buffers, this chunk's activations and its own K/V gradient go
                held_chunks -= 1
                acts = acts - act[c] if held_chunks else 0.0  # (no rounding left over once empty)
                after = (const - kv_freed) + acts
                points.append((t1, math.ceil(after)))
            if held > peak:
                peak = held
            action_times[a] = (t0, t1)
        peaks.append(math.ceil(peak))
        if lanes > 1:  # groups of GPUs side by side: the busiest one's memory at each moment
            points = _lanes_timeline(plan, points[0][1], fstart[0], bstart[0], bend[0], act, tr)
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
        comm_time_s=comm,
        sync_time_s=sync,
        stage_comm_bytes=moved,
    )


def _lanes_timeline(plan: Plan, static: int, fstart, bstart, bend, act, tr) -> list[tuple[float, int]]:
    """Memory over time of a plan of rounds: each group of GPUs holds its own chunk from its
    forward to the end of its backward (transient buffers during the backward); the largest over
    the groups at each moment. A round's chunks are all that is alive during it."""
    out: list[tuple[float, int]] = [(0.0, static)]
    for members in plan.groups:
        times = sorted({fstart[c] for c in members} | {bstart[c] for c in members} | {bend[c] for c in members})
        for t in times:
            held = max((act[c] + (tr[c] if t >= bstart[c] else 0.0) for c in members if fstart[c] <= t < bend[c]),
                       default=0.0)
            out.append((t, math.ceil(static + held)))
    return out


def _run_rounds(plan: Plan, lanes: int, fdur: list[float], bdur: list[float]):
    """Timing of a one-stage plan whose groups are rounds run on ``lanes`` groups of GPUs at
    once (module docstring); the same tuple as :func:`~.dry_run.run_program`."""
    n = plan.num_chunks
    fstart, fend, bstart, bend = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    t = 0.0
    for members in plan.groups:
        if len(members) > lanes:
            raise PlanError(f"a round of {len(members)} chunks {list(members)} on data_parallel={lanes} groups of GPUs")
        tf = max(fdur[c] for c in members)
        tb = max(bdur[c] for c in members)
        for c in members:
            fstart[c], fend[c] = t, t + fdur[c]
            bstart[c], bend[c] = t + tf, t + tf + bdur[c]
        t += tf + tb
    return [fstart], [fend], [bstart], [bend], [t]


def backward_slack(plan: Plan, cost: CostModel, res: SimResult) -> list[list[float]]:
    """Total float of every backward in the simulated schedule: how long ``B(s, c)`` can slip
    without delaying the step (latest start minus earliest start).

    Latest times come from a reverse sweep over the same dependencies the simulator follows
    (next action on the stage; ``F(s+1, c)`` after ``F(s, c)``; ``B(s-1, c)`` after ``B(s, c)``,
    each cross-stage edge carrying one message).
    """
    cost = cost.for_plan(plan)
    p, n = plan.num_stages, plan.num_chunks
    at = res.action_times
    T = res.step_time_s - res.sync_time_s
    FWD = ActionKind.FORWARD
    p2p = [cost.p2p_time(c) for c in plan.chunks]
    lf_start: list[list[float | None]] = [[None] * n for _ in range(p)]  # latest start of F
    lb_start: list[list[float | None]] = [[None] * n for _ in range(p)]  # latest start of B
    ptr = [len(a) - 1 for a in plan.schedule]
    nxt_ls = [T] * p  # latest start of the action after the current one on each stage
    left = sum(len(a) for a in plan.schedule)
    sweep = 0
    while left:
        progressed = False
        order = range(p - 1, -1, -1) if sweep % 2 == 0 else range(p)
        sweep += 1
        for s in order:
            acts = plan.schedule[s]
            k = ptr[s]
            while k >= 0:
                a = acts[k]
                c = a.chunk
                lf = nxt_ls[s]
                if a.kind is FWD:
                    if s < p - 1:
                        down = lf_start[s + 1][c]
                        if down is None:
                            break
                        lf = min(lf, down - p2p[c])
                else:
                    if s > 0:
                        up = lb_start[s - 1][c]
                        if up is None:
                            break
                        lf = min(lf, up - p2p[c])
                t0, t1 = at[a]
                ls = lf - (t1 - t0)
                (lf_start if a.kind is FWD else lb_start)[s][c] = ls
                nxt_ls[s] = ls
                k -= 1
            if k != ptr[s]:
                left -= ptr[s] - k
                ptr[s] = k
                progressed = True
        if not progressed:  # cannot happen after a successful forward simulation
            raise PlanError("internal: reverse sweep of the schedule made no progress")
    out = []
    for s in range(p):
        row = [0.0] * n
        for c in range(n):
            row[c] = max(0.0, lb_start[s][c] - at[Action(s, ActionKind.BACKWARD, c)][0])
        out.append(row)
    return out
