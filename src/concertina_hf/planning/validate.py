"""The invariants of a plan, checked by :meth:`~concertina_hf.planning.plan.Plan.validate`: what
the runtime, the simulator and the recompute planner rely on and do not check again.

:func:`validate_plan` lists them and raises a :class:`~.types.PlanError` naming the first broken
one; :func:`validate_placements` checks the chunks' placements (whole-doc / per-doc) against the
K/V a split sequence carries from slice to slice.

Cost: one pass over the chunks' slices and one over each stage's actions. Pure Python; no torch.
"""

from __future__ import annotations

from typing import Any

from .types import ActionKind, ChunkKind, PlanError, Slice

__all__ = ["validate_placements", "validate_plan"]


def validate_plan(plan: Any) -> None:
    """Check every structural invariant of ``plan`` (a :class:`~.plan.Plan`); raise
    :class:`~.types.PlanError` naming the first broken one.

    Invariants: every token of every sequence lands in exactly one slice, slices of a
    sequence are in chunk order; chunk kinds match their content; no chunk holds slices of
    two split sequences; groups partition the chunks in order and a split sequence stays in
    one group; each stage forwards and backwards every chunk exactly once (compute actions
    only), forward before backward, slices of a sequence forward in order and backward in
    reverse order (any order under the knob ``segment_gradient="none"``); neighbouring stages
    order the forwards (and the backwards) of the chunks the same way; recompute is within each
    stage's layer count.
    """
    p = plan.num_stages
    lay = plan.layout
    if lay.num_stages < 1 or lay.layer_ranges[0][0] != 0 or lay.layer_ranges[-1][1] != lay.num_layers:
        raise PlanError(f"stage layout {lay.layer_ranges} does not cover {lay.num_layers} layers")
    for (a0, b0), (a1, _) in zip(lay.layer_ranges, lay.layer_ranges[1:]):
        if b0 != a1 or a0 >= b0:
            raise PlanError(f"stage layout {lay.layer_ranges} is not contiguous and non-empty")
    if lay.layer_ranges[-1][0] >= lay.layer_ranges[-1][1]:
        raise PlanError(f"stage layout {lay.layer_ranges} has an empty last stage")
    for i, c in enumerate(plan.chunks):
        if c.index != i:
            raise PlanError(f"chunk at position {i} has index {c.index}")
        if not c.slices:
            raise PlanError(f"chunk {i} is empty")
        split = {s.seq for s in c.slices if s.length != plan.seq_lens[s.seq]}
        if len(split) > 1:
            raise PlanError(f"chunk {i} holds slices of two split sequences {sorted(split)}")
        if c.kind is ChunkKind.PACKED and split:
            raise PlanError(f"packed chunk {i} holds a slice of split sequence {split.pop()}")
        if c.kind is ChunkKind.SPLIT and (len(c.slices) != 1 or not split):
            raise PlanError(f"split chunk {i} must hold exactly one slice of a split sequence")
        if c.kind is ChunkKind.SPLIT and c.slices[0].end == plan.seq_lens[c.slices[0].seq]:
            raise PlanError(f"split chunk {i} holds a final slice (that is a hybrid chunk)")
        if c.kind is ChunkKind.HYBRID:
            if not split:
                raise PlanError(f"hybrid chunk {i} holds no tail slice")
            tail = c.slices[0]
            if tail.seq not in split:
                raise PlanError(f"hybrid chunk {i} must list its tail slice first")
            if tail.end != plan.seq_lens[tail.seq]:
                raise PlanError(f"hybrid chunk {i} holds a non-final slice of sequence {tail.seq}")
    # token coverage and slice order
    chunk_group = {}
    for g, members in enumerate(plan.groups):
        for ci in members:
            if ci in chunk_group:
                raise PlanError(f"chunk {ci} is in two pipeline groups")
            chunk_group[ci] = g
    flat = [ci for members in plan.groups for ci in members]
    if flat != list(range(plan.num_chunks)):
        raise PlanError("pipeline groups must list every chunk once, in forward order")
    by_seq: list[list[tuple[int, Slice]]] = [[] for _ in plan.seq_lens]  # slices_of, for all at once
    for c in plan.chunks:
        for sl in c.slices:
            if not 0 <= sl.seq < len(by_seq):
                raise PlanError(f"chunk {c.index} holds a slice of sequence {sl.seq}, not in the step")
            by_seq[sl.seq].append((c.index, sl))
    seq_chunks: list[list[int]] = []
    for seq, n in enumerate(plan.seq_lens):
        parts = sorted(by_seq[seq], key=lambda cs: cs[1].start)
        pos = 0
        for ci, s in parts:
            if s.start != pos:
                raise PlanError(f"sequence {seq}: tokens [{pos}, {s.start}) are missing or repeated")
            pos = s.end
            if s.length <= 0:
                raise PlanError(f"sequence {seq}: empty slice in chunk {ci}")
        if pos != n:
            raise PlanError(f"sequence {seq}: covers {pos} of {n} tokens")
        chunk_ids = [ci for ci, _ in parts]
        seq_chunks.append(chunk_ids)
        if chunk_ids != sorted(chunk_ids) or len(set(chunk_ids)) != len(chunk_ids):
            raise PlanError(f"sequence {seq}: slices are not in increasing chunk order")
        if len({chunk_group[ci] for ci in chunk_ids}) > 1:
            raise PlanError(f"sequence {seq} is split across pipeline groups")
    # schedule
    if len(plan.schedule) != p:
        raise PlanError(f"schedule has {len(plan.schedule)} stages, layout has {p}")
    # position of each (sequence, chunk) in the sequence's chain of chunks
    chain_pos = {(seq, ci): k for seq, chain in enumerate(seq_chunks) for k, ci in enumerate(chain)}
    # segment-level training with gradient "none": no gradient crosses a slice boundary
    chained = plan.knob("segment_gradient") != "none"
    for st, actions in enumerate(plan.schedule):
        fdone: set[int] = set()
        bdone: set[int] = set()
        for a in actions:
            if a.stage != st:
                raise PlanError(f"action {a} listed under stage {st}")
            if not a.kind.is_compute:
                raise PlanError(f"action {a} in the schedule: a plan lists forwards and backwards only "
                                "(lower(plan) adds the sends and receives)")
            if not 0 <= a.chunk < plan.num_chunks:
                raise PlanError(f"action {a} names a chunk that does not exist")
            done = fdone if a.kind is ActionKind.FORWARD else bdone
            if a.chunk in done:
                raise PlanError(f"action {a} appears twice")
            if a.kind is ActionKind.BACKWARD and a.chunk not in fdone:
                raise PlanError(f"action {a} runs before its forward")
            for s in plan.chunks[a.chunk].slices:
                chain = seq_chunks[s.seq]
                k = chain_pos[(s.seq, a.chunk)]
                if a.kind is ActionKind.FORWARD and k > 0 and chain[k - 1] not in fdone:
                    raise PlanError(f"action {a}: earlier slice (chunk {chain[k-1]}) not forwarded yet")
                if (a.kind is ActionKind.BACKWARD and k + 1 < len(chain) and chain[k + 1] not in bdone
                        and chained):
                    raise PlanError(f"action {a}: later slice (chunk {chain[k+1]}) not backwarded yet")
            done.add(a.chunk)
        if len(fdone) != plan.num_chunks or len(bdone) != plan.num_chunks:
            raise PlanError(f"stage {st} does not run every chunk forward and backward once")
    # a stage's messages to its neighbour match in issue order (NCCL ignores tags)
    for st in range(p - 1):
        for kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
            a = [x.chunk for x in plan.schedule[st] if x.kind is kind]
            b = [x.chunk for x in plan.schedule[st + 1] if x.kind is kind]
            if a != b:
                i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                raise PlanError(
                    f"stages {st} and {st + 1} run the {kind.name.lower()} passes of the chunks in different "
                    f"orders: at position {i} chunk {a[i]} on stage {st} but chunk {b[i]} on stage {st + 1} "
                    f"({a} vs {b}); their messages would not match"
                )
    if len(plan.recompute) != p or any(len(r) != plan.num_chunks for r in plan.recompute):
        raise PlanError("recompute must be [stage][chunk]")
    for st, row in enumerate(plan.recompute):
        n = lay.num_stage_layers(st)
        for ci, r in enumerate(row):
            if not 0 <= r <= n:
                raise PlanError(f"recompute[{st}][{ci}] = {r} outside 0..{n}")
    if plan.memory_budget_bytes and len(plan.memory_budget_bytes) != p:
        raise PlanError("memory_budget_bytes must have one entry per stage")
    if any(c.placement for c in plan.chunks):
        validate_placements(plan)
    lanes = int(plan.knob("data_parallel", 1))
    if lanes > 1:  # the groups are rounds run at once on `lanes` groups of GPUs (simulate.py)
        if p != 1:
            raise PlanError(f"knob data_parallel={lanes} needs a plan of one stage, not {p}")
        wide = next((g for g in plan.groups if len(g) > lanes), None)
        if wide is not None:
            raise PlanError(f"a round of {len(wide)} chunks {list(wide)} on data_parallel={lanes} groups of GPUs")


