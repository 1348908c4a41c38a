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
  - r``): the K/V of every per-doc piece of the chunk (and the shards of the per-doc slices
  before them, below) are all-gathered within the stage in one collective per layer
  (:func:`gather_rows`: autograd, the backward a reduce-scatter of dK/dV; padded to the largest
  rank's rows, as gloo needs equal sizes), the slices' keys rebuilt in position order on every
  rank, and each local query piece attends causally, by position, to the keys before and at it
  (plus the K/V of earlier slices).

Each local piece is a *segment* of an inner :class:`~.attention.ChunkAttentionContext`
(:class:`_PieceContext`: a piece at positions ``[a, b)`` of a slice starting at ``S0`` has the
prefix ``[carried K/V of positions < S0, gathered keys of [S0, a)]`` and its own local keys), so
every attention kernel of the backend (CPU flash, varlen, per-segment SDPA, the eager formula for
sinks and soft-capping), any number of query and K/V heads, and MLA's distinct value head size run
unchanged: there is no head-count rule.

K/V carried to later slices (non-final slices), in the rank's :class:`~.attention.KVStore` under
the slice's start: a whole-doc slice's K/V on its rank; a per-doc slice's **shard**, the rank's
own two pieces (``1 / sp`` of the slice's K/V per rank, not the gathered whole). A later slice of
the sequence reads a whole-doc predecessor from its own rank's store (so it is whole-doc on that
rank) and per-doc predecessors through the gather: every layer of a chunk holding such a slice
gathers, besides its per-doc pieces, every rank's shard of those earlier slices
(:func:`~concertina_hf.planning.sharding.earlier_slices`, from the plan) in the same collective,
and the backward's reduce-scatter returns each rank its shard's gradient (into the leaf the
store's entry holds, which the earlier slice's own backward then takes). So a per-doc chain may
end in a whole-doc slice on any rank; no per-doc slice may follow a whole-doc one, and a
whole-doc slice after whole-doc ones stays on their rank (:meth:`Plan.validate
<concertina_hf.planning.plan.Plan.validate>` refuses the rest). A rank whose attention reads
nothing it gathered (the whole-doc tail is on another rank) ties its output to the gathered
tensor (times 0), so its backward's reduce-scatter runs as everyone's does.

A rank holding no token of a chunk (a whole-doc chunk of fewer sequences than ranks; a chunk with
a per-doc slice has tokens on every rank) runs the chunk's layers on one pad token
(:data:`EMPTY_RANK_TOKENS`: position 0, no target, a zero attention output), since HF's layers
cannot run on none and the rank takes part in whatever collectives its layers and the step run
(FSDP's weight gathers under ``concertina_shard_parameters``, the logits gather, the loss and
gradient reductions); its gradients are zeros. It exchanges no message for that chunk with the
neighbouring stages (:func:`~concertina_hf.planning.lower.rank_program`, from the plan on both
ends); a later stage's rank starts the chunk from zeros.

Collective order: every rank runs one all-gather per layer and chunk with per-doc slices or
per-doc predecessors (same layers, same order; recompute replays the first ``r`` layers of the
stage on every rank alike), and the backward's reduce-scatters are each layer's single gather
node, ordered by the layers.

Costs per layer and chunk with per-doc slices: forward one all-gather of ``(sp - 1) / sp`` of the
K/V of the per-doc slices and of their sequences' per-doc predecessors (``tokens x K x (D_k +
D_v)``), backward one reduce-scatter of the same size; whole-doc slices move nothing. Evaluation
hooks get the chunk's whole logits gathered in token order
(:meth:`ContextParallelContext.gather_tokens`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..planning.sharding import EMPTY_RANK_TOKENS, PER_DOC, Piece, rank_pieces, shard_rows, zigzag_bounds
from ..planning.types import Chunk, Slice
from .attention import ChunkAttentionContext, KVStore, SliceSpec, autocast_dtype

__all__ = ["EMPTY_RANK_TOKENS", "ContextParallelContext", "gather_rows", "piece_order"]


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
    its sequence's earlier slices' (per-doc ones as this layer's gather rebuilt them from every
    rank's shard, whole-doc ones from the store), then (per-doc) the slice's gathered keys before
    the piece; everything else is the store's."""

    def __init__(self, store: KVStore, ctx: "_PieceContext") -> None:
        # a weak reference: the context holds this store, and a cycle would keep the context
        # (and what it references) alive after the chunk's backward until a garbage collection
        self._store, self._ctx = store, weakref.proxy(ctx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def prefix_parts(self, seq: int, context: int, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        slice_start, per_doc = self._ctx.info_at[(seq, context)]
        gathered = self._ctx.gathered.get(layer, {})
        parts = []
        for sl, sharded in self._ctx.earlier.get(seq, ()):
            kv = gathered.get((seq, sl.start)) if sharded else self._store.leaves(seq, sl.start, layer)
            if kv is None:
                raise RuntimeError(f"K/V of sequence {seq} at tokens [{sl.start}, {sl.end}) on layer {layer} is "
                                   "missing: an earlier slice did not run forward on this stage first")
            parts.append(kv)
        if per_doc and context > slice_start:
            k, v = gathered[(seq, slice_start)]
            parts.append((k[:, :, :context - slice_start], v[:, :, :context - slice_start]))
        return parts


class _PieceContext(ChunkAttentionContext):
    """The local pieces as segments (``SliceSpec`` per piece, ``start`` its position in the
    sequence), reading earlier keys through :class:`_PieceStore`; non-final slices store this
    rank's K/V of them (whole-doc: the slice; per-doc: its two pieces, adjacent locally) under the
    slice's start."""

    def __init__(self, specs: Sequence[SliceSpec], info: Sequence[tuple[int, bool]], store: KVStore,
                 earlier: Mapping[int, tuple[tuple[Slice, bool], ...]], device: torch.device,
                 requires_grad: bool) -> None:
        super().__init__(specs, _PieceStore(store, self), device, requires_grad)
        self.info = tuple(info)  # per piece: (slice start, per-doc)
        self.info_at = {(s.seq, s.start): x for s, x in zip(self.slices, self.info)}
        self.earlier = earlier
        # layer -> (seq, slice start) -> (K, V): the slices this layer's gather rebuilt
        self.gathered: dict[int, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}

    def store_own(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        first: dict[tuple[int, int], int] = {}  # (seq, slice start) -> offset of its first local piece
        rows: dict[tuple[int, int], int] = {}
        for s, (slice_start, _) in zip(self.slices, self.info):
            if not s.final:
                first.setdefault((s.seq, slice_start), s.offset)
                rows[(s.seq, slice_start)] = rows.get((s.seq, slice_start), 0) + s.length
        for (seq, slice_start), off in first.items():
            n = rows[(seq, slice_start)]
            self.store.put_if_absent(seq, slice_start, layer, key[:, :, off:off + n], value[:, :, off:off + n],
                                     self.requires_grad)


class ContextParallelContext:
    """What the decoder layers get as ``concertina_ctx`` for a placed chunk on a stage of ``sp``
    ranks (see the module docstring): ``pieces`` (this rank's tokens as ``SliceSpec``, ``start``
    the position in the sequence, ``offset`` the local offset), their ``position_ids`` and the
    attention hook. ``slices``: the chunk's slices (chunk offsets), ``sp``: the stage's
    :class:`~.ulysses.SequenceParallel`, ``earlier``: the plan's
    :func:`~concertina_hf.planning.sharding.earlier_slices` of the chunk."""

    def __init__(self, chunk: Chunk, slices: Sequence[SliceSpec], store: KVStore, device: torch.device,
                 requires_grad: bool, sp: Any, earlier: Mapping[int, tuple[tuple[Slice, bool], ...]]) -> None:
        self.chunk, self.sp = chunk, sp
        self.slices = tuple(slices)
        size, rank = sp.size, sp.rank
        self.all_pieces: list[tuple[Piece, ...]] = [rank_pieces(chunk, size, r) for r in range(size)]
        specs, info, off = [], [], 0
        for p in self.all_pieces[rank]:
            sl = self.slices[p.slice_index]
            specs.append(SliceSpec(p.seq, p.start, p.length, off, sl.final))
            info.append((sl.start, chunk.placement[p.slice_index] == PER_DOC))
            off += p.length
        self.pieces = tuple(specs)
        self.inner = _PieceContext(specs, info, store, earlier, device, requires_grad)
        # a rank holding no token of the chunk runs its layers on one pad token (HF's layers cannot
        # run on none), which attends to nothing, has no target and is sent nowhere
        self.pad = 0 if off else EMPTY_RANK_TOKENS
        self.num_tokens = self.local_tokens = off + self.pad
        self.position_ids = self.inner.position_ids if off else torch.zeros((1, self.pad), dtype=torch.long,
                                                                             device=device)
        # what the per-layer gather rebuilds: the chunk's per-doc slices (their local pieces), then
        # the per-doc slices before its slices (each rank's shard, from its store); every rank
        # contributes its two pieces of each, so every rank gathers, whether or not it reads them
        carried = sorted({sl for items in earlier.values() for sl, sharded in items if sharded},
                         key=lambda sl: (sl.seq, sl.start))
        self.carried = tuple(carried)
        self.gathered_slices = tuple([sl for sl, w in zip(chunk.slices, chunk.placement) if w == PER_DOC] + carried)
        self.gather_rows = [sum(shard_rows(sl.length, size, r) for sl in self.gathered_slices) for r in range(size)]
        # whether this rank's attention reads what it gathers (else its output is tied to it, so
        # that its backward's reduce-scatter runs on every rank)
        self.reads_gather = any(per_doc for _, per_doc in info) or any(
            sharded for s in self.pieces for _, sharded in earlier.get(s.seq, ()))

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
        blocks = None
        if self.gathered_slices:
            self.inner.gathered[layer], blocks = self._gather(layer, key, value)
        try:
            if self.pad:  # an empty rank's pad token: nothing to attend to
                out = _pad_attention(query, key, value, sink, blocks), None
            else:
                out = forward(module, query, key, value, concertina_ctx=self.inner, s_aux=sink, **kwargs)
            if blocks is not None and not self.reads_gather and not self.pad:
                out = (out[0] + (blocks.sum() * 0).to(out[0].dtype), *out[1:])
            return out
        finally:
            # read only inside this call (the pieces' prefixes); kept past it, the gathered K/V
            # and, through their autograd history, a recomputed layer's replay would live as long
            # as the chunk's context
            self.inner.gathered.pop(layer, None)

    def _gather(self, layer: int, key: torch.Tensor, value: torch.Tensor
                ) -> tuple[dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The keys and values ``[1, K, length, D]`` in position order of :attr:`gathered_slices`,
        by ``(seq, start)``, from every rank's pieces (one all-gather), and the gathered blocks."""
        sp, rank = self.sp.size, self.sp.rank
        kh, dk, dv = key.shape[1], key.shape[3], value.shape[3]

        def rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [1, K, n, D] -> [n, K * (Dk + Dv)]
            n = k.shape[2]
            return torch.cat([k[0].transpose(0, 1).reshape(n, kh * dk), v[0].transpose(0, 1).reshape(n, kh * dv)], 1)

        own = [rows(key[:, :, s.offset:s.offset + s.length], value[:, :, s.offset:s.offset + s.length])
               for s, (_, per_doc) in zip(self.pieces, self.inner.info) if per_doc]
        for sl in self.carried:  # this rank's shard of an earlier per-doc slice, from its store
            kv = self.inner.store.leaves(sl.seq, sl.start, layer)
            if kv is None:
                raise RuntimeError(f"K/V of sequence {sl.seq} at tokens [{sl.start}, {sl.end}) on layer {layer} "
                                   "is missing: an earlier slice did not run forward on this stage first")
            own.append(rows(*(t.to(key.dtype) for t in kv)))
        x = own[0] if len(own) == 1 else torch.cat(own) if own else key.new_zeros((0, kh * (dk + dv)))
        blocks = gather_rows(x, self.gather_rows, rank, self.sp.group)  # [sp, max rows, w]
        out, base = {}, [0] * sp  # base[r]: where rank r's shard of the next slice starts in its block
        for sl in self.gathered_slices:
            b = zigzag_bounds(sl.length, sp)
            parts = []
            for j, (r, which) in enumerate(piece_order(sp)):
                row = base[r] + (b[r + 1] - b[r] if which else 0)
                parts.append(blocks[r, row:row + b[j + 1] - b[j]])
            for r in range(sp):
                base[r] += shard_rows(sl.length, sp, r)
            full = torch.cat(parts)  # [length, K * (Dk + Dv)]
            n = full.shape[0]
            k = full[:, :kh * dk].reshape(n, kh, dk).transpose(0, 1).unsqueeze(0)
            v = full[:, kh * dk:].reshape(n, kh, dv).transpose(0, 1).unsqueeze(0)
            out[(sl.seq, sl.start)] = (k, v)
        return out, blocks

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


def _pad_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sink: Any,
                   gathered: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output ``[1, t, H, Dv]`` (zeros) of a rank's pad tokens, still a function of
    query, key, value, the sinks and what the rank gathered, so that every parameter gets a
    gradient (zeros: the pad token has no target) on every rank, as FSDP's reduce-scatter needs,
    and the gather's reduce-scatter runs on every rank."""
    out = value.new_zeros((1, query.shape[2], query.shape[1], value.shape[3]))
    for t in (query, key, value, sink if isinstance(sink, torch.Tensor) else None, gathered):
        if t is not None:
            out = out + t.sum().to(out.dtype) * 0
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # autocast's rule for its lower-precision ops: floating tensors except float64
    if t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype:
        return t.to(dtype)
    return t
