"""Profiler: fit the planner's :class:`~concertina_hf.planning.cost.CostModel` from the real
model's layers on the real device, so plans are grounded in measurement.

Algorithm. A chunk *shape* is a tuple of ``(context, length)`` slices (:func:`default_shapes`
covers packed chunks of several sizes and sequence counts, slices with context, and hybrids).
For each shape the profiler runs ``num_layers`` real decoder layers of the model through
:meth:`PipelineWrapper.run_layers <concertina_hf.runtime.stage.PipelineWrapper.run_layers>`
itself (the runtime's code, called on a view of the profiled modules) with a real
:class:`~.attention.ChunkAttentionContext`: a slice with context ``C`` attends to random K/V
leaves of shape ``[1, kv_heads, C, head_dim]`` put in the :class:`~.attention.KVStore`, as the
earlier slices of its sequence would have left them. Then:

- **time**: forward (context construction included) and backward with a random output
  gradient, ``warmup`` runs then ``repeats`` timed ones, divided by the number of layers. On
  CUDA the median of wall times around synchronised work; on CPU with one thread the minimum
  of the process's CPU times (other jobs on shared cores inflate wall time by preemption, and
  CPU time only upwards, by contention);
- **activation bytes**, in a separate untimed forward: every tensor the chunk's forward created
  that is still alive once the executor has dropped its own references (saved tensors, the K/V
  a non-final slice keeps in the store, and, when layers recompute, what checkpoint closures
  keep: the layer inputs, rotary tables, the attention context and its masks), less the output
  (counted by the cost model as the next stage's input or the head's). On CPU every live
  tensor is counted (:class:`LiveTensorMeter`), on CUDA the allocator's growth. Counting only
  saved tensors (:class:`~.memory.SavedTensorMeter`, the executor's meter) would miss what the
  closures keep. Measured with no recompute on every shape, and with every layer recomputed on
  a whole sequence, a non-final slice and a packed chunk;
- **recompute**: the extra time of a chunk with every layer checkpointed, on three shapes,
  relative to its plain forward (``recompute_factor``: non-reentrant checkpointing stops the
  replay once the tensors backward needs exist);
- **backward transients**: the peak a decoder layer's backward and the head's backward hold
  beyond the activations they free (every live tensor on CPU, :class:`LiveTensorMeter`; the
  allocator on CUDA), per token;
- **head** (final norm, LM head, float32 summed cross-entropy) and **embedding**: time and bytes
  on a few token counts.

Mixed precision: every forward runs under the autocast state the executor's would (the
caller's, or ``autocast_dtype``), backwards outside it, with stored K/V in the autocast dtype;
so a ``bf16=True`` run (float32 weights) is profiled with bf16 activations, K/V and mask. The
weight copies autocast casts once and keeps for the whole step are made before anything is
measured and added to ``static_bytes_per_param`` (spread over the profiled parameters).

Fit. Times go to :meth:`CostModel.fit` (``alpha_attn``, ``alpha_tok``, ``beta``,
``bwd_factor``; plus ``alpha_mask`` on SDPA backends, which compute attention densely over
``T x S`` keys whenever a chunk needs a mask, i.e. everywhere but flash-attn). Bytes with no
recompute: non-negative least squares of ``bytes = layers * (act * T + ctx * context_tokens) +
mask * T * S`` over every shape -> ``act_bytes_per_token``, ``context_bytes_per_token``,
``mask_bytes_per_pair``; with full recompute and with one recomputed layer (whole sequence) ->
``ckpt_bytes_per_token`` and ``ckpt_chunk_bytes_per_token`` (what closures keep once per chunk
beyond the saved layers: index tensors), (the extra of the non-final slice)
``kv_bytes_per_token``, and (the packed chunk's extra per key pair, when larger: what the
context keeps of its mask under recompute) ``mask_bytes_per_pair``; backward transients
-> ``bwd_transient_bytes_per_token``, ``head_bwd_transient_bytes_per_token``; recompute ->
``recompute_factor``; head -> ``logits_bytes_per_token`` (everything the head keeps per token)
and ``head_time_per_token``;
embedding -> ``embed_time_per_token``. The cost model applies ``bwd_factor`` to head and
embedding too, so their per-token times are ``(forward + backward) / (1 + bwd_factor)``: the
step total is right, the forward/backward split of those two approximate. Parameter counts
are the model's own; static bytes per parameter, P2P rates and the layer count come from
``base`` (default: the analytic model of the config).

Cost: per shape ``warmup + repeats`` forward+backward passes of ``num_layers`` layers and one or
two untimed forwards, plus a few head, embedding and transient passes. On one CPU thread the
default profile (``max_tokens=512``) of a tiny Llama (hidden 64) takes about 1 s, and
``default_shapes(1024)`` of a hidden-256 Llama about 10 s; time grows with the model's FLOPs
and the chunk sizes (bound it with ``max_tokens`` or ``shapes``).

Accuracy (benchmarks/cost_model_accuracy.py): held-out chunk shapes of a hidden-256 Llama on
CPU within 5% in time, activation bytes within 0.3%. Not modelled: the embedding's saved
token ids (8 bytes per token); per-chunk tensors (the mask, rotary tables) are spread over the
profiled layers, so profile about as many layers as a stage holds when they matter.

Shape legend: ``T`` tokens of a chunk, ``S`` keys (``T`` plus the contexts).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..planning.cost import CostModel, DeviceSpec, ProfileSample, _needs_mask, _nnls
from .attention import (
    ATTN_IMPLEMENTATION,
    ChunkAttentionContext,
    KVStore,
    SliceSpec,
    autocast_dtype as _caller_autocast,
    flash_attn_available,
    register_attention,
)
from .memory import LiveTensorMeter
from .stage import PipelineWrapper

__all__ = ["LiveTensorMeter", "default_shapes", "measure_chunk", "profile_cost_model"]

Shape = tuple[tuple[int, int], ...]


# ---------------------------------------------------------------------------------- shapes
def default_shapes(max_tokens: int) -> list[Shape]:
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


def _check_shape(shape: Sequence[Sequence[int]]) -> Shape:
    out = tuple((int(c), int(s)) for c, s in shape)
    if not out or any(c < 0 or s <= 0 for c, s in out):
        raise ValueError(f"a chunk shape is a non-empty tuple of (context >= 0, length > 0) slices, got {shape!r}")
    return out


# ---------------------------------------------------------------------------------- probe
class _StageView:
    """Duck-typed stage holding the profiled modules, so the runtime's own
    :class:`PipelineWrapper` methods run them (same layer loop, checkpointing and head)."""

    run_layers = PipelineWrapper.run_layers
    head_loss_sum = PipelineWrapper.head_loss_sum
    embed = PipelineWrapper.embed

    def __init__(self, layers: Sequence[nn.Module], rotary: nn.Module, norm: nn.Module | None,
                 lm_head: nn.Module | None, embed_tokens: nn.Module | None) -> None:
        self.decoder_layers = list(layers)
        self.model = SimpleNamespace(model=SimpleNamespace(rotary_emb=rotary, norm=norm, embed_tokens=embed_tokens),
                                     lm_head=lm_head)


@dataclass
class _Probe:
    stage: Any  # a PipelineWrapper or a _StageView
    layer_ids: list[int]
    has_head: bool
    has_embed: bool
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    vocab_size: int
    num_kv_heads: int
    head_dim: int
    dense_mask: bool
    config: Any
    own_params: list[nn.Parameter]  # parameters of the caller's modules used in place
    exclude: list[torch.Tensor]
    layer_params: int
    embed_params: int
    head_params: int
    amp: torch.dtype | None = None  # autocast dtype of the forwards (None: autocast off)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of stored K/V: the attention casts them to the autocast dtype."""
        return self.amp if self.amp is not None and self.dtype != torch.float64 else self.dtype