def validate_placements(plan: Any) -> None:
    """Placements as data (:mod:`.sharding`; the ranks against ``sp``:
    :func:`~.sharding.plan_placement_refusal`): one entry per slice, each a rank or ``-1``
    (per-doc); a split sequence's slices all Ulysses or all placed, each per-doc slice after
    per-doc ones only, a whole-doc slice after per-doc ones or ones on its own rank (the K/V
    carried from slice to slice must be where the next one attends)."""
    where: dict[int, list[tuple[int, int | None]]] = {}
    for c in plan.chunks:
        if c.placement and len(c.placement) != len(c.slices):
            raise PlanError(f"chunk {c.index}: {len(c.placement)} placements for {len(c.slices)} slices")
        if any(w < -1 for w in c.placement):
            raise PlanError(f"chunk {c.index}: placement {list(c.placement)} holds an entry below -1 (per-doc)")
        for i, sl in enumerate(c.slices):
            if sl.length != plan.seq_lens[sl.seq]:
                where.setdefault(sl.seq, []).append((sl.start, c.placement[i] if c.placement else None))
    for seq, items in sorted(where.items()):
        items.sort()
        if len({w is None for _, w in items}) > 1:
            raise PlanError(f"sequence {seq} has slices run by Ulysses and slices placed whole-doc / per-doc; "
                            "their carried K/V are laid out differently (heads vs tokens)")
        for (_, before), (start, w) in zip(items, items[1:]):
            if w is None or w == before or before == -1:
                continue
            raise PlanError(f"sequence {seq}: the slice at token {start} is placed "
                            f"{'per-doc' if w == -1 else f'on rank {w}'} but the earlier slice's K/V live on "
                            f"rank {before} only")
