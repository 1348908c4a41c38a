"""Where a chunk's tokens live on the ``sp`` ranks of a pipeline stage.

Three modes, recorded per chunk in :attr:`~.types.Chunk.placement` (one entry per slice):

- **Ulysses** (``placement == ()``, the default): every rank holds ``ceil(T / sp)`` consecutive
  tokens of the chunk and attention runs over all tokens after an all-to-all by heads
  (:mod:`concertina_hf.runtime.ulysses`).
- **whole-doc** (entry ``r`` in ``0 .. sp-1``): the slice lies entirely on rank ``r``; its
  attention needs nothing from the other ranks.
- **per-doc** (entry :data:`PER_DOC`): the slice is cut into ``2 sp`` pieces at
  :func:`zigzag_bounds`, rank ``r`` holding pieces ``r`` and ``2 sp - 1 - r`` (so causal work
  balances); its K/V are all-gathered within the stage for attention.

Every rank's local tokens are the pieces :func:`rank_pieces` lists, in that order (the chunk's
slice order; a per-doc slice's two pieces in position order). A rank may hold none (a whole-doc
chunk of fewer sequences than ranks, e.g. one sequence shorter than ``2 sp``): the runtime runs
the chunk's layers there on a pad token, taking part in the stage's collectives, and exchanges no
message for it with the neighbouring stages (:func:`~.lower.rank_program`). Pure Python; planner,
lowering and runtime all read the layout from here.
"""

from __future__ import annotations

from typing import NamedTuple

from .plan import Plan
from .types import Chunk, PlanError, Slice

PER_DOC = -1
#: the pad tokens a rank holding no token of a placed chunk runs the chunk's layers on (the
#: runtime: :mod:`concertina_hf.runtime.context_parallel`; the cost model counts their memory)
EMPTY_RANK_TOKENS = 1
MODES = ("ulysses", "whole-doc", "per-doc", "mixed")


class Piece(NamedTuple):
    """Tokens ``[start, start + length)`` of sequence ``seq``, from slice ``slice_index`` of the chunk."""

    slice_index: int
    seq: int
    start: int
    length: int