def _with_amp(pr: _Probe, amp: torch.dtype | str | None) -> _Probe:
    """``pr`` with the autocast dtype its forwards run under: ``amp``, or (``"caller"``) the
    caller's autocast state on the probe's device."""
    if amp == "caller":
        amp = _caller_autocast(pr.device.type)
    return dataclasses.replace(pr, amp=amp)


def _fwd(pr: _Probe):
    """A forward under the run's autocast state, as the executor runs it; backwards run
    outside autocast (as in the executor), and so does everything else here."""
    if pr.amp is None:
        return contextlib.nullcontext()
    return torch.autocast(pr.device.type, dtype=pr.amp)


def _no_amp(pr: _Probe):
    return torch.autocast(pr.device.type, enabled=False)


def _warm_amp_cache(pr: _Probe) -> int:
    """Under autocast the first forward casts the weights, and autocast keeps those copies until
    the outermost autocast context exits: in the executor, the whole step (static memory of the
    step, not a chunk's). Cast them before anything is measured (the caller holds an autocast
    context open, :func:`_no_amp`) and return their bytes."""
    if pr.amp is None:
        return 0
    with _live_meter(pr) as meter, torch.no_grad(), _fwd(pr):
        specs = _specs(((0, 16),), False)
        x = torch.zeros(1, 16, pr.hidden_size, dtype=pr.dtype, device=pr.device)
        y = pr.stage.run_layers(x, ChunkAttentionContext(specs, KVStore(), pr.device, requires_grad=False), 0)
        if pr.has_head:
            pr.stage.head_loss_sum(y, torch.zeros(16, dtype=torch.long, device=pr.device))
        if pr.has_embed:
            pr.stage.embed(torch.zeros(16, dtype=torch.long, device=pr.device))
        del x, y
        return int(meter.current_bytes)


