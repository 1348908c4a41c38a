"""Cost model: time and memory of one chunk on one pipeline stage.

Per decoder layer, for a chunk whose slices have lengths ``s_i`` and contexts ``C_i``::

    forward  = alpha_attn * sum((C_i + s_i)^2 - C_i^2) + alpha_tok * sum(s_i) + beta
    backward = bwd_factor * forward          (+ one more forward per recomputed layer)

The attention term counts (query, key) pairs under the causal mask, so a late slice of a long
sequence costs more than an early one of the same length; a chunked-attention layer (Llama 4's,
:attr:`CostModel.chunked_layers`) counts those within its chunk of ``attention_chunk`` tokens
only (:func:`attn_pairs`), linear in a long sequence's length; a sliding-window layer
(:attr:`CostModel.windowed_layers`) those within its window (:func:`windowed_pairs`). The first stage adds the embedding,
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

Terms of the real runtime beyond those (the analytic model counts them from the config,
:mod:`.activations`, where marked; the profiler measures them): a slice with context ``C``
saves, on every layer that keeps its activations, the concatenated keys and values it attends to
(``context_bytes_per_token`` per layer and context token, analytic for the varlen and eager
kernels; a non-final slice with context also keeps its own K/V in the store, counted with the
same coefficient); the eager attention formula (soft-capped scores, sinks) keeps, per saved
layer, its score blocks: ``attn_bytes_per_pair`` per entry of each slice's ``s x (C + s)``
block (analytic; the fused kernels keep none); a stage other than the last keeps its
output until the backward (``output_bytes_per_token``, analytic); a chunk with any recomputed layer keeps,
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

**Layer kinds.** A model with linear-attention (Gated DeltaNet) or Mamba2 layers lists each layer's kind
(:attr:`CostModel.layer_kinds`, from ``config.layer_types``: :mod:`.mixers`); empty, every layer is
an attention layer and nothing below changes. A linear layer's forward is
``lin_alpha_tok * sum(s_i) + lin_beta_segment * slices + beta`` (no context term: a slice reads a
fixed-size state; a per-segment overhead: one scan call per slice), plus ``lin_pad_time_per_token``
per token of each slice's padding to ``lin_scan_chunk`` (a profiled chunked scan, which computes its
padding: HF's torch scan on CPU); saved, it keeps
``lin_act_bytes_per_token`` per token (a Mamba2 layer also ``lin_act_bytes_per_slice`` per slice and
``lin_pad_bytes_per_token`` per token of each slice's padding to ``lin_scan_chunk``); recomputed,
its input as an attention layer; it keeps no
K/V, but a non-final slice keeps its state and convolution tail (``lin_state_bytes`` per linear
layer, saved or recomputed) and the later slices' backward its gradient. A stage's time, memory
and parameters count its layers by kind (the partition balances per-layer costs). The recompute
planner's model is linear in ``r``: a recomputed layer is priced in memory at its stage's mix of
kinds and in time as the model's mean layer (:meth:`CostModel.recompute_time` does not know the
stage), not as the stage's first ``r`` layers' own kinds (exact at ``r = 0`` and ``r = n``). At sp > 1
(Ulysses, Gated DeltaNet only) a linear layer's per-token time, activations and state are one GPU's
share and it adds two all-to-alls per direction (:meth:`ParallelCosts.lin_a2a_time`).

A stage of several GPUs (Ulysses inside attention), a chunk placed whole-doc / per-doc over
them and sharded weights and optimizer state are priced by :mod:`.cost_parallel`
(:class:`~.cost_parallel.ParallelCosts`, whose methods :class:`CostModel` inherits): the formulas
above then hold per GPU, with the collectives added.

**Within the profiled range.** The time model is linear in tokens and pairs, which measured
chunks follow only up to a size: a profiled model records its largest profiled chunk
(``max_chunk_tokens``), under which every pipeline strategy plans (profile up to the chunk sizes a
run should use). The LM head's time per token is not one line either: a profile keeps it at a
ladder of chunk sizes (``head_time_points``, interpolated), and the embedding's and head's
per-call constants (``embed_time_per_call``, ``head_time_per_call``), so the partition and the
simulator price the end stages at the chunk sizes plans use.

Two ways to a model: :meth:`CostModel.from_hf_config` (FLOPs and bytes of the architecture at a
device's rates, :mod:`.coefficients`) and :func:`concertina_hf.planning.fit.fit_profile` (least
squares over measured samples, e.g. from :mod:`concertina_hf.runtime.profiler`).
Pure Python; no torch.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .coefficients import analytic_coefficients
from .cost_parallel import ParallelCosts, whole_doc_carried_of
from .segments import parse_heads
from .types import Chunk, ChunkKind, Slice, StageLayout

__all__ = ["CostModel", "attn_pairs", "windowed_pairs"]

#: fields of cost models saved before, no longer modelled (:meth:`CostModel.from_dict`)
_RETIRED_FIELDS = ("alpha_mask", "mask_bytes_per_pair")


def windowed_pairs(context: int, length: int, window: int) -> int:
    """:func:`attn_pairs` of one slice under a sliding window of ``window`` keys (a query attends to
    its ``window`` latest keys, itself included): quadratic while a query's keys fit in the window,
    ``2 * window`` per query beyond.

    >>> windowed_pairs(0, 4, 8), windowed_pairs(0, 12, 4), windowed_pairs(8, 4, 4)
    (16, 80, 32)
    """
    a, b = min(context, window), min(context + length, window)
    return b * b - a * a + 2 * window * max(0, context + length - max(context, window))


def attn_pairs(slices: Iterable[Slice], kv_tail: int | None = None, chunk: int | None = None) -> int:
    """(query, key) pairs of causal attention: ``sum((C+s)^2 - C^2)`` (twice the true count,
    a constant absorbed by ``alpha_attn``): a late slice costs more than an early one. Under a
    segment K/V tail ``W`` (segment-level training) a slice attends to ``min(C, W)`` earlier keys.
    Under chunked attention (chunks of ``chunk`` tokens of the document, Llama 4) a query attends
    within its chunk only: per piece of a slice within one chunk, its keys from the chunk's edge,
    so a long sequence's pairs grow linearly in its length.

    >>> attn_pairs([Slice(0, 0, 4)]), attn_pairs([Slice(0, 8, 4)]), attn_pairs([Slice(0, 8, 4)], 2)
    (16, 80, 32)
    >>> attn_pairs([Slice(0, 0, 16)], chunk=8), attn_pairs([Slice(0, 6, 4)], chunk=8)
    (128, 32)
    """
    if chunk is not None:
        return sum(_chunked_pairs(s.context, s.length, chunk, kv_tail) for s in slices)
    if kv_tail is None:
        return sum((s.context + s.length) ** 2 - s.context**2 for s in slices)
    return sum((min(s.context, kv_tail) + s.length) ** 2 - min(s.context, kv_tail) ** 2 for s in slices)




def _chunked_pairs(context: int, length: int, chunk: int, kv_tail: int | None) -> int:
    """:func:`attn_pairs` of one slice under chunked attention: per piece ``[a, b)`` within the
    chunk starting at ``e``, ``(c_in + b - a)^2 - c_in^2`` with ``c_in`` its earlier keys in the
    chunk (``a - e``, nonzero only for the slice's first piece; at most ``W`` under a K/V tail)."""
    total, a, end = 0, context, context + length
    while a < end:
        e = (a // chunk) * chunk
        b = min(e + chunk, end)
        c_in = a - e if kv_tail is None else min(a - e, kv_tail)
        total += (c_in + b - a) ** 2 - c_in**2
        a = b
    return total


@dataclass(frozen=True, slots=True)
class CostModel(ParallelCosts):
    """Per-layer coefficients of time and memory; see the module docstring for the formulas (and
    :mod:`.cost_parallel` for a stage of several GPUs, placed chunks and sharded state)."""

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
    # per saved layer and entry of each slice's s x (C + s) score block: what the eager attention
    # formula keeps (probabilities, soft-capped scores, mask); 0 for the fused kernels
    attn_bytes_per_pair: float = 0.0
    # ... and what a layer's backward holds per entry of a slice's block besides (their gradients)
    bwd_transient_bytes_per_pair: float = 0.0
    # per chunk token on the first stage (the ids the embedding saves) and on the last (the
    # targets the loss saves): a whole chunk's on every GPU of the stage (a rank's share is a
    # view of them), so not divided by sp
    ids_bytes_per_token: float = 0.0
    # a recomputed layer's forward, relative to a plain one (non-reentrant checkpointing stops
    # the replay once the tensors backward needs exist, so the last ops are skipped)
    recompute_factor: float = 1.0
    # a stage of several GPUs and sharded state (:mod:`.cost_parallel`, ``with_parallel``)
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
    # GPUs (:meth:`CostModel.at_rank`: a per-rank prediction); None, the planner's: each chunk's busiest
    # rank. Not a fitted coefficient: to_dict leaves it out while None.
    sp_rank: int | None = None
    # whole-doc slices whose sequence's earlier slices ran per-doc (placement.py: a last slice too
    # short to cut into 2 sp pieces): ``(seq, start, tokens)``, those tokens' K/V, sharded over the
    # stage, gathered again per layer on every GPU for the slice. Set by for_plan from the plan;
    # to_dict leaves it out while empty.
    whole_doc_carried: tuple[tuple[int, int, int], ...] = ()
    # each decoder layer's kind, "attention" or "linear" (a Gated DeltaNet: module docstring,
    # :mod:`.mixers`); empty: every layer attention. to_dict leaves these out while empty
    layer_kinds: tuple[str, ...] = ()
    # chunked-attention layers (Llama 4's, config.layer_types "chunked_attention"): their indices and
    # the chunk size; their attention term counts the pairs within the chunk (attn_pairs). to_dict
    # leaves these out while empty
    chunked_layers: tuple[int, ...] = ()
    attention_chunk: int = 0
    lin_alpha_tok: float = 0.0  # a linear layer's forward seconds per token
    lin_beta_segment: float = 0.0  # ... per slice of the chunk (one scan call each)
    lin_act_bytes_per_token: float = 0.0  # what a saved linear layer keeps per token
    lin_state_bytes: float = 0.0  # per linear layer and non-final slice: its state and convolution tail
    # per saved linear layer and slice: what a scan call keeps besides its tokens' (a Mamba2 scan's
    # initial state), and per token of the padding of each call to a multiple of lin_scan_chunk
    lin_act_bytes_per_slice: float = 0.0
    lin_scan_chunk: int = 0
    lin_pad_bytes_per_token: float = 0.0
    # Falcon-H1's layers, a Mamba2 beside the attention (mixers.hybrid_mixer_terms): per saved layer and
    # slice its scan call's initial state, per token of each call's padding to hybrid_scan_chunk; per
    # layer and split chunk the state and convolution tail kept. to_dict leaves them out while 0
    hybrid_act_bytes_per_slice: float = 0.0
    hybrid_scan_chunk: int = 0
    hybrid_pad_bytes_per_token: float = 0.0
    hybrid_state_bytes: float = 0.0
    lin_pad_time_per_token: float = 0.0  # forward seconds per token of that padding (profiled)
    lin_layer_params: int = 0  # parameters of a linear layer
    # a Gated DeltaNet layer's two all-to-alls under Ulysses, bytes per token (whole, sp = 1): the
    # convolution's input with beta and a, and the scan's output (0: its layers refuse sp > 1)
    lin_a2a_bytes_per_token: float = 0.0
    # per decoder layer, its attention shape against the model's attention layer (per-layer configs:
    # heads, K/V heads, head size per layer; :func:`~.coefficients.layer_fields`): factors on
    # (alpha_attn, alpha_tok, act_bytes_per_token, kv_bytes_per_token, layer_params); empty: all alike.
    # to_dict leaves it out while empty
    layer_scales: tuple[tuple[float, float, float, float, float], ...] = ()
    # decoder-layer ranges [a, b] a stage holds whole: layers up to b read the K/V layer a wrote (Gemma 4's
    # KV sharing, num_kv_shared_layers; the runtime passes no K/V between stages), kept together by the
    # partition. to_dict leaves it out while empty
    kv_share_spans: tuple[tuple[int, int], ...] = ()
    # sliding-window layers (config.layer_types' sliding_attention; config.sliding_window =
    # attention_window): a query attends to its attention_window latest keys, itself included
    # (:func:`windowed_pairs`). to_dict leaves them out while empty
    windowed_layers: tuple[int, ...] = ()
    attention_window: int = 0

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(cls, config: Any, *args: Any, **kwargs: Any) -> "CostModel":
        """Analytic model from an HF decoder config (a ``PretrainedConfig`` or a dict):
        :func:`~.coefficients.analytic_coefficients`'s fields, with its arguments (``device``,
        ``dtype_bytes``, ``static_bytes_per_param``, ``compute_dtype_bytes``: autocast's dtype,
        ``attention_kernel``: the runtime's kernel)."""
        return cls(**analytic_coefficients(config, *args, **kwargs))

    def for_plan(self, plan: Any) -> "CostModel":
        """The model a plan runs under: this one with the plan's segment K/V tail and global heads
        (:mod:`.segments`) and its whole-doc slices reading per-doc K/V
        (:attr:`whole_doc_carried`), at the plan's own stage size and sharding when it records them
        (knobs ``sp``, ``state_shards``, ``zero3``: the ``sp-only`` baseline's plans, which run the
        replica's GPUs as one stage)."""
        tail = plan.knob("segment_kv_tail") if plan.knob("segment_tokens") is not None else None
        heads = parse_heads(plan.knob("segment_global_heads")) if tail is not None else ()
        glob = min(1.0, len(heads) / self.num_heads) if heads and self.num_heads else 0.0
        if tail != self.segment_kv_tail or glob != self.segment_global_fraction:
            return dataclasses.replace(self, segment_kv_tail=tail, segment_global_fraction=glob).for_plan(plan)
        carried = whole_doc_carried_of(plan)
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

    # ------------------------------------------------------------------ time
    def layer_compute_time(self, slices: Sequence[Slice]) -> float:
        """Forward compute of one decoder layer on one GPU (no communication)."""
        tok = sum(s.length for s in slices)
        pairs = attn_pairs(slices, self.segment_kv_tail)
        if self.segment_global_fraction:  # global heads attend to every earlier key
            g = self.segment_global_fraction
            pairs = (1.0 - g) * pairs + g * attn_pairs(slices)
        return self.alpha_attn * pairs + self.alpha_tok * tok + self.beta

    def linear_layer_time(self, slices: Sequence[Slice]) -> float:
        """Forward compute of one linear-attention layer: linear in tokens, per slice an overhead, per
        token of the slices' padding to ``lin_scan_chunk`` its share."""
        t = self.lin_alpha_tok * sum(s.length for s in slices) + self.lin_beta_segment * len(slices) + self.beta
        if self.lin_pad_time_per_token and self.lin_scan_chunk:
            t += self.lin_pad_time_per_token * sum(-s.length % self.lin_scan_chunk for s in slices)
        return t

    def linear_layer_fwd_time(self, slices: Sequence[Slice]) -> float:
        """Forward of one linear-attention layer, its all-to-alls included (``sp > 1``)."""
        return self.linear_layer_time(slices) + self.lin_a2a_time(sum(s.length for s in slices))

    def chunked_saving(self, slices: Sequence[Slice]) -> float:
        """Forward compute a chunked-attention layer saves against a full one on ``slices``."""
        if not self.chunked_layers:
            return 0.0
        pairs = attn_pairs(slices, self.segment_kv_tail) - attn_pairs(slices, self.segment_kv_tail,
                                                                      self.attention_chunk)
        return self.alpha_attn * pairs

    def num_chunked(self, layout: StageLayout, stage: int) -> int:
        """Chunked-attention layers of ``stage``."""
        a, b = layout.layer_ranges[stage]
        return sum(1 for i in self.chunked_layers if a <= i < b)

    def layer_kind_counts(self, layout: StageLayout, stage: int, first: int | None = None) -> tuple[int, int]:
        """``(attention, linear)`` decoder layers of ``stage`` (of its ``first`` layers when given)."""
        a, b = layout.layer_ranges[stage]
        if first is not None:
            b = min(b, a + first)
        kinds = self.layer_kinds
        lin = sum(1 for i in range(a, b) if i < len(kinds) and kinds[i] == "linear") if kinds else 0
        return b - a - lin, lin

    def shape_sums(self, layout: StageLayout, stage: int) -> tuple[float, ...]:
        """The factors of :attr:`layer_scales` summed over ``stage``'s attention layers (its
        attention layer count each, without per-layer shapes)."""
        a, b = layout.layer_ranges[stage]
        kinds = self.layer_kinds
        rows = [self.layer_scales[i] if i < len(self.layer_scales) else (1.0,) * 5 for i in range(a, b)
                if not (i < len(kinds) and kinds[i] == "linear")]
        return tuple(sum(r[k] for r in rows) for k in range(5))

    def _shape_extra_time(self, n_attn: float, sums: Sequence[float], slices: Sequence[Slice]) -> float:
        """Forward compute of attention layers of the shape factors ``sums`` beyond ``n_attn`` model layers."""
        pairs = attn_pairs(slices, self.segment_kv_tail)
        if self.segment_global_fraction:
            g = self.segment_global_fraction
            pairs = (1.0 - g) * pairs + g * attn_pairs(slices)
        tok = sum(s.length for s in slices)
        return (sums[0] - n_attn) * self.alpha_attn * pairs + (sums[1] - n_attn) * self.alpha_tok * tok

    def window_saving(self, slices: Sequence[Slice]) -> float:
        """Forward compute a sliding-window layer (of the model's attention shape) saves against a full one."""
        if not self.windowed_layers:
            return 0.0
        full = attn_pairs(slices, self.segment_kv_tail)
        windowed = sum(windowed_pairs(s.context, s.length, self.attention_window) for s in slices)
        return self.alpha_attn * max(0, full - windowed)

    def windowed_share(self, layout: StageLayout, stage: int) -> float:
        """``stage``'s sliding-window layers, each at its attention shape's factor (:attr:`layer_scales`)."""
        a, b = layout.layer_ranges[stage]
        scales = self.layer_scales
        return sum(scales[i][0] if i < len(scales) else 1.0 for i in self.windowed_layers if a <= i < b)

    def _mean_linear_share(self) -> float:
        kinds = self.layer_kinds
        return sum(k == "linear" for k in kinds) / len(kinds) if kinds else 0.0

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

    def fwd_time(self, layout: StageLayout, stage: int, chunk: Chunk) -> float:
        """Forward time of ``chunk`` on ``stage`` (its layers, plus embedding / head); a placed
        chunk (whole-doc / per-doc): its busiest GPU's, the K/V all-gathers included."""
        if chunk.placement and self.sp > 1:
            return self._placed_fwd(layout, stage, chunk)
        n_attn, n_lin = self.layer_kind_counts(layout, stage)
        t = n_attn * self.layer_fwd_time(chunk.slices)
        if self.layer_scales:  # per-layer attention shapes: the stage's own layers
            t += self._shape_extra_time(n_attn, self.shape_sums(layout, stage), chunk.slices)
        if self.windowed_layers:  # sliding-window layers: the keys within their window only
            t -= self.windowed_share(layout, stage) * self.window_saving(chunk.slices)
        if n_lin:
            t += n_lin * self.linear_layer_fwd_time(chunk.slices)
        if self.chunked_layers:  # attention within the chunk only
            t -= self.num_chunked(layout, stage) * self.chunked_saving(chunk.slices)
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
        n_attn, n_lin = self.layer_kind_counts(layout, stage)
        t = n_attn * self.layer_bwd_time(chunk.slices)
        if n_lin:
            t += n_lin * (self.bwd_factor * self.linear_layer_time(chunk.slices) + self.lin_a2a_time(chunk.num_tokens))
        if self.chunked_layers:
            t -= self.bwd_factor * self.num_chunked(layout, stage) * self.chunked_saving(chunk.slices)
        if self.layer_scales:
            t += self.bwd_factor * self._shape_extra_time(n_attn, self.shape_sums(layout, stage), chunk.slices)
        if self.windowed_layers:
            t -= self.bwd_factor * self.windowed_share(layout, stage) * self.window_saving(chunk.slices)
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
            return self._placed_recompute(chunk, recompute_layers)
        if self.sp == 1 and not self.zero3:
            layer = self.layer_fwd_time(chunk.slices)
            if self.chunked_layers:  # the model's mean layer, as for the kinds below
                layer -= len(self.chunked_layers) / self.num_layers * self.chunked_saving(chunk.slices)
            if self.layer_scales:  # the model's mean attention layer, as for the kinds below
                n = len(self.layer_scales)
                layer += self._shape_extra_time(1.0, [sum(r[k] for r in self.layer_scales) / n for k in range(2)],
                                                chunk.slices)
            if self.windowed_layers:  # the model's mean layer
                whole = StageLayout(self.num_layers, ((0, self.num_layers),))
                layer -= self.windowed_share(whole, 0) / self.num_layers * self.window_saving(chunk.slices)
            share = self._mean_linear_share()
            if share:  # the model's mean layer (the stage is not known here: module docstring)
                layer = (1.0 - share) * layer + share * self.linear_layer_time(chunk.slices)
            return recompute_layers * self.recompute_factor * layer
        layer = self.recompute_factor * self.layer_compute_time(chunk.slices) + self.a2a_time(chunk.num_tokens)
        share = self._mean_linear_share()
        if share:  # the model's mean layer, as at sp = 1
            layer = (1.0 - share) * layer + share * (self.recompute_factor * self.linear_layer_time(chunk.slices)
                                                     + self.lin_a2a_time(chunk.num_tokens))
        return recompute_layers * layer

    def p2p_time(self, chunk: Chunk) -> float:
        """Time to send one chunk's hidden states (or their gradient) to the next stage (sp
        rank to the same sp rank: a placed chunk's busiest rank's tokens)."""
        if chunk.placement and self.sp > 1:
            return self._placed_p2p(chunk)
        return self.p2p_latency_s + self.hidden_bytes_per_token * chunk.num_tokens / self.p2p_bandwidth

    # ------------------------------------------------------------------ memory
    def act_memory(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int = 0) -> float:
        """Bytes a chunk holds on ``stage`` from its forward until its backward.

        A split chunk keeps its K/V on recomputed layers too (later slices attend to it); a
        hybrid chunk's tail slice is final and keeps no K/V of its own (``chunk.kind`` says which).
        A placed chunk: its busiest GPU's (:meth:`ParallelCosts._placed_act`).
        """
        if chunk.placement and self.sp > 1:
            return self._placed_act(layout, stage, chunk, recompute_layers)
        n = layout.num_stage_layers(stage)
        tok = chunk.num_tokens
        kv_tok = tok if chunk.kind is ChunkKind.SPLIT else 0
        saved = n - recompute_layers
        mem = saved * self.act_bytes_per_token * tok
        if self.hybrid_state_bytes:  # Falcon-H1's Mamba2 beside each layer's attention
            c = self.hybrid_scan_chunk
            pad = sum(-s.length % c for s in chunk.slices) if c else 0
            mem += saved * (self.hybrid_act_bytes_per_slice * len(chunk.slices) + self.hybrid_pad_bytes_per_token * pad)
            mem += n * self.hybrid_state_bytes * (chunk.kind is ChunkKind.SPLIT)
        mem += recompute_layers * (self.ckpt_bytes_per_token * tok + self.kv_bytes_per_token * kv_tok)
        if recompute_layers and self.ckpt_chunk_bytes_per_token:
            mem += self.ckpt_chunk_bytes_per_token * tok
        attn_saved = saved
        if self.layer_kinds:  # linear layers: their own bytes, no K/V, a state per non-final slice
            # the recomputed layers at the stage's mix of kinds (linear in r, as the recompute
            # planner's model; exact at r = 0 and r = n)
            _, lin = self.layer_kind_counts(layout, stage)
            lin_rec = lin * recompute_layers / n if n else 0.0
            attn_saved = saved - (lin - lin_rec)
            mem += (lin - lin_rec) * (self.lin_act_bytes_per_token - self.act_bytes_per_token) * tok
            mem -= lin_rec * self.kv_bytes_per_token * kv_tok
            mem += lin * self.lin_state_bytes * (chunk.kind is ChunkKind.SPLIT)
            if self.lin_act_bytes_per_slice or self.lin_scan_chunk:
                pad = sum(-s.length % self.lin_scan_chunk for s in chunk.slices) if self.lin_scan_chunk else 0
                mem += (lin - lin_rec) * (self.lin_act_bytes_per_slice * len(chunk.slices)
                                          + self.lin_pad_bytes_per_token * pad)
        if self.layer_scales and n:  # per-layer shapes: the stage's mean attention layer's bytes
            # (linear in r, as the kinds above; exact at r = 0 and r = n)
            n_attn = self.layer_kind_counts(layout, stage)[0]
            sums = self.shape_sums(layout, stage)
            if n_attn:
                act_f, kv_f = sums[2] / n_attn - 1.0, sums[3] / n_attn - 1.0
                mem += act_f * attn_saved * self.act_bytes_per_token * tok
                mem += kv_f * (n_attn * recompute_layers / n) * self.kv_bytes_per_token * kv_tok
        if n:
            mem += self.stage_bytes_per_token * tok  # what the layers share (saved or replayed)
        mem += self.ids_bytes_per_token * tok * (layout.has_embedding(stage) + layout.has_head(stage))
        if layout.has_head(stage):
            mem += self.logits_bytes_per_token * tok
        else:
            mem += self.output_bytes_per_token * tok
        if attn_saved and self.context_bytes_per_token:
            # keys attended to beyond the slice's own (its earlier slices'), and the own K/V a
            # non-final slice keeps in the store besides that concatenated copy
            ctx_tok = sum(self._attended(s.context) + (s.length if chunk.kind is ChunkKind.SPLIT else 0)
                          for s in chunk.slices if s.context > 0)
            mem += attn_saved * self.context_bytes_per_token * ctx_tok
        if attn_saved and self.attn_bytes_per_pair:
            # the eager formula's score blocks, one slice at a time: its queries by the keys it
            # attends to (own ones included, masked entries too)
            block = sum(s.length * (self._attended(s.context) + s.length) for s in chunk.slices)
            mem += attn_saved * self.attn_bytes_per_pair * block
        if saved and self.segment_global_fraction:
            # segment-level training's global heads: per saved layer, their keys and values of every
            # token before the tail, gathered per query head for the backward (the runtime's copy)
            per_head = self.kv_bytes_per_token / max(1, self.num_kv_heads or self.num_heads)
            beyond = sum(s.context - self._attended(s.context) for s in chunk.slices)
            mem += saved * self.segment_global_fraction * self.num_heads * per_head * beyond
        return mem

    def kv_grad_memory(self, layout: StageLayout, stage: int, earlier_tokens: int) -> float:
        """Bytes of K/V gradient buffers for ``earlier_tokens`` tokens of earlier slices, alive
        while a split sequence's later slices run backward (a linear layer: its carried state's)."""
        n_attn, n_lin = self.layer_kind_counts(layout, stage)
        kv_layers = self.shape_sums(layout, stage)[3] if self.layer_scales else n_attn
        mem = kv_layers * self.kv_bytes_per_token * earlier_tokens
        if n_lin and earlier_tokens:
            mem += n_lin * self.lin_state_bytes
        return mem

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
        placed chunk's gathered dK/dV, :meth:`ParallelCosts._placed_transient`)."""
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
        if n and self.bwd_transient_bytes_per_pair:
            # the eager formula's backward, one slice at a time: gradients of its score block
            block = max(s.length * (self._attended(s.context) + s.length) for s in chunk.slices)
            layer = max(layer, self.bwd_transient_bytes_per_token * tok + self.bwd_transient_bytes_per_pair * block)
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
        n_attn, n_lin = self.layer_kind_counts(layout, stage)
        attn_params = self.shape_sums(layout, stage)[4] if self.layer_scales else n_attn
        params = round(attn_params * self.layer_params) + n_lin * self.lin_layer_params
        if layout.has_embedding(stage):
            params += self.embed_params
        if layout.has_head(stage):
            params += self.head_params
        return params

    def static_memory(self, layout: StageLayout, stage: int) -> float:
        """Weights, gradients and optimizer state on one GPU of ``stage``: ``static_bytes_per_param``
        per parameter (sharded state: :mod:`.cost_parallel`)."""
        if self.zero3 or self.sharded_bytes_per_param:
            return self._sharded_static_memory(layout, stage)
        return self._stage_params(layout, stage) * self.static_bytes_per_param

    def _attended(self, context: int) -> int:
        """Earlier keys a slice with ``context`` attends to (``min(C, W)`` under a segment K/V tail)."""
        return context if self.segment_kv_tail is None else min(context, self.segment_kv_tail)

    # ------------------------------------------------------------------ serialization
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
        if not d["layer_scales"]:
            del d["layer_scales"]
        if not d["kv_share_spans"]:
            del d["kv_share_spans"]
        if not d["windowed_layers"]:
            del d["windowed_layers"], d["attention_window"]
        if not d["chunked_layers"]:
            del d["chunked_layers"], d["attention_chunk"]
        if not d["layer_kinds"]:  # an attention model's file stays as it was
            for k in ("layer_kinds", "lin_alpha_tok", "lin_beta_segment", "lin_act_bytes_per_token",
                      "lin_state_bytes", "lin_layer_params", "lin_a2a_bytes_per_token"):
                del d[k]
        if not d["hybrid_state_bytes"]:  # only Falcon-H1's hybrid layers have them
            for k in ("hybrid_act_bytes_per_slice", "hybrid_scan_chunk", "hybrid_pad_bytes_per_token",
                      "hybrid_state_bytes"):
                d.pop(k, None)
        if not d["lin_act_bytes_per_slice"] and not d["lin_scan_chunk"]:  # only a Mamba2 scan has them
            for k in ("lin_act_bytes_per_slice", "lin_scan_chunk", "lin_pad_bytes_per_token", "lin_pad_time_per_token"):
                d.pop(k, None)
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
        if "chunked_layers" in d:
            d["chunked_layers"] = tuple(int(i) for i in d["chunked_layers"])
        if "layer_kinds" in d:
            d["layer_kinds"] = tuple(str(k) for k in d["layer_kinds"])
        if "layer_scales" in d:
            d["layer_scales"] = tuple(tuple(float(x) for x in row) for row in d["layer_scales"])
        if "kv_share_spans" in d:
            d["kv_share_spans"] = tuple((int(a), int(b)) for a, b in d["kv_share_spans"])
        if "windowed_layers" in d:
            d["windowed_layers"] = tuple(int(i) for i in d["windowed_layers"])
        return cls(**d)
