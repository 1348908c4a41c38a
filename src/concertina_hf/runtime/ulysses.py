"""Ulysses sequence parallelism inside one pipeline stage: the stage's ``sp`` ranks share each chunk.

A chunk of ``T`` tokens is padded to ``T_pad = sp * t`` (``t = ceil(T / sp)``) and rank ``r`` of
the stage's sequence-parallel group holds tokens ``[r * t, (r + 1) * t)`` (:func:`local_shard`):
the embedding, norms, MLPs, the LM head and the loss run on that local shard. Inside each
attention (the hook in :func:`concertina_hf.runtime.attention.concertina_attention_forward`):

1. an all-to-all (:func:`all_to_all`, autograd through ``all_to_all_single``) turns the local
   tokens of all ``H`` heads into all ``T_pad`` tokens of ``H / sp`` heads (rank ``r``: heads
   ``[r * H / sp, (r + 1) * H / sp)``), for ``q``, ``k`` and ``v``; padded positions are cut off;
2. the ordinary concertina attention runs on those heads with the chunk's full token layout
   (:class:`~concertina_hf.runtime.attention.ChunkAttentionContext`: packed isolation, K/V
   carried from earlier slices of a split sequence, sliding windows). Each rank's
   :class:`~concertina_hf.runtime.attention.KVStore` keeps the K/V of its own heads only
   (memory divided by ``sp``);
3. the output is padded again and the inverse all-to-all returns local tokens of all heads.

Grouped-query attention: with ``K`` key/value heads, ``K % sp == 0`` splits them like the query
heads (``K / sp`` per rank); ``K < sp`` with ``sp % K == 0`` replicates each K/V head ``sp / K``
times before the all-to-all, as DeepSpeed's Ulysses does (each rank then gets the one K/V head its
query heads use; the gradient of the copies is summed by autograd). Anything else is refused
(:func:`check_heads`).

Attention sinks (gpt-oss's ``s_aux``: one logit per query head) are sliced to the rank's query
heads (their gradient is summed over the group with the others'); per-query sinks of the local
tokens go through the all-to-all like the query (:meth:`UlyssesContext._rank_sinks`).

Evaluation hooks: the last stage's ``on_logits`` gets the whole chunk's logits on every rank
(:meth:`SequenceParallel.gather_tokens`: one all-gather of the ranks' token shards per chunk), or
its local shard when it gathers what it keeps itself (``preprocess_logits_for_metrics``: each
rank applies it to its own tokens and the per-token results are gathered,
:meth:`SequenceParallel.gather_objects`, so no rank holds the whole chunk's logits).

Padded positions: token id 0 at stage 0, position 0, target ``-100`` (no loss), and their
query/key/value are dropped before attention, so they affect nothing; their hidden states still
run through the MLPs (at most ``sp - 1`` tokens per chunk).

Correctness across ranks: every rank of the group runs the same program on tensors of the same
shapes, so the collectives inside autograd (the all-to-all's backward, the replay of a
checkpointed layer) are issued in the same order everywhere. Parameters' gradients on one rank
cover its own tokens only: the stage's gradient is their sum over the group (with the replicas':
:func:`concertina_hf.runtime.distributed.reduce_gradients`), and the step's loss is summed over the group
(:meth:`SequenceParallel.all_reduce_sum`).

Costs per decoder layer and chunk: forward 4 all-to-alls (q, k, v, out), each moving
``(sp - 1) / sp`` of the rank's ``t x heads x head_dim`` tensor; backward the same 4; K/V
replicated for ``K < sp`` move ``sp / K`` times more. The attention mask of a chunk is still
built for the whole chunk on every rank (``T x S``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..planning.fit import nonneg_lstsq
from .attention import ChunkAttentionContext
from .per_layer import layer_heads

__all__ = [
    "SequenceParallel",
    "UlyssesContext",
    "all_to_all",
    "default_a2a_token_counts",
    "fit_all_to_all",
    "fit_latency_bound",
    "measure_all_gather",
    "measure_all_to_all",
    "profile_all_gather",
    "profile_all_to_all",
    "check_heads",
    "heads_to_tokens_recv",
    "heads_to_tokens_send",
    "local_shard",
    "shard_length",
    "tokens_to_heads_recv",
    "tokens_to_heads_send",
]


# ---------------------------------------------------------------------- layout (pure tensor code)
def shard_length(num_tokens: int, sp: int) -> int:
    """Tokens per rank: ``ceil(num_tokens / sp)`` (the chunk padded to ``sp`` times it)."""
    return -(-int(num_tokens) // int(sp))


def local_shard(x: torch.Tensor, sp: int, rank: int, pad_value: float | int = 0) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of ``x`` along dim 0, padded with ``pad_value`` to the
    shard length (:func:`shard_length`)."""
    t = shard_length(x.shape[0], sp)
    part = x[rank * t:(rank + 1) * t]
    if part.shape[0] < t:
        pad = x.new_full((t - part.shape[0], *x.shape[1:]), pad_value)
        part = torch.cat([part, pad])
    return part