def _layer_idx(layer: nn.Module) -> int:
    for m in layer.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int):
            return idx
    raise ValueError(f"{type(layer).__name__} has no layer_idx; the concertina attention backend needs it")


def _on(module: nn.Module, device: torch.device) -> tuple[nn.Module, bool]:
    """``module`` itself when its parameters are on ``device`` (used in place), else a copy there."""
    params = list(module.parameters())
    if all(p.device == device for p in params):
        return module, True
    return copy.deepcopy(module).to(device), False


def _probe(model_or_wrapper: Any, num_layers: int | None, device: Any) -> _Probe:
    if isinstance(model_or_wrapper, _Probe):
        return model_or_wrapper
    register_attention()
    if isinstance(model_or_wrapper, PipelineWrapper):
        w = model_or_wrapper
        dev = w.device
        if device is not None and torch.device(device) != dev:
            raise ValueError(f"the PipelineWrapper lives on {dev}; move it to {device} before profiling "
                             "(or pass device=None)")
        all_layers = w.decoder_layers
        n = len(all_layers) if num_layers is None else int(num_layers)
        if not 1 <= n <= len(all_layers):
            raise ValueError(f"num_layers={num_layers}: the stage has {len(all_layers)} decoder layers")
        layers = all_layers[:n]
        stage: Any = _StageView(layers, w.model.model.rotary_emb,
                                w.model.model.norm if w.is_last else None, w.model.lm_head if w.is_last else None,
                                w.model.model.embed_tokens if w.is_first else None)
        has_head, has_embed = w.is_last, w.is_first
        config = w.config
        own = list(w.parameters())
        head = [w.model.model.norm, w.model.lm_head] if has_head else []
        embed = [w.model.model.embed_tokens] if has_embed else []
    else:
        model = model_or_wrapper
        for path in ("model", "lm_head"):
            if not hasattr(model, path):
                raise ValueError(f"{type(model).__name__} is not an HF causal LM with model.layers and lm_head; "
                                 "pass such a model or a PipelineWrapper")
        inner = model.model
        for path in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(inner, path):
                raise ValueError(f"{type(model).__name__}.model has no `{path}`; the profiler supports HF causal LMs "
                                 "with model.embed_tokens / .layers / .norm / .rotary_emb and lm_head")
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        total = len(inner.layers)
        n = min(2, total) if num_layers is None else int(num_layers)
        if not 1 <= n <= total:
            raise ValueError(f"num_layers={num_layers}: the model has {total} decoder layers")
        # copies of the profiled layers, switched to the concertina backend: the model is untouched
        copies = copy.deepcopy(nn.ModuleList([*inner.layers[:n], inner.rotary_emb])).to(dev)
        for m in copies.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = ATTN_IMPLEMENTATION
            if getattr(m, "gradient_checkpointing", False) is True:  # the plan decides recompute
                m.gradient_checkpointing = False
        layers = list(copies[:n])
        norm, norm_own = _on(inner.norm, dev)
        lm_head, head_own = _on(model.lm_head, dev)
        embed_tokens, embed_own = _on(inner.embed_tokens, dev)
        stage = _StageView(layers, copies[n], norm, lm_head, embed_tokens)
        has_head = has_embed = True
        config = model.config
        own = [p for m, o in ((norm, norm_own), (lm_head, head_own), (embed_tokens, embed_own)) if o
               for p in m.parameters()]
        head, embed = [norm, lm_head], [embed_tokens]
    dtype = next(layers[0].parameters()).dtype
    c = config
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    mods = [*layers, *head, *embed]
    exclude = [t for m in mods for t in (*m.parameters(), *m.buffers())]
    exclude += list(stage.model.model.rotary_emb.buffers())
    head_params = sum(p.numel() for m in head for p in m.parameters())
    if head and head[1].weight is (embed[0].weight if embed else None):  # tied: counted with the embedding
        head_params -= head[1].weight.numel()
    return _Probe(
        stage=stage,
        layer_ids=[_layer_idx(layer) for layer in layers],
        has_head=has_head,
        has_embed=has_embed,
        device=dev,
        dtype=dtype,
        hidden_size=int(c.hidden_size),
        vocab_size=int(c.vocab_size),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        # the runtime takes flash-attn's varlen kernel only on CUDA in half precision
        dense_mask=not (dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_attn_available()),
        config=c,
        own_params=own,
        exclude=exclude,
        layer_params=sum(p.numel() for p in layers[0].parameters()),
        embed_params=sum(p.numel() for m in embed for p in m.parameters()),
        head_params=head_params,
    )


