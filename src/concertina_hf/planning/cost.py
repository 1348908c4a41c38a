"""Cost model: time and memory of one chunk on one pipeline stage.

Per decoder layer, for a chunk whose slices have lengths ``s_i`` and contexts ``C_i``::

    forward  = alpha_attn * sum((C_i + s_i)^2 - C_i^2) + alpha_tok * sum(s_i) + beta
    backward = bwd_factor * forward          (+ one more forward per recomputed layer)

The attention term counts (query, key) pairs under the causal mask, so a late slice of a long
sequence costs more than an early one of the same length. Activation memory per layer is
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
counted with the same coefficient); an explicit attention mask, built once per chunk when the
chunk is not one whole sequence, holds ``mask_bytes_per_pair * T * S`` bytes (``T`` tokens,
``S = T + sum C`` keys; SDPA backends, not flash-attn); a stage other than the last keeps its
output until the backward (``output_bytes_per_token``); a chunk with any recomputed layer keeps,
once, what the checkpoint closures hold beyond the layers' inputs and what saved layers keep too
(``ckpt_chunk_bytes_per_token``: the attention context's index tensors), a step at ``r >= 1`` that
the recompute planner's linear model over-approximates by ``(r - 1)`` times it (conservative). Backends that compute attention densely
over ``T x S`` whenever a chunk needs a mask (SDPA on CPU) cost ``alpha_mask * T * S`` per layer
instead of ``alpha_attn * pairs`` on such chunks (``alpha_mask = 0``: flash-attn's varlen kernel).
During a chunk's backward the stage briefly holds more than its activations: the hidden-state
gradients in and out (``2 * hidden_bytes_per_token``), or, when measured, the peak extra of a
decoder layer's backward (``bwd_transient_bytes_per_token``: gradients of its intermediate
activations) or of the head's (``head_bwd_transient_bytes_per_token``: the logits' gradient;
it runs first and frees the logits before the layers' backward), whichever is largest. A
recomputed layer re-materializes its activations in backward, but the runtime recomputes the
*first* ``r`` layers of a stage, which run backward last, after every saved layer has freed its
own (at least as many bytes): so this raises the backward's peak only when all the stage's layers
recompute (``r == n``), by ``act_bytes_per_token`` per token.

Two constructors: :meth:`CostModel.from_hf_config` (FLOPs and bytes of the architecture at a
device's rates) and :meth:`CostModel.fit` (least squares over measured samples, e.g. from
:mod:`concertina_hf.runtime.profiler`; the fitting code is :mod:`concertina_hf.planning.fit`).
Pure Python; no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .types import Chunk, ChunkKind, Slice, StageLayout

__all__ = ["ChunkShape", "CostModel", "DeviceSpec", "ProfileSample", "attn_pairs", "needs_mask"]

ChunkShape = tuple[tuple[int, int], ...]
"""A chunk as measured by the profiler: its slices as ``(context, length)`` pairs."""


def attn_pairs(slices: Iterable[Slice]) -> int:
    """(query, key) pairs of causal attention: ``sum((C+s)^2 - C^2)`` (twice the true count,
    a constant absorbed by ``alpha_attn``)."""
    return sum((s.context + s.length) ** 2 - s.context**2 for s in slices)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Rates of one pipeline stage (a stage may be several GPUs: give their aggregate).

    ``flops``: sustained dense matmul FLOP/s (not peak); ``mem_bandwidth``: bytes/s for the
    memory-bound element-wise work; ``kernel_overhead_s``: fixed cost per layer call;
    ``p2p_bandwidth`` / ``p2p_latency_s``: stage-to-stage link; ``memory_bytes``: capacity.
    """

    flops: float = 150e12
    mem_bandwidth: float = 1.5e12
    kernel_overhead_s: float = 2e-4
    p2p_bandwidth: float = 20e9
    p2p_latency_s: float = 2e-5
    memory_bytes: int = 80 * 2**30

    @classmethod
    def a800(cls, num_gpus: int = 1) -> "DeviceSpec":
        """An A800-80GB at a typical 50% of its 312 TFLOP/s bf16 peak, times ``num_gpus``
        (a stage spread over several GPUs with tensor/sequence parallelism)."""
        return cls(
            flops=156e12 * num_gpus,
            mem_bandwidth=1.6e12 * num_gpus,
            kernel_overhead_s=2e-4,
            p2p_bandwidth=25e9 * num_gpus,
            p2p_latency_s=2e-5,
            memory_bytes=80 * 2**30 * num_gpus,
        )

    @classmethod
    def cpu(cls) -> "DeviceSpec":
        """One CPU thread, roughly (refit from measurements for real use)."""
        return cls(flops=3e10, mem_bandwidth=5e9, kernel_overhead_s=5e-5, p2p_bandwidth=2e9,
                   p2p_latency_s=5e-5, memory_bytes=8 * 2**30)


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
    alpha_mask: float = 0.0  # s per (query, key) element of a dense masked attention, per layer
    context_bytes_per_token: float = 0.0  # per saved layer and token of context attended to
    mask_bytes_per_pair: float = 0.0  # per chunk and (query, key) element of an explicit mask
    output_bytes_per_token: float = 0.0  # stage output kept until backward (not the last stage)
    bwd_transient_bytes_per_token: float = 0.0  # peak extra during a decoder layer's backward
    head_bwd_transient_bytes_per_token: float = 0.0  # peak extra during the head's backward
    ckpt_chunk_bytes_per_token: float = 0.0  # per chunk with any recomputed layer (closures keep it)
    # a recomputed layer's forward, relative to a plain one (non-reentrant checkpointing stops
    # the replay once the tensors backward needs exist, so the last ops are skipped)
    recompute_factor: float = 1.0

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
        dev = device or DeviceSpec()
        h = int(c["hidden_size"])
        n_heads = int(c["num_attention_heads"])
        n_kv = int(c.get("num_key_value_heads") or n_heads)
        head_dim = int(c.get("head_dim") or h // n_heads)
        inter = int(c["intermediate_size"])
        vocab = int(c["vocab_size"])
        n_layers = int(c["num_hidden_layers"])
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
        head_params = (0 if c.get("tie_word_embeddings") else vocab * h) + h
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
            layer_params=layer_params,
            embed_params=embed_params,
            head_params=head_params,
            static_bytes_per_param=16.0 if static_bytes_per_param is None else static_bytes_per_param,
            p2p_bandwidth=dev.p2p_bandwidth,
            p2p_latency_s=dev.p2p_latency_s,
            source="analytic",
        )

    def fit(self, samples: Sequence[ProfileSample], *, dense_mask: bool = False) -> "CostModel":
        """This model with its decoder-layer time coefficients (and activation bytes per token)
        fitted to ``samples``: :func:`concertina_hf.planning.fit.fit_profile`."""
        from .fit import fit_profile  # fit.py builds on this module

        return fit_profile(self, samples, dense_mask=dense_mask)

    # ------------------------------------------------------------------ time
    def layer_fwd_time(self, slices: Sequence[Slice]) -> float:
        tok = sum(s.length for s in slices)
        if self.alpha_mask and needs_mask([(s.context, s.length) for s in slices]):
            attn = self.alpha_mask * tok * sum(s.context + s.length for s in slices)
        else:
            attn = self.alpha_attn * attn_pairs(slices)
        return attn + self.alpha_tok * tok + self.beta

    def fwd_time(self, layout: StageLayout, stage: int, chunk: Chunk) -> float:
        """Forward time of ``chunk`` on ``stage`` (its layers, plus embedding / head)."""
        t = layout.num_stage_layers(stage) * self.layer_fwd_time(chunk.slices)
        if layout.has_embedding(stage):
            t += self.embed_time_per_token * chunk.num_tokens
        if layout.has_head(stage):
            t += self.head_time_per_token * chunk.num_tokens
        return t

    def bwd_time(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int = 0) -> float:
        """Backward time, including ``recompute_layers`` extra layer forwards."""
        return self.bwd_factor * self.fwd_time(layout, stage, chunk) + self.recompute_time(chunk, recompute_layers)

    def recompute_time(self, chunk: Chunk, recompute_layers: int) -> float:
        return recompute_layers * self.recompute_factor * self.layer_fwd_time(chunk.slices)

    def p2p_time(self, chunk: Chunk) -> float:
        """Time to send one chunk's hidden states (or their gradient) to the next stage."""
        return self.p2p_latency_s + self.hidden_bytes_per_token * chunk.num_tokens / self.p2p_bandwidth

    # ------------------------------------------------------------------ memory
    def act_memory(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int = 0) -> float:
        """Bytes a chunk holds on ``stage`` from its forward until its backward.

        A split chunk keeps its K/V on recomputed layers too (later slices attend to it); a
        hybrid chunk's tail slice is final and keeps no K/V of its own (``chunk.kind`` says which).
        """
        n = layout.num_stage_layers(stage)
        tok = chunk.num_tokens
        kv_tok = tok if chunk.kind is ChunkKind.SPLIT else 0
        saved = n - recompute_layers
        mem = saved * self.act_bytes_per_token * tok
        mem += recompute_layers * (self.ckpt_bytes_per_token * tok + self.kv_bytes_per_token * kv_tok)
        if recompute_layers and self.ckpt_chunk_bytes_per_token:
            mem += self.ckpt_chunk_bytes_per_token * tok
        if layout.has_head(stage):
            mem += self.logits_bytes_per_token * tok
        else:
            mem += self.output_bytes_per_token * tok
        if saved and self.context_bytes_per_token:
            # keys attended to beyond the slice's own (its earlier slices'), and the own K/V a
            # non-final slice keeps in the store besides that concatenated copy
            ctx_tok = sum(s.context + (s.length if chunk.kind is ChunkKind.SPLIT else 0)
                          for s in chunk.slices if s.context > 0)
            mem += saved * self.context_bytes_per_token * ctx_tok
        if self.mask_bytes_per_pair and needs_mask([(s.context, s.length) for s in chunk.slices]):
            mem += self.mask_bytes_per_pair * tok * sum(s.context + s.length for s in chunk.slices)
        return mem

    def kv_grad_memory(self, layout: StageLayout, stage: int, earlier_tokens: int) -> float:
        """Bytes of K/V gradient buffers for ``earlier_tokens`` tokens of earlier slices, alive
        while a split sequence's later slices run backward."""
        return layout.num_stage_layers(stage) * self.kv_bytes_per_token * earlier_tokens

    def transient_memory(self, layout: StageLayout, stage: int, chunk: Chunk, recompute_layers: int = 0) -> float:
        """Extra bytes during the chunk's backward: the incoming/outgoing hidden-state gradients
        (or the measured peak of a layer's or the head's backward, when larger), plus a
        recomputed layer's activations when every layer of the stage recomputes (see the module
        docstring: with ``recompute_layers < n`` the saved layers' backwards free more first)."""
        tok = chunk.num_tokens
        n = layout.num_stage_layers(stage)
        # a layer's backward: its gradients in flight (at least the hidden-state gradients in
        # and out), plus the activations it recomputes when no saved layer freed room first
        layer = max(2 * self.hidden_bytes_per_token, self.bwd_transient_bytes_per_token)
        if n and recompute_layers >= n:
            layer += self.act_bytes_per_token
        head = 0.0
        if layout.has_head(stage) and self.head_bwd_transient_bytes_per_token:
            # measured: the head's backward comes first, alone, and frees the logits before
            # any layer's backward starts (the analytic model keeps the conservative sum)
            head = self.head_bwd_transient_bytes_per_token
            layer -= self.logits_bytes_per_token
        return max(layer, head, 0.0) * tok

    def static_memory(self, layout: StageLayout, stage: int) -> float:
        params = layout.num_stage_layers(stage) * self.layer_params
        if layout.has_embedding(stage):
            params += self.embed_params
        if layout.has_head(stage):
            params += self.head_params
        return params * self.static_bytes_per_param

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostModel":
        return cls(**d)


def needs_mask(slices: Sequence[tuple[int, int]]) -> bool:
    """Whether a chunk of ``(context, length)`` slices needs an explicit attention mask: all
    but one whole sequence (plain causal attention) do.

    >>> needs_mask([(0, 128)]), needs_mask([(0, 64), (0, 64)]), needs_mask([(512, 128)])
    (False, True, True)
    """
    return not (len(slices) == 1 and slices[0][0] == 0)