def heads_to_tokens_send(x: torch.Tensor, sp: int) -> torch.Tensor:
    """``[1, H, t, D]`` (local tokens, all heads) -> the all-to-all's input ``[sp, H/sp, t, D]``:
    block ``j`` (heads of rank ``j``) goes to rank ``j``."""
    _, h, t, d = x.shape
    return x.reshape(sp, h // sp, t, d).contiguous()


def heads_to_tokens_recv(y: torch.Tensor) -> torch.Tensor:
    """The all-to-all's output ``[sp, h, t, D]`` (block ``j``: rank ``j``'s tokens of this rank's
    heads) -> ``[1, h, sp * t, D]`` (all tokens in order)."""
    sp, h, t, d = y.shape
    return y.permute(1, 0, 2, 3).reshape(1, h, sp * t, d)


def tokens_to_heads_send(o: torch.Tensor, sp: int) -> torch.Tensor:
    """``[1, sp * t, h, D]`` (all tokens, this rank's heads; the attention's output layout) -> the
    all-to-all's input ``[sp, t, h, D]``: block ``j`` (rank ``j``'s tokens) goes to rank ``j``."""
    _, n, h, d = o.shape
    return o.reshape(sp, n // sp, h, d).contiguous()


def tokens_to_heads_recv(y: torch.Tensor) -> torch.Tensor:
    """The all-to-all's output ``[sp, t, h, D]`` (block ``j``: heads of rank ``j``) ->
    ``[1, t, sp * h, D]`` (local tokens, all heads in order)."""
    sp, t, h, d = y.shape
    return y.permute(1, 0, 2, 3).reshape(1, t, sp * h, d)


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How many times each K/V head is replicated before the all-to-all (1: none); raises a
    ``ValueError`` naming the fields when ``sp`` cannot split the heads."""
    if num_heads % sp:
        raise ValueError(
            f"concertina_sequence_parallel_size={sp} must divide the model's num_attention_heads={num_heads} "
            "(Ulysses gives each rank of a stage num_attention_heads / sp heads)"
        )
    if num_kv_heads % sp == 0:
        return 1
    if sp % num_kv_heads == 0:
        return sp // num_kv_heads
    raise ValueError(
        f"concertina_sequence_parallel_size={sp} and the model's num_key_value_heads={num_kv_heads}: one must "
        "divide the other (K/V heads are split over the ranks, or replicated when there are fewer than sp)"
    )


# ---------------------------------------------------------------------- the collective
_RELEASE_WAIT_S = 0.05


def _all_to_all_single(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``all_to_all_single`` of a contiguous ``x`` into a new tensor. On CPU it returns only once
    the backend has let go of ``x``: gloo's worker thread drops its reference to a collective's
    tensors after waking the caller, so without the wait about one all-to-all in four (four
    ranks on two cores) keeps its send buffer alive into the next ops, one buffer more than the
    memory model counts at a peak. The wait is the time that thread needs (tens of microseconds),
    at most :data:`_RELEASE_WAIT_S`."""
    out = torch.empty_like(x)
    held = x._use_count()
    dist.all_to_all_single(out, x, group=group)
    if x.device.type == "cpu":
        deadline = time.perf_counter() + _RELEASE_WAIT_S
        while x._use_count() > held and time.perf_counter() < deadline:
            time.sleep(0)
    return out


class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` along dim 0; its adjoint is the same all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all_single(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all_single(grad.contiguous(), ctx.group), None


def all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Block ``j`` of ``x`` (dim 0 split in group-size equal blocks) goes to rank ``j``; block ``j``
    of the result came from rank ``j``. Differentiable."""
    return _AllToAll.apply(x, group)


# ---------------------------------------------------------------------- the stage's group
class SequenceParallel:
    """The sequence-parallel ranks of one pipeline stage (``group``: the mesh's ``sp`` group)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def check_model(self, config: Any) -> int:
        """The K/V replication for ``config`` (see :func:`check_heads`); a per-layer config's layers
        each checked (:func:`~.per_layer.layer_heads`), the replication then per layer from the K/V's shape."""
        shapes = layer_heads(config)
        if not shapes:
            heads = int(config.num_attention_heads)
            shapes = [(heads, int(getattr(config, "num_key_value_heads", None) or heads))]
        return [check_heads(heads, kv, self.size) for heads, kv in shapes][0]

    def tokens(self, num_tokens: int) -> int:
        """This rank's tokens of a chunk of ``num_tokens`` (padding included)."""
        return shard_length(num_tokens, self.size)

    def shard(self, x: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        return local_shard(x, self.size, self.rank, pad_value)

    def context(self, inner: ChunkAttentionContext) -> "UlyssesContext":
        return UlyssesContext(inner, self)

    def gather_tokens(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The chunk's ``[1, num_tokens, ...]`` from every rank's shard ``x`` ``[1, t, ...]``
        (collective over the group; the padding cut off): the ranks' token shards in order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=1)[:, :num_tokens]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order; collective over the group."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


class UlyssesContext:
    """What the decoder layers get as ``concertina_ctx`` under sequence parallelism: the local
    shard's ``position_ids`` (for the rotary embedding) and the attention hook; ``inner`` is the
    whole chunk's :class:`ChunkAttentionContext` (token layout and K/V store)."""

    def __init__(self, inner: ChunkAttentionContext, sp: SequenceParallel) -> None:
        self.inner = inner
        self.sp = sp
        self.num_tokens = inner.num_tokens
        self.local_tokens = sp.tokens(inner.num_tokens)
        self.position_ids = sp.shard(inner.position_ids[0], 0).unsqueeze(0)

    def sequence_parallel_attention(self, forward: Callable, module: Any, query: torch.Tensor,
                                    key: torch.Tensor, value: torch.Tensor, sink: Any = None, **kwargs: Any):
        """``query`` [1, H, t, D], ``key``/``value`` [1, K, t, D] of the local tokens -> the
        attention output [1, t, H, D] of the local tokens (``forward``: the concertina attention,
        run on all tokens of this rank's heads, with the other keywords ``kwargs``)."""
        sp, group = self.sp.size, self.sp.group
        if query.shape[2] != self.local_tokens:
            raise ValueError(f"sequence-parallel attention expects {self.local_tokens} local tokens, "
                             f"got query {tuple(query.shape)}")
        if sink is not None:
            sink = self._rank_sinks(module, sink, query.shape[1])
        repeat = check_heads(query.shape[1], key.shape[1], sp)
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        n = self.num_tokens
        q, k, v = (heads_to_tokens_recv(all_to_all(heads_to_tokens_send(x, sp), group))[:, :, :n]
                   for x in (query, key, value))
        out, _ = forward(module, q, k, v, concertina_ctx=self.inner, s_aux=sink, **kwargs)  # [1, n, H/sp, Dv]
        out = F.pad(out, (0, 0, 0, 0, 0, sp * self.local_tokens - n))
        return tokens_to_heads_recv(all_to_all(tokens_to_heads_send(out, sp), group)), None

    def _rank_sinks(self, module: Any, sink: torch.Tensor, heads: int) -> torch.Tensor:
        """The attention sinks of this rank's query heads ``[r * H/sp, (r + 1) * H/sp)``: ``[H]``
        (gpt-oss's ``s_aux``, one logit per query head; the slice's gradient is zero at the other
        ranks' heads and the sum over the group puts each head's together) or ``[1, H, 1, 1]``
        sliced; per-query sinks ``[1, H, t, 1]`` of the local tokens go through the all-to-all like
        the query. Sinks belong to query heads, so the K/V replication of grouped-query attention
        does not touch them."""
        sp, h = self.sp.size, heads // self.sp.size
        lo = self.sp.rank * h
        if sink.dim() <= 1 and sink.numel() == heads:
            return sink.reshape(heads)[lo:lo + h]
        if sink.dim() == 4 and sink.shape[0] == 1 and sink.shape[1] == heads:
            if sink.shape[2] == self.local_tokens:  # (with one local token: right for either reading)
                return heads_to_tokens_recv(all_to_all(heads_to_tokens_send(sink, sp), self.sp.group))[
                    :, :, :self.num_tokens]
            if sink.shape[2] == 1:
                return sink[:, lo:lo + h]
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise NotImplementedError(
            f"attention sinks of shape {tuple(sink.shape)} (model type {model_type!r}) with "
            f"concertina_sequence_parallel_size={sp}: expected one per query head ([{heads}] or [1, {heads}, 1, 1]) "
            f"or per head and local token ([1, {heads}, {self.local_tokens}, 1]); use sequence parallel size 1")


# ---------------------------------------------------------------------- measuring the all-to-all
def _a2a_numels(cost: Any, tokens: int, sp: int) -> list[int]:
    """float32 element counts of the four tensors one rank sends for a chunk of ``tokens`` tokens
    (q, k, v, out; K/V replicated up to ``sp`` heads), each a multiple of ``sp``; their bytes are
    the cost model's ``_a2a_bytes(sp) * ceil(tokens / sp)``."""
    t = shard_length(tokens, sp)
    heads, kv = int(cost.num_heads or 1), int(cost.num_kv_heads or cost.num_heads or 1)
    per_head = cost.a2a_bytes_per_token / (2 * (heads + kv))  # bytes of one head of one token
    kv_sent = max(kv, sp) if cost.num_kv_heads else kv
    out = []
    for h in (heads, kv_sent, kv_sent, heads):
        n = -(-int(round(h * per_head * t)) // 4)
        out.append(-(-n // sp) * sp)
    return out


def measure_all_to_all(cost: Any, group: Any, token_counts: Sequence[int], *, repeats: int = 5,
                       device: torch.device | str = "cpu") -> list[tuple[float, float]]:
    """Time one decoder layer's four all-to-alls (q, k, v, out shard sizes of ``cost``'s model)
    on the real ``group`` for chunks of each of ``token_counts`` tokens. Collective over
    ``group`` (every rank calls it with the same arguments). Returns ``(bytes moved per rank
    per collective summed over the four, seconds)`` per token count: the bytes that leave a rank,
    ``(sp - 1) / sp`` of what it sends, as :meth:`CostModel.a2a_time` counts them; the seconds are
    the fastest of ``repeats`` timings of the slowest rank (load on a shared machine only ever adds
    time: the minimum is the link's cost, a median still carries the load's spikes)."""
    sp = dist.get_world_size(group)
    device = torch.device(device)
    out: list[tuple[float, float]] = []
    for tokens in token_counts:
        numels = _a2a_numels(cost, int(tokens), sp)
        send = [torch.ones(n, device=device) for n in numels]
        recv = [torch.empty_like(x) for x in send]

        def a2a() -> None:
            for x, y in zip(send, recv):
                dist.all_to_all_single(y, x, group=group)

        moved = 4.0 * sum(numels) * (sp - 1) / sp  # float32: 4 bytes an element
        out.append((moved, _fastest(a2a, group, repeats, device)))
    return out


def _fastest(run: Callable[[], None], group: Any, repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` timings (after one warm-up) of the collective ``run`` on the
    slowest rank of ``group`` (see :func:`measure_all_to_all`)."""
    times = []
    for i in range(repeats + 1):  # the first: warm-up
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if i:
            times.append(float(elapsed))
    return min(times)


def measure_all_gather(cost: Any, group: Any, token_counts: Sequence[int], *, repeats: int = 5,
                       device: torch.device | str = "cpu") -> list[tuple[float, float, float]]:
    """Time the per-doc K/V collectives of one decoder layer on the real ``group``
    (:mod:`.context_parallel`: an all-gather of every rank's ``[rows, w]`` K/V rows forward, a
    reduce-scatter of their gradients backward, ``w`` one token's K and V at one GPU's width,
    ``cost.rank_model().kv_bytes_per_token``) for chunks of each of ``token_counts`` per-doc
    tokens (``ceil(tokens / sp)`` rows a rank). Collective over ``group``. Returns ``(bytes,
    all-gather seconds, reduce-scatter seconds)`` per token count: bytes as
    :meth:`~concertina_hf.planning.CostModel.gather_kv_time` counts them (``(sp - 1) / sp`` of the
    chunk's K/V), seconds as :func:`measure_all_to_all` takes them."""
    sp = dist.get_world_size(group)
    device = torch.device(device)
    width = max(1, -(-int(round(cost.rank_model().kv_bytes_per_token)) // 4))  # float32 elements
    out: list[tuple[float, float, float]] = []
    for tokens in token_counts:
        rows = shard_length(int(tokens), sp)
        x = torch.ones(rows, width, device=device)
        parts = [torch.empty_like(x) for _ in range(sp)]
        moved = 4.0 * rows * width * (sp - 1)  # each rank's rows to the sp - 1 others
        gather = _fastest(lambda: dist.all_gather(parts, x, group=group), group, repeats, device)
        scatter = _fastest(lambda: dist.reduce_scatter(x, parts, group=group), group, repeats, device)
        out.append((moved, gather, scatter))
    return out


def profile_all_gather(cost: Any, group: Any, token_counts: Sequence[int], *, device: torch.device | str = "cpu",
                       repeats: int = 5) -> Any:
    """``cost`` with ``all_gather_latency_s`` / ``all_gather_bandwidth`` and
    ``reduce_scatter_latency_s`` / ``reduce_scatter_bandwidth`` fitted (one latency per
    collective, :func:`fit_latency_bound` with ``calls=1``) to the per-doc K/V collectives measured
    on ``group`` (:func:`measure_all_gather`); collective over the default group (the slowest
    group's times), unchanged when the group spans nodes, as :func:`profile_all_to_all`."""
    sp = dist.get_world_size(group)
    samples = measure_all_gather(cost, group, token_counts, repeats=repeats, device=device)
    secs = torch.tensor([[g, s] for _, g, s in samples], dtype=torch.float64, device=torch.device(device))
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    if sp > int(cost.gpus_per_node):
        return cost
    ag = fit_latency_bound([(b, float(t)) for (b, _, _), t in zip(samples, secs[:, 0])])
    rs = fit_latency_bound([(b, float(t)) for (b, _, _), t in zip(samples, secs[:, 1])])
    return dataclasses.replace(cost, all_gather_latency_s=ag[0], all_gather_bandwidth=ag[1],
                               reduce_scatter_latency_s=rs[0], reduce_scatter_bandwidth=rs[1])


def fit_all_to_all(samples: Sequence[tuple[float, float]], calls: int = 4) -> tuple[float, float]:
    """``(latency_s, bandwidth)`` of ``seconds = calls * latency + bytes / bandwidth`` fitted to
    ``samples`` (``(bytes, seconds)``, at least two distinct sizes) by non-negative least squares
    (:func:`~concertina_hf.planning.fit.nonneg_lstsq`: a negative latency is dropped, the bandwidth
    refitted through the origin). Raises ``ValueError`` when the times do not grow with the size
    (no bandwidth to fit)."""
    import numpy as np

    xs, ys = [float(b) for b, _ in samples], [float(s) for _, s in samples]
    if len(set(xs)) < 2:
        raise ValueError("fitting the all-to-all needs at least two distinct sizes")
    coef = nonneg_lstsq(np.array([[float(calls), x] for x in xs]), np.array(ys))
    if coef is None or coef[1] <= 0:
        raise ValueError(f"the all-to-all times {ys} do not grow with the sizes {xs}: no bandwidth to fit")
    return float(coef[0]), 1.0 / float(coef[1])


#: the bandwidth :func:`profile_all_to_all` / :func:`profile_all_gather` record for collectives
#: whose times do not grow with their size over the sizes measured (latency-bound: gloo on 4
#: processes sharing 2 cores, a layer's all-to-alls of up to 36 KiB took 4.6, 5.1, 7.6, 4.8 ms)
LATENCY_BOUND_BANDWIDTH = 1e15


def fit_latency_bound(samples: Sequence[tuple[float, float]], calls: int = 1) -> tuple[float, float]:
    """:func:`fit_all_to_all`; when the times do not grow with the size, their mean over
    ``calls`` as the latency and :data:`LATENCY_BOUND_BANDWIDTH` (a profiled run does not stop
    on a latency-bound link)."""
    try:
        return fit_all_to_all(samples, calls=calls)
    except ValueError:
        if len({b for b, _ in samples}) < 2:
            raise
        return sum(s for _, s in samples) / len(samples) / calls, LATENCY_BOUND_BANDWIDTH


def default_a2a_token_counts(max_tokens: int | None, sp: int) -> list[int]:
    """Four chunk sizes, a factor 4 apart, up to ``max_tokens`` (default 8192), at least ``sp``."""
    top = max(int(max_tokens or 8192), 64 * sp)
    return [max(sp, top // 4 ** i) for i in (3, 2, 1, 0)]


def profile_all_to_all(cost: Any, group: Any, token_counts: Sequence[int], *, device: torch.device | str = "cpu",
                       repeats: int = 5) -> Any:
    """``cost`` (a :class:`~concertina_hf.planning.CostModel`) with ``intra_node_latency_s`` and
    ``intra_node_bandwidth`` fitted to the all-to-alls measured on ``group`` (:func:`measure_all_to_all`,
    :func:`fit_latency_bound`); collective over the default group (the slowest group's times, so
    every rank gets the same model). Unchanged when the group spans nodes (``sp > gpus_per_node``:
    those fields do not describe it alone)."""
    sp = dist.get_world_size(group)
    samples = measure_all_to_all(cost, group, token_counts, repeats=repeats, device=device)
    secs = torch.tensor([s for _, s in samples], dtype=torch.float64, device=torch.device(device))
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    if sp > int(cost.gpus_per_node):
        return cost
    lat, bw = fit_latency_bound([(b, float(s)) for (b, _), s in zip(samples, secs)], calls=4)
    return dataclasses.replace(cost, intra_node_latency_s=lat, intra_node_bandwidth=bw)