class _GradsKept:
    """Profiling runs backward through the caller's own modules: keep their ``.grad`` as found."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)

    def __enter__(self) -> "_GradsKept":
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return self

    def __exit__(self, *exc) -> None:
        for p, g in zip(self.params, self.saved):
            p.grad = g


# ---------------------------------------------------------------------------------- one chunk
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _clock(dev: torch.device):
    """The profiler's clock and how it summarises repeats.

    CUDA: wall time around synchronised work, median. CPU with one thread: the process's CPU
    time, which other jobs sharing the cores do not inflate by preemption, and the minimum,
    since what they still add (cache and memory-bandwidth contention) only ever adds. CPU with
    several threads: wall time (CPU time would add the threads up), median.
    """
    if dev.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time, min
    return time.perf_counter, statistics.median


def _specs(shape: Shape, split: bool) -> list[SliceSpec]:
    if split and len(shape) != 1:
        raise ValueError(f"a split (non-final) chunk holds exactly one slice, got shape {shape}")
    out, off = [], 0
    for i, (c, s) in enumerate(shape):
        out.append(SliceSpec(seq=i, start=c, length=s, offset=off, final=not split))
        off += s
    return out


def _store(pr: _Probe, specs: Sequence[SliceSpec]) -> KVStore:
    """A store holding, for every slice with context, random K/V of its earlier tokens."""
    store = KVStore()
    for s in specs:
        if s.start > 0:
            for layer in pr.layer_ids:
                k = torch.randn(1, pr.num_kv_heads, s.start, pr.head_dim, dtype=pr.kv_dtype, device=pr.device)
                v = torch.randn_like(k)
                store.put_if_absent(s.seq, 0, layer, k, v, requires_grad=True)
    return store


def _time_chunk(pr: _Probe, shape: Shape, split: bool, recompute: int, repeats: int,
                warmup: int) -> tuple[float, float]:
    """Forward and backward seconds of the probe's layers on one chunk (see :func:`_clock`)."""
    clock, summary = _clock(pr.device)
    specs = _specs(shape, split)
    tokens = sum(s for _, s in shape)
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        store = _store(pr, specs)
        x = torch.randn(1, tokens, pr.hidden_size, dtype=pr.dtype, device=pr.device).requires_grad_()
        _sync(pr.device)
        t0 = clock()
        with _fwd(pr):
            ctx = ChunkAttentionContext(specs, store, pr.device, requires_grad=True)
            y = pr.stage.run_layers(x, ctx, recompute)
        _sync(pr.device)
        t1 = clock()
        grad = torch.randn_like(y)
        _sync(pr.device)
        t2 = clock()
        torch.autograd.backward(y, grad)
        _sync(pr.device)
        t3 = clock()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
        del y, x, grad, ctx, store
    return summary(fwd), summary(bwd)


def _live_meter(pr: _Probe, exclude: Sequence[torch.Tensor] = ()) -> Any:
    """Every live tensor: :class:`LiveTensorMeter` on CPU, the allocator on CUDA."""
    return _CudaPeak(pr.device) if pr.device.type == "cuda" else LiveTensorMeter([*pr.exclude, *exclude])


