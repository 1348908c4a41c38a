"""The cost model of a stage of several GPUs, of placed chunks and of sharded state.

:class:`ParallelCosts` holds the methods of :class:`~.cost.CostModel` that price them (the class
inherits them; its fields hold the coefficients, :mod:`.cost` the single-GPU formulas).

**A stage of several GPUs** (``sp > 1``, Ulysses sequence parallelism inside the stage;
:meth:`ParallelCosts.with_parallel`): a chunk's tokens are sharded over the stage's ``sp`` GPUs, so
every per-token and per-pair coefficient (compute and activation bytes) is that of one GPU
and is ``1/sp`` of the single-GPU one; ``beta`` (per layer call), the embedding's and head's
per-call times are not divided. Two things a GPU holds beyond its
``1/sp`` share, per saved (or replayed) layer and chunk token (measured on the allocated peak:
``act_bytes_per_token`` and ``recompute_bwd_transient_bytes_per_token`` add them,
:meth:`ParallelCosts._sp_layer_extra`): the attention output twice, the kernel's (all tokens of
``H/sp`` heads) and the output projection's input (the rank's tokens of all heads), one storage at
``sp = 1``, ``H * head_dim * dtype_bytes / sp``; and with fewer K/V heads than ``sp`` (replicated)
the kernel's K and V, ``sp/K`` times their share: ``2 * (sp - K) * head_dim * dtype_bytes / sp``
more (the K/V store, ``kv_bytes_per_token`` and ``context_bytes_per_token``, is multiplied by
``sp/K``). Token padding to a multiple of ``sp`` (at most ``sp - 1`` tokens) is ignored. Each
decoder layer adds four all-to-alls forward
(q, k, v: the token shard of all heads becomes all tokens of ``H/sp`` heads; the attention
output back) and four backward (their gradients), each moving the rank's shard::

    a2a(T) = 4 * latency + A * (T / sp) * (sp - 1) / sp / bandwidth

with ``A = a2a_bytes_per_token`` (q, k, v and output of one token, K/V heads replicated up to
``sp`` when the model has fewer, as DeepSpeed's Ulysses does for GQA) and the intra-node link
when the ``sp`` GPUs fit one node (``gpus_per_node``); across nodes the share of the shard
leaving the node goes over the inter-node link and the slower part sets the time. A recomputed
layer repeats its four forward all-to-alls. Backward is ``bwd_factor`` times the compute plus
one ``a2a``, not ``bwd_factor`` times the all-to-alls.

**Whole-doc / per-doc chunks** (a chunk with a ``placement``, :mod:`.sharding`; chosen per chunk
by :mod:`.placement`): every GPU runs whole layers on its own pieces at one GPU's rates
(:meth:`ParallelCosts.rank_model`, the model at ``sp = 1``): its tokens and the causal pairs of its
pieces (a per-doc piece's queries attend to every earlier token of the sequence, so the zig-zag
pieces ``r`` and ``2 sp - 1 - r`` balance), and the stage takes its busiest GPU's time. Per layer,
the per-doc slices' K/V are all-gathered forward and their gradients reduce-scattered backward
(:meth:`ParallelCosts.gather_kv_time`: each GPU sends ``(sp - 1) / sp`` of the slices' K/V bytes, one
latency, the inter-node link for the share leaving the node; a recomputed layer gathers again;
a profiled model times the two collectives apart on the stage's own group, ``all_gather_*`` and
``reduce_scatter_*``, since gloo's reduce-scatter costs several all-gathers);
whole-doc slices move nothing. A per-doc slice's earlier slices (per-doc too) left their K/V
sharded over the GPUs (each its own pieces'), so its gather moves them again: ``tokens`` is the
slices' ends, not their lengths (and a whole-doc slice after per-doc ones, the planner's for a
last slice too short to cut, gathers theirs, :attr:`~.cost.CostModel.whole_doc_carried`). Memory, the
busiest GPU's per chunk (or one GPU's, :meth:`ParallelCosts.at_rank`): its own tokens' activations
(an empty GPU's pad token's) plus, on every saved layer, the gathered K/V its pieces attend to,
and in a layer's backward the whole dK/dV of what it gathered before the reduce-scatter, the
keys each piece attends to (its position in the sequence) and, when every layer recomputes, the
replay's gathered K/V; a placed split slice keeps, and takes gradients into, its GPU's own
tokens' K/V (a per-doc slice's shard, :meth:`ParallelCosts.kv_grad_scale`). So per-doc moves
``O(T)`` bytes a GPU where Ulysses moves ``O(T / sp)``; whole-doc moves none but balances only
when a chunk holds many sequences.

**Sharded state** (``state_shards = dp x sp`` ranks hold one stage's state): the model is the
pipeline's (FSDP2 with ``reshard_after_forward=False``, as torchtitan composes FSDP with
pipelining): weights are gathered once per step and gradients accumulate whole over the step's
chunks, reduce-scattered once after the last backward, so ``static_bytes_per_param`` (weights
and gradients, ``2 * dtype_bytes``) stays on every GPU while ``sharded_bytes_per_param`` (fp32
master weights and the two Adam moments, 12 bytes in bf16) is divided by ``state_shards``. The
gather and reduce-scatter once per step (:meth:`ParallelCosts.step_sync_time`) are added to the step
time by the simulator. ``zero3=True`` (the ``sp-only`` baseline: DeepSpeed ZeRO-3 / ALST) shards
everything (weights and gradients too) and gathers each layer's weights per micro-batch, once
forward and once backward, plus a reduce-scatter of its gradients; prefetching overlaps these
with compute, so a layer takes ``max(compute + a2a, gather)`` forward and ``max(compute + a2a,
gather + reduce-scatter)`` backward; the gathered weights of two layers and of the embedding or
head are resident (:meth:`~.cost.CostModel.static_memory`). Gathers of the embedding and head weights are not timed.
Pure Python; no torch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, NamedTuple, Self

from .sharding import EMPTY_RANK_TOKENS, PER_DOC, rank_pieces, shard_rows
from .types import Chunk, PlanError, Remedy, Slice, StageLayout

__all__ = ["ParallelCosts", "whole_doc_carried_of"]


class ParallelCosts:
    """What :class:`~.cost.CostModel` prices for a stage of ``sp`` GPUs, a placed (whole-doc /
    per-doc) chunk and sharded state (module docstring)."""

    __slots__ = ()

    # ------------------------------------------------------------------ a stage of several GPUs
    # per-token and per-pair coefficients that a stage of sp GPUs divides by sp
    _PER_GPU = ("alpha_attn", "alpha_tok", "embed_time_per_token", "head_time_per_token",
                "act_bytes_per_token", "ckpt_bytes_per_token", "kv_bytes_per_token", "logits_bytes_per_token",
                "hidden_bytes_per_token", "context_bytes_per_token", "output_bytes_per_token",
                "bwd_transient_bytes_per_token", "head_bwd_transient_bytes_per_token", "ckpt_chunk_bytes_per_token",
                "embed_bwd_bytes_per_token", "bwd_transient_slope", "head_bwd_transient_slope",
                "recompute_bwd_transient_bytes_per_token", "bwd_context_bytes_per_token", "stage_bytes_per_token",
                "attn_bytes_per_pair", "bwd_transient_bytes_per_pair", "lin_alpha_tok", "lin_act_bytes_per_token",
                "lin_state_bytes", "lin_pad_time_per_token")

    def with_parallel(self, *, sp: int = 1, state_shards: int | None = None, zero3: bool = False,
                      ulysses: bool = True) -> Self:
        """This model for a stage of ``sp`` GPUs (Ulysses inside attention) whose state is
        sharded over ``state_shards`` ranks (default ``sp``: one replica; ``dp * sp`` with
        ``dp`` replicas), per GPU; ``zero3``: weights and gradients sharded too (module
        docstring). Relative to this model's own ``sp``, so ``m.with_parallel(sp=8)`` and
        ``m.with_parallel(sp=2).with_parallel(sp=8)`` agree.

        Raises :class:`~.types.PlanError` when ``sp`` does not divide the attention heads
        (Ulysses gives each GPU ``H / sp`` whole heads), unless ``ulysses=False``: a stage whose
        chunks are all placed whole-doc / per-doc (no head-count limit; the planner then never
        chooses Ulysses, :func:`~.placement.ulysses_allowed`).
        """
        sp = int(sp)
        shards = sp if state_shards is None else int(state_shards)
        if sp < 1 or shards < 1:
            raise PlanError(f"the sequence-parallel size must be >= 1 (got sp={sp}, state_shards={shards})")
        if ulysses and self.num_heads and self.num_heads % sp:
            raise PlanError(f"sequence-parallel size {sp} does not divide the model's {self.num_heads} attention "
                            "heads (Ulysses gives each GPU whole heads)",
                            Remedy("sequence_parallel_size", "set", value=f"a divisor of {self.num_heads}"),
                            Remedy("sequence_parallel_mode", "set",
                                   value="'auto' or 'context' (whole-doc / per-doc sharding, no head-count rule)"))
        ratio = self.sp / sp
        changes: dict[str, Any] = {name: getattr(self, name) * ratio for name in self._PER_GPU}
        # K/V heads fewer than sp GPUs: each GPU holds (and receives) one replicated K/V head
        rep = lambda n: max(1.0, n / self.num_kv_heads) if self.num_kv_heads else 1.0  # noqa: E731
        changes["kv_bytes_per_token"] *= rep(sp) / rep(self.sp)
        changes["context_bytes_per_token"] *= rep(sp) / rep(self.sp)
        # what a saved (or replayed) layer holds at sp > 1 beyond its 1/sp share: removed at this
        # model's sp, added at the new one
        for name in ("act_bytes_per_token", "recompute_bwd_transient_bytes_per_token"):
            if getattr(self, name):
                changes[name] += self._sp_layer_extra(sp) - self._sp_layer_extra(self.sp) * ratio
        if self.head_time_points:  # a GPU's head runs on the chunk's tokens over sp
            changes["head_time_points"] = tuple((t * sp / self.sp, x) for t, x in self.head_time_points)
        if self.max_chunk_tokens:  # a chunk's tokens are sharded over the sp GPUs
            changes["max_chunk_tokens"] = max(1, self.max_chunk_tokens * sp // self.sp)
        changes.update(sp=sp, state_shards=shards, zero3=bool(zero3))
        if shards > 1 and not self.sharded_bytes_per_param:
            keep = min(self.static_bytes_per_param, 2.0 * self.dtype_bytes)  # weights and gradients
            changes.update(static_bytes_per_param=keep, sharded_bytes_per_param=self.static_bytes_per_param - keep)
        return dataclasses.replace(self, **changes)

    def _sp_layer_extra(self, sp: int) -> float:
        """Bytes per chunk token one GPU of a stage of ``sp`` holds per saved decoder layer beyond
        ``1/sp`` of one GPU's activations (module docstring): the
        attention output twice (the kernel's, all tokens of ``H/sp`` heads, and the output
        projection's input, the rank's tokens of all heads, one storage at ``sp = 1``), and with
        ``K < sp`` K/V heads the replicated K and V the kernel keeps (``sp/K`` times the share).
        0 at ``sp = 1`` or without the head counts."""
        if sp <= 1 or not self.num_heads or not self.a2a_bytes_per_token:
            return 0.0
        kv = self.num_kv_heads or self.num_heads
        per_head = self.a2a_bytes_per_token / (2 * (self.num_heads + kv))  # one head of one token
        return per_head * (self.num_heads + 2 * (max(kv, sp) - kv)) / sp

    def _link(self, group: int) -> tuple[float, float, float]:
        """``(latency, intra bandwidth, inter bandwidth)`` of a collective over ``group`` GPUs,
        and whether it leaves the node (inter bandwidth 0 when it does not)."""
        if group <= self.gpus_per_node:
            return self.intra_node_latency_s, self.intra_node_bandwidth, 0.0
        return self.inter_node_latency_s, self.intra_node_bandwidth, self.inter_node_bandwidth

    def a2a_time(self, tokens: int) -> float:
        """The four all-to-alls of one decoder layer in one direction for a chunk of ``tokens``
        tokens (module docstring); 0 at ``sp = 1``."""
        return self._all_to_alls(self._a2a_bytes(self.sp), 4, tokens)

    def lin_a2a_time(self, tokens: int) -> float:
        """The two all-to-alls of one Gated DeltaNet layer in one direction under Ulysses
        (``lin_a2a_bytes_per_token``: the convolution's input with ``beta`` and ``a`` to the
        rank's heads, the scan's output back); 0 at ``sp = 1``."""
        return self._all_to_alls(self.lin_a2a_bytes_per_token, 2, tokens)

    def _all_to_alls(self, bytes_per_token: float, calls: int, tokens: int) -> float:
        sp = self.sp
        if sp <= 1:
            return 0.0
        moved = bytes_per_token * tokens / sp * (sp - 1) / sp
        lat, intra, inter = self._link(sp)
        if not inter:
            return calls * lat + moved / intra
        g = self.gpus_per_node
        return calls * lat + max(moved * (sp - g) / (sp - 1) / inter, moved * (g - 1) / (sp - 1) / intra)

    def _a2a_bytes(self, sp: int) -> float:
        """Bytes per token of the four tensors, K and V replicated up to ``sp`` heads."""
        if not self.num_kv_heads or not self.num_heads or sp <= self.num_kv_heads:
            return self.a2a_bytes_per_token
        per_head = self.a2a_bytes_per_token / (2 * (self.num_heads + self.num_kv_heads))
        return 2 * per_head * (self.num_heads + sp)

    # ------------------------------------------------------------------ sharded state
    def gather_time(self) -> float:
        """``zero3``: all-gather of one decoder layer's weights over the ``state_shards`` ranks
        (a reduce-scatter of its gradients costs the same)."""
        n = self.state_shards
        if n <= 1:
            return 0.0
        lat, intra, inter = self._link(n)
        return lat + self.layer_params * self.dtype_bytes * (n - 1) / n / (inter or intra)

    def step_sync_time(self, layout: StageLayout, stage: int) -> float:
        """Once per step (not ``zero3``): gathering the stage's weights before its first chunk and
        reduce-scattering its gradients after its last backward, over ``state_shards`` ranks."""
        n = self.state_shards
        if n <= 1 or self.zero3:
            return 0.0
        lat, intra, inter = self._link(n)
        return 2 * (lat + self._stage_params(layout, stage) * self.dtype_bytes * (n - 1) / n / (inter or intra))

    def sharded_state_memory(self, layout: StageLayout, stage: int) -> float:
        """``zero3``: the shards one GPU of ``stage`` holds (weights, gradients and optimizer
        state over ``state_shards``), without the gathered working set of :meth:`CostModel.static_memory`."""
        per = (self.static_bytes_per_param + self.sharded_bytes_per_param) / self.state_shards
        return self._stage_params(layout, stage) * per

    def _sharded_static_memory(self, layout: StageLayout, stage: int) -> float:
        """:meth:`~.cost.CostModel.static_memory` with sharded state: ``static_bytes_per_param``
        whole and ``sharded_bytes_per_param`` over ``state_shards`` per parameter; ``zero3``:
        everything over ``state_shards``, plus the gathered weights of two layers and of the larger
        of embedding and head."""
        if self.zero3:
            gathered = 2 * self.layer_params + max(self.embed_params, self.head_params)
            return self.sharded_state_memory(layout, stage) + gathered * self.dtype_bytes
        params = self._stage_params(layout, stage)
        return params * (self.static_bytes_per_param + self.sharded_bytes_per_param / self.state_shards)

    # ------------------------------------------------------------------ whole-doc / per-doc chunks
    def rank_model(self) -> Self:
        """This model for one GPU running whole layers on its own tokens (``sp = 1``, the same
        state sharding): what each rank of a stage computes on a chunk placed whole-doc /
        per-doc (:mod:`.sharding`). ``self`` at ``sp = 1``."""
        return self if self.sp == 1 else _rank_model(self)

    def at_rank(self, sp_rank: int | None) -> Self:
        """This model with the memory of placed chunks taken on GPU ``sp_rank`` of the stage
        (what that GPU holds of each chunk), not on each chunk's busiest GPU: the per-rank
        prediction ``simulate(plan, cost.at_rank(r))`` of rank ``r``'s peak. ``None``: the
        planner's view (an upper bound of every rank's)."""
        return self if sp_rank == self.sp_rank else dataclasses.replace(self, sp_rank=sp_rank)

    def _placement(self, chunk: Chunk) -> "_Placement":
        carried = tuple((i, n) for q, start, n in self.whole_doc_carried
                        for i, sl in enumerate(chunk.slices) if (sl.seq, sl.start) == (q, start))
        return _placed(chunk, self.sp, carried)

    def _over_ranks(self, per_rank: Iterable[float]) -> float:
        """A placed chunk's per-rank memory term on :attr:`CostModel.sp_rank`, or the largest over ranks."""
        values = list(per_rank)
        return max(values) if self.sp_rank is None else values[self.sp_rank]

    def placed_layer_time(self, chunk: Chunk) -> float:
        """Forward plus backward of one decoder layer on ``chunk`` (no recompute), on the busiest
        GPU of the stage, communication included: the per-layer time the placement search
        compares (``layer_fwd_time + layer_bwd_time`` for a Ulysses chunk)."""
        if not chunk.placement or self.sp <= 1:
            return self.layer_fwd_time(chunk.slices) + self.layer_bwd_time(chunk.slices)
        info = self._placement(chunk)
        base = self.rank_model()
        comp = max(base.layer_compute_time(sl) for sl in info.time_slices)
        return ((1.0 + self.bwd_factor) * comp + self.gather_kv_time(info.gathered)
                + self.gather_kv_time(info.gathered, backward=True))

    def gather_kv_time(self, tokens: int, backward: bool = False) -> float:
        """The all-gather of the K/V of ``tokens`` per-doc tokens over the stage's ``sp`` GPUs for
        one decoder layer (``backward``: the reduce-scatter of their gradients): each GPU sends its
        ``1/sp`` share to the others, ``(sp - 1) / sp`` of the slices' K/V bytes at one GPU's width
        (all K/V heads), at the fitted latency and bandwidth of that collective
        (``all_gather_*`` / ``reduce_scatter_*``), else one latency of the intra-node link as the
        all-to-alls; the share crossing nodes on the inter-node link when the stage spans nodes.
        0 without tokens."""
        sp = self.sp
        if sp <= 1 or tokens <= 0:
            return 0.0
        moved = self.rank_model().kv_bytes_per_token * tokens * (sp - 1) / sp
        lat, bw = ((self.reduce_scatter_latency_s, self.reduce_scatter_bandwidth) if backward
                   else (self.all_gather_latency_s, self.all_gather_bandwidth))
        if bw > 0 and sp <= self.gpus_per_node:
            return lat + moved / bw
        return self._collective_time(moved, 1)

    def _collective_time(self, moved: float, count: int) -> float:
        """``count`` collectives over the stage's ``sp`` GPUs in which each GPU sends ``moved``
        bytes in all, spread evenly over the other GPUs (the all-to-all's rule, :meth:`a2a_time`)."""
        sp = self.sp
        lat, intra, inter = self._link(sp)
        if not inter:
            return count * lat + moved / intra
        g = self.gpus_per_node
        return count * lat + max(moved * (sp - g) / (sp - 1) / inter, moved * (g - 1) / (sp - 1) / intra)

    def stage_comm_bytes(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int = 0) -> float:
        """Bytes the GPUs of ``stage`` send one another (summed over them) for the forward and
        backward of ``chunk``, its recomputed layers' forwards included: Ulysses' four
        all-to-alls per layer and direction, ``(sp - 1) / sp`` of the chunk's q, k, v and output
        bytes; per-doc slices' K/V all-gather forward and dK/dV reduce-scatter backward,
        ``(sp - 1)`` times their K/V bytes (each GPU receives everyone else's share); whole-doc
        slices nothing. 0 at ``sp = 1``."""
        sp = self.sp
        if sp <= 1:
            return 0.0
        calls = 2 * layout.num_stage_layers(stage) + recompute_layers
        if not chunk.placement:
            n_attn, n_lin = self.layer_kind_counts(layout, stage)
            share = n_lin / max(1, n_attn + n_lin)  # recomputed layers at the stage's mix
            per_token = (1 - share) * self._a2a_bytes(sp) + share * self.lin_a2a_bytes_per_token
            return calls * per_token * chunk.num_tokens * (sp - 1) / sp
        return calls * self.rank_model().kv_bytes_per_token * self._placement(chunk).gathered * (sp - 1)

    def kv_grad_scale(self, chunk: Chunk, slice_index: int) -> float:
        """How many times this model's per-GPU K/V bytes the K/V gradient buffers of ``chunk``'s
        split slice ``slice_index`` take on a GPU: 1 for Ulysses (each GPU its heads' share); for
        a placed chunk one GPU's whole-head bytes (:meth:`rank_model`) of the tokens the GPU keeps
        of the slice: a whole-doc slice's on the GPU holding it (0 on the others, with
        :attr:`CostModel.sp_rank`), a per-doc slice's shard (its two pieces; the busiest GPU's without
        :attr:`CostModel.sp_rank`), into which the later slices' gathers reduce-scatter their gradients."""
        if not chunk.placement or self.sp <= 1 or not self.kv_bytes_per_token:
            return 1.0
        where, sl = chunk.placement[slice_index], chunk.slices[slice_index]
        whole = self.rank_model().kv_bytes_per_token / self.kv_bytes_per_token
        if where != PER_DOC:
            return 0.0 if self.sp_rank not in (None, where) else whole
        rows = [shard_rows(sl.length, self.sp, r) for r in range(self.sp)]
        return whole * self._over_ranks(rows) / sl.length

    def comm_time(self, layout: StageLayout, stage: int, chunk: Chunk, backward: bool,
                  recompute_layers: int = 0) -> float:
        """The all-to-all share of a forward (or backward, with its recomputed layers' own) of
        ``chunk`` on ``stage``: what the Gantt chart draws as communication (a placed chunk:
        its per-doc slices' K/V all-gathers and dK/dV reduce-scatters)."""
        if chunk.placement and self.sp > 1:
            g = self._placement(chunk).gathered
            if not backward:
                return layout.num_stage_layers(stage) * self.gather_kv_time(g)
            return (layout.num_stage_layers(stage) * self.gather_kv_time(g, backward=True)
                    + recompute_layers * self.gather_kv_time(g))
        n_attn, n_lin = self.layer_kind_counts(layout, stage)
        a, lin = self.a2a_time(chunk.num_tokens), self.lin_a2a_time(chunk.num_tokens)
        rec = recompute_layers if backward else 0
        share = n_lin / max(1, n_attn + n_lin)  # recomputed layers at the stage's mix
        return n_attn * a + n_lin * lin + rec * ((1 - share) * a + share * lin)

    def _placed_fwd(self, layout: StageLayout, stage: int, chunk: Chunk) -> float:
        info, base = self._placement(chunk), self.rank_model()
        comp = max(base.fwd_time(layout, stage, rc) for rc in info.time_chunks(chunk))
        return comp + self.comm_time(layout, stage, chunk, False)

    def _placed_bwd(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int) -> float:
        info, base = self._placement(chunk), self.rank_model()
        comp = max(base.bwd_time(layout, stage, rc, recompute_layers) for rc in info.time_chunks(chunk))
        return comp + self.comm_time(layout, stage, chunk, True, recompute_layers)

    def _placed_recompute(self, chunk: Chunk, recompute_layers: int) -> float:
        info, base = self._placement(chunk), self.rank_model()
        return (max(base.recompute_time(rc, recompute_layers) for rc in info.time_chunks(chunk))
                + recompute_layers * self.gather_kv_time(info.gathered))

    def _placed_p2p(self, chunk: Chunk) -> float:
        return self.p2p_latency_s + (self.rank_model().hidden_bytes_per_token
                                     * max(self._placement(chunk).rank_tokens) / self.p2p_bandwidth)

    def _placed_act(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int) -> float:
        """The busiest rank's :meth:`CostModel.act_memory` of its own tokens (on :attr:`CostModel.sp_rank`, that
        rank's; a non-final slice's K/V it keeps for later slices are its own tokens' too, a
        per-doc slice's its shard), plus, on every saved layer, the keys its per-doc pieces attend
        to beyond what that counts: the slices' gathered K/V and a second copy of their carried
        prefix (each of the rank's two pieces of a slice attends to all of it); plus the whole
        chunk's token ids / targets (every GPU of the first / last stage)."""
        info, base = self._placement(chunk), self.rank_model()
        saved = layout.num_stage_layers(stage) - recompute_layers
        ends = layout.has_embedding(stage) + layout.has_head(stage)
        return self._over_ranks(base.act_memory(layout, stage, rc, recompute_layers)
                                + base.kv_bytes_per_token * saved * info.saved_gathered
                                + self.ids_bytes_per_token * (chunk.num_tokens - rc.num_tokens) * ends
                                for rc in info.mem_chunks(chunk))

    def _placed_transient(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int) -> float:
        """The busiest rank's :meth:`CostModel.transient_memory` (on :attr:`CostModel.sp_rank`, that rank's) with
        each of its pieces a slice of its own whose context is its position (the keys its
        attention's backward takes gradients of: a per-doc piece attends to every earlier token
        of its sequence, the gathered ones included), its layers' backward holding besides the
        whole dK/dV of what the layer gathered (:attr:`_Placement.gathered`) before their
        reduce-scatter and, when every layer of the stage recomputes, the replayed layer's
        gathered K/V (a saved layer's are counted in :meth:`_placed_act`; with saved layers, the
        recomputed ones run backward after those freed theirs); not the LM head's backward, which
        runs before any layer's."""
        info, base = self._placement(chunk), self.rank_model()
        n = layout.num_stage_layers(stage)
        gathered = base.kv_bytes_per_token * info.gathered if n else 0.0
        replay = gathered if n and recompute_layers >= n else 0.0
        return self._over_ranks(base.transient_memory(layout, stage, rc, recompute_layers, gathered + replay)
                                for rc in info.time_chunks(chunk))


