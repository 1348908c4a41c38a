"""1F1B over heterogeneous chunks, pipeline group by pipeline group.

Within a group the forward order is the chunk order. The backward order is the same except
that the chunks of each split sequence are reversed in place (its slices run backward from the
last to the first, because an earlier slice's K/V gradient is complete only after every later
slice's backward). Stage ``s`` of ``p`` runs, before the backward of the ``i``-th chunk ``b_i``
of the backward order, the forwards of all chunks up to ``max_{j<=i} pos(b_j) + (p - s - 1)``
in forward order: with no split sequence this is textbook 1F1B (``p - s`` warm-up forwards,
then one forward / one backward), and a sequence of ``n`` chunks raises the in-flight window
to ``p - s - 1 + n`` chunks. Groups run back to back (fill and drain each).

``prefetch=True`` replaces ``max_{j<=i} pos(b_j)`` by its look-ahead envelope
``max_{j>=i} (max_{k<=j} pos(b_k) - (j - i))``: a stage forwards the next split chain one
backward earlier per chunk of the chain, so the stage below, which must forward the whole chain
before its first backward, never waits for chunks its neighbour holds back behind backwards
(without it every split chain costs about one backward of idle time per stage). The in-flight
maximum stays ``p - s - 1 + n``; with no split sequence the two rules coincide.

``extra_warmup=k`` lets every stage but the last run ``k`` more forwards ahead of each backward
(``k`` more chunks in flight there, memory the simulator charges): in 1F1B a stage waits, after
its warm-up, for the first backward to come back through every later stage (their forward and
backward of the first chunk), and in the steady state a stage whose next forward sits behind a
backward it waits for starves the stage below. One forward more fills most of that
(``plan_adaptive`` adds one at a time while it simulates faster within the budgets).
"""

from __future__ import annotations

from typing import Sequence

from .types import Action, ActionKind, Chunk

__all__ = ["backward_order", "build_schedule"]


def backward_order(chunks: Sequence[Chunk], group: Sequence[int], chained: bool = True) -> list[int]:
    """The group's chunks in backward order: forward order, each split chain reversed in place
    (``chained=False``: forward order; segment-level training with ``gradient="none"``, whose
    slices send no gradient to earlier slices)."""
    if not chained:
        return list(group)
    chain_of: dict[int, list[int]] = {}
    for ci in group:
        seq = chunks[ci].split_seq
        if seq is not None:
            chain_of.setdefault(seq, []).append(ci)
    order = list(group)
    pos = {ci: k for k, ci in enumerate(group)}
    for chain in chain_of.values():
        slots = sorted(pos[ci] for ci in chain)
        for slot, ci in zip(slots, reversed(chain)):
            order[slot] = ci
    return order


def build_schedule(chunks: Sequence[Chunk], groups: Sequence[Sequence[int]], num_stages: int,
                   *, prefetch: bool = False, extra_warmup: int = 0,
                   chained: bool = True) -> tuple[tuple[Action, ...], ...]:
    """Per-stage action lists for groups run back to back (see the module docstring);
    ``chained=False``: split chains are not reversed (:func:`backward_order`), textbook 1F1B."""
    if extra_warmup < 0:
        raise ValueError(f"extra_warmup must be >= 0, got {extra_warmup}")
    p = num_stages
    stages: list[list[Action]] = [[] for _ in range(p)]
    for group in groups:
        fwd = list(group)
        bwd = backward_order(chunks, group, chained)
        pos = {ci: k for k, ci in enumerate(fwd)}
        needs, need = [], -1
        for b in bwd:
            need = max(need, pos[b])
            needs.append(need)
        if prefetch:
            for i in range(len(needs) - 2, -1, -1):
                needs[i] = max(needs[i], needs[i + 1] - 1)
        for s in range(p):
            acts = stages[s]
            done = 0
            for b, need in zip(bwd, needs):
                target = min(len(fwd), need + 1 + (p - s - 1) + (extra_warmup if s < p - 1 else 0))
                while done < target:
                    acts.append(Action(s, ActionKind.FORWARD, fwd[done]))
                    done += 1
                acts.append(Action(s, ActionKind.BACKWARD, b))
    return tuple(tuple(a) for a in stages)
