"""Probing a model's layers on a device: the measurements the profiler fits the cost model to.

:func:`build_probe` takes an HF causal LM (copies of ``num_layers`` of its decoder layers,
switched to the concertina attention backend; the model is untouched) or a
:class:`~.stage.PipelineWrapper` (its own layers) and returns a :class:`Probe`: the layers, the
head and embedding when present, the device, dtypes and sizes. The probe runs them through
:meth:`PipelineWrapper.run_layers <concertina_hf.runtime.stage.PipelineWrapper.run_layers>`
itself (the runtime's code, called on a view of the profiled modules) with a real
:class:`~.attention.ChunkAttentionContext`: a slice with context ``C`` attends to random K/V
leaves of shape ``[1, kv_heads, C, head_dim]`` put in the :class:`~.attention.KVStore`, as the
earlier slices of its sequence would have left them. What it measures, inside
:meth:`Probe.measuring`:

- **time** (:meth:`Probe.time_chunk`): forward (context construction included) and backward
  with a random output gradient, ``warmup`` runs then ``repeats`` timed ones. On CUDA the
  median of wall times around synchronised work; on CPU with one thread the minimum of the
  process's CPU times (other jobs on shared cores inflate wall time by preemption, and CPU time
  only upwards, by contention);
- **activation bytes** (:meth:`Probe.chunk_bytes`), in an untimed forward: every tensor the
  chunk's forward created that is still alive once the executor has dropped its own references
  (saved tensors, the K/V a non-final slice keeps in the store, and, when layers recompute, what
  checkpoint closures keep: the layer inputs, rotary tables, the attention context and its
  masks), less the output (counted by the cost model as the next stage's input or the head's).
  On CPU every live tensor is counted (:class:`~.memory.LiveTensorMeter`), on CUDA the
  allocator's growth (:class:`~.memory.CudaPeakMeter`). Counting only saved tensors
  (:class:`~.memory.SavedTensorMeter`, the executor's meter) would miss what the closures keep;
- **backward transients** (:meth:`Probe.bwd_transients`): the peak a decoder layer's backward
  and the head's backward hold beyond the activations they free, per token;
- **head** (final norm, LM head, float32 summed cross-entropy, :meth:`Probe.time_head`) and
  **embedding** (:meth:`Probe.time_embed`): time, and the bytes the head keeps.

Mixed precision: every forward runs under the autocast state the executor's would (the
caller's, or ``autocast_dtype``), backwards outside it, with stored K/V in the autocast dtype;
so a ``bf16=True`` run (float32 weights) is measured with bf16 activations, K/V and mask. The
weight copies autocast casts once and keeps for the whole step are made when
:meth:`Probe.measuring` starts, before anything is measured; it returns their bytes.

Profiling runs backward through the caller's own modules where they are used in place (a
wrapper's, or a model's head and embedding already on the device): their ``.grad`` are put
back as found when :meth:`Probe.measuring` ends.

Cost: each measurement is ``warmup + repeats`` (timed) or one (bytes) forward and backward of
the probe's layers on one chunk; the meters add a Python call per op on CPU.

Shape legend: ``T`` tokens of a chunk, ``S`` keys (``T`` plus the contexts).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..planning.coefficients import ChunkShape
from ..planning.mixers import LINEAR_KIND
from .attention import (
    ATTN_IMPLEMENTATION,
    ChunkAttentionContext,
    KVStore,
    SliceSpec,
    autocast_dtype as _caller_autocast,
    register_attention,
)
from .memory import CudaPeakMeter, LiveTensorMeter
from .families import ModelFamily, inspect_model, install_mixers
from .per_layer import PER_LAYER_TYPES
from .stage import PipelineWrapper

__all__ = ["Probe", "build_probe"]


class _StageView:
    """Duck-typed stage holding the profiled modules, so the runtime's own
    :class:`PipelineWrapper` methods run them (same layer loop, checkpointing and head)."""

    run_layers = PipelineWrapper.run_layers
    head_loss_sum = PipelineWrapper.head_loss_sum
    head_logits = PipelineWrapper.head_logits
    loss_sum = PipelineWrapper.loss_sum
    embed = PipelineWrapper.embed
    label_smoothing = 0.0

    def __init__(self, layers: Sequence[nn.Module], rotary: nn.Module, norm: nn.Module | None,
                 lm_head: nn.Module | None, embed_tokens: nn.Module | None, family: ModelFamily,
                 layer_start: int = 0) -> None:
        self.decoder_layers = list(layers)
        self.family = family  # what the model does outside the layers (scaling, rotary per layer type)
        self.layer_start, self.layer_end = layer_start, layer_start + len(self.decoder_layers)
        self._embedding_norm = norm if family.norm_before_layers else None
        self.model = SimpleNamespace(model=SimpleNamespace(embed_tokens=embed_tokens), lm_head=lm_head)
        self.rotary_emb, self.final_norm = rotary, norm


@dataclass
class Probe:
    """The profiled modules on a device and what can be measured on them (module docstring).

    Build it with :func:`build_probe`; measure inside ``with probe.measuring():``.
    """

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
    config: Any
    own_params: list[nn.Parameter]  # parameters of the caller's modules used in place
    exclude: list[torch.Tensor]  # parameters and buffers: never counted as activation bytes
    layer_params: int
    embed_params: int
    head_params: int
    amp: torch.dtype | None = None  # autocast dtype of the forwards (None: autocast off)
    # the decoder-layer indices (of layer_ids) whose token mixer is linear (Gated DeltaNet, Mamba2,
    # short convolution, ...: CostModel.layer_kinds); a slice with context finds their carried
    # state in the store instead of K/V
    linear_ids: frozenset[int] = frozenset()

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of stored K/V: the attention casts them to the autocast dtype."""
        return self.amp if self.amp is not None and self.dtype != torch.float64 else self.dtype

    @property
    def profiled_params(self) -> int:
        """Parameters of the profiled modules (the layers, and the head and embedding when present)."""
        return self.num_layers * self.layer_params + (self.head_params if self.has_head else 0) + (
            self.embed_params if self.has_embed else 0)

    # ------------------------------------------------------------------ session
    @contextlib.contextmanager
    def measuring(self) -> Iterator[int]:
        """The context every measurement runs in: the caller's ``.grad`` put back on exit, the
        caller's autocast context suspended (each forward enters the probe's own), autocast's
        weight copies made first. Yields their bytes (0 without autocast)."""
        with _GradsKept(self.own_params), torch.autocast(self.device.type, enabled=False):
            yield self._warm_amp_cache()

    def _fwd(self):
        """A forward under the run's autocast state, as the executor runs it; backwards run
        outside autocast (as in the executor), and so does everything else here."""
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp)

    def _warm_amp_cache(self) -> int:
        """Under autocast the first forward casts the weights, and autocast keeps those copies
        until the outermost autocast context exits: in the executor, the whole step (static
        memory of the step, not a chunk's). Cast them before anything is measured (inside
        :meth:`measuring`'s open autocast context) and return their bytes."""
        if self.amp is None:
            return 0
        with self._live_meter() as meter, torch.no_grad(), self._fwd():
            specs = _specs(((0, 16),), False)
            x = torch.zeros(1, 16, self.hidden_size, dtype=self.dtype, device=self.device)
            y = self.stage.run_layers(x, ChunkAttentionContext(specs, KVStore(), self.device, requires_grad=False), 0)
            if self.has_head:
                self.stage.head_loss_sum(y, torch.zeros(16, dtype=torch.long, device=self.device))
            if self.has_embed:
                self.stage.embed(torch.zeros(16, dtype=torch.long, device=self.device))
            del x, y
            return int(meter.current_bytes)

    def _live_meter(self, exclude: Sequence[torch.Tensor] = ()) -> Any:
        """Every live tensor: :class:`LiveTensorMeter` on CPU, the allocator on CUDA."""
        if self.device.type == "cuda":
            return CudaPeakMeter(self.device)
        return LiveTensorMeter([*self.exclude, *exclude])

    def _store(self, specs: Sequence[SliceSpec]) -> KVStore:
        """A store holding, for every slice with context, random K/V of its earlier tokens on
        the attention layers, and on the linear layers (:attr:`linear_ids`) the state and
        convolution tail an earlier slice of its sequence leaves (:meth:`_carried`)."""
        store = KVStore()
        self._carried(specs, store)
        for s in specs:
            if s.start > 0:
                for layer in self.layer_ids:
                    if layer in self.linear_ids:
                        continue
                    k = torch.randn(1, self.num_kv_heads, s.start, self.head_dim, dtype=self.kv_dtype,
                                    device=self.device)
                    v = torch.randn_like(k)
                    store.put_if_absent(s.seq, 0, layer, k, v, requires_grad=True)
        return store

    def _carried(self, specs: Sequence[SliceSpec], store: KVStore) -> None:
        """Put in ``store``, for every slice with context and linear layer, the entry (state,
        convolution tail) a non-final first slice of its sequence leaves: the probe's layers run
        without gradient on such slices of ``min(16, context)`` tokens, and the linear layers'
        entries are kept (their sizes do not depend on the earlier tokens' count)."""
        later = [s for s in specs if s.start > 0]
        if not self.linear_ids or not later:
            return
        short = [min(16, s.start) for s in later]
        pre, off, pre_specs = KVStore(), 0, []
        for s, n in zip(later, short):
            pre_specs.append(SliceSpec(seq=s.seq, start=0, length=n, offset=off, final=False))
            off += n
        x = torch.randn(1, off, self.hidden_size, dtype=self.dtype, device=self.device)
        with torch.no_grad(), self._fwd():
            self.stage.run_layers(x, ChunkAttentionContext(pre_specs, pre, self.device, requires_grad=False), 0)
        for s in later:
            for layer in self.linear_ids:
                state, tail = pre.leaves(s.seq, 0, layer)
                store.put_if_absent(s.seq, 0, layer, state, tail, requires_grad=True)
        pre.clear()

    # ------------------------------------------------------------------ one chunk
    def time_chunk(self, shape: ChunkShape, split: bool, recompute: int, repeats: int,
                   warmup: int) -> tuple[float, float]:
        """Forward and backward seconds of the probe's layers (all of them, with the first
        ``recompute`` checkpointed) on one chunk of ``shape``; ``split``: one non-final slice."""
        clock, summary = _clock(self.device)
        specs = _specs(shape, split)
        tokens = sum(s for _, s in shape)
        fwd, bwd = [], []
        for i in range(warmup + repeats):
            store = self._store(specs)
            x = torch.randn(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device).requires_grad_()
            _sync(self.device)
            t0 = clock()
            with self._fwd():
                ctx = ChunkAttentionContext(specs, store, self.device, requires_grad=True)
                y = self.stage.run_layers(x, ctx, recompute)
            _sync(self.device)
            t1 = clock()
            grad = torch.randn_like(y)
            _sync(self.device)
            t2 = clock()
            torch.autograd.backward(y, grad)
            _sync(self.device)
            t3 = clock()
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t3 - t2)
            del y, x, grad, ctx, store
        return summary(fwd), summary(bwd)

    def chunk_bytes(self, shape: ChunkShape, split: bool, recompute: int) -> int:
        """Bytes one chunk keeps alive on the probe's layers from its forward to its backward:
        every tensor created by its forward and still alive when the executor would have
        dropped its own references (the context goes; checkpoint closures keep it when layers
        recompute), less the output, which the cost model counts as the next stage's input or
        the head's."""
        specs = _specs(shape, split)
        tokens = sum(s for _, s in shape)
        store = self._store(specs)  # earlier slices' K/V exist before: counted with their own chunks
        with self._live_meter() as meter, torch.enable_grad():
            x = torch.randn(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device).requires_grad_()
            with self._fwd():
                ctx = ChunkAttentionContext(specs, store, self.device, requires_grad=True)
                y = self.stage.run_layers(x, ctx, recompute)
            del ctx
            nbytes = meter.current_bytes - y.untyped_storage().nbytes()
        del y, x
        store.clear()
        return int(nbytes)

    def bwd_transients(self, tokens: int, recompute: int = 0) -> tuple[float, float]:
        """Peak bytes per token that the backward of a decoder layer and of the head hold beyond
        the activations they free (gradients of intermediate activations, the logits' gradient),
        on a whole sequence of ``tokens`` with no recompute: every live tensor on CPU, the
        allocator on CUDA. The incoming gradient is allocated inside the measurement, as the
        executor receives it. ``recompute``: that many layers (the first) run checkpointed, the
        head is not measured (0)."""
        params = [p for m in self.stage.decoder_layers for p in m.parameters()]
        if self.has_head:
            params += [*self.stage.final_norm.parameters(), *self.stage.model.lm_head.parameters()]
        for p in params:  # gradients are static memory; accumulating into them is not a transient
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        exclude = [*self.exclude, *(p.grad for p in params)]

        specs = _specs(((0, tokens),), False)
        with self._live_meter(exclude) as m, torch.enable_grad():
            ctx = ChunkAttentionContext(specs, KVStore(), self.device, requires_grad=True)
            x = torch.randn(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device).requires_grad_()
            with self._fwd():
                y = self.stage.run_layers(x, ctx, recompute)
            start = m.current_bytes
            m.reset()
            torch.autograd.backward(y, torch.randn_like(y))
            layers = (m.peak_bytes - start) / tokens
        del x, y, ctx
        head = 0.0
        if self.has_head and not recompute:
            targets = torch.randint(0, self.vocab_size, (tokens,),
                                    generator=torch.Generator().manual_seed(1)).to(self.device)
            with self._live_meter(exclude) as m, torch.enable_grad():
                x = torch.randn(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device).requires_grad_()
                with self._fwd():
                    loss = self.stage.head_loss_sum(x, targets)
                start = m.current_bytes
                m.reset()
                loss.backward()
                head = (m.peak_bytes - start) / tokens
            del x, loss
        return max(0.0, layers), max(0.0, head)

    def bwd_context_bytes(self, context: int, tokens: int) -> float:
        """Peak bytes per key (``context + tokens``) that a decoder layer's backward holds beyond
        the activations it frees, on one final slice of ``tokens`` tokens after ``context``
        tokens of its sequence: the gradients of every key and value it attended to (the
        kernel's at the query heads' width, their sum over them), as in the executor after
        the sequence's first backward, whose K/V gradient buffers already exist (made here
        before the measurement, left out of it). Every live tensor on CPU, the allocator on
        CUDA."""
        params = [p for m in self.stage.decoder_layers for p in m.parameters()]
        for p in params:  # gradients are static memory
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        specs = _specs(((context, tokens),), False)
        store = self._store(specs)
        leaves = [t for layer in self.layer_ids if layer not in self.linear_ids
                  for pair in store.prefix_parts(0, context, layer) for t in pair]
        for t in leaves:
            t.grad = torch.zeros_like(t)
        exclude = [*self.exclude, *(p.grad for p in params), *leaves, *(t.grad for t in leaves)]
        with self._live_meter(exclude) as m, torch.enable_grad():
            ctx = ChunkAttentionContext(specs, store, self.device, requires_grad=True)
            x = torch.randn(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device).requires_grad_()
            with self._fwd():
                y = self.stage.run_layers(x, ctx, 0)
            start = m.current_bytes
            m.reset()
            torch.autograd.backward(y, torch.randn_like(y))
            peak = m.peak_bytes - start
        del x, y, ctx, leaves
        store.clear()
        return max(0.0, peak / (context + tokens))

    def shared_bytes(self, tokens: int) -> float:
        """Bytes per token of what a stage's decoder layers share on a chunk, once per stage
        whatever its layer count (the rotary tables), which :meth:`chunk_bytes` counts with the
        probe's layers."""
        pos = torch.arange(tokens, device=self.device).unsqueeze(0)
        x = torch.zeros(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        with self._live_meter() as m, torch.no_grad(), self._fwd():
            rotary = self.stage.family.position_embeddings(self.stage.rotary_emb, x, pos,
                                                           range(self.stage.layer_start, self.stage.layer_end))
            nbytes = m.current_bytes
        del rotary
        return nbytes / tokens

    def embed_bwd_bytes(self, tokens: int) -> float:
        """Peak bytes of the embedding's backward on ``tokens`` tokens beyond its saved ids: the
        output's gradient (allocated inside, as a layer's backward hands it over) and the dense
        weight gradient computed before it is added into ``.grad`` (which exists: gradients
        are static memory). Every live tensor on CPU, the allocator on CUDA."""
        emb = self.stage.model.model.embed_tokens
        params = [p for p in emb.parameters() if p.requires_grad]
        if not params:
            return 0.0
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        exclude = [*self.exclude, *(p.grad for p in params)]
        ids = torch.randint(0, self.vocab_size, (tokens,), generator=torch.Generator().manual_seed(2)).to(self.device)
        with self._live_meter(exclude) as m, torch.enable_grad():
            with self._fwd():
                y = self.stage.embed(ids)
            start = m.current_bytes
            m.reset()
            y.backward(torch.randn_like(y))
            peak = m.peak_bytes - start
        del y
        return max(0.0, float(peak))

    def time_head(self, tokens: int, repeats: int, warmup: int) -> tuple[float, float, int]:
        """Head (final norm, LM head, float32 CE): forward seconds, backward seconds, saved bytes."""
        clock, summary = _clock(self.device)
        gen = torch.Generator().manual_seed(tokens)
        targets = torch.randint(0, self.vocab_size, (tokens,), generator=gen).to(self.device)
        fwd, bwd = [], []
        for i in range(warmup + repeats):
            x = torch.randn(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device).requires_grad_()
            _sync(self.device)
            t0 = clock()
            with self._fwd():
                loss = self.stage.head_loss_sum(x, targets)
            _sync(self.device)
            t1 = clock()
            loss.backward()
            _sync(self.device)
            t2 = clock()
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
            del loss, x
        with self._live_meter() as meter, torch.enable_grad():
            x = torch.randn(1, tokens, self.hidden_size, dtype=self.dtype, device=self.device).requires_grad_()
            with self._fwd():
                loss = self.stage.head_loss_sum(x, targets.clone())  # the executor builds targets per chunk
            nbytes = meter.current_bytes
        del loss, x
        return summary(fwd), summary(bwd), int(nbytes)

    def time_embed(self, tokens: int, repeats: int, warmup: int) -> float:
        """Embedding forward + backward seconds."""
        clock, summary = _clock(self.device)
        ids = torch.randint(0, self.vocab_size, (tokens,),
                            generator=torch.Generator().manual_seed(tokens)).to(self.device)
        out = []
        for i in range(warmup + repeats):
            _sync(self.device)
            t0 = clock()
            with self._fwd():
                y = self.stage.embed(ids)
            grad = torch.ones_like(y)
            y.backward(grad)
            _sync(self.device)
            if i >= warmup:
                out.append(clock() - t0)
            del y, grad
        return summary(out)


def build_probe(model_or_wrapper: Any, num_layers: int | None = None, device: Any = None,
                autocast_dtype: torch.dtype | str | None = "caller", layers: Sequence[int] | None = None,
                layer_kinds: Sequence[str] = ()) -> Probe:
    """A :class:`Probe` of an HF causal LM (copies of ``num_layers`` of its decoder layers,
    default 2, on ``device``, default the model's; head and embedding included) or of a
    :class:`PipelineWrapper` (its own first ``num_layers`` layers, default all, and its head or
    embedding when it holds them). ``layers``: the model's decoder-layer indices to probe instead
    of a prefix (a wrapper's: within its stage), e.g. the layers of one kind; ``layer_kinds``: each
    of the model's decoder layers' kind (:attr:`~concertina_hf.planning.cost.CostModel.layer_kinds`;
    empty: all attention), whose ``"linear"`` layers are fed a carried state on slices with context.
    ``autocast_dtype``: the dtype the forwards run under
    ``torch.autocast``; ``"caller"`` takes the caller's autocast state on the device, ``None``
    none. A :class:`Probe` is returned as is, with that autocast dtype.
    """
    if isinstance(model_or_wrapper, Probe):
        pr = model_or_wrapper
    else:
        if layers is not None and num_layers is not None:
            raise ValueError("pass num_layers (a prefix) or layers (chosen indices), not both")
        _refuse_per_layer_inputs(model_or_wrapper)
        pr = _probe_modules(model_or_wrapper, num_layers, device, layers)
        linear = frozenset(i for i in pr.layer_ids if i < len(layer_kinds) and layer_kinds[i] == LINEAR_KIND)
        pr = dataclasses.replace(pr, linear_ids=linear)
    if autocast_dtype == "caller":
        autocast_dtype = _caller_autocast(pr.device.type)
    return dataclasses.replace(pr, amp=autocast_dtype)


def _refuse_per_layer_inputs(model_or_wrapper: Any) -> None:
    """The probe feeds its layers hidden states alone: Gemma 4's per-layer inputs and shared K/V
    (:mod:`.per_layer`) are not measured."""
    inner = getattr(getattr(model_or_wrapper, "model", None), "model", None)
    kind = str(getattr(getattr(model_or_wrapper, "config", None), "model_type", "") or "")
    if kind in PER_LAYER_TYPES or getattr(inner, "embed_tokens_per_layer", None) is not None:
        raise ValueError(f"model type {kind!r}: the profiler does not measure layers fed per-layer inputs or shared "
                         "K/V (runtime/per_layer.py); set concertina_cost_model='analytic'")


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


def _view_family(family: ModelFamily, ids: Sequence[int]) -> tuple[ModelFamily, int]:
    """The family and ``layer_start`` of a :class:`_StageView` of the model's layers ``ids``: as
    is for consecutive layers, else the per-layer rotary fields renumbered 0.. in that order."""
    if list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return family, ids[0]
    none = family.no_position_layers
    types = family.rotary_layer_types
    return dataclasses.replace(
        family, no_position_layers=None if none is None else frozenset(k for k, i in enumerate(ids) if i in none),
        rotary_layer_types=None if types is None else tuple(types[i] for i in ids)), 0


def _chosen(ids: Sequence[int] | None, count: int, total: int, num_layers: int | None, default: int) -> list[int]:
    """Positions ``0..total-1`` of the probed layers: the chosen ``ids`` (less ``count``'s offset),
    or a prefix of ``num_layers`` (``default`` when None)."""
    if ids is not None:
        out = [int(i) - count for i in ids]
        if not out or len(set(out)) != len(out) or not all(0 <= i < total for i in out):
            raise ValueError(f"layers={list(ids)}: choose distinct decoder layers among {count}..{count + total - 1}")
        return out
    n = default if num_layers is None else int(num_layers)
    if not 1 <= n <= total:
        raise ValueError(f"num_layers={num_layers}: {total} decoder layers to choose from")
    return list(range(n))


def _probe_modules(model_or_wrapper: Any, num_layers: int | None, device: Any,
                   chosen: Sequence[int] | None = None) -> Probe:
    register_attention()
    if isinstance(model_or_wrapper, PipelineWrapper):
        w = model_or_wrapper
        dev = w.device
        if device is not None and torch.device(device) != dev:
            raise ValueError(f"the PipelineWrapper lives on {dev}; move it to {device} before profiling "
                             "(or pass device=None)")
        all_layers = w.decoder_layers
        pos = _chosen(chosen, w.layer_start, len(all_layers), num_layers, len(all_layers))
        layers = [all_layers[i] for i in pos]
        family, start = _view_family(w.family, [w.layer_start + i for i in pos])
        stage: Any = _StageView(layers, w.rotary_emb,
                                w.final_norm if w.is_last else None, w.model.lm_head if w.is_last else None,
                                getattr(w.model.model, w.family.embedding) if w.is_first else None, family,
                                start)
        has_head, has_embed = w.is_last, w.is_first
        config = w.config
        own = list(w.parameters())
        head = [w.final_norm, w.model.lm_head] if has_head else []
        embed = [getattr(w.model.model, w.family.embedding)] if has_embed else []
    else:
        model = model_or_wrapper
        for path in ("model", "lm_head"):
            if not hasattr(model, path):
                raise ValueError(f"{type(model).__name__} is not an HF causal LM with model.layers and lm_head; "
                                 "pass such a model or a PipelineWrapper")
        inner = model.model
        family = inspect_model(model)
        rotary = (family.rotary,) if family.no_position_layers is not None else ()  # none without one
        for path in (family.embedding, "layers", family.final_norm, *rotary):
            if not hasattr(inner, path):
                raise ValueError(f"{type(model).__name__}.model has no `{path}`; the profiler supports HF causal LMs "
                                 "with model.embed_tokens / .layers / .norm / .rotary_emb and lm_head")
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        total = len(inner.layers)
        pos = _chosen(chosen, 0, total, num_layers, min(2, total))
        n = len(pos)
        # copies of the profiled layers, switched to the concertina backend: the model is untouched
        copies = copy.deepcopy(nn.ModuleList([*(inner.layers[i] for i in pos),
                                              getattr(inner, family.rotary, None)])).to(dev)
        for m in copies.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = ATTN_IMPLEMENTATION
            if getattr(m, "gradient_checkpointing", False) is True:  # the plan decides recompute
                m.gradient_checkpointing = False
        layers = list(copies[:n])
        install_mixers(SimpleNamespace(config=model.config, modules=copies.modules), family)  # as the stage's
        norm, norm_own = _on(getattr(inner, family.final_norm), dev)
        lm_head, head_own = _on(model.lm_head, dev)
        embed_tokens, embed_own = _on(getattr(inner, family.embedding), dev)
        view_family, start = _view_family(family, pos)
        stage = _StageView(layers, copies[n], norm, lm_head, embed_tokens, view_family, start)
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
    if stage.rotary_emb is not None:  # (a model without rotary embeddings: OLMo Hybrid's, Granite-4.0's)
        exclude += list(stage.rotary_emb.buffers())
    head_params = sum(p.numel() for m in head for p in m.parameters())
    if head and head[1].weight is (embed[0].weight if embed else None):  # tied: counted with the embedding
        head_params -= head[1].weight.numel()
    return Probe(
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


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _clock(dev: torch.device):
    """The probe's clock and how it summarises repeats.

    CUDA: wall time around synchronised work, median. CPU with one thread: the process's CPU
    time, which other jobs sharing the cores do not inflate by preemption, and the minimum,
    since what they still add (cache and memory-bandwidth contention) only ever adds. CPU with
    several threads: wall time (CPU time would add the threads up), median.
    """
    if dev.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time, min
    return time.perf_counter, statistics.median


def _specs(shape: ChunkShape, split: bool) -> list[SliceSpec]:
    if split and len(shape) != 1:
        raise ValueError(f"a split (non-final) chunk holds exactly one slice, got shape {shape}")
    out, off = [], 0
    for i, (c, s) in enumerate(shape):
        out.append(SliceSpec(seq=i, start=c, length=s, offset=off, final=not split))
        off += s
    return out