@functools.lru_cache(maxsize=16)
def _rank_model(cost: ParallelCosts) -> ParallelCosts:
    return cost.with_parallel(sp=1, state_shards=cost.state_shards, zero3=cost.zero3)


class _Placement(NamedTuple):
    """A placed chunk seen rank by rank (:func:`_placed`)."""

    #: per rank, its pieces as slices whose context is the piece's position (attention pairs:
    #: a per-doc piece's queries attend to every earlier token of its sequence)
    time_slices: tuple[tuple[Slice, ...], ...]
    #: per rank, its tokens of each slice as one slice with the slice's own context (memory; an
    #: empty rank's pad tokens)
    mem_slices: tuple[tuple[Slice, ...], ...]
    rank_tokens: tuple[int, ...]
    #: tokens whose K/V every rank gathers per layer: the per-doc slices' and their earlier
    #: slices' (per-doc too, :meth:`~.plan.Plan.validate_placements`: sharded over the ranks),
    #: and a whole-doc slice's earlier per-doc slices' (:attr:`CostModel.whole_doc_carried`)
    gathered: int
    #: of those, the per-doc slices' and their earlier slices' (what every rank's pieces attend to)
    saved_gathered: int

    def time_chunks(self, chunk: Chunk) -> list[Chunk]:
        return [Chunk(chunk.index, chunk.kind, sl) for sl in self.time_slices]

    def mem_chunks(self, chunk: Chunk) -> list[Chunk]:
        return [Chunk(chunk.index, chunk.kind, sl) for sl in self.mem_slices]


