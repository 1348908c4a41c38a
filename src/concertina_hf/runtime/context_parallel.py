"""Document-aware context parallelism inside one pipeline stage (FlashCP's whole-doc / per-doc).

A chunk with a :attr:`~concertina_hf.planning.types.Chunk.placement` runs on the stage's ``sp``
ranks with every rank holding exactly the tokens of
:func:`~concertina_hf.planning.sharding.rank_pieces` (its *pieces*, in that order): the embedding,
norms, MLPs, LM head and loss run on them, each token at its own position in its sequence (so
rotary embeddings, windows and targets are the single-device ones). Attention, per layer
(:meth:`ContextParallelContext.sequence_parallel_attention`, the hook the concertina attention
calls, as Ulysses' is):

- a **whole-doc** slice lies on one rank: its queries attend to its own keys plus the K/V its
  sequence's earlier slices left in that rank's :class:`~.attention.KVStore`; nothing is sent;
- a **per-doc** slice is cut into ``2 sp`` zig-zag pieces (rank ``r``: pieces ``r`` and ``2 sp - 1
  - r``): the K/V of every per-doc piece of the chunk are all-gathered within the stage in one
  collective per layer (:func:`gather_rows`: autograd, the backward a reduce-scatter of dK/dV;
  padded to the largest rank's rows, as gloo needs equal sizes), the slice's keys rebuilt in
  position order on every rank, and each local query piece attends causally, by position, to the
  keys before and at it (plus the carried K/V of earlier slices).

Each local piece is a *segment* of an inner :class:`~.attention.ChunkAttentionContext`
(:class:`_PieceContext`: a piece at positions ``[a, b)`` of a slice starting at ``S0`` has the
prefix ``[carried K/V of positions < S0, gathered keys of [S0, a)]`` and its own local keys), so
every attention kernel of the backend (CPU flash, varlen, per-segment SDPA, the eager formula for
sinks and soft-capping), any number of query and K/V heads, and MLA's distinct value head size run
unchanged: there is no head-count rule.

K/V carried to later slices (non-final slices): a whole-doc slice's own K/V on its rank; a per-doc
slice's *gathered* K/V (the whole slice, every head) on every rank of the stage, so a later slice
of the sequence may be per-doc, or whole-doc on any rank. Memory: ``sp`` times the local share of
that slice's K/V per rank until its backward. A whole-doc slice's successor must therefore be on
the same rank (its K/V exist nowhere else) and no per-doc slice may follow a whole-doc one
(:meth:`Plan.validate <concertina_hf.planning.types.Plan.validate>` refuses both).

A rank holding no token of a chunk (a whole-doc chunk of fewer sequences than ranks; a chunk with
a per-doc slice has tokens on every rank) runs the chunk's layers on one pad token
(:data:`EMPTY_RANK_TOKENS`: position 0, no target, a zero attention output), since HF's layers
cannot run on none and the rank takes part in whatever collectives its layers and the step run
(FSDP's weight gathers under ``concertina_shard_parameters``, the logits gather, the loss and
gradient reductions); its gradients are zeros. It exchanges no message for that chunk with the
neighbouring stages (:func:`~concertina_hf.planning.lower.rank_program`, from the plan on both
ends); a later stage's rank starts the chunk from zeros.

Collective order: every rank runs one all-gather per layer and chunk with per-doc slices (same
layers, same order; recompute replays the first ``r`` layers of the stage on every rank alike), and
the backward's reduce-scatters are each layer's single gather node, ordered by the layers.

Costs per layer and chunk with per-doc slices: forward one all-gather of ``(sp - 1) / sp`` of the
per-doc slices' K/V (``tokens x K x (D_k + D_v)``), backward one reduce-scatter of the same size;
whole-doc slices move nothing. Evaluation hooks get the chunk's whole logits gathered in token
order (:meth:`ContextParallelContext.gather_tokens`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..planning.sharding import PER_DOC, Piece, rank_pieces
from ..planning.types import Chunk
from .attention import ChunkAttentionContext, KVStore, SliceSpec, autocast_dtype

__all__ = ["EMPTY_RANK_TOKENS", "ContextParallelContext", "gather_rows", "piece_order"]

#: the pad tokens a rank holding no token of a placed chunk runs the chunk's layers on
EMPTY_RANK_TOKENS = 1


# ---------------------------------------------------------------------- the collective
class _GatherRows(torch.autograd.Function):
    """Every rank's ``[n_r, w]`` rows, stacked padded as ``[sp, max n, w]``; backward: the
    reduce-scatter of the gradient (rank ``r`` gets the sum over ranks of block ``r``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: tuple[int, ...], rank: int, group: Any) -> torch.Tensor:
        ctx.rows, ctx.rank, ctx.group = rows, rank, group
        m = max(rows)
        x = x.contiguous()
        if x.shape[0] < m:
            x = torch.cat([x, x.new_zeros((m - x.shape[0], x.shape[1]))])
        parts = [torch.empty_like(x) for _ in rows]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad[0])
        dist.reduce_scatter(out, list(grad.contiguous().unbind(0)), group=ctx.group)
        return out[:ctx.rows[ctx.rank]], None, None, None