def zigzag_bounds(length: int, sp: int) -> tuple[int, ...]:
    """The ``2 sp + 1`` offsets (within a slice of ``length`` tokens) that cut it into ``2 sp`` pieces.

    >>> zigzag_bounds(10, 2)
    (0, 2, 5, 7, 10)
    """
    n = 2 * sp
    return tuple(j * length // n for j in range(n + 1))


def chunk_mode(chunk: Chunk) -> str:
    """``ulysses``, ``whole-doc``, ``per-doc`` or ``mixed`` (whole-doc and per-doc slices)."""
    if not chunk.placement:
        return "ulysses"
    per_doc = sum(1 for r in chunk.placement if r == PER_DOC)
    if per_doc == 0:
        return "whole-doc"
    return "per-doc" if per_doc == len(chunk.placement) else "mixed"


def rank_pieces(chunk: Chunk, sp: int, rank: int) -> tuple[Piece, ...]:
    """The tokens rank ``rank`` of the stage holds of a whole-doc / per-doc chunk, in local order."""
    if not chunk.placement:
        raise ValueError(f"chunk {chunk.index} is a Ulysses chunk: its tokens are split evenly, not by piece")
    out: list[Piece] = []
    for i, (sl, where) in enumerate(zip(chunk.slices, chunk.placement)):
        if where == rank:
            out.append(Piece(i, sl.seq, sl.start, sl.length))
        elif where == PER_DOC:
            b = zigzag_bounds(sl.length, sp)
            for j in (rank, 2 * sp - 1 - rank):
                out.append(Piece(i, sl.seq, sl.start + b[j], b[j + 1] - b[j]))
    return tuple(out)


def rank_tokens(chunk: Chunk, sp: int, rank: int) -> int:
    """Tokens rank ``rank`` holds of the chunk (Ulysses: ``ceil(T / sp)``, padding included)."""
    if not chunk.placement:
        return -(-chunk.num_tokens // sp)
    return sum(p.length for p in rank_pieces(chunk, sp, rank))


def earlier_slices(plan: Plan, chunk: Chunk) -> dict[int, tuple[tuple[Slice, bool], ...]]:
    """For each sequence of which ``chunk`` holds a slice after its first: the sequence's slices
    before that one, in token order, each with whether it is per-doc (its K/V then lie sharded
    over the stage's ranks, each rank its two pieces, and the chunk's per-layer gather rebuilds
    them; a whole-doc one's lie whole on its rank)."""
    def per_doc(c: Chunk, e: Slice) -> bool:
        return bool(c.placement) and c.placement[c.slices.index(e)] == PER_DOC

    return {sl.seq: tuple((e, per_doc(plan.chunks[ci], e)) for ci, e in plan.slices_of(sl.seq) if e.start < sl.start)
            for sl in chunk.slices if sl.start > 0}


def shard_rows(length: int, sp: int, rank: int) -> int:
    """Tokens rank ``rank`` holds of a per-doc slice of ``length`` tokens (its two zig-zag pieces)."""
    b = zigzag_bounds(length, sp)
    return b[rank + 1] - b[rank] + b[2 * sp - rank] - b[2 * sp - 1 - rank]


def placement_refusal(chunk: Chunk, sp: int) -> str | None:
    """Why ``chunk.placement`` cannot run on a stage of ``sp`` ranks, or ``None``.

    One entry per slice, each a rank or :data:`PER_DOC`; a per-doc slice has at least ``2 sp``
    tokens (no empty piece). A rank may hold no token (module docstring).
    """
    if not chunk.placement:
        return None
    if len(chunk.placement) != len(chunk.slices):
        return f"chunk {chunk.index}: {len(chunk.placement)} placements for {len(chunk.slices)} slices"
    for sl, where in zip(chunk.slices, chunk.placement):
        if where != PER_DOC and not 0 <= where < sp:
            return f"chunk {chunk.index}: slice of sequence {sl.seq} placed on rank {where}, not in 0..{sp - 1}"
        if where == PER_DOC and sl.length < 2 * sp:
            return (f"chunk {chunk.index}: per-doc slice of sequence {sl.seq} has {sl.length} tokens, "
                    f"fewer than 2 x sp = {2 * sp}")
    return None


def plan_placement_refusal(plan: Plan, sp: int) -> str | None:
    """Why ``plan``'s placements cannot run on stages of ``sp`` ranks, or ``None``: the first
    chunk's :func:`placement_refusal`, or a split sequence placed inconsistently
    (:meth:`~.plan.Plan.validate_placements`: its carried K/V must be where the next slice
    attends)."""
    if not any(c.placement for c in plan.chunks):
        return None
    for c in plan.chunks:
        why = placement_refusal(c, sp)
        if why is not None:
            return why
    try:
        plan.validate_placements()
    except PlanError as e:
        return str(e)
    return None


def ulysses_heads_refusal(num_heads: int, num_kv_heads: int, sp: int) -> str | None:
    """Why the runtime's Ulysses attention cannot split ``num_heads`` query and ``num_kv_heads``
    K/V heads over ``sp`` GPUs, or ``None`` when it can (the rule of ``runtime.ulysses.check_heads``:
    ``sp`` divides the heads, and divides the K/V heads or is a multiple of them).

    >>> ulysses_heads_refusal(40, 40, 8) is None, ulysses_heads_refusal(32, 8, 16) is None
    (True, True)
    >>> ulysses_heads_refusal(40, 40, 16)
    'sp=16 does not divide the 40 attention heads (Ulysses gives each GPU whole heads)'
    """
    if sp <= 1 or not num_heads:
        return None
    if num_heads % sp:
        return f"sp={sp} does not divide the {num_heads} attention heads (Ulysses gives each GPU whole heads)"
    kv = num_kv_heads or num_heads
    if kv % sp and sp % kv:
        return (f"sp={sp} and the {kv} K/V heads: neither divides the other (K/V heads are split over the GPUs, "
                "or replicated when fewer)")
    return None