@functools.lru_cache(maxsize=4096)
def _placed(chunk: Chunk, sp: int, carried: tuple[tuple[int, int], ...] = ()) -> _Placement:
    """``chunk`` on ``sp`` GPUs; ``carried``: ``(slice index, tokens)`` of its whole-doc slices
    reading per-doc K/V (:attr:`CostModel.whole_doc_carried`)."""
    time_s, mem_s, toks = [], [], []
    per_doc = {i for i, w in enumerate(chunk.placement) if w == PER_DOC}
    for r in range(sp):
        pieces = rank_pieces(chunk, sp, r)
        time_s.append(tuple(Slice(p.seq, p.start, p.length) for p in pieces if p.length))
        mine: dict[int, int] = {}
        for p in pieces:
            mine[p.slice_index] = mine.get(p.slice_index, 0) + p.length
        # an empty rank runs the chunk's layers on pad tokens (at position 0)
        mem_s.append(tuple(Slice(chunk.slices[i].seq, chunk.slices[i].start, n) for i, n in mine.items() if n)
                     or (Slice(chunk.slices[0].seq, 0, EMPTY_RANK_TOKENS),))
        toks.append(sum(mine.values()))
    gathered = sum(chunk.slices[i].end for i in per_doc)
    return _Placement(tuple(time_s), tuple(mem_s), tuple(toks), gathered + sum(n for _, n in carried), gathered)


def whole_doc_carried_of(plan: Any) -> tuple[tuple[int, int, int], ...]:
    """:attr:`CostModel.whole_doc_carried` of ``plan``: ``(seq, start, tokens)`` of each whole-doc
    slice after per-doc ones, ``tokens`` theirs."""
    if not any(c.placement for c in plan.chunks):
        return ()
    chains: dict[int, list[tuple[int, int, int | None]]] = {}
    for c in plan.chunks:
        for i, sl in enumerate(c.slices):
            if sl.length != plan.seq_lens[sl.seq]:
                chains.setdefault(sl.seq, []).append((sl.start, sl.length, c.placement[i] if c.placement else None))
    out = []
    for seq, chain in chains.items():
        sharded = 0
        for start, length, where in sorted(chain):
            if where == PER_DOC:
                sharded += length
            elif where is not None and sharded:
                out.append((seq, start, sharded))
    return tuple(sorted(out))
