"""Cost model: time and memory of one chunk on one pipeline stage.

Per decoder layer, for a chunk whose slices have lengths ``s_i`` and contexts ``C_i``::

    forward  = alpha_attn * sum((C_i + s_i)^2 - C_i^2) + alpha_tok * sum(s_i) + beta
    backward = bwd_factor * forward          (+ one more forward per recomputed layer)

The attention term counts (query, key) pairs under the causal mask, so a late slice of a long
sequence costs more than an early one of the same length. The first stage adds the embedding,
the last the head and loss: ``embed_time_per_token * T + embed_time_per_call`` forward (and
``head_...`` likewise), backward ``bwd_factor`` times it. Activation memory per layer is
``act_bytes_per_token * tokens`` when the layer saves its activations and
``ckpt_bytes_per_token * tokens`` when it is recomputed (only its input is kept); a split chunk (a
non-final slice of a split sequence) additionally keeps its K/V (``kv_bytes_per_token`` per
recomputed layer) for later slices, freed with the chunk's backward. A hybrid chunk's tail slice
is final: it keeps no K/V of its own (the earlier slices' K/V it attends to are counted with their
chunks). While a split sequence runs backward (reverse slice order), the
gradient buffers of its earlier slices' K/V are alive too. The last stage keeps the chunk's
logits (``logits_bytes_per_token``) until its backward. Static memory is parameters, gradients
and optimizer state: ``static_bytes_per_param`` per parameter of the stage.

Terms the profiler measures on the real runtime (all 0 in the analytic model, which then reduces
to the formulas above): a slice with context ``C`` saves, on every layer that keeps its
activations, the concatenated keys and values it attends to (``context_bytes_per_token`` per
layer and context token; a non-final slice with context also keeps its own K/V in the store,
counted with the same coefficient); a stage other than the last keeps its
output until the backward (``output_bytes_per_token``); a chunk with any recomputed layer keeps,
once, what the checkpoint closures hold beyond the layers' inputs and what saved layers keep too
(``ckpt_chunk_bytes_per_token``: the attention context's index tensors), a step at ``r >= 1`` that
the recompute planner's linear model over-approximates by ``(r - 1)`` times it (conservative).
The layers of a stage share per chunk what they all read (the rotary tables), held once per
stage whatever its layer count (``stage_bytes_per_token``; the profiler measures it apart, so a
one-layer stage is not predicted a share of it spread over the profiled layers). The first stage
keeps the token ids its embedding saved and the last the targets its loss saved
(``ids_bytes_per_token`` each: int64, the whole chunk's on every GPU of the stage).
During a chunk's backward the stage briefly holds more than its activations: the hidden-state
gradients in and out (``2 * hidden_bytes_per_token``), or, when measured, the peak extra of a
decoder layer's backward (``bwd_transient_bytes_per_token``: gradients of its intermediate
activations) or of the head's (``head_bwd_transient_bytes_per_token``: the logits' gradient;
it runs first and frees the logits before the layers' backward), whichever is largest; for a
slice with context, its attention's backward holds the gradients of every key and value it
attended to, ``bwd_context_bytes_per_token`` per key (``C + s``; the kernel's at the query heads'
width and their sum over the heads sharing a K/V head, ``2 * (q_dim + kv_dim) * dtype_bytes``:
a short late slice of a long sequence holds more there than its own activations), the largest
slice of the chunk (slices run one at a time), if larger still; and,
whatever the chunk's size, the weight gradient a backward computes before adding it into
``.grad`` (``bwd_transient_bytes`` and ``head_bwd_transient_bytes`` plus their per-token slopes:
the LM head's is ``vocab x hidden``, more than a short chunk's activations). The embedding's
backward, last in a stage-0 backward after the layers freed their activations, holds its dense
weight gradient (``embed_bwd_transient_bytes``, :meth:`CostModel.embed_bwd_memory`). A
recomputed layer re-materializes its activations in backward, but the runtime recomputes the
*first* ``r`` layers of a stage, which run backward last, after every saved layer has freed its
own (at least as many bytes): so this raises the backward's peak only when all the stage's layers
recompute (``r == n``), by ``act_bytes_per_token`` per token.

**A stage of several GPUs** (``sp > 1``, Ulysses sequence parallelism inside the stage;
:meth:`CostModel.with_parallel`): a chunk's tokens are sharded over the stage's ``sp`` GPUs, so
every per-token and per-pair coefficient above (compute and activation bytes) is that of one GPU
and is ``1/sp`` of the single-GPU one; ``beta`` (per layer call), the embedding's and head's
per-call times are not divided. Two things a GPU holds beyond its
``1/sp`` share, per saved (or replayed) layer and chunk token (measured on the allocated peak:
``act_bytes_per_token`` and ``recompute_bwd_transient_bytes_per_token`` add them,
:meth:`CostModel._sp_layer_extra`): the attention output twice, the kernel's (all tokens of
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
(:meth:`CostModel.rank_model`, the model at ``sp = 1``): its tokens and the causal pairs of its
pieces (a per-doc piece's queries attend to every earlier token of the sequence, so the zig-zag
pieces ``r`` and ``2 sp - 1 - r`` balance), and the stage takes its busiest GPU's time. Per layer,
the per-doc slices' K/V are all-gathered forward and their gradients reduce-scattered backward
(:meth:`CostModel.gather_kv_time`: each GPU sends ``(sp - 1) / sp`` of the slices' K/V bytes, one
latency, the inter-node link for the share leaving the node; a recomputed layer gathers again;
a profiled model times the two collectives apart on the stage's own group, ``all_gather_*`` and
``reduce_scatter_*``, since gloo's reduce-scatter costs several all-gathers);
whole-doc slices move nothing. A per-doc slice's earlier slices (per-doc too) left their K/V
sharded over the GPUs (each its own pieces'), so its gather moves them again: ``tokens`` is the
slices' ends, not their lengths (and a whole-doc slice after per-doc ones, the planner's for a
last slice too short to cut, gathers theirs, :attr:`CostModel.whole_doc_carried`). Memory, the
busiest GPU's per chunk (or one GPU's, :meth:`CostModel.at_rank`): its own tokens' activations
(an empty GPU's pad token's) plus, on every saved layer, the gathered K/V its pieces attend to,
and in a layer's backward the whole dK/dV of what it gathered before the reduce-scatter, the
keys each piece attends to (its position in the sequence) and, when every layer recomputes, the
replay's gathered K/V; a placed split slice keeps, and takes gradients into, its GPU's own
tokens' K/V (a per-doc slice's shard, :meth:`CostModel.kv_grad_scale`). So per-doc moves
``O(T)`` bytes a GPU where Ulysses moves ``O(T / sp)``; whole-doc moves none but balances only
when a chunk holds many sequences.

**Sharded state** (``state_shards = dp x sp`` ranks hold one stage's state): the model is the
pipeline's (FSDP2 with ``reshard_after_forward=False``, as torchtitan composes FSDP with
pipelining): weights are gathered once per step and gradients accumulate whole over the step's
chunks, reduce-scattered once after the last backward, so ``static_bytes_per_param`` (weights
and gradients, ``2 * dtype_bytes``) stays on every GPU while ``sharded_bytes_per_param`` (fp32
master weights and the two Adam moments, 12 bytes in bf16) is divided by ``state_shards``. The
gather and reduce-scatter once per step (:meth:`CostModel.step_sync_time`) are added to the step
time by the simulator. ``zero3=True`` (the ``sp-only`` baseline: DeepSpeed ZeRO-3 / ALST) shards
everything (weights and gradients too) and gathers each layer's weights per micro-batch, once
forward and once backward, plus a reduce-scatter of its gradients; prefetching overlaps these
with compute, so a layer takes ``max(compute + a2a, gather)`` forward and ``max(compute + a2a,
gather + reduce-scatter)`` backward; the gathered weights of two layers and of the embedding or
head are resident (``static_memory``). Gathers of the embedding and head weights are not timed.

**Within the profiled range.** The time model is linear in tokens and pairs, which measured
chunks follow only up to a size: a profiled model records its largest profiled chunk
(``max_chunk_tokens``), under which every pipeline strategy plans (profile up to the chunk sizes a
run should use). The LM head's time per token is not one line either: a profile keeps it at a
ladder of chunk sizes (``head_time_points``, interpolated), and the embedding's and head's
per-call constants (``embed_time_per_call``, ``head_time_per_call``), so the partition and the
simulator price the end stages at the chunk sizes plans use.

Two ways to a model: :meth:`CostModel.from_hf_config` (FLOPs and bytes of the architecture at a
device's rates) and :func:`concertina_hf.planning.fit.fit_profile` (least squares over measured
samples, e.g. from :mod:`concertina_hf.runtime.profiler`).
Pure Python; no torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from .segments import parse_heads
from .sharding import EMPTY_RANK_TOKENS, PER_DOC, rank_pieces, shard_rows
from .types import Chunk, ChunkKind, PlanError, Remedy, Slice, StageLayout

__all__ = ["DEVICE_PRESETS", "ChunkShape", "CostModel", "DeviceSpec", "ProfileSample", "attn_pairs"]

#: the GPUs :meth:`DeviceSpec.preset` (and ``concertina plan --device``) knows, and ``cpu``
DEVICE_PRESETS = ("a800", "h100", "h200", "b200", "cpu")

def _active_moe_width(get: Any) -> int | None:
    """The MLP width a token goes through in a config without ``intermediate_size`` (MoE only):
    its routed experts' widths plus the shared experts'."""
    moe = get("moe_intermediate_size")
    if not moe:
        return None
    shared = get("shared_expert_intermediate_size") or moe * int(get("n_shared_experts") or 0)
    return int(moe) * max(1, int(get("num_experts_per_tok") or 1)) + int(shared)


#: fields of cost models saved before, no longer modelled (:meth:`CostModel.from_dict`)
_RETIRED_FIELDS = ("alpha_mask", "mask_bytes_per_pair")

#: what :meth:`CostModel.from_hf_config` reads (GPT-2 / T5-style configs name them otherwise)
_REQUIRED_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "num_hidden_layers")

ChunkShape = tuple[tuple[int, int], ...]
"""A chunk as measured by the profiler: its slices as ``(context, length)`` pairs."""


def attn_pairs(slices: Iterable[Slice], kv_tail: int | None = None) -> int:
    """(query, key) pairs of causal attention: ``sum((C+s)^2 - C^2)`` (twice the true count,
    a constant absorbed by ``alpha_attn``): a late slice costs more than an early one. Under a
    segment K/V tail ``W`` (segment-level training) a slice attends to ``min(C, W)`` earlier keys.

    >>> attn_pairs([Slice(0, 0, 4)]), attn_pairs([Slice(0, 8, 4)]), attn_pairs([Slice(0, 8, 4)], 2)
    (16, 80, 32)
    """
    if kv_tail is None:
        return sum((s.context + s.length) ** 2 - s.context**2 for s in slices)
    return sum((min(s.context, kv_tail) + s.length) ** 2 - min(s.context, kv_tail) ** 2 for s in slices)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Rates of one GPU (a stage of several GPUs: :meth:`CostModel.with_parallel`).

    ``flops``: sustained dense matmul FLOP/s (not peak); ``mem_bandwidth``: bytes/s for the
    memory-bound element-wise work; ``kernel_overhead_s``: fixed cost per layer call;
    ``p2p_bandwidth`` / ``p2p_latency_s``: stage-to-stage link (one GPU to the same sp rank of
    the next stage); ``memory_bytes``: capacity. Collectives inside a stage or over the sharded
    state (all-to-all, all-gather, reduce-scatter): ``intra_node_bandwidth`` /
    ``intra_node_latency_s`` between GPUs of one node (bytes/s each GPU sends), and
    ``inter_node_bandwidth`` / ``inter_node_latency_s`` per GPU between nodes of
    ``gpus_per_node`` GPUs.
    """

    flops: float = 150e12
    mem_bandwidth: float = 1.5e12
    kernel_overhead_s: float = 2e-4
    p2p_bandwidth: float = 20e9
    p2p_latency_s: float = 2e-5
    memory_bytes: int = 80 * 2**30
    intra_node_bandwidth: float = 150e9
    intra_node_latency_s: float = 1e-5
    inter_node_bandwidth: float = 20e9
    inter_node_latency_s: float = 2e-5
    gpus_per_node: int = 8

    @classmethod
    def a800(cls) -> "DeviceSpec":
        """An A800-80GB at a typical 50% of its 312 TFLOP/s bf16 peak; NVLink at 400 GB/s
        (about 150 GB/s each GPU sends in an all-to-all), one 200 Gb/s NIC per GPU between nodes
        of 8 (assumed, not measured). A stage of several GPUs:
        ``CostModel.from_hf_config(config, DeviceSpec.a800()).with_parallel(sp=...)``."""
        return cls(
            flops=156e12,
            mem_bandwidth=1.6e12,
            kernel_overhead_s=2e-4,
            p2p_bandwidth=25e9,
            p2p_latency_s=2e-5,
            memory_bytes=80 * 2**30,
            intra_node_bandwidth=150e9,
            intra_node_latency_s=1e-5,
            inter_node_bandwidth=25e9,
            inter_node_latency_s=2e-5,
            gpus_per_node=8,
        )

    # Hopper and Blackwell presets, on a800's conventions: ``flops`` 50% of the datasheet's dense
    # (no sparsity) bf16 Tensor Core peak; ``mem_bandwidth`` 80% of the datasheet's HBM bandwidth
    # (a800: 1.6 of 2.04 TB/s, 78%); ``intra_node_bandwidth`` what a GPU sends in an NVLink
    # all-to-all, 3/8 of the datasheet's total (bidirectional) NVLink bandwidth (a800: 150 of 400
    # GB/s); ``inter_node_bandwidth`` and ``p2p_bandwidth`` one NIC per GPU at its line rate (the
    # stage link may leave the node); latencies and the per-layer overhead as a800's. Assumed, not
    # measured: fit a profile (``concertina_cost_model="profiled"``) for real use.
    @classmethod
    def h100(cls) -> "DeviceSpec":
        """An H100 SXM5 80GB. Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 Tensor
        Core 1,979 TFLOP/s with sparsity, so 989 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900
        GB/s) and NVIDIA DGX H100 datasheet (eight ConnectX-7 400 Gb/s InfiniBand/Ethernet ports,
        one per GPU, 8 GPUs a node). Here: 495 TFLOP/s (50%), 2.68 TB/s (80%), 80 GiB (as a800's
        80 GB), all-to-all 337.5 GB/s (3/8 of 900), 50 GB/s (400 Gb/s) between nodes."""
        return cls(flops=494.5e12, mem_bandwidth=2.68e12, kernel_overhead_s=2e-4, p2p_bandwidth=50e9,
                   p2p_latency_s=2e-5, memory_bytes=80 * 2**30, intra_node_bandwidth=337.5e9,
                   intra_node_latency_s=1e-5, inter_node_bandwidth=50e9, inter_node_latency_s=2e-5, gpus_per_node=8)

    @classmethod
    def h200(cls) -> "DeviceSpec":
        """An H200 SXM 141GB. Sources: NVIDIA H200 Tensor Core GPU datasheet (SXM: BF16 Tensor Core
        1,979 TFLOP/s with sparsity, so 989 dense, as H100; 141 GB HBM3e at 4.8 TB/s; NVLink 900
        GB/s) and NVIDIA DGX H200 datasheet (eight ConnectX-7 400 Gb/s ports, one per GPU, 8 GPUs
        a node). Here: 495 TFLOP/s (50%), 3.84 TB/s (80%), 141e9 bytes (the datasheet's decimal
        GB, 131 GiB: a budget on the safe side; ``--memory-gb`` sets another), all-to-all 337.5
        GB/s (3/8 of 900), 50 GB/s (400 Gb/s) between nodes."""
        return cls(flops=494.5e12, mem_bandwidth=3.84e12, kernel_overhead_s=2e-4, p2p_bandwidth=50e9,
                   p2p_latency_s=2e-5, memory_bytes=141 * 10**9, intra_node_bandwidth=337.5e9,
                   intra_node_latency_s=1e-5, inter_node_bandwidth=50e9, inter_node_latency_s=2e-5, gpus_per_node=8)

    @classmethod
    def b200(cls) -> "DeviceSpec":
        """A B200 (HGX/DGX B200, 8 GPUs a node). Sources: NVIDIA HGX B200 datasheet (8 GPUs: FP16/BF16
        Tensor Core 36 PFLOP/s with sparsity, so 2.25 PFLOP/s dense per GPU; 1.4 TB of HBM3e, 180 GB
        a GPU, and 64 TB/s, 8 TB/s a GPU; fifth-generation NVLink at 1.8 TB/s per GPU) and NVIDIA
        DGX B200 datasheet (1,440 GB of GPU memory; eight ConnectX-7 400 Gb/s ports for the compute
        fabric, one per GPU). Here: 1,125 TFLOP/s (50%), 6.4 TB/s (80%), 180e9 bytes (decimal GB,
        168 GiB), all-to-all 675 GB/s (3/8 of 1.8 TB/s), 50 GB/s (400 Gb/s) between nodes."""
        return cls(flops=1125e12, mem_bandwidth=6.4e12, kernel_overhead_s=2e-4, p2p_bandwidth=50e9,
                   p2p_latency_s=2e-5, memory_bytes=180 * 10**9, intra_node_bandwidth=675e9,
                   intra_node_latency_s=1e-5, inter_node_bandwidth=50e9, inter_node_latency_s=2e-5, gpus_per_node=8)

    @classmethod
    def preset(cls, name: str) -> "DeviceSpec":
        """The preset called ``name`` (one of :data:`DEVICE_PRESETS`)."""
        if name not in DEVICE_PRESETS:
            raise PlanError(f"unknown device preset {name!r}; choose one of {', '.join(DEVICE_PRESETS)}")
        return getattr(cls, name)()

    @classmethod
    def cpu(cls) -> "DeviceSpec":
        """One CPU thread, roughly (refit from measurements for real use)."""
        return cls(flops=3e10, mem_bandwidth=5e9, kernel_overhead_s=5e-5, p2p_bandwidth=2e9,
                   p2p_latency_s=5e-5, memory_bytes=8 * 2**30, intra_node_bandwidth=2e9,
                   intra_node_latency_s=5e-5, inter_node_bandwidth=1e9, inter_node_latency_s=1e-4)