def _chunk_bytes(pr: _Probe, shape: Shape, split: bool, recompute: int) -> int:
    """Bytes one chunk keeps alive on the probe's layers from its forward to its backward: every
    tensor created by its forward and still alive when the executor would have dropped its own
    references (the context goes; checkpoint closures keep it when layers recompute), less the
    output, which the cost model counts as the next stage's input or the head's."""
    specs = _specs(shape, split)
    tokens = sum(s for _, s in shape)
    store = _store(pr, specs)  # earlier slices' K/V exist before: counted with their own chunks
    with _live_meter(pr) as meter, torch.enable_grad():
        x = torch.randn(1, tokens, pr.hidden_size, dtype=pr.dtype, device=pr.device).requires_grad_()
        with _fwd(pr):
            ctx = ChunkAttentionContext(specs, store, pr.device, requires_grad=True)
            y = pr.stage.run_layers(x, ctx, recompute)
        del ctx
        nbytes = meter.current_bytes - y.untyped_storage().nbytes()
    del y, x
    store.clear()
    return int(nbytes)


class _CudaPeak:
    """The allocator's view, with :class:`LiveTensorMeter`'s interface."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> "_CudaPeak":
        self.reset()
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        pass

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def current_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base

    @property
    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.base


def _bwd_transients(pr: _Probe, tokens: int) -> tuple[float, float]:
    """Peak bytes per token that the backward of a decoder layer and of the head hold beyond the
    activations they free (gradients of intermediate activations, the logits' gradient), on a
    whole sequence of ``tokens`` with no recompute: every live tensor on CPU, the allocator on
    CUDA. The incoming gradient is allocated inside the measurement, as the executor receives it."""
    params = [p for m in pr.stage.decoder_layers for p in m.parameters()]
    if pr.has_head:
        params += [*pr.stage.model.model.norm.parameters(), *pr.stage.model.lm_head.parameters()]
    for p in params:  # gradients are static memory; accumulating into them is not a transient
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    exclude = [*pr.exclude, *(p.grad for p in params)]

    specs = _specs(((0, tokens),), False)
    with _live_meter(pr, exclude) as m, torch.enable_grad():
        ctx = ChunkAttentionContext(specs, KVStore(), pr.device, requires_grad=True)
        x = torch.randn(1, tokens, pr.hidden_size, dtype=pr.dtype, device=pr.device).requires_grad_()
        with _fwd(pr):
            y = pr.stage.run_layers(x, ctx, 0)
        start = m.current_bytes
        m.reset()
        torch.autograd.backward(y, torch.randn_like(y))
        layers = (m.peak_bytes - start) / tokens
    del x, y, ctx
    head = 0.0
    if pr.has_head:
        targets = torch.randint(0, pr.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).to(pr.device)
        with _live_meter(pr, exclude) as m, torch.enable_grad():
            x = torch.randn(1, tokens, pr.hidden_size, dtype=pr.dtype, device=pr.device).requires_grad_()
            with _fwd(pr):
                loss = pr.stage.head_loss_sum(x, targets)
            start = m.current_bytes
            m.reset()
            loss.backward()
            head = (m.peak_bytes - start) / tokens
        del x, loss
    return max(0.0, layers), max(0.0, head)


def _time_head(pr: _Probe, tokens: int, repeats: int, warmup: int) -> tuple[float, float, int]:
    """Head (final norm, LM head, float32 CE): forward seconds, backward seconds, saved bytes."""
    clock, summary = _clock(pr.device)
    gen = torch.Generator().manual_seed(tokens)
    targets = torch.randint(0, pr.vocab_size, (tokens,), generator=gen).to(pr.device)
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        x = torch.randn(1, tokens, pr.hidden_size, dtype=pr.dtype, device=pr.device).requires_grad_()
        _sync(pr.device)
        t0 = clock()
        with _fwd(pr):
            loss = pr.stage.head_loss_sum(x, targets)
        _sync(pr.device)
        t1 = clock()
        loss.backward()
        _sync(pr.device)
        t2 = clock()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        del loss, x
    with _live_meter(pr) as meter, torch.enable_grad():
        x = torch.randn(1, tokens, pr.hidden_size, dtype=pr.dtype, device=pr.device).requires_grad_()
        with _fwd(pr):
            loss = pr.stage.head_loss_sum(x, targets.clone())  # the executor builds targets per chunk
        nbytes = meter.current_bytes
    del loss, x
    return summary(fwd), summary(bwd), int(nbytes)


def _time_embed(pr: _Probe, tokens: int, repeats: int, warmup: int) -> float:
    """Embedding forward + backward seconds."""
    clock, summary = _clock(pr.device)
    ids = torch.randint(0, pr.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(pr.device)
    out = []
    for i in range(warmup + repeats):
        _sync(pr.device)
        t0 = clock()
        with _fwd(pr):
            y = pr.stage.embed(ids)
        grad = torch.ones_like(y)
        y.backward(grad)
        _sync(pr.device)
        if i >= warmup:
            out.append(clock() - t0)
        del y, grad
    return summary(out)


def measure_chunk(model_or_wrapper: Any, shape: Sequence[Sequence[int]], *, split: bool = False,
                  recompute_layers: int = 0, repeats: int = 3, warmup: int = 1, num_layers: int | None = None,
                  device: Any = None, autocast_dtype: torch.dtype | str | None = "caller") -> ProfileSample:
    """Profile one chunk shape on real decoder layers (see the module docstring).

    ``shape``: ``(context, length)`` per slice; every slice is the last of its sequence unless
    ``split`` (then the chunk is one non-final slice, which keeps its K/V for later slices).
    ``recompute_layers``: the first layers run under activation checkpointing, as in a plan.
    ``model_or_wrapper``: an HF causal LM (``num_layers`` of its layers are copied, default 2)
    or a :class:`PipelineWrapper` (its own layers, default all of the stage).

    Returns a :class:`ProfileSample` with forward and backward seconds **per layer** (summary of
    ``repeats`` after ``warmup``, see the module docstring) and the activation bytes the chunk
    keeps until its backward **per layer** (the chunk's total over the profiled layers, divided
    by their number; a chunk's mask is spread over its layers). ``repeats=0`` skips timing
    (times are 0). ``autocast_dtype``: see :func:`profile_cost_model`.
    """
    shp = _check_shape(shape)
    pr = _with_amp(_probe(model_or_wrapper, num_layers, device), autocast_dtype)
    if not 0 <= recompute_layers <= pr.num_layers:
        raise ValueError(f"recompute_layers={recompute_layers} outside 0..{pr.num_layers} (the profiled layers)")
    with _GradsKept(pr.own_params), _no_amp(pr):
        _warm_amp_cache(pr)
        f = b = 0.0
        if repeats > 0:
            f, b = _time_chunk(pr, shp, split, recompute_layers, repeats, warmup)
        nbytes = _chunk_bytes(pr, shp, split, recompute_layers)
    n = pr.num_layers
    return ProfileSample(slices=shp, fwd_time_s=f / n, bwd_time_s=b / n, act_bytes=nbytes / n)


# ---------------------------------------------------------------------------------- fit
def _context_tokens(shape: Shape, split: bool) -> int:
    """Context tokens whose K/V a saved layer holds beyond the chunk's own activations (the
    cost model's ``context_bytes_per_token`` term)."""
    return sum(c + (s if split else 0) for c, s in shape if c > 0)


def _through_origin(xs: Sequence[float], ys: Sequence[float]) -> float:
    den = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys)) / den if den else 0.0


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
    pr = _with_amp(_probe(model, num_layers, device), autocast_dtype)
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
    with _GradsKept(pr.own_params), _no_amp(pr):
        cast_bytes = _warm_amp_cache(pr)
        for k, shp in enumerate(shape_list):
            f, b = _time_chunk(pr, shp, False, 0, repeats, warmup)
            nbytes = _chunk_bytes(pr, shp, False, 0)
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
            mem_bytes.append(_chunk_bytes(pr, shp, True, 0))
        # full recompute: the layer inputs, plus K/V of a non-final slice
        ckpt_final = _chunk_bytes(pr, ((0, size),), False, n)
        # one recomputed layer of n: what closures keep once per chunk beyond what the saved
        # layers keep too (e), from b0 = n A, b1 = (n - 1) A + K + e, bn = n K + e
        chunk_extra = 0.0
        if n >= 2:
            b0 = _chunk_bytes(pr, ((0, size),), False, 0)
            b1 = _chunk_bytes(pr, ((0, size),), False, 1)
            chunk_extra = max(0.0, (n * (b1 - b0) + b0 - ckpt_final) / (n - 1))
        ckpt_split = _chunk_bytes(pr, ((0, size),), True, n)
        # a chunk with a mask, recomputed: checkpoint closures keep its attention context alive
        masked = ((0, size // 2), (0, size - size // 2))
        mask_rec = (_chunk_bytes(pr, masked, False, n) - ckpt_final) / (size * size)
        transients = [_bwd_transients(pr, tok) for tok in (max(16, size // 2), size)]
        # recompute: the extra time of every layer checkpointed, on the largest whole sequence,
        # packed chunk and slice with context
        extra, plain_fwd = 0.0, 0.0
        for pick in (lambda x: len(x) == 1 and x[0][0] == 0, lambda x: len(x) > 1, lambda x: x[0][0] > 0):
            cands = [i for i, x in enumerate(shape_list) if pick(x)]
            if not cands:
                continue
            i = max(cands, key=lambda j: sum(s for _, s in shape_list[j]))
            f, b = _time_chunk(pr, shape_list[i], False, n, repeats, warmup)
            extra += f + b - n * (samples[i].fwd_time_s + samples[i].bwd_time_s)
            plain_fwd += n * samples[i].fwd_time_s
        heads = []
        if pr.has_head:
            for tok in sorted({max(16, longest // 4), max(16, longest)}):
                heads.append((tok, *_time_head(pr, tok, repeats, warmup)))
        embeds = []
        if pr.has_embed:
            for tok in sorted({max(16, longest // 4), max(16, longest)}):
                embeds.append((tok, _time_embed(pr, tok, repeats, warmup)))
    say(f"measured in {time.perf_counter() - t_start:.1f} s")

    if samples_out is not None:
        samples_out.extend(samples)
    timed = [dataclasses.replace(s, act_bytes=0.0) for s in samples]  # bytes are fitted below, with more terms
    cost = base.fit(timed, dense_mask=pr.dense_mask)
    feats, ys = [], []
    for (shp, split), nbytes in zip(mem_rows, mem_bytes):
        tok = sum(s for _, s in shp)
        keys = sum(c + s for c, s in shp)
        feats.append([n * tok, n * _context_tokens(shp, split), tok * keys if _needs_mask(shp) else 0.0])
        ys.append(nbytes)
    act, ctx_b, mask_b = (float(v) for v in _nnls(np.array(feats, dtype=float), np.array(ys, dtype=float)))
    mask_b = max(mask_b, mask_rec)  # the cost model has one mask term: take the larger
    ckpt = (ckpt_final - chunk_extra) / (n * size)
    kv = max(0.0, (ckpt_split - ckpt_final) / (n * size))
    hidden_bytes = float(dtype_bytes * pr.hidden_size)
    changes: dict[str, Any] = dict(
        act_bytes_per_token=act,
        context_bytes_per_token=ctx_b,
        mask_bytes_per_pair=mask_b,
        ckpt_bytes_per_token=ckpt,
        ckpt_chunk_bytes_per_token=chunk_extra / size,
        kv_bytes_per_token=kv,
        hidden_bytes_per_token=hidden_bytes,
        output_bytes_per_token=hidden_bytes,
        bwd_transient_bytes_per_token=max(t for t, _ in transients),
        recompute_factor=min(1.5, max(0.0, extra / plain_fwd)) if plain_fwd > 0 else base.recompute_factor,
        layer_params=pr.layer_params,
        source="profiled",
    )
    if cast_bytes:
        # autocast's weight copies live for the step: spread over the profiled parameters
        profiled_params = n * pr.layer_params + (pr.head_params if pr.has_head else 0) + (
            pr.embed_params if pr.has_embed else 0)
        changes["static_bytes_per_param"] = base.static_bytes_per_param + cast_bytes / max(1, profiled_params)
    per_tok = 1.0 + cost.bwd_factor
    if heads:
        toks = [h[0] for h in heads]
        changes["head_time_per_token"] = _through_origin(toks, [(f + b) / per_tok for _, f, b, _ in heads])
        changes["logits_bytes_per_token"] = _through_origin(toks, [m for *_, m in heads])
        changes["head_bwd_transient_bytes_per_token"] = max(h for _, h in transients)
        changes["head_params"] = pr.head_params
    if embeds:
        changes["embed_time_per_token"] = _through_origin([t for t, _ in embeds], [s / per_tok for _, s in embeds])
        changes["embed_params"] = pr.embed_params
    return dataclasses.replace(cost, **changes)
