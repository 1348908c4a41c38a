"""Profiler: fit the planner's :class:`~concertina_hf.planning.cost.CostModel` from the real
model's layers on the real device, so plans are grounded in measurement.

Algorithm. A chunk *shape* is a tuple of ``(context, length)`` slices (:func:`default_shapes`
covers packed chunks of several sizes and sequence counts, slices with context, and hybrids).
:func:`profile_cost_model` builds a :class:`~.probe.Probe` of ``num_layers`` real decoder layers
of the model (:mod:`.probe`: how each measurement is made, under which clock, meter and
autocast state) and measures:

- every shape with no recompute: forward and backward time (``warmup`` runs then ``repeats``
  timed ones, divided by the number of layers) and activation bytes;
- the bytes of non-final slices (with and without context: the K/V they keep for later
  slices), and, on a whole sequence, a non-final slice and a packed chunk, with every layer
  recomputed; on a whole sequence with one recomputed layer too (what checkpoint closures keep
  once per chunk);
- **recompute**: the extra time of a chunk with every layer checkpointed, on three shapes,
  relative to its plain forward (``recompute_factor``: non-reentrant checkpointing stops the
  replay once the tensors backward needs exist);
- **backward transients** of a decoder layer and of the head, on two token counts (the larger
  one's per token), their constant parts (the weight gradients computed before they are added
  into ``.grad``) from 8 and 16 tokens, the embedding's backward likewise, and a layer's backward
  with every layer recomputed;
- **head** (final norm, LM head, float32 summed cross-entropy) and **embedding**: time and bytes
  on a few token counts.

:func:`measure_chunk` measures one shape alone (a :class:`ProfileSample`).

Fit (:mod:`concertina_hf.planning.fit`). Times go to :func:`~concertina_hf.planning.fit.fit_profile`
(``alpha_attn``, ``alpha_tok``, ``beta``, ``bwd_factor``). Bytes with no recompute:
:func:`~concertina_hf.planning.fit.fit_activation_bytes`, non-negative least squares of ``bytes
= layers * (act * T + ctx * context_tokens)`` over every shape ->
``act_bytes_per_token``, ``context_bytes_per_token``; with full
recompute and with one recomputed layer (whole sequence) -> ``ckpt_bytes_per_token`` and
``ckpt_chunk_bytes_per_token`` (what closures keep once per chunk beyond the saved layers: index
tensors), (the extra of the non-final slice) ``kv_bytes_per_token``; backward transients ->
``bwd_transient_bytes_per_token``,
``bwd_context_bytes_per_token`` (a 16-token slice after ``size`` and ``2 * size`` tokens of
context, per key: the larger context's, or the slope between the two when steeper),
``head_bwd_transient_bytes_per_token``; recompute -> ``recompute_factor``; head ->
``logits_bytes_per_token`` (everything the head keeps per token, through the origin,
:func:`~concertina_hf.planning.fit.through_origin`) and ``head_time_per_token`` /
``head_time_per_call`` and the measured points ``head_time_points``; embedding ->
``embed_time_per_token`` / ``embed_time_per_call`` (both timed on chunks from the largest
profiled one down to 1/64 of it, the lines fitted on relative errors,
:func:`~concertina_hf.planning.fit.relative_line`). Why: the embedding's dense weight gradient is
a per-call constant (1.9 ms of a 10M Llama's 2.0 ms at 512 tokens), and the LM head's time per
token is no line on CPU (114-120 us per token fwd + bwd from 256 to 896 tokens, 132-151 from
1024 up): the former line through the origin at 1024 and 4096 tokens priced it 12-20% too high
at the 256-512-token chunks of pp=2 plans, so the last stage ran faster than planned. The cost model applies ``bwd_factor`` to
head and embedding too, so their per-token times are ``(forward + backward) / (1 +
bwd_factor)``: the step total is right, the forward/backward split of those two approximate.
The largest profiled chunk (tokens) becomes ``max_chunk_tokens``: the planner builds no larger
chunk (:func:`~concertina_hf.planning.strategies.plan_step`), since the fit is linear and the
time per token grows beyond some size (on CPU, a 10M Llama's 8K-13K-token chunks ran 1.2-1.6x
their prediction in the executor, the fp32 logits' log-softmax at up to 7x its per-element time
in 4K-token chunks, the matmuls slower too). Profile up to the largest chunk
a run should use (``max_tokens`` or ``shapes``).
Under autocast, the weight copies it keeps for the step are added to ``static_bytes_per_param``
(spread over the profiled parameters). Parameter counts are the model's own; static bytes per
parameter, P2P rates and the layer count come from ``base`` (default: the analytic model of
the config).

Cost: per shape ``warmup + repeats`` forward+backward passes of ``num_layers`` layers and one or
two untimed forwards, plus a few head, embedding and transient passes. On one CPU thread the
default profile (``max_tokens=512``) of a tiny Llama (hidden 64) takes about 1 s, and
``default_shapes(1024)`` of a hidden-256 Llama about 10 s; time grows with the model's FLOPs
and the chunk sizes (bound it with ``max_tokens`` or ``shapes``).

Accuracy (benchmarks/cost_model_accuracy.py): held-out chunk shapes of a hidden-256 Llama on
CPU within 5% in time, activation bytes within 0.3%. Not modelled: the embedding's saved
token ids (8 bytes per token). The rotary tables the stage's layers share are measured apart
(``stage_bytes_per_token``, once per stage) and taken out of the per-layer bytes; other
per-chunk tensors (the context's index tensors) are spread over the profiled layers, so
profile about as many layers as a stage holds when they matter.

Shape legend: ``T`` tokens of a chunk, ``S`` keys (``T`` plus the contexts).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Sequence

import torch

from ..planning.coefficients import ChunkShape, DeviceSpec, ProfileSample
from ..planning.cost import CostModel
from ..planning.fit import (
    fit_activation_bytes,
    fit_linear_bytes,
    fit_linear_layer,
    fit_profile,
    relative_line,
    through_origin,
)
from ..planning.mixers import LINEAR_KIND, SCAN_CHUNK, layer_kinds as config_layer_kinds
from .probe import Probe, build_probe

__all__ = ["default_shapes", "kind_layers", "linear_shapes", "measure_chunk", "profile_cost_model"]


def default_shapes(max_tokens: int) -> list[ChunkShape]:
    """Chunk shapes up to ``max_tokens`` tokens, as ``(context, length)`` per slice.

    Whole sequences of four sizes (``M/8 .. M``); packed chunks of 2, 4 and 8 sequences and
    uneven ones; single slices with context (a late slice of a long sequence: ``C`` from
    ``M/4`` to ``2M``); hybrids (a tail slice with context plus whole sequences). 16 shapes,
    enough to separate every fitted coefficient, in about 20 forward+backward token-budgets.
    """
    m = int(max_tokens)
    if m < 32:
        raise ValueError(f"max_tokens must be at least 32 to profile distinct chunk shapes (got {max_tokens})")
    e, q, h = m // 8, m // 4, m // 2
    return [
        # whole sequences (plain causal attention)
        ((0, e),), ((0, q),), ((0, h),), ((0, m),),
        # packed
        ((0, q), (0, q)), ((0, e),) * 4, ((0, e),) * 8, ((0, h), (0, q), (0, e), (0, e)),
        # slices with context
        ((q, q),), ((h, h),), ((m, q),), ((2 * m, e),), ((h, m),),
        # hybrid: a tail slice plus whole sequences
        ((h, q), (0, q)), ((m, q), (0, e), (0, e), (0, e), (0, e)), ((q, h), (0, q), (0, e), (0, e)),
    ]


def _check_shape(shape: Sequence[Sequence[int]]) -> ChunkShape:
    out = tuple((int(c), int(s)) for c, s in shape)
    if not out or any(c < 0 or s <= 0 for c, s in out):
        raise ValueError(f"a chunk shape is a non-empty tuple of (context >= 0, length > 0) slices, got {shape!r}")
    return out


def measure_chunk(model_or_wrapper: Any, shape: Sequence[Sequence[int]], *, split: bool = False,
                  recompute_layers: int = 0, repeats: int = 3, warmup: int = 1, num_layers: int | None = None,
                  device: Any = None, autocast_dtype: torch.dtype | str | None = "caller",
                  layers: Sequence[int] | None = None) -> ProfileSample:
    """Profile one chunk shape on real decoder layers (see the module docstring).

    ``shape``: ``(context, length)`` per slice; every slice is the last of its sequence unless
    ``split`` (then the chunk is one non-final slice, which keeps its K/V for later slices).
    ``recompute_layers``: the first layers run under activation checkpointing, as in a plan.
    ``model_or_wrapper``: an HF causal LM (``num_layers`` of its layers are copied, default 2)
    or a :class:`PipelineWrapper` (its own layers, default all of the stage).

    Returns a :class:`ProfileSample` with forward and backward seconds **per layer** (summary of
    ``repeats`` after ``warmup``, see the module docstring) and the activation bytes the chunk
    keeps until its backward **per layer** (the chunk's total over the profiled layers, divided
    by their number). ``repeats=0`` skips timing
    (times are 0). ``autocast_dtype``: see :func:`profile_cost_model`. ``layers``: the decoder
    layers measured instead of a prefix (model indices, e.g. one kind's: :func:`kind_layers`).
    """
    shp = _check_shape(shape)
    pr = build_probe(model_or_wrapper, num_layers, device, autocast_dtype, layers=layers,
                     layer_kinds=_model_kinds(model_or_wrapper, None))
    if not 0 <= recompute_layers <= pr.num_layers:
        raise ValueError(f"recompute_layers={recompute_layers} outside 0..{pr.num_layers} (the profiled layers)")
    with pr.measuring():
        f = b = 0.0
        if repeats > 0:
            f, b = pr.time_chunk(shp, split, recompute_layers, repeats, warmup)
        nbytes = pr.chunk_bytes(shp, split, recompute_layers)
    n = pr.num_layers
    return ProfileSample(slices=shp, fwd_time_s=f / n, bwd_time_s=b / n, act_bytes=nbytes / n)


def profile_cost_model(
    model: Any,
    *,
    shapes: Sequence[Sequence[Sequence[int]]] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    base: CostModel | None = None,
    device: Any = None,
    progress: bool = False,
    num_layers: int | None = None,
    max_tokens: int | None = None,
    samples_out: list[ProfileSample] | None = None,
    autocast_dtype: torch.dtype | str | None = "caller",
) -> CostModel:
    """Profile ``model`` (an HF causal LM or a :class:`PipelineWrapper`) on ``device`` and return
    the fitted :class:`CostModel` (``source="profiled"``); see the module docstring.

    ``shapes``: chunk shapes to time and measure (default :func:`default_shapes` of
    ``max_tokens``: 512 on CPU, 8192 on CUDA). ``base``: the model whose other fields are kept
    (default: :meth:`CostModel.from_hf_config` of the model's config at its dtype). A
    :class:`PipelineWrapper` stage without the head (or embedding) keeps ``base``'s terms for it.
    ``num_layers``: layers profiled (default 2 of a model, all of a wrapper's stage).
    ``samples_out``: a list that receives the per-shape :class:`ProfileSample` measurements.
    ``autocast_dtype``: the dtype the forwards run under ``torch.autocast`` (mixed precision,
    e.g. ``bf16=True``: float32 weights, bf16 matmuls and stored K/V), as the executor runs
    them; ``"caller"`` (default) takes the caller's autocast state on the device, ``None``
    profiles without autocast. Backwards run outside autocast, as in the executor.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    kinds = _model_kinds(model, base)
    attn_ids, lin_ids = kind_layers(model, kinds, num_layers)
    if lin_ids and attn_ids:  # a hybrid model: each kind measured on its own layers
        pr = build_probe(model, None, device, autocast_dtype, layers=attn_ids, layer_kinds=kinds)
    else:
        pr = build_probe(model, num_layers, device, autocast_dtype, layer_kinds=kinds)
    lin_pr = build_probe(model, None, device, autocast_dtype, layers=lin_ids, layer_kinds=kinds) if lin_ids else None
    if max_tokens is None:
        max_tokens = 8192 if pr.device.type == "cuda" else 512
    shape_list = [_check_shape(s) for s in (shapes if shapes is not None else default_shapes(max_tokens))]
    if len({s for s in shape_list}) < 3:
        raise ValueError("profiling needs at least 3 distinct chunk shapes")
    dtype_bytes = torch.empty((), dtype=pr.dtype).element_size()
    if base is None:
        spec = DeviceSpec.cpu() if pr.device.type == "cpu" else DeviceSpec()
        base = CostModel.from_hf_config(pr.config, device=spec, dtype_bytes=dtype_bytes)
    n = pr.num_layers

    def say(msg: str) -> None:
        if progress:
            print(f"[profile] {msg}", file=sys.stderr, flush=True)

    samples, mem_rows, mem_bytes = [], [], []
    t_start = time.perf_counter()
    with pr.measuring() as cast_bytes:
        for k, shp in enumerate(shape_list):
            f, b = pr.time_chunk(shp, False, 0, repeats, warmup)
            nbytes = pr.chunk_bytes(shp, False, 0)
            samples.append(ProfileSample(shp, f / n, b / n, nbytes / n))
            mem_rows.append((shp, False))
            mem_bytes.append(nbytes)
            say(f"{k + 1}/{len(shape_list)} {shp}: fwd {1e3 * f / n:.2f} ms, bwd {1e3 * b / n:.2f} ms per layer, "
                f"{nbytes / n / 2**20:.2f} MiB per layer")
        # non-final slices (with and without context): the K/V they keep for later slices
        longest = max((s for shp in shape_list for _, s in shp))
        size = max(16, min(longest, max_tokens // 2))
        for shp in (((size, size),), ((0, size),)):
            mem_rows.append((shp, True))
            mem_bytes.append(pr.chunk_bytes(shp, True, 0))
        # full recompute: the layer inputs, plus K/V of a non-final slice
        ckpt_final = pr.chunk_bytes(((0, size),), False, n)
        # one recomputed layer of n: what closures keep once per chunk beyond what the saved
        # layers keep too (e), from b0 = n A, b1 = (n - 1) A + K + e, bn = n K + e
        chunk_extra = 0.0
        if n >= 2:
            b0 = pr.chunk_bytes(((0, size),), False, 0)
            b1 = pr.chunk_bytes(((0, size),), False, 1)
            chunk_extra = max(0.0, (n * (b1 - b0) + b0 - ckpt_final) / (n - 1))
        ckpt_split = pr.chunk_bytes(((0, size),), True, n)
        # per token at two sizes (the larger one's is kept), and the constant part (weight
        # gradients, whatever the tokens) from a line through two short chunks
        tr_tokens = (max(16, size // 2), size)
        transients = [pr.bwd_transients(tok) for tok in tr_tokens]
        # every layer recomputed: the backward re-materializes one layer's activations, less
        # than a saved layer keeps (checkpointing stops the replay once backward has its tensors)
        rec_transient = pr.bwd_transients(size, recompute=n)[0]
        # a short final slice after a long context: its backward's K/V gradients, per key (at
        # two contexts: the larger's, or the slope between them when steeper, since a constant
        # part, the weight gradients, hides the keys' share at short contexts)
        tail = min(16, size)
        ctx_peaks = [pr.bwd_context_bytes(c, tail) * (c + tail) for c in (size, 2 * size)]
        ctx_transient = max(ctx_peaks[1] / (2 * size + tail), (ctx_peaks[1] - ctx_peaks[0]) / size)
        # the layers' shared per-chunk tensors (rotary tables): once per stage, not per layer
        shared = pr.shared_bytes(size)
        short = (8, 16)
        short_tr = [pr.bwd_transients(tok) for tok in short]
        embed_bwd = [pr.embed_bwd_bytes(tok) for tok in short] if pr.has_embed else []
        # recompute: the extra time of every layer checkpointed, on the largest whole sequence,
        # packed chunk and slice with context
        extra, plain_fwd = 0.0, 0.0
        for pick in (lambda x: len(x) == 1 and x[0][0] == 0, lambda x: len(x) > 1, lambda x: x[0][0] > 0):
            cands = [i for i, x in enumerate(shape_list) if pick(x)]
            if not cands:
                continue
            i = max(cands, key=lambda j: sum(s for _, s in shape_list[j]))
            f, b = pr.time_chunk(shape_list[i], False, n, repeats, warmup)
            extra += f + b - n * (samples[i].fwd_time_s + samples[i].bwd_time_s)
            plain_fwd += n * samples[i].fwd_time_s
        # the head on chunk sizes from the largest profiled one down to 1/64 of it, by factors of
        # 2 with 1.5x between (kept as measured points: its time per token is no line on CPU),
        # the embedding by factors of 4 (a line: a per-call constant and a per-token rate)
        biggest = max(sum(s for _, s in shp) for shp in shape_list)
        head_ladder = sorted({max(16, x) for k in range(7) for x in (biggest >> k, 3 * (biggest >> k) // 4)})
        heads = []
        if pr.has_head:
            for tok in head_ladder:  # (at least 4 repeats: small and cheap, and their minimum is kept)
                heads.append((tok, *pr.time_head(tok, max(repeats, 4), warmup)))
        embeds = []
        if pr.has_embed:
            for tok in sorted({max(16, biggest >> k) for k in (0, 2, 4, 6)}):
                embeds.append((tok, pr.time_embed(tok, repeats, warmup)))
    lin_rows: list[tuple[ChunkShape, float, float]] = []
    lin_split = 0.0
    if lin_pr is not None:
        with lin_pr.measuring():
            lin_rows, lin_split = _measure_linear(lin_pr, max_tokens, repeats, warmup)
            lin_shared = lin_pr.shared_bytes(max_tokens // 2)
        say(f"linear layers {lin_pr.layer_ids}: {len(lin_rows)} chunks measured")
    say(f"measured in {time.perf_counter() - t_start:.1f} s")

    if samples_out is not None:
        samples_out.extend(samples)
    timed = [dataclasses.replace(s, act_bytes=0.0) for s in samples]  # bytes are fitted below, with more terms
    cost = fit_profile(base, timed)
    act, ctx_b = fit_activation_bytes(mem_rows, mem_bytes, n)
    ckpt = (ckpt_final - chunk_extra) / (n * size)
    # every measurement above holds the shared tables once for its n layers: the cost model
    # counts them once per stage (stage_bytes_per_token), whatever its layer count
    shared = min(shared, n * act, n * ckpt)
    act -= shared / n
    ckpt -= shared / n
    kv = max(0.0, (ckpt_split - ckpt_final) / (n * size))
    hidden_bytes = float(dtype_bytes * pr.hidden_size)
    changes: dict[str, Any] = dict(
        act_bytes_per_token=act,
        context_bytes_per_token=ctx_b,
        ckpt_bytes_per_token=ckpt,
        ckpt_chunk_bytes_per_token=chunk_extra / size,
        kv_bytes_per_token=kv,
        hidden_bytes_per_token=hidden_bytes,
        output_bytes_per_token=hidden_bytes,
        # a + b * tokens through the two token counts: the weight gradients are per backward
        bwd_transient_bytes_per_token=transients[-1][0],
        recompute_bwd_transient_bytes_per_token=rec_transient,
        bwd_context_bytes_per_token=ctx_transient,
        stage_bytes_per_token=shared,
        **dict(zip(("bwd_transient_bytes", "bwd_transient_slope"),
                   _line(short, [t * k for (t, _), k in zip(short_tr, short)]))),
        recompute_factor=min(1.5, max(0.0, extra / plain_fwd)) if plain_fwd > 0 else base.recompute_factor,
        layer_params=pr.layer_params,
        # the planner builds no larger chunk: beyond the profiled sizes the per-token time can grow
        max_chunk_tokens=max(sum(s for _, s in shp) for shp in shape_list),
        source="profiled",
    )
    if cast_bytes:
        # autocast's weight copies live for the step: spread over the profiled parameters
        changes["static_bytes_per_param"] = base.static_bytes_per_param + cast_bytes / max(1, pr.profiled_params)
    per_tok = 1.0 + cost.bwd_factor
    if heads:
        toks = [h[0] for h in heads]
        head_s = [(f + b) / per_tok for _, f, b, _ in heads]
        changes["head_time_per_call"], changes["head_time_per_token"] = relative_line(toks, head_s)
        # a larger chunk never takes less time (noise between neighbouring sizes)
        changes["head_time_points"] = tuple((float(t), max(head_s[:i + 1])) for i, t in enumerate(toks))
        changes["logits_bytes_per_token"] = through_origin(toks, [m for *_, m in heads])
        changes["head_bwd_transient_bytes_per_token"] = max(h for _, h in transients)
        changes["head_bwd_transient_bytes"], changes["head_bwd_transient_slope"] = _line(
            short, [h * k for (_, h), k in zip(short_tr, short)])
        changes["head_params"] = pr.head_params
    if embeds:
        changes["embed_time_per_call"], changes["embed_time_per_token"] = relative_line(
            [t for t, _ in embeds], [s / per_tok for _, s in embeds])
        changes["embed_params"] = pr.embed_params
    if embed_bwd:
        const, per_tok = _line(short, embed_bwd)
        # (what the executor holds besides on a stage without the head: CostModel.embed_bwd_memory)
        changes["embed_bwd_transient_bytes"] = const
        changes["embed_bwd_bytes_per_token"] = per_tok
    if lin_pr is not None:
        changes.update(_fit_linear(base, lin_pr, lin_rows, lin_split, lin_shared, cost.beta, cost.bwd_factor))
    return dataclasses.replace(cost, **changes)


def _model_kinds(model: Any, base: CostModel | None) -> tuple[str, ...]:
    """Each decoder layer's kind (:attr:`CostModel.layer_kinds`): ``base``'s, else the config's."""
    if base is not None:
        return tuple(base.layer_kinds)
    if isinstance(model, Probe):
        return ()
    config = getattr(model, "config", None)
    return config_layer_kinds(lambda k: getattr(config, k, None)) if config is not None else ()


def kind_layers(model: Any, kinds: Sequence[str], num_layers: int | None = None) -> tuple[list[int], list[int]]:
    """The decoder layers (model indices) a profile measures of each kind, ``(attention,
    linear)``: up to ``num_layers`` of each (default 2 of a model, every one of a
    :class:`PipelineWrapper`'s stage) among the model's (the stage's) layers; ``([], [])`` for
    a model with no linear layer (its prefix is profiled) or a :class:`Probe`."""
    if LINEAR_KIND not in kinds or isinstance(model, Probe):
        return [], []
    wrapper = hasattr(model, "decoder_layers") and hasattr(model, "layer_start")
    ids = range(model.layer_start, model.layer_end) if wrapper else range(len(model.model.layers))
    n = len(ids) if num_layers is None and wrapper else 2 if num_layers is None else int(num_layers)
    attn = [i for i in ids if i >= len(kinds) or kinds[i] != LINEAR_KIND][:n]
    lin = [i for i in ids if i < len(kinds) and kinds[i] == LINEAR_KIND][:n]
    return attn, lin


def linear_shapes(max_tokens: int) -> list[ChunkShape]:
    """Chunk shapes timed and measured on the linear layers: whole sequences (``M/8 .. M`` and
    ``3M/8``), packed chunks of several slices of the same token counts (``M/4`` as 4 and 16
    slices, ``M/2`` as 4 and 8, ``M`` as 16: the per-slice term; the scan pads each slice), and
    a slice with context."""
    m = int(max_tokens)
    e, q, h = m // 8, m // 4, m // 2
    return [((0, e),), ((0, q),), ((0, 3 * e),), ((0, h),), ((0, m),),
            ((0, q // 4),) * 4, ((0, q // 16),) * 16, ((0, e),) * 4, ((0, h // 8),) * 8,
            ((0, m // 16),) * 16, ((h, q),)]


def _measure_linear(pr: Any, max_tokens: int, repeats: int, warmup: int) -> tuple[list, float]:
    """Per :func:`linear_shapes` shape ``(shape, seconds, bytes)`` per linear layer (forward plus
    backward; the bytes a chunk keeps, shared tables included), and the extra bytes per layer of a
    non-final slice of ``M/2`` tokens over a final one (its state and convolution tail)."""
    n = pr.num_layers
    rows = []
    for shp in linear_shapes(max_tokens):
        f, b = pr.time_chunk(shp, False, 0, repeats, warmup)
        rows.append((shp, (f + b) / n, pr.chunk_bytes(shp, False, 0) / n))
    size = max(16, max_tokens // 2)
    split = (pr.chunk_bytes(((0, size),), True, 0) - pr.chunk_bytes(((0, size),), False, 0)) / n
    return rows, split


def _fit_linear(base: CostModel, pr: Any, rows: Sequence[tuple[ChunkShape, float, float]], split: float,
                shared: float, beta: float, bwd_factor: float) -> dict[str, Any]:
    """The linear kind's fields from :func:`_measure_linear`'s rows: ``lin_alpha_tok``,
    ``lin_beta_segment`` and ``lin_pad_time_per_token`` (per token of each slice's padding to the
    scan chunk: HF's torch scan computes it) from the forward-plus-backward times over ``1 + bwd_factor`` (the
    planner prices a linear layer's backward as the attention's, ``bwd_factor`` times its
    forward); ``lin_act_bytes_per_token``, ``lin_pad_bytes_per_token`` and ``lin_act_bytes_per_slice``
    (:func:`~concertina_hf.planning.fit.fit_linear_bytes`, the scan chunk :func:`_scan_chunk`'s) from the
    bytes less the shared tables
    (counted once per stage); ``lin_state_bytes``: what a non-final slice keeps besides (its state
    and convolution tail, the graph of its final state)."""
    shapes = [shp for shp, _, _ in rows]
    n = pr.num_layers
    scan = _scan_chunk(base, pr.config)
    alpha, seg, pad_t = fit_linear_layer(shapes, [t / (1.0 + bwd_factor) for _, t, _ in rows], beta, scan)
    act, pad, per_slice = fit_linear_bytes(
        shapes, [nbytes - shared * sum(s for _, s in shp) / n for shp, _, nbytes in rows], scan)
    return dict(lin_alpha_tok=alpha, lin_beta_segment=seg, lin_pad_time_per_token=pad_t,
                lin_act_bytes_per_token=act, lin_act_bytes_per_slice=per_slice, lin_pad_bytes_per_token=pad,
                lin_scan_chunk=scan if pad or pad_t else 0, lin_state_bytes=max(0.0, split),
                lin_layer_params=pr.layer_params)


def _scan_chunk(base: CostModel, config: Any) -> int:
    """The tokens of a linear layer's scan chunk, to which each slice is padded: ``base``'s, else a
    Mamba2 config's (``mamba_chunk_size`` / ``chunk_size``, default 256, as
    :func:`~concertina_hf.planning.mixers.ssm_layer_fields` reads it), else HF's Gated DeltaNet scan's
    (:data:`~concertina_hf.planning.mixers.SCAN_CHUNK`)."""
    if base.lin_scan_chunk:
        return int(base.lin_scan_chunk)
    if getattr(config, "mamba_d_state", None) or getattr(config, "ssm_state_size", None):
        return int(getattr(config, "mamba_chunk_size", None) or getattr(config, "chunk_size", None) or 256)
    return SCAN_CHUNK


def _line(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b * x`` through two points, both >= 0 and ``a + b * x`` at
    least the measured ``y`` at both points (a negative slope becomes a constant).

    >>> _line((16, 32), (1100.0, 1200.0))
    (1000.0, 6.25)
    >>> _line((16, 32), (1200.0, 1100.0))
    (1200.0, 0.0)
    """
    (x0, x1), (y0, y1) = xs, ys
    b = max(0.0, (y1 - y0) / (x1 - x0)) if x1 != x0 else 0.0
    a = max(0.0, y0 - b * x0, y1 - b * x1)
    return a, b