def gather_rows(x: torch.Tensor, rows: Sequence[int], rank: int, group: Any) -> torch.Tensor:
    """All-gather ``x`` ``[rows[rank], w]`` from every rank of ``group`` -> ``[sp, max(rows), w]``
    (block ``j``: rank ``j``'s rows, zero-padded). Differentiable (backward: reduce-scatter)."""
    if x.shape[0] != rows[rank]:
        raise ValueError(f"rank {rank} gathers {x.shape[0]} rows, the plan says {rows[rank]}")
    return _GatherRows.apply(x, tuple(int(r) for r in rows), int(rank), group)


# ---------------------------------------------------------------------- layout
def piece_order(sp: int) -> list[tuple[int, int]]:
    """For the zig-zag pieces ``j = 0 .. 2 sp - 1`` of a per-doc slice: ``(rank, which)``, the rank
    holding it and whether it is that rank's first (0) or second (1) piece of the slice.

    >>> piece_order(2)
    [(0, 0), (1, 0), (1, 1), (0, 1)]
    """
    return [(j, 0) if j < sp else (2 * sp - 1 - j, 1) for j in range(2 * sp)]


# ---------------------------------------------------------------------- the contexts
class _PieceStore:
    """The chunk's :class:`~.attention.KVStore` as the pieces read it: the keys before a piece are
    the carried K/V before its slice, then (per-doc) the slice's gathered keys before the piece;
    everything else is the store's."""

    def __init__(self, store: KVStore, ctx: "_PieceContext") -> None:
        # a weak reference: the context holds this store, and a cycle would keep the context
        # (and what it references) alive after the chunk's backward until a garbage collection
        self._store, self._ctx = store, weakref.proxy(ctx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def prefix_parts(self, seq: int, context: int, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        i, slice_start, per_doc = self._ctx.info_at[(seq, context)]
        parts = self._store.prefix_parts(seq, slice_start, layer) if slice_start > 0 else []
        if per_doc and context > slice_start:
            k, v = self._ctx.gathered[layer][i]
            parts = parts + [(k[:, :, :context - slice_start], v[:, :, :context - slice_start])]
        return parts


class _PieceContext(ChunkAttentionContext):
    """The local pieces as segments (``SliceSpec`` per piece, ``start`` its position in the
    sequence), reading earlier keys through :class:`_PieceStore`; non-final slices store their own
    (whole-doc) or gathered (per-doc) K/V under the slice's start."""

    def __init__(self, specs: Sequence[SliceSpec], info: Sequence[tuple[int, int, bool]], store: KVStore,
                 device: torch.device, requires_grad: bool) -> None:
        super().__init__(specs, _PieceStore(store, self), device, requires_grad)
        self.info = tuple(info)  # per piece: (slice index, slice start, per-doc)
        self.info_at = {(s.seq, s.start): x for s, x in zip(self.slices, self.info)}
        self.gathered: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> slice -> (K, V)

    def store_own(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        for s, (i, slice_start, per_doc) in zip(self.slices, self.info):
            if s.final:
                continue
            if per_doc:
                k, v = self.gathered[layer][i]
            else:
                k, v = key[:, :, s.offset:s.offset + s.length], value[:, :, s.offset:s.offset + s.length]
            self.store.put_if_absent(s.seq, slice_start, layer, k, v, self.requires_grad)


class ContextParallelContext:
    """What the decoder layers get as ``concertina_ctx`` for a placed chunk on a stage of ``sp``
    ranks (see the module docstring): ``pieces`` (this rank's tokens as ``SliceSpec``, ``start``
    the position in the sequence, ``offset`` the local offset), their ``position_ids`` and the
    attention hook. ``slices``: the chunk's slices (chunk offsets), ``sp``: the stage's
    :class:`~.ulysses.SequenceParallel`."""

    def __init__(self, chunk: Chunk, slices: Sequence[SliceSpec], store: KVStore, device: torch.device,
                 requires_grad: bool, sp: Any) -> None:
        self.chunk, self.sp = chunk, sp
        self.slices = tuple(slices)
        size, rank = sp.size, sp.rank
        self.all_pieces: list[tuple[Piece, ...]] = [rank_pieces(chunk, size, r) for r in range(size)]
        specs, info, off = [], [], 0
        for p in self.all_pieces[rank]:
            sl = self.slices[p.slice_index]
            specs.append(SliceSpec(p.seq, p.start, p.length, off, sl.final))
            info.append((p.slice_index, sl.start, chunk.placement[p.slice_index] == PER_DOC))
            off += p.length
        self.pieces = tuple(specs)
        self.inner = _PieceContext(specs, info, store, device, requires_grad)
        # a rank holding no token of the chunk runs its layers on one pad token (HF's layers cannot
        # run on none), which attends to nothing, has no target and is sent nowhere
        self.pad = 0 if off else EMPTY_RANK_TOKENS
        self.num_tokens = self.local_tokens = off + self.pad
        self.position_ids = self.inner.position_ids if off else torch.zeros((1, self.pad), dtype=torch.long,
                                                                             device=device)
        self.per_doc = [i for i, w in enumerate(chunk.placement) if w == PER_DOC]
        # rows each rank contributes to the per-layer gather (its per-doc pieces' tokens)
        self.gather_rows = [sum(p.length for p in ps if chunk.placement[p.slice_index] == PER_DOC)
                            for ps in self.all_pieces]

    # ------------------------------------------------------------------ attention
    def sequence_parallel_attention(self, forward: Callable, module: Any, query: torch.Tensor,
                                    key: torch.Tensor, value: torch.Tensor, sink: Any = None, **kwargs: Any):
        """``query`` [1, H, t, D], ``key``/``value`` [1, K, t, D] / [1, K, t, Dv] of the local tokens
        -> the attention output [1, t, H, Dv] of the local tokens."""
        if query.shape[2] != self.local_tokens:
            raise ValueError(f"context-parallel attention expects {self.local_tokens} local tokens, "
                             f"got query {tuple(query.shape)}")
        layer = getattr(module, "layer_idx", None)
        amp = autocast_dtype(query.device.type)
        if amp is not None:  # cast as the attention does before storing, so the gathered K/V match
            query, key, value = (_cast(t, amp) for t in (query, key, value))
        if self.per_doc:
            self.inner.gathered[layer] = self._gather(key, value)
        try:
            if self.pad:  # an empty rank's pad token: nothing to attend to
                return _pad_attention(query, key, value, sink), None
            return forward(module, query, key, value, concertina_ctx=self.inner, s_aux=sink, **kwargs)
        finally:
            # read only inside this call (the pieces' prefixes, the store of non-final slices, which
            # keeps its own reference); kept past it, the gathered K/V and, through their autograd
            # history, a recomputed layer's replay would live as long as the chunk's context
            self.inner.gathered.pop(layer, None)

    def _gather(self, key: torch.Tensor, value: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The per-doc slices' keys and values ``[1, K, length, D]`` in position order, from the
        pieces of every rank (one all-gather)."""
        sp, rank = self.sp.size, self.sp.rank
        kh, dk, dv = key.shape[1], key.shape[3], value.shape[3]
        rows_k = key[0].transpose(0, 1).reshape(key.shape[2], kh * dk)  # [t, K * D]
        rows_v = value[0].transpose(0, 1).reshape(value.shape[2], kh * dv)
        own = [torch.cat([rows_k[s.offset:s.offset + s.length], rows_v[s.offset:s.offset + s.length]], dim=1)
               for s, (_, _, per_doc) in zip(self.pieces, self.inner.info) if per_doc]
        x = own[0] if len(own) == 1 else torch.cat(own) if own else rows_k.new_zeros((0, kh * (dk + dv)))
        blocks = gather_rows(x, self.gather_rows, rank, self.sp.group)  # [sp, max rows, w]
        # where each rank's pieces of each per-doc slice lie in its block
        at: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (rank, slice) -> [(row, length)] in order
        for r, ps in enumerate(self.all_pieces):
            row = 0
            for p in ps:
                if self.chunk.placement[p.slice_index] == PER_DOC:
                    at.setdefault((r, p.slice_index), []).append((row, p.length))
                    row += p.length
        out = {}
        for i in self.per_doc:
            parts = []
            for r, which in piece_order(sp):
                row, n = at[(r, i)][which]
                parts.append(blocks[r, row:row + n])
            full = torch.cat(parts)  # [length, K * (Dk + Dv)]
            n = full.shape[0]
            k = full[:, :kh * dk].reshape(n, kh, dk).transpose(0, 1).unsqueeze(0)
            v = full[:, kh * dk:].reshape(n, kh, dv).transpose(0, 1).unsqueeze(0)
            out[i] = (k, v)
        return out

    # ------------------------------------------------------------------ evaluation
    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The chunk's ``[1, T, ...]`` in chunk token order from every rank's local ``x`` ``[1, t,
        ...]`` (collective over the group, padded to the largest rank's tokens)."""
        sp = self.sp.size
        counts = [sum(p.length for p in ps) for ps in self.all_pieces]
        m = max(counts)
        x = x.contiguous()
        if x.shape[1] < m:
            x = torch.cat([x, x.new_zeros((1, m - x.shape[1], *x.shape[2:]))], dim=1)
        parts = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(parts, x, group=self.sp.group)
        out = x.new_empty((1, sum(s.length for s in self.slices), *x.shape[2:]))
        for r, ps in enumerate(self.all_pieces):
            row = 0
            for p in ps:
                sl = self.slices[p.slice_index]
                at = sl.offset + p.start - sl.start
                out[:, at:at + p.length] = parts[r][:, row:row + p.length]
                row += p.length
        return out


def _pad_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sink: Any) -> torch.Tensor:
    """The attention output ``[1, t, H, Dv]`` (zeros) of a rank's pad tokens, still a function of
    query, key, value and the sinks, so that every parameter gets a gradient (zeros: the pad
    token has no target) on every rank, as FSDP's reduce-scatter needs."""
    out = value.new_zeros((1, query.shape[2], query.shape[1], value.shape[3]))
    for t in (query, key, value, sink if isinstance(sink, torch.Tensor) else None):
        if t is not None:
            out = out + t.sum().to(out.dtype) * 0
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # autocast's rule for its lower-precision ops: floating tensors except float64
    if t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype:
        return t.to(dtype)
    return t