@dataclass(frozen=True, slots=True)
class ProfileSample:
    """One measurement of a decoder layer on a chunk shape: ``slices`` as ``(context, length)``
    pairs, times in seconds per layer, saved activation bytes per layer."""

    slices: ChunkShape
    fwd_time_s: float
    bwd_time_s: float
    act_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-layer coefficients of time and memory; see the module docstring for the formulas."""

    num_layers: int
    alpha_attn: float
    alpha_tok: float
    beta: float
    bwd_factor: float = 2.0
    # embedding (stage 0) and head + loss (last stage), forward seconds per token
    embed_time_per_token: float = 0.0
    head_time_per_token: float = 0.0
    # ... and forward seconds per chunk, whatever its tokens (the embedding's dense weight
    # gradient, the head's; backward bwd_factor times it, like the per-token rates). 0: not
    # measured (analytic models, models saved before the fields)
    embed_time_per_call: float = 0.0
    head_time_per_call: float = 0.0
    # the head's forward seconds measured at a ladder of chunk sizes, ``((tokens, seconds), ...)``
    # ascending: fwd_time interpolates them (the line above stays for the planner's proxies and
    # beyond the ends). On CPU the head's time per token is not a line: 114-120 us/token (fwd +
    # bwd) from 256 to 896 tokens, 132-151 from 1024 up. Empty: the line alone
    head_time_points: tuple[tuple[float, float], ...] = ()
    # bytes
    act_bytes_per_token: float = 0.0
    ckpt_bytes_per_token: float = 0.0
    kv_bytes_per_token: float = 0.0
    logits_bytes_per_token: float = 0.0
    hidden_bytes_per_token: float = 0.0  # one activation message between stages
    layer_params: int = 0
    embed_params: int = 0
    head_params: int = 0  # includes the final norm
    static_bytes_per_param: float = 16.0
    p2p_bandwidth: float = 20e9
    p2p_latency_s: float = 2e-5
    source: str = "analytic"
    # measured terms of the real runtime (see the module docstring); 0 = not modelled
    context_bytes_per_token: float = 0.0  # per saved layer and token of context attended to
    output_bytes_per_token: float = 0.0  # stage output kept until backward (not the last stage)
    bwd_transient_bytes_per_token: float = 0.0  # peak extra during a decoder layer's backward
    head_bwd_transient_bytes_per_token: float = 0.0  # peak extra during the head's backward
    ckpt_chunk_bytes_per_token: float = 0.0  # per chunk with any recomputed layer (closures keep it)
    # per backward, whatever its tokens: weight gradients computed before they are added into
    # ``.grad`` (one layer's, the LM head's, the embedding's dense vocab x hidden one); per GPU
    # too, but not divided by sp (every GPU of a stage holds whole weights)
    bwd_transient_bytes: float = 0.0  # peak extra of a decoder layer's backward, constant part
    bwd_transient_slope: float = 0.0  # ... and its bytes per token (gradients in flight then)
    head_bwd_transient_bytes: float = 0.0  # of the head's backward, constant part
    head_bwd_transient_slope: float = 0.0  # ... and its bytes per token
    embed_bwd_transient_bytes: float = 0.0  # the embedding's backward: its weight gradient
    embed_bwd_bytes_per_token: float = 0.0  # per token held during the embedding's backward
    # peak extra of a layer's backward when every layer of the stage recomputes (measured; 0: a
    # saved layer's transient plus its activations, act_bytes_per_token, the conservative sum)
    recompute_bwd_transient_bytes_per_token: float = 0.0
    # per key (context and own tokens) of a slice with context, during a decoder layer's
    # backward: the gradients of every key and value it attended to (module docstring)
    bwd_context_bytes_per_token: float = 0.0
    # per chunk token, once per stage with decoder layers: what its layers share (rotary tables)
    stage_bytes_per_token: float = 0.0
    # per chunk token on the first stage (the ids the embedding saves) and on the last (the
    # targets the loss saves): a whole chunk's on every GPU of the stage (a rank's share is a
    # view of them), so not divided by sp
    ids_bytes_per_token: float = 0.0
    # a recomputed layer's forward, relative to a plain one (non-reentrant checkpointing stops
    # the replay once the tensors backward needs exist, so the last ops are skipped)
    recompute_factor: float = 1.0
    # a stage of several GPUs and sharded state (module docstring, ``with_parallel``)
    sp: int = 1  # GPUs of the stage's Ulysses group; the coefficients above are per GPU
    state_shards: int = 1  # ranks one stage's sharded state is divided over (dp x sp)
    sharded_bytes_per_param: float = 0.0  # per parameter, divided over state_shards
    zero3: bool = False  # weights and gradients sharded too, gathered per layer and micro-batch
    a2a_bytes_per_token: float = 0.0  # q, k, v and attention output of one token (whole, sp = 1)
    num_heads: int = 0  # attention (query) heads; 0 = unknown (not checked)
    num_kv_heads: int = 0
    dtype_bytes: int = 2  # of weights and gradients
    intra_node_bandwidth: float = 150e9
    intra_node_latency_s: float = 1e-5
    inter_node_bandwidth: float = 20e9
    inter_node_latency_s: float = 2e-5
    gpus_per_node: int = 8
    # per-doc K/V collectives fitted on the stage's own group (runtime.ulysses.profile_all_gather):
    # ``seconds = latency + bytes / bandwidth`` per collective, bytes as gather_kv_time counts them;
    # the all-gather forward, the reduce-scatter of dK/dV backward (on gloo, CPU, several times
    # the all-gather: 5-21 ms against 1.5-9 ms a layer at sp=4). 0: the intra-node link's (the
    # all-to-all's latency and bandwidth). Within a node only (a stage spanning nodes: the links)
    all_gather_latency_s: float = 0.0
    all_gather_bandwidth: float = 0.0
    reduce_scatter_latency_s: float = 0.0
    reduce_scatter_bandwidth: float = 0.0
    # the largest chunk (tokens, per GPU's sp = 1 equivalent: scaled by sp in with_parallel) the
    # time coefficients were fitted on; the planner builds no larger chunk (plan_step). 0: no cap
    # (analytic models, models saved before the field). Beyond it the per-token time can grow:
    # on CPU, 8K-13K-token chunks of a 10M Llama ran 1.2-1.6x their linear prediction (the head's
    # log-softmax over the fp32 logits up to 7x its per-element time in 4K-token chunks)
    max_chunk_tokens: int = 0
    # segment-level training (planning.segments): the K/V tail W of the plan being simulated, set
    # by for_plan from its knobs (a slice attends to min(C, W) earlier keys); None: unbounded.
    # Not a fitted coefficient: to_dict leaves it out while None.
    segment_kv_tail: int | None = None
    # segment-level training's global heads: the share of the query heads that attend to every
    # earlier key despite the tail (set by for_plan; 0: none). Left out of to_dict while 0.
    segment_global_fraction: float = 0.0
    # the memory of placed (whole-doc / per-doc) chunks seen from this rank of the stage's sp
    # GPUs (:meth:`at_rank`: a per-rank prediction); None, the planner's: each chunk's busiest
    # rank. Not a fitted coefficient: to_dict leaves it out while None.
    sp_rank: int | None = None
    # whole-doc slices whose sequence's earlier slices ran per-doc (placement.py: a last slice too
    # short to cut into 2 sp pieces): ``(seq, start, tokens)``, those tokens' K/V, sharded over the
    # stage, gathered again per layer on every GPU for the slice. Set by for_plan from the plan;
    # to_dict leaves it out while empty.
    whole_doc_carried: tuple[tuple[int, int, int], ...] = ()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        device: DeviceSpec | None = None,
        dtype_bytes: int = 2,
        static_bytes_per_param: float | None = None,
    ) -> "CostModel":
        """Analytic model from an HF decoder config (a ``PretrainedConfig`` or a dict).

        Reads ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
        ``intermediate_size``, ``vocab_size``, ``num_hidden_layers``, ``head_dim`` (optional),
        ``tie_word_embeddings``. ``static_bytes_per_param`` defaults to 16 (bf16 weights and
        grads, fp32 master weights and two Adam moments) for 2-byte dtypes, 16 for fp32 (weights,
        grads and two moments).
        """
        c = config if isinstance(config, Mapping) else config.to_dict()

        def get(key: str) -> Any:
            if isinstance(config, Mapping):
                return c.get(key)
            try:  # the config's attribute map (e.g. n_routed_experts for num_local_experts) applies
                return getattr(config, key, None)
            except Exception:  # an attribute a config refuses to give globally (per-layer values)
                return c.get(key)

        inter = get("intermediate_size") or _active_moe_width(get)
        missing = [k for k in _REQUIRED_CONFIG_KEYS if get(k) is None and not (k == "intermediate_size" and inter)]
        if missing:
            raise ValueError(
                f"the config of model type {c.get('model_type', '?')!r} has no {', '.join(missing)}: the cost model "
                "(and ConcertinaTrainer) needs a decoder-only causal LM laid out like Llama (model.model.embed_tokens "
                "/ .layers / .norm and lm_head; see docs/supported_models.md)"
            )
        dev = device or DeviceSpec()
        h = int(get("hidden_size"))
        n_heads = int(get("num_attention_heads"))
        n_kv = int(get("num_key_value_heads") or n_heads)
        head_dim = int(get("head_dim") or h // n_heads)
        inter = int(inter)
        vocab = int(get("vocab_size"))
        n_layers = int(get("num_hidden_layers"))
        q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim
        layer_params = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * inter + 2 * h
        b = dtype_bytes
        # matmul FLOPs per token: 2 per weight; attention: QK^T and AV, 2 FLOPs each per
        # (query, key, head_dim) -> 4 * q_dim per pair; attn_pairs counts pairs twice.
        alpha_attn = 2.0 * q_dim / dev.flops
        elementwise_bytes = b * (10 * h + 4 * inter)  # norms, residuals, rotary, activation
        alpha_tok = 2.0 * layer_params / dev.flops + elementwise_bytes / dev.mem_bandwidth
        # saved activations per token: input + norm out (2h), q, k, v, attn out (q_dim*2 +
        # 2 kv), post-attn residual + norm (2h), gate, up, act(gate)*up (3 inter), softmax stats
        act = b * (4 * h + 2 * q_dim + 2 * kv_dim + 3 * inter) + 4 * n_heads
        embed_params = vocab * h
        head_params = (0 if get("tie_word_embeddings") else vocab * h) + h
        # weight gradients before accumulation (see transient_memory): a layer's largest matrix,
        # the LM head's and the embedding's dense one (tied or not: each backward makes its own)
        layer_grad = b * h * max(inter, q_dim)
        return cls(
            num_layers=n_layers,
            alpha_attn=alpha_attn,
            alpha_tok=alpha_tok,
            beta=dev.kernel_overhead_s,
            bwd_factor=2.0,
            embed_time_per_token=b * h / dev.mem_bandwidth,
            head_time_per_token=2.0 * h * vocab / dev.flops + 3 * 4 * vocab / dev.mem_bandwidth,
            act_bytes_per_token=act,
            ckpt_bytes_per_token=b * h,
            kv_bytes_per_token=b * 2 * kv_dim,
            # logits in the model dtype plus the fp32 copy the loss makes
            logits_bytes_per_token=(b + 4) * vocab,
            hidden_bytes_per_token=b * h,
            bwd_transient_bytes=layer_grad,
            bwd_transient_slope=2 * b * h,
            head_bwd_transient_bytes=b * vocab * h,
            head_bwd_transient_slope=2 * b * h,
            embed_bwd_transient_bytes=b * vocab * h,
            embed_bwd_bytes_per_token=b * h,  # the embedding output's gradient
            # a slice with context, backward: dK and dV of its keys at the query heads' width
            # (the kernel's, before the K/V heads' sum) and their sum
            bwd_context_bytes_per_token=b * 2 * (q_dim + kv_dim),
            stage_bytes_per_token=b * 2 * head_dim,  # the rotary cos and sin of the chunk
            ids_bytes_per_token=8.0,  # int64 token ids (embedding) and targets (loss)
            layer_params=layer_params,
            embed_params=embed_params,
            head_params=head_params,
            static_bytes_per_param=16.0 if static_bytes_per_param is None else static_bytes_per_param,
            p2p_bandwidth=dev.p2p_bandwidth,
            p2p_latency_s=dev.p2p_latency_s,
            source="analytic",
            a2a_bytes_per_token=b * 2 * (q_dim + kv_dim),
            num_heads=n_heads,
            num_kv_heads=n_kv,
            dtype_bytes=b,
            intra_node_bandwidth=dev.intra_node_bandwidth,
            intra_node_latency_s=dev.intra_node_latency_s,
            inter_node_bandwidth=dev.inter_node_bandwidth,
            inter_node_latency_s=dev.inter_node_latency_s,
            gpus_per_node=dev.gpus_per_node,
        )

    # per-token and per-pair coefficients that a stage of sp GPUs divides by sp
    _PER_GPU = ("alpha_attn", "alpha_tok", "embed_time_per_token", "head_time_per_token",
                "act_bytes_per_token", "ckpt_bytes_per_token", "kv_bytes_per_token", "logits_bytes_per_token",
                "hidden_bytes_per_token", "context_bytes_per_token", "output_bytes_per_token",
                "bwd_transient_bytes_per_token", "head_bwd_transient_bytes_per_token", "ckpt_chunk_bytes_per_token",
                "embed_bwd_bytes_per_token", "bwd_transient_slope", "head_bwd_transient_slope",
                "recompute_bwd_transient_bytes_per_token", "bwd_context_bytes_per_token", "stage_bytes_per_token")

    def with_parallel(self, *, sp: int = 1, state_shards: int | None = None, zero3: bool = False,
                      ulysses: bool = True) -> "CostModel":
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
        ``1/sp`` of one GPU's activations (module docstring, *A stage of several GPUs*): the
        attention output twice (the kernel's, all tokens of ``H/sp`` heads, and the output
        projection's input, the rank's tokens of all heads, one storage at ``sp = 1``), and with
        ``K < sp`` K/V heads the replicated K and V the kernel keeps (``sp/K`` times the share).
        0 at ``sp = 1`` or without the head counts."""
        if sp <= 1 or not self.num_heads or not self.a2a_bytes_per_token:
            return 0.0
        kv = self.num_kv_heads or self.num_heads
        per_head = self.a2a_bytes_per_token / (2 * (self.num_heads + kv))  # one head of one token
        return per_head * (self.num_heads + 2 * (max(kv, sp) - kv)) / sp

    def for_plan(self, plan: Any) -> "CostModel":
        """The model a plan runs under: this one, unless the plan records its own stage size
        and sharding (knobs ``sp``, ``state_shards``, ``zero3``: the ``sp-only`` baseline's plans,
        which run the replica's GPUs as one stage)."""
        tail = plan.knob("segment_kv_tail") if plan.knob("segment_tokens") is not None else None
        heads = parse_heads(plan.knob("segment_global_heads")) if tail is not None else ()
        glob = min(1.0, len(heads) / self.num_heads) if heads and self.num_heads else 0.0
        if tail != self.segment_kv_tail or glob != self.segment_global_fraction:
            return dataclasses.replace(self, segment_kv_tail=tail, segment_global_fraction=glob).for_plan(plan)
        carried = _whole_doc_carried(plan)
        if carried != self.whole_doc_carried:
            return dataclasses.replace(self, whole_doc_carried=carried).for_plan(plan)
        sp = plan.knob("sp")
        if sp is None:
            return self
        shards = int(plan.knob("state_shards", sp))
        zero3 = bool(plan.knob("zero3", False))
        if (int(sp), shards, zero3) == (self.sp, self.state_shards, self.zero3):
            return self
        return self.with_parallel(sp=int(sp), state_shards=shards, zero3=zero3)

    # ------------------------------------------------------------------ whole-doc / per-doc chunks
    def rank_model(self) -> "CostModel":
        """This model for one GPU running whole layers on its own tokens (``sp = 1``, the same
        state sharding): what each rank of a stage computes on a chunk placed whole-doc /
        per-doc (:mod:`.sharding`). ``self`` at ``sp = 1``."""
        return self if self.sp == 1 else _rank_model(self)

    def at_rank(self, sp_rank: int | None) -> "CostModel":
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
        """A placed chunk's per-rank memory term on :attr:`sp_rank`, or the largest over ranks."""
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
            return calls * self._a2a_bytes(sp) * chunk.num_tokens * (sp - 1) / sp
        return calls * self.rank_model().kv_bytes_per_token * self._placement(chunk).gathered * (sp - 1)

    def kv_grad_scale(self, chunk: Chunk, slice_index: int) -> float:
        """How many times this model's per-GPU K/V bytes the K/V gradient buffers of ``chunk``'s
        split slice ``slice_index`` take on a GPU: 1 for Ulysses (each GPU its heads' share); for
        a placed chunk one GPU's whole-head bytes (:meth:`rank_model`) of the tokens the GPU keeps
        of the slice: a whole-doc slice's on the GPU holding it (0 on the others, with
        :attr:`sp_rank`), a per-doc slice's shard (its two pieces; the busiest GPU's without
        :attr:`sp_rank`), into which the later slices' gathers reduce-scatter their gradients."""
        if not chunk.placement or self.sp <= 1 or not self.kv_bytes_per_token:
            return 1.0
        where, sl = chunk.placement[slice_index], chunk.slices[slice_index]
        whole = self.rank_model().kv_bytes_per_token / self.kv_bytes_per_token
        if where != PER_DOC:
            return 0.0 if self.sp_rank not in (None, where) else whole
        rows = [shard_rows(sl.length, self.sp, r) for r in range(self.sp)]
        return whole * self._over_ranks(rows) / sl.length

    def _placed_fwd(self, layout: StageLayout, stage: int, chunk: Chunk) -> float:
        info, base = self._placement(chunk), self.rank_model()
        comp = max(base.fwd_time(layout, stage, rc) for rc in info.time_chunks(chunk))
        return comp + self.comm_time(layout, stage, chunk, False)

    def _placed_bwd(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int) -> float:
        info, base = self._placement(chunk), self.rank_model()
        comp = max(base.bwd_time(layout, stage, rc, recompute_layers) for rc in info.time_chunks(chunk))
        return comp + self.comm_time(layout, stage, chunk, True, recompute_layers)

    def _placed_act(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int) -> float:
        """The busiest rank's :meth:`act_memory` of its own tokens (on :attr:`sp_rank`, that
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
        """The busiest rank's :meth:`transient_memory` (on :attr:`sp_rank`, that rank's) with
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

    # ------------------------------------------------------------------ time
    def layer_compute_time(self, slices: Sequence[Slice]) -> float:
        """Forward compute of one decoder layer on one GPU (no communication)."""
        tok = sum(s.length for s in slices)
        pairs = attn_pairs(slices, self.segment_kv_tail)
        if self.segment_global_fraction:  # global heads attend to every earlier key
            g = self.segment_global_fraction
            pairs = (1.0 - g) * pairs + g * attn_pairs(slices)
        return self.alpha_attn * pairs + self.alpha_tok * tok + self.beta

    def layer_fwd_time(self, slices: Sequence[Slice]) -> float:
        """Forward of one decoder layer: compute, the four all-to-alls (``sp > 1``), and with
        ``zero3`` at least the gather of its weights."""
        t = self.layer_compute_time(slices)
        if self.sp == 1 and not self.zero3:
            return t
        t += self.a2a_time(sum(s.length for s in slices))
        return max(t, self.gather_time()) if self.zero3 else t

    def layer_bwd_time(self, slices: Sequence[Slice]) -> float:
        """Backward of one decoder layer (recompute excluded)."""
        t = self.bwd_factor * self.layer_compute_time(slices)
        if self.sp == 1 and not self.zero3:
            return t
        t += self.a2a_time(sum(s.length for s in slices))
        return max(t, 2.0 * self.gather_time()) if self.zero3 else t

    def _link(self, group: int) -> tuple[float, float, float]:
        """``(latency, intra bandwidth, inter bandwidth)`` of a collective over ``group`` GPUs,
        and whether it leaves the node (inter bandwidth 0 when it does not)."""
        if group <= self.gpus_per_node:
            return self.intra_node_latency_s, self.intra_node_bandwidth, 0.0
        return self.inter_node_latency_s, self.intra_node_bandwidth, self.inter_node_bandwidth

    def a2a_time(self, tokens: int) -> float:
        """The four all-to-alls of one decoder layer in one direction for a chunk of ``tokens``
        tokens (module docstring); 0 at ``sp = 1``."""
        sp = self.sp
        if sp <= 1:
            return 0.0
        moved = self._a2a_bytes(sp) * tokens / sp * (sp - 1) / sp
        lat, intra, inter = self._link(sp)
        if not inter:
            return 4 * lat + moved / intra
        g = self.gpus_per_node
        return 4 * lat + max(moved * (sp - g) / (sp - 1) / inter, moved * (g - 1) / (sp - 1) / intra)

    def _a2a_bytes(self, sp: int) -> float:
        """Bytes per token of the four tensors, K and V replicated up to ``sp`` heads."""
        if not self.num_kv_heads or not self.num_heads or sp <= self.num_kv_heads:
            return self.a2a_bytes_per_token
        per_head = self.a2a_bytes_per_token / (2 * (self.num_heads + self.num_kv_heads))
        return 2 * per_head * (self.num_heads + sp)

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

    def fwd_time(self, layout: StageLayout, stage: int, chunk: Chunk) -> float:
        """Forward time of ``chunk`` on ``stage`` (its layers, plus embedding / head); a placed
        chunk (whole-doc / per-doc): its busiest GPU's, the K/V all-gathers included."""
        if chunk.placement and self.sp > 1:
            return self._placed_fwd(layout, stage, chunk)
        t = layout.num_stage_layers(stage) * self.layer_fwd_time(chunk.slices)
        if layout.has_embedding(stage):
            t += self.embed_time_per_token * chunk.num_tokens + self.embed_time_per_call
        if layout.has_head(stage):
            t += self.head_time(chunk.num_tokens)
        return t

    def head_time(self, tokens: int) -> float:
        """Forward seconds of the head and loss on a chunk of ``tokens`` tokens: interpolated
        between the measured ``head_time_points`` (beyond the ends, their nearest point moved
        along the per-token rate), else ``head_time_per_call + head_time_per_token * tokens``."""
        pts = self.head_time_points
        if not pts:
            return self.head_time_per_call + self.head_time_per_token * tokens
        (t0, s0), (t1, s1) = pts[0], pts[-1]
        if tokens <= t0:
            return max(0.0, s0 - self.head_time_per_token * (t0 - tokens))
        if tokens >= t1:
            return s1 + self.head_time_per_token * (tokens - t1)
        i = bisect.bisect_left(pts, (tokens, -1.0))
        (xa, ya), (xb, yb) = pts[i - 1], pts[i]
        return ya + (yb - ya) * (tokens - xa) / (xb - xa)

    def bwd_time(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int = 0) -> float:
        """Backward time, including ``recompute_layers`` extra layer forwards."""
        if chunk.placement and self.sp > 1:
            return self._placed_bwd(layout, stage, chunk, recompute_layers)
        if self.sp == 1 and not self.zero3:
            return self.bwd_factor * self.fwd_time(layout, stage, chunk) + self.recompute_time(chunk, recompute_layers)
        t = layout.num_stage_layers(stage) * self.layer_bwd_time(chunk.slices)
        if layout.has_embedding(stage):
            t += self.bwd_factor * (self.embed_time_per_token * chunk.num_tokens + self.embed_time_per_call)
        if layout.has_head(stage):
            t += self.bwd_factor * self.head_time(chunk.num_tokens)
        return t + self.recompute_time(chunk, recompute_layers)

    def recompute_time(self, chunk: Chunk, recompute_layers: int) -> float:
        """Extra forwards of ``recompute_layers`` layers in the chunk's backward (their
        all-to-alls included; ``zero3``: the weights the backward gathers serve them; a placed
        chunk: its busiest GPU's and the K/V all-gathers)."""
        if chunk.placement and self.sp > 1:
            base = self.rank_model()
            info = self._placement(chunk)
            return (max(base.recompute_time(rc, recompute_layers) for rc in info.time_chunks(chunk))
                    + recompute_layers * self.gather_kv_time(info.gathered))
        if self.sp == 1 and not self.zero3:
            return recompute_layers * self.recompute_factor * self.layer_fwd_time(chunk.slices)
        return recompute_layers * (self.recompute_factor * self.layer_compute_time(chunk.slices)
                                   + self.a2a_time(chunk.num_tokens))

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
        a = self.a2a_time(chunk.num_tokens)
        return a * (layout.num_stage_layers(stage) + (recompute_layers if backward else 0))

    def p2p_time(self, chunk: Chunk) -> float:
        """Time to send one chunk's hidden states (or their gradient) to the next stage (sp
        rank to the same sp rank: a placed chunk's busiest rank's tokens)."""
        if chunk.placement and self.sp > 1:
            return self.p2p_latency_s + (self.rank_model().hidden_bytes_per_token
                                         * max(self._placement(chunk).rank_tokens) / self.p2p_bandwidth)
        return self.p2p_latency_s + self.hidden_bytes_per_token * chunk.num_tokens / self.p2p_bandwidth

    # ------------------------------------------------------------------ memory
    def act_memory(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int = 0) -> float:
        """Bytes a chunk holds on ``stage`` from its forward until its backward.

        A split chunk keeps its K/V on recomputed layers too (later slices attend to it); a
        hybrid chunk's tail slice is final and keeps no K/V of its own (``chunk.kind`` says which).
        A placed chunk: its busiest GPU's (:meth:`_placed_act`).
        """
        if chunk.placement and self.sp > 1:
            return self._placed_act(layout, stage, chunk, recompute_layers)
        n = layout.num_stage_layers(stage)
        tok = chunk.num_tokens
        kv_tok = tok if chunk.kind is ChunkKind.SPLIT else 0
        saved = n - recompute_layers
        mem = saved * self.act_bytes_per_token * tok
        mem += recompute_layers * (self.ckpt_bytes_per_token * tok + self.kv_bytes_per_token * kv_tok)
        if recompute_layers and self.ckpt_chunk_bytes_per_token:
            mem += self.ckpt_chunk_bytes_per_token * tok
        if n:
            mem += self.stage_bytes_per_token * tok  # what the layers share (saved or replayed)
        mem += self.ids_bytes_per_token * tok * (layout.has_embedding(stage) + layout.has_head(stage))
        if layout.has_head(stage):
            mem += self.logits_bytes_per_token * tok
        else:
            mem += self.output_bytes_per_token * tok
        if saved and self.context_bytes_per_token:
            # keys attended to beyond the slice's own (its earlier slices'), and the own K/V a
            # non-final slice keeps in the store besides that concatenated copy
            ctx_tok = sum(self._attended(s.context) + (s.length if chunk.kind is ChunkKind.SPLIT else 0)
                          for s in chunk.slices if s.context > 0)
            mem += saved * self.context_bytes_per_token * ctx_tok
        if saved and self.segment_global_fraction:
            # segment-level training's global heads: per saved layer, their keys and values of every
            # token before the tail, gathered per query head for the backward (the runtime's copy)
            per_head = self.kv_bytes_per_token / max(1, self.num_kv_heads or self.num_heads)
            beyond = sum(s.context - self._attended(s.context) for s in chunk.slices)
            mem += saved * self.segment_global_fraction * self.num_heads * per_head * beyond
        return mem

    def kv_grad_memory(self, layout: StageLayout, stage: int, earlier_tokens: int) -> float:
        """Bytes of K/V gradient buffers for ``earlier_tokens`` tokens of earlier slices, alive
        while a split sequence's later slices run backward."""
        return layout.num_stage_layers(stage) * self.kv_bytes_per_token * earlier_tokens

    def transient_memory(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int = 0,
                         layer_extra: float = 0.0) -> float:
        """Extra bytes during the chunk's backward: the incoming/outgoing hidden-state gradients
        (or the measured peak of a layer's or the head's backward, when larger), plus a
        recomputed layer's activations when every layer of the stage recomputes (see the module
        docstring: with ``recompute_layers < n`` the saved layers' backwards free more first),
        plus, whatever the chunk's size, the weight gradient a backward computes before adding
        it into ``.grad`` (``bwd_transient_bytes``, ``head_bwd_transient_bytes``: a short chunk
        on a large vocabulary can hold more in the LM head's weight gradient than in its
        activations). The embedding's backward is a moment of its own
        (:meth:`embed_bwd_memory`). ``layer_extra``: bytes a layer's backward holds besides (a
        placed chunk's gathered dK/dV, :meth:`_placed_transient`)."""
        if chunk.placement and self.sp > 1:
            return self._placed_transient(layout, stage, chunk, recompute_layers)
        tok = chunk.num_tokens
        n = layout.num_stage_layers(stage)
        # a layer's backward: its gradients in flight (at least the hidden-state gradients in
        # and out), plus the activations it recomputes when no saved layer freed room first
        layer = max(2 * self.hidden_bytes_per_token, self.bwd_transient_bytes_per_token) * tok
        if n and self.bwd_transient_bytes:
            # while it computes a weight gradient (the per-token peak is another moment of it)
            layer = max(layer, self.bwd_transient_bytes + self.bwd_transient_slope * tok)
        if n and self.bwd_context_bytes_per_token:
            # a slice with context: the attention's backward, one slice at a time, holds the
            # gradients of every key and value the slice attended to
            keys = max((self._attended(s.context) + s.length for s in chunk.slices if s.context > 0), default=0)
            layer = max(layer, self.bwd_context_bytes_per_token * keys)
        if n and recompute_layers >= n:
            if self.recompute_bwd_transient_bytes_per_token:
                # measured with the replay: it holds less than a saved layer's activations
                layer = max(layer, self.recompute_bwd_transient_bytes_per_token * tok)
            else:
                layer += self.act_bytes_per_token * tok
        if n:
            layer += layer_extra
        head = 0.0
        if layout.has_head(stage):
            if self.head_bwd_transient_bytes_per_token:
                # measured: the head's backward comes first, alone, and frees the logits before
                # any layer's backward starts (the analytic model keeps the conservative sum)
                head = self.head_bwd_transient_bytes_per_token * tok
                layer -= self.logits_bytes_per_token * tok
            if self.head_bwd_transient_bytes:
                head = max(head, self.head_bwd_transient_bytes + self.head_bwd_transient_slope * tok)
        return max(layer, head, 0.0)

    def embed_bwd_memory(self, layout: StageLayout, stage: int, chunk: Chunk) -> float:
        """Bytes of the chunk during the embedding's backward (stage 0, the last thing its
        backward runs, after every layer freed its activations): the embedding's dense weight
        gradient before it is added into ``.grad`` and the per-token gradients still held (with
        more stages, the received gradient and the stage output it belongs to too, until the
        backward returns). 0 on other stages (no such moment)."""
        if not layout.has_embedding(stage) or not (self.embed_bwd_transient_bytes or self.embed_bwd_bytes_per_token):
            return 0.0
        per_tok = self.embed_bwd_bytes_per_token
        if not layout.has_head(stage):
            per_tok += 2 * self.hidden_bytes_per_token
        return self.embed_bwd_transient_bytes + per_tok * chunk.num_tokens

    def _stage_params(self, layout: StageLayout, stage: int) -> int:
        params = layout.num_stage_layers(stage) * self.layer_params
        if layout.has_embedding(stage):
            params += self.embed_params
        if layout.has_head(stage):
            params += self.head_params
        return params

    def static_memory(self, layout: StageLayout, stage: int) -> float:
        """Weights, gradients and optimizer state on one GPU of ``stage`` (module docstring):
        ``static_bytes_per_param`` whole and ``sharded_bytes_per_param`` over ``state_shards``
        per parameter; ``zero3``: everything over ``state_shards``, plus the gathered weights of
        two layers and of the larger of embedding and head."""
        params = self._stage_params(layout, stage)
        if self.zero3:
            gathered = 2 * self.layer_params + max(self.embed_params, self.head_params)
            return self.sharded_state_memory(layout, stage) + gathered * self.dtype_bytes
        if self.sharded_bytes_per_param:
            return params * (self.static_bytes_per_param + self.sharded_bytes_per_param / self.state_shards)
        return params * self.static_bytes_per_param

    def sharded_state_memory(self, layout: StageLayout, stage: int) -> float:
        """``zero3``: the shards one GPU of ``stage`` holds (weights, gradients and optimizer
        state over ``state_shards``), without the gathered working set of :meth:`static_memory`."""
        per = (self.static_bytes_per_param + self.sharded_bytes_per_param) / self.state_shards
        return self._stage_params(layout, stage) * per

    # ------------------------------------------------------------------ serialization
    def _attended(self, context: int) -> int:
        """Earlier keys a slice with ``context`` attends to (``min(C, W)`` under a segment K/V tail)."""
        return context if self.segment_kv_tail is None else min(context, self.segment_kv_tail)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["segment_kv_tail"] is None:  # a plan's setting, not a coefficient: files stay as they were
            del d["segment_kv_tail"]
        if not d["segment_global_fraction"]:
            del d["segment_global_fraction"]
        if d["sp_rank"] is None:
            del d["sp_rank"]
        if not d["whole_doc_carried"]:
            del d["whole_doc_carried"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostModel":
        """A model from :meth:`to_dict` (fields added since default to what they add nothing at).
        Models saved with a dense-mask attention term (``alpha_mask``, ``mask_bytes_per_pair``:
        a CPU backend that attended over ``T x S`` whenever a chunk needed a mask) load when the
        terms are 0 and are refused otherwise: no backend computes that now."""
        d = dict(d)
        retired = {k: d.pop(k) for k in _RETIRED_FIELDS if k in d}
        if any(retired.values()):
            raise ValueError(f"this cost model was profiled on a dense-mask attention backend ({retired}), which "
                             "no backend is now; profile the model again")
        if "head_time_points" in d:  # JSON gives lists
            d["head_time_points"] = tuple((float(t), float(s)) for t, s in d["head_time_points"])
        if "whole_doc_carried" in d:
            d["whole_doc_carried"] = tuple(tuple(int(x) for x in e) for e in d["whole_doc_carried"])
        return cls(**d)



@functools.lru_cache(maxsize=16)
def _rank_model(cost: CostModel) -> CostModel:
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
    #: slices' (per-doc too, :meth:`~.types.Plan.validate_placements`: sharded over the ranks),
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


def _whole_doc_carried(plan: Any) -> tuple[tuple[int, int, int], ...]:
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
