"""The ``"concertina"`` attention backend: packed, sliced sequences through unmodified HF models.

A chunk is a padding-free concatenation of slices (see :mod:`concertina_hf.planning.types`).
HF attention modules call the function registered in ``AttentionInterface`` under the model's
``config._attn_implementation``. The runtime calls the decoder layers itself
(:meth:`PipelineWrapper.run_layers <concertina_hf.runtime.stage.PipelineWrapper.run_layers>`) and
delivers the chunk's :class:`ChunkAttentionContext` two ways: as the keyword ``concertina_ctx``
(which most layers forward unchanged to the attention function) and in a context variable set
around each layer call (:func:`chunk_context`), so it also arrives through layers that drop their
``**kwargs`` (StableLM, Nemotron). The variable is set *inside* the function that activation
checkpointing wraps, so the forward that non-reentrant checkpointing replays during backward
(possibly in autograd's device thread) sees it too. While the runtime runs a step
(:func:`step_active`, a process-wide flag) an attention call that finds no context raises
instead of silently attending over the whole chunk.

The attention, per slice ``i`` of the chunk (a *segment*): the slice's queries (positions
``start_i .. start_i + s_i - 1``) attend to keys ``[prefix_i, own_i]``, where ``prefix_i`` is the
K/V its sequence's earlier slices left in the :class:`KVStore` (``C_i = start_i`` tokens) and
``own_i`` the slice's own keys: query at position ``p`` sees key at ``p' <= p`` (causal, aligned
bottom-right: queries shorter than keys) and, under a sliding window ``W``, ``p - p' < W``. With it,
for each layer:

1. every slice that is not the last of its sequence stores its post-rotary K and V (a view of the
   chunk's keys, still attached to the graph, for its own backward) and a detached leaf alias
   with ``requires_grad`` that later slices read, in the :class:`KVStore` (set-if-absent, so the
   forward replayed by activation checkpointing leaves the originals in place);
2. a slice with context ``C > 0`` attends to the concatenated leaves of its sequence's earlier
   slices followed by its own keys; the gradient that flows into those leaves is what the runtime
   hands to the earlier slices' backward;
3. the kernel (:func:`attention_kernel` names the one a device takes; each is logged once when it
   first runs and :func:`kernels_used` lists those that ran):

   - CPU: SDPA's flash kernel per segment (:class:`_SegmentsCPU`): a segment with no context runs
     ``is_causal``; one with context runs twice, its queries against the earlier slices' keys
     (no mask) and against its own (``is_causal``), merged by logsumexp; only a binding sliding
     window gets an explicit mask (``s_i x`` the keys within the window), built in forward and
     again in backward and never kept. No ``T x S`` mask exists and no masked pair beyond a
     window is computed: cost follows the attended pairs ``sum(s_i * C_i + s_i^2 / 2)``;
   - CUDA, half precision: ``flash_attn_varlen_func`` when flash-attn is installed, else torch's
     ``torch.nn.attention.varlen.varlen_attn`` when present (its keywords checked by signature:
     ``window_size``, ``enable_gqa``, ``scale``, ``is_causal`` differ across torch releases), one
     call over the chunk with ``cu_seqlens`` from the context (queries shorter than keys, causal
     bottom-right, the kernels' convention);
   - CUDA otherwise (float32, a feature the varlen kernel lacks: dropout for ``varlen_attn``, or
     what FlashAttention-2 does not take: a GPU older than compute capability 8.0, a head
     dimension over 256, for ``varlen_attn`` one that is not a multiple of 8):
     one SDPA call per segment (:func:`_segments_sdpa`), ``is_causal`` or an ``s_i x (C_i + s_i)``
     mask; never a ``T x S`` mask;
   - the eager formula per segment (:func:`_segments_math`), on any device, for what the kernels
     above do not implement: attention soft-capping (Gemma2's ``softcap``; flash-attn does it
     itself), attention sinks (gpt-oss's ``s_aux``, per-query ``sinks``); it keeps the
     ``H x s_i x (C_i + s_i)`` probabilities of each segment for backward, like HF's eager path.

Keywords. The function implements ``dropout`` (on CPU through per-segment SDPA, autograd keeping
the concatenated keys of a segment with context), ``scaling``, per-layer ``sliding_window``,
``softcap``, ``s_aux`` / ``sinks`` and value heads of another size than query/key heads (MLA,
DeepSeek-V3: the kernels get zero-padded heads, the output is cut back). It raises, naming the
keyword and ``module.config.model_type``, on any other keyword unless :data:`IGNORED_KEYWORDS`
lists it as harmless, or :data:`NEUTRAL_KEYWORDS` as harmless at a neutral value (``None``,
``False``) that it has; within a step also on an ``attention_mask`` (the context defines the mask)
and on ``is_causal=False``.

Under autocast (``torch.autocast``, e.g. ``bf16=True``), query, key and value are first cast to the
autocast dtype, as SDPA (an autocast op) would cast them in HF's own path: post-rotary query and
key are often float32 (rotary tables in the parameters' dtype) while value is already bfloat16.
Casting before the own K/V are stored gives stored K/V, later slices' leaves and every attention
path one dtype (and halves the stored K/V of float32 models); the replay of a checkpointed layer
runs under the same autocast state (``torch.utils.checkpoint`` restores it).

Costs: SDPA on CPU saves ``q, k, v, out, logsumexp``; :class:`_SegmentsCPU` saves those and the
earlier slices' leaves (alive in the store anyway), not the concatenated keys of a segment with
context, which it rebuilds in backward one segment at a time. The earlier slices' K/V stay alive
(in the store) until their own backward. The varlen kernels, the per-segment SDPA and the eager
path go through ``torch.cat``, so autograd also keeps the concatenated ``C + s`` keys of each
layer until the slice's backward (``O(n^2)`` K/V over a chain of ``n`` slices).

Without a context and outside a step (a plain ``model(...)`` call on a model set to
``"concertina"``) the function falls back to HF's SDPA path (the eager formula when the layer
passes ``softcap`` or sinks, which HF's SDPA does not implement), and the mask function
registered under the same name is HF's SDPA mask, so ``generate`` and ordinary evaluation work.

Shape legend: ``T`` query tokens of the chunk, ``S`` key tokens (``T`` plus the contexts), ``s``
/ ``C`` a segment's queries / context, ``H`` query heads, ``K`` key/value heads, ``D`` head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "ATTN_IMPLEMENTATION",
    "IGNORED_KEYWORDS",
    "KERNELS",
    "NEUTRAL_KEYWORDS",
    "ChunkAttentionContext",
    "KVStore",
    "SliceSpec",
    "attention_kernel",
    "autocast_dtype",
    "chunk_context",
    "concertina_attention_forward",
    "current_context",
    "flash_attn_available",
    "kernels_used",
    "register_attention",
    "step_active",
    "torch_varlen_available",
]

ATTN_IMPLEMENTATION = "concertina"

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """A slice as the attention sees it: ``tokens [start, start+length)`` of sequence ``seq``,
    at ``offset`` in the chunk; ``final`` when no later slice of the sequence exists."""

    seq: int
    start: int
    length: int
    offset: int
    final: bool


@dataclass(slots=True)
class _KVEntry:
    k: torch.Tensor  # [1, K, s, D], attached to the slice's own graph
    v: torch.Tensor
    k_leaf: torch.Tensor  # detached alias (same storage) that later slices attend to
    v_leaf: torch.Tensor


class KVStore:
    """Post-rotary K/V of non-final slices, per ``(sequence, slice start, layer)``.

    The runtime frees a slice's entries after that slice's backward (all later slices of the
    sequence have run backward by then, so its leaf gradients are complete), or, without
    gradients, once the sequence's last slice has run forward.
    """

    def __init__(self) -> None:
        # seq -> layer -> {start: entry}
        self._kv: dict[int, dict[int, dict[int, _KVEntry]]] = {}

    def put_if_absent(self, seq: int, start: int, layer: int, k: torch.Tensor, v: torch.Tensor,
                      requires_grad: bool) -> None:
        per_start = self._kv.setdefault(seq, {}).setdefault(layer, {})
        if start in per_start:  # the replay of a checkpointed layer: keep the originals
            return
        k_leaf = k.detach().requires_grad_(requires_grad)
        v_leaf = v.detach().requires_grad_(requires_grad)
        per_start[start] = _KVEntry(k, v, k_leaf, v_leaf)

    def prefix_parts(self, seq: int, context: int, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Leaves ``(K, V)`` ([1, K, s, D]) of the slices of ``seq`` before token ``context``, in order."""
        per_start = self._kv.get(seq, {}).get(layer, {})
        parts = [per_start[s] for s in sorted(per_start) if s < context]
        have = sum(e.k_leaf.shape[2] for e in parts)
        if have != context:
            raise RuntimeError(
                f"K/V of sequence {seq} before token {context} on layer {layer} is incomplete "
                f"({have} tokens stored): an earlier slice did not run forward on this stage first"
            )
        return [(e.k_leaf, e.v_leaf) for e in parts]

    def prefix(self, seq: int, context: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`prefix_parts` concatenated: [1, K, context, D] each."""
        parts = self.prefix_parts(seq, context, layer)
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

    def entries(self, seq: int, start: int) -> list[_KVEntry]:
        """This slice's entries on every layer of the stage (layer order)."""
        layers = self._kv.get(seq, {})
        return [layers[l][start] for l in sorted(layers) if start in layers[l]]

    def entries_before(self, seq: int, start: int) -> list[tuple[int, _KVEntry]]:
        """``(slice start, entry)`` of the slices of ``seq`` before token ``start``, every layer."""
        return [(s, e) for per_start in self._kv.get(seq, {}).values() for s, e in per_start.items() if s < start]

    def free_slice(self, seq: int, start: int) -> None:
        layers = self._kv.get(seq)
        if not layers:
            return
        for per_start in layers.values():
            per_start.pop(start, None)
        if all(not p for p in layers.values()):
            del self._kv[seq]

    def free_seq(self, seq: int) -> None:
        self._kv.pop(seq, None)

    def clear(self) -> None:
        self._kv.clear()

    def tensors(self) -> list[torch.Tensor]:
        """Every stored tensor, with the leaves' gradients (for memory accounting)."""
        out = []
        for layers in self._kv.values():
            for per_start in layers.values():
                for e in per_start.values():
                    out += [e.k, e.v]
                    out += [g for g in (e.k_leaf.grad, e.v_leaf.grad) if g is not None]
        return out

    def __len__(self) -> int:
        return sum(len(p) for layers in self._kv.values() for p in layers.values())


# ---------------------------------------------------------------------------- context delivery
_CURRENT: contextvars.ContextVar["ChunkAttentionContext | None"] = contextvars.ContextVar(
    "concertina_chunk_context", default=None)
_STEP_LOCK = threading.Lock()
_STEP_DEPTH = 0


@contextlib.contextmanager
def chunk_context(ctx: "ChunkAttentionContext") -> Iterator[None]:
    """Make ``ctx`` the chunk context of attention calls in this (thread's) context.

    The runtime wraps each decoder-layer call in it, inside the function that activation
    checkpointing wraps, so a layer that drops ``**kwargs`` and the forward that non-reentrant
    checkpointing replays in backward both reach the context."""
    token = _CURRENT.set(ctx)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_context() -> "ChunkAttentionContext | None":
    """The context :func:`chunk_context` set in this thread's context (``None`` outside)."""
    return _CURRENT.get()


@contextlib.contextmanager
def step_active() -> Iterator[None]:
    """Mark a runtime step as running (process-wide, any thread): an attention call that finds
    no chunk context meanwhile raises instead of falling back to plain causal SDPA."""
    global _STEP_DEPTH
    with _STEP_LOCK:
        _STEP_DEPTH += 1
    try:
        yield
    finally:
        with _STEP_LOCK:
            _STEP_DEPTH -= 1


# ---------------------------------------------------------------------------- keywords
#: Keywords HF layers pass to the attention function that carry nothing the attention needs
#: (ignored at any value), with the reason.
IGNORED_KEYWORDS: dict[str, str] = {
    "position_ids": "the chunk's positions come from the context; rotary embeddings are applied before the call",
    "position_embeddings": "rotary (cos, sin), already applied to query and key",
    "cache_position": "positions in a KV cache; the runtime runs without one",
    "use_cache": "the runtime runs without a KV cache (use_cache=False); no cached keys reach the attention",
    "output_router_logits": "a flag of MoE blocks, passed down through the layer; not an attention setting",
}

#: Keywords that are harmless only at a neutral value (``None`` or ``False``): any other value
#: asks for something the backend does not do, and raises.
NEUTRAL_KEYWORDS: dict[str, str] = {
    "output_attentions": "attention probabilities are never materialized",
    "past_key_values": "no KV cache",
    "past_key_value": "no KV cache",
    "encoder_hidden_states": "no cross-attention",
    "position_bias": "no additive position bias (T5-style relative attention)",
    "indices": "no sparse (top-k indexed) attention",
    "block_indices": "no block-sparse attention",
    "cu_seq_lens_q": "the chunk context defines the varlen layout",
    "cu_seq_lens_k": "the chunk context defines the varlen layout",
    "max_length_q": "the chunk context defines the varlen layout",
    "max_length_k": "the chunk context defines the varlen layout",
}


def _model_type(module: torch.nn.Module) -> str:
    return str(getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__)


def _check_keywords(kwargs: dict, module: torch.nn.Module, in_chunk: bool) -> None:
    for name, val in kwargs.items():
        if name in IGNORED_KEYWORDS:
            continue
        if name in NEUTRAL_KEYWORDS:
            if not in_chunk or val is None or val is False:
                continue
            raise ValueError(
                f"the concertina attention backend got {name}={_short(val)} from {type(module).__name__} "
                f"(model type {_model_type(module)!r}); it supports only {name}=None/False here "
                f"({NEUTRAL_KEYWORDS[name]})")
        raise ValueError(
            f"the concertina attention backend does not implement the keyword {name!r} that "
            f"{type(module).__name__} (model type {_model_type(module)!r}) passes ({_short(val)}); refusing "
            "rather than training a different model")


def _short(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"a tensor of shape {tuple(val.shape)}"
    r = repr(val)
    return r if len(r) < 60 else r[:57] + "..."


# ---------------------------------------------------------------------------- chunk context
class ChunkAttentionContext:
    """Token layout of one chunk plus the K/V store; delivered to decoder layers as
    ``concertina_ctx`` and through :func:`chunk_context`.

    ``position_ids`` ([1, T]) are ``start + arange(length)`` per slice, so rotary embeddings
    continue across slice boundaries. ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32) describe the
    varlen layout: slice ``i`` is segment ``i``, its keys ``[prefix_i, own_i]``.
    """

    def __init__(self, slices: Sequence[SliceSpec], store: KVStore, device: torch.device | str,
                 requires_grad: bool) -> None:
        self.slices = tuple(slices)
        self.store = store
        self.requires_grad = requires_grad
        self.device = torch.device(device)
        self.num_tokens = sum(s.length for s in self.slices)
        pos = [torch.arange(s.start, s.start + s.length) for s in self.slices]
        self.position_ids = torch.cat(pos).to(self.device).unsqueeze(0)
        self.has_context = any(s.start > 0 for s in self.slices)
        self.cu_seqlens_q = torch.tensor([0] + _cumsum([s.length for s in self.slices]), dtype=torch.int32,
                                         device=self.device)
        self.cu_seqlens_k = torch.tensor([0] + _cumsum([s.start + s.length for s in self.slices]),
                                         dtype=torch.int32, device=self.device)
        self.max_seqlen_q = max(s.length for s in self.slices)
        self.max_seqlen_k = max(s.start + s.length for s in self.slices)

    def store_own(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep this chunk's non-final slices' K/V (set-if-absent) for their later slices."""
        for s in self.slices:
            if not s.final:
                self.store.put_if_absent(s.seq, s.start, layer, key[:, :, s.offset:s.offset + s.length],
                                         value[:, :, s.offset:s.offset + s.length], self.requires_grad)

    def prefix(self, s: SliceSpec, layer: int, window: int | None, dtype: torch.dtype | None
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
        """The earlier slices' leaves ``(K, V)`` slice ``s`` attends to under ``window``, the tokens
        to cut from the front of the first (outside the window) and ``lo``, the position of the
        first key kept. Leaves stored in another dtype than ``dtype`` (earlier slices run under
        another autocast state; the runtime never does that within a step) are cast to it,
        through autograd, so their gradient still reaches the leaf."""
        lo = _window_lo(s.start, window)
        if s.start == 0:
            return [], 0, lo
        kept, cut, p0 = [], 0, 0
        for k_leaf, v_leaf in self.store.prefix_parts(s.seq, s.start, layer):
            p1 = p0 + k_leaf.shape[2]
            if p1 > lo:
                if not kept:
                    cut = max(0, lo - p0)
                if dtype is not None and k_leaf.dtype != dtype:
                    k_leaf, v_leaf = k_leaf.to(dtype), v_leaf.to(dtype)
                kept.append((k_leaf, v_leaf))
            p0 = p1
        return kept, cut, lo

    def segment_kv(self, s: SliceSpec, layer: int, key: torch.Tensor, value: torch.Tensor,
                   window: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Keys and values slice ``s`` attends to ([1, K, kc, D], positions ``lo .. start + length``,
        concatenated through autograd) and ``lo``."""
        own_k = key[:, :, s.offset:s.offset + s.length]
        own_v = value[:, :, s.offset:s.offset + s.length]
        parts, cut, lo = self.prefix(s, layer, window, key.dtype)
        if not parts:
            return own_k, own_v, lo
        k = torch.cat([p[0] for p in parts] + [own_k], dim=2)[:, :, cut:]
        v = torch.cat([p[1] for p in parts] + [own_v], dim=2)[:, :, cut:]
        return k, v, lo

    def keys(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the own K/V and return the keys in the varlen layout (slice by slice,
        ``[prefix_i, own_i]``): [1, K, S, D] each."""
        self.store_own(layer, key, value)
        return self.varlen_keys(layer, key, value)

    def varlen_keys(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys in the varlen layout ([1, K, S, D] each), the own K/V already stored."""
        if not self.has_context:
            return key, value
        ks, vs = [], []
        for s in self.slices:
            k, v, _ = self.segment_kv(s, layer, key, value, None)
            ks.append(k)
            vs.append(v)
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def _window_lo(start: int, window: int | None) -> int:
    """Position of the first key the first query (position ``start``) of a segment sees."""
    return 0 if window is None else max(0, start - window + 1)


def _segment_mask(start: int, length: int, lo: int, window: int | None, device: torch.device
                  ) -> torch.Tensor | None:
    """Boolean ``[length, start + length - lo]``: query at ``start + i`` may attend to key at
    ``lo + j``; ``None`` when plain causal attention (``is_causal``, square) is exactly that."""
    if start == 0 and (window is None or window >= length):
        return None
    qp = torch.arange(start, start + length, device=device)[:, None]
    kp = torch.arange(lo, start + length, device=device)[None, :]
    m = kp <= qp
    if window is not None:
        m &= (qp - kp) < window
    return m


def _cumsum(xs: Sequence[int]) -> list[int]:
    out, t = [], 0
    for x in xs:
        t += x
        out.append(t)
    return out


def _pad_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA (value heads of another size than query/key heads) for kernels that need one head
    size: zero-pad the smaller side (zero value columns give zero output columns, cut later;
    zero query/key columns leave the scores unchanged under an explicit scale)."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    return q, k, v


# ---------------------------------------------------------------------------- CPU: SDPA flash kernel per segment
def _cpu_segments(ctx: ChunkAttentionContext, layer: int, window: int | None, dtype: torch.dtype
                  ) -> tuple[tuple, list[torch.Tensor], list[torch.Tensor]]:
    """Per slice ``(offset, length, start, lo, prefix indices, cut)`` plus the flat prefix leaves."""
    segs, pk, pv = [], [], []
    for s in ctx.slices:
        parts, cut, lo = ctx.prefix(s, layer, window, dtype)
        idx = tuple(range(len(pk), len(pk) + len(parts)))
        pk += [p[0] for p in parts]
        pv += [p[1] for p in parts]
        segs.append((s.offset, s.length, s.start, lo, idx, cut))
    return tuple(segs), pk, pv


def _cpu_seg_parts(query, key, value, pk, pv, seg, window):
    """The kernel calls of one segment: ``[(q, k, v, mask, causal)]``.

    A slice with context and no binding window: two calls, queries against the earlier slices'
    keys (no mask: all visible) and against their own keys (``is_causal``: square), merged by
    their logsumexp; no mask at all, no masked pair computed. Otherwise one call against
    ``[prefix, own]`` keys, ``is_causal`` (a whole sequence) or with an ``s x kc`` additive mask
    (a binding window)."""
    off, n, start, lo, idx, cut = seg
    q = query[:, :, off:off + n]
    k, v = key[:, :, off:off + n], value[:, :, off:off + n]
    if idx and (window is None or window >= start + n):
        kp = pk[idx[0]] if len(idx) == 1 else torch.cat([pk[i] for i in idx], dim=2)
        vp = pv[idx[0]] if len(idx) == 1 else torch.cat([pv[i] for i in idx], dim=2)
        return [(q, kp, vp, None, False), (q, k, v, None, True)]
    if idx:
        k = torch.cat([pk[i] for i in idx] + [k], dim=2)[:, :, cut:]
        v = torch.cat([pv[i] for i in idx] + [v], dim=2)[:, :, cut:]
    m = _segment_mask(start, n, lo, window, query.device)
    mask = None
    if m is not None:
        mask = torch.zeros(m.shape, dtype=query.dtype, device=query.device).masked_fill_(~m, float("-inf"))
    return [(q, k, v, mask, mask is None)]


class _SegmentsCPU(torch.autograd.Function):
    """SDPA's CPU flash kernel per segment (a slice's queries against ``[prefix, own]`` keys,
    :func:`_cpu_seg_parts`), saving the pieces (queries, own keys, earlier slices' leaves, output,
    logsumexp) rather than any concatenated copy; masks and concatenations are rebuilt in
    backward, one segment at a time. Two calls of one segment are merged by their logsumexp, and
    each call's backward with the merged output and logsumexp gives that call's exact share of
    the gradients. The key gradient is split back into the pieces (the leaves' share accumulates
    in their ``.grad``, which the runtime hands to the earlier slices' backward)."""

    @staticmethod
    def forward(fctx, query, key, value, scale, window, segs, n_prefix, *prefix):
        pk, pv = prefix[:n_prefix], prefix[n_prefix:]
        dv = value.shape[-1]
        # [1, H, T, Dv] laid out as [1, T, H, Dv], as the kernel lays out its own output: the
        # caller's transpose(1, 2).contiguous() is then free, and the one output saved here is
        # the one the next projection reads
        out = query.new_empty((1, query.shape[2], query.shape[1], dv)).transpose(1, 2)
        lses = []
        for seg in segs:
            off, n = seg[0], seg[1]
            res = []
            for q, k, v, mask, causal in _cpu_seg_parts(query, key, value, pk, pv, seg, window):
                q, k, v = _pad_head_dims(q, k, v)
                res.append(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, causal, attn_mask=mask, scale=scale))
            if len(res) == 1:
                o, lse = res[0]
            else:
                (o1, l1), (o2, l2) = res
                lse = torch.logaddexp(l1, l2)
                o = o1.float() * torch.exp(l1 - lse)[..., None] + o2.float() * torch.exp(l2 - lse)[..., None]
            out[:, :, off:off + n] = o[..., :dv]
            lses.append(lse)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
        fctx.save_for_backward(query, key, value, out, lse, *prefix)
        fctx.scale, fctx.window, fctx.segs, fctx.n_prefix = scale, window, segs, n_prefix
        return out

    @staticmethod
    def backward(fctx, grad_out):
        query, key, value, out, lse, *prefix = fctx.saved_tensors
        n_prefix, window = fctx.n_prefix, fctx.window
        pk, pv = prefix[:n_prefix], prefix[n_prefix:]
        d, dv = query.shape[-1], value.shape[-1]
        # every token's gradient is written by its segment when the segments tile the chunk (the
        # runtime's always do): no zero fill needed
        new = torch.empty_like if _tiles(fctx.segs, query.shape[2]) else torch.zeros_like
        dquery, dkey, dvalue = new(query), new(key), new(value)
        dpk: list = [None] * n_prefix
        dpv: list = [None] * n_prefix
        for seg in fctx.segs:
            off, n, start, lo, idx, cut = seg
            o, go = out[:, :, off:off + n], grad_out[:, :, off:off + n]
            if dv < d:
                o, go = F.pad(o, (0, d - dv)), F.pad(go, (0, d - dv))
            o, go, l = o.contiguous(), go.contiguous(), lse[:, :, off:off + n].contiguous()
            dq, dks, dvs = 0, [], []
            for q, k, v, mask, causal in _cpu_seg_parts(query, key, value, pk, pv, seg, window):
                q, k, v = _pad_head_dims(q, k, v)
                dq_i, dk_i, dv_i = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    go, q, k, v, o, l, 0.0, causal, attn_mask=mask, scale=fctx.scale)
                dq = dq + dq_i
                dks.append(dk_i)
                dvs.append(dv_i)
            dk = dks[0] if len(dks) == 1 else torch.cat(dks, dim=2)  # keys [prefix, own] from lo
            dvv = dvs[0] if len(dvs) == 1 else torch.cat(dvs, dim=2)
            dq, dk, dvv = dq[..., :d], dk[..., :d], dvv[..., :dv]
            dquery[:, :, off:off + n] = dq
            dkey[:, :, off:off + n] = dk[:, :, -n:]
            dvalue[:, :, off:off + n] = dvv[:, :, -n:]
            pos = -cut  # position of the current piece's first token in dk (negative: cut away)
            for i in idx:
                length = pk[i].shape[2]
                a, b = max(pos, 0), pos + length
                gk, gv = torch.empty_like(pk[i]), torch.empty_like(pv[i])
                if a > pos:  # tokens cut by the window get no gradient
                    gk[:, :, :a - pos].zero_()
                    gv[:, :, :a - pos].zero_()
                gk[:, :, a - pos:] = dk[:, :, a:b]
                gv[:, :, a - pos:] = dvv[:, :, a:b]
                dpk[i] = gk if dpk[i] is None else dpk[i] + gk
                dpv[i] = gv if dpv[i] is None else dpv[i] + gv
                pos = b
        return (dquery, dkey, dvalue, None, None, None, None, *dpk, *dpv)


def _tiles(segs, tokens: int) -> bool:
    """Whether the segments ``(offset, length, ...)`` cover ``[0, tokens)`` exactly, in order."""
    t = 0
    for seg in segs:
        if seg[0] != t:
            return False
        t += seg[1]
    return t == tokens


# ---------------------------------------------------------------------------- per-segment autograd paths
def _segments_sdpa(ctx: ChunkAttentionContext, layer: int, query, key, value, scale: float,
                   window: int | None, dropout: float) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` once per segment (``is_causal`` or an ``s x kc``
    boolean mask): SDPA on CUDA without a varlen kernel, and CPU with dropout. -> [1, H, T, Dv]."""
    gqa = query.shape[1] != key.shape[1]
    dv = value.shape[-1]
    outs = []
    for s in ctx.slices:
        k, v, lo = ctx.segment_kv(s, layer, key, value, window)
        q = query[:, :, s.offset:s.offset + s.length]
        q, k, v = _pad_head_dims(q, k, v)
        m = _segment_mask(s.start, s.length, lo, window, query.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout, is_causal=m is None,
                                           scale=scale, enable_gqa=gqa)
        outs.append(o[..., :dv])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None,
           sink: torch.Tensor | None, dropout: float, allowed: torch.Tensor | None = None,
           additive: torch.Tensor | None = None) -> torch.Tensor:
    """HF's eager attention formula (``q`` [B, H, q, D], ``k``/``v`` [B, K, kv, D]) with soft-capping
    (Gemma2: ``cap * tanh(scores / cap)`` before the mask) and sinks (gpt-oss: one more logit per
    head, or per head and query, with a zero value), softmax in float32. -> [B, H, q, Dv]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if additive is not None:
        w = w + additive
    if allowed is not None:
        w = w.masked_fill(~allowed, torch.finfo(w.dtype).min)
    if sink is not None:
        sink = sink.to(w.dtype).expand(w.shape[0], w.shape[1], w.shape[2], 1)
        p = F.softmax(torch.cat([w, sink], dim=-1).float(), dim=-1)[..., :-1]
    else:
        p = F.softmax(w.float(), dim=-1)
    p = p.to(v.dtype)
    if dropout:
        p = F.dropout(p, p=dropout, training=True)
    return torch.matmul(p, v)


def _sink_rows(sink: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """Sinks as [B, H, q or 1, 1]: ``s_aux`` is one logit per head ([H]); per-query sinks come as
    [B, H, q, 1]."""
    if sink is None or sink.dim() == 4:
        return sink
    if sink.numel() != heads:
        raise ValueError(f"attention sinks of shape {tuple(sink.shape)} for {heads} heads: expected [H] or [B, H, q, 1]")
    return sink.reshape(1, heads, 1, 1)


def _segments_math(ctx: ChunkAttentionContext, layer: int, query, key, value, scale: float,
                   window: int | None, dropout: float, softcap: float | None,
                   sink: torch.Tensor | None) -> torch.Tensor:
    """:func:`_eager` once per segment (``s x kc`` mask). -> [1, H, T, Dv]."""
    sink = _sink_rows(sink, query.shape[1])
    outs = []
    for s in ctx.slices:
        k, v, lo = ctx.segment_kv(s, layer, key, value, window)
        q = query[:, :, s.offset:s.offset + s.length]
        m = _segment_mask(s.start, s.length, lo, window, query.device)
        if m is None:
            m = torch.ones(s.length, s.length, dtype=torch.bool, device=query.device).tril()
        sk = sink if sink is None or sink.shape[2] == 1 else sink[:, :, s.offset:s.offset + s.length]
        outs.append(_eager(q, k, v, scale, softcap, sk, dropout, allowed=m))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# ---------------------------------------------------------------------------- CUDA varlen kernels
def flash_attn_available() -> bool:
    """Whether the flash-attn package imports."""
    return _flash_attn_fn() is not None


@functools.lru_cache(maxsize=None)
def _flash_attn_fn() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def _flash_attn_params() -> frozenset:
    fn = _flash_attn_fn()
    try:
        return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()
    except (TypeError, ValueError):
        return frozenset()


@functools.lru_cache(maxsize=None)
def _torch_varlen() -> tuple[Callable, frozenset] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    params = frozenset(inspect.signature(varlen_attn).parameters)
    if "is_causal" not in params and "window_size" not in params:
        return None  # no way to ask for causal attention
    return varlen_attn, params


def torch_varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` with a causal mode."""
    return _torch_varlen() is not None


def _flash_attn_call(q, k, v, ctx: ChunkAttentionContext, scale, window, dropout, softcap):
    """q [T, H, D], k/v [S, K, D] in the varlen layout; flash-attn >= 2.1 aligns causal bottom-right."""
    kw = {}
    if softcap is not None:
        kw["softcap"] = softcap
    return _flash_attn_fn()(
        q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
        dropout_p=dropout, softmax_scale=scale, causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1), **kw)


def _torch_varlen_call(q, k, v, ctx: ChunkAttentionContext, scale, window):
    """torch's ``varlen_attn`` (ATen's FlashAttention-2: causal and window masks aligned
    bottom-right, queries shorter than keys), its keywords chosen by signature.

    Read in the sources of torch 2.11 and 2.13 (both: ``(query, key, value, cu_seq_q, cu_seq_k,
    max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1))``, 2.13 adding
    ``enable_gqa``, ``seqused_k``, ``block_table``, ``num_splits``; int32 ``cu_seq_*`` on the
    device; returns the output ``[T, H, D]`` alone): neither has ``is_causal``; both derive it as
    ``window_size == (-1, 0)``, a *tuple* comparison (a list would silently give non-causal
    attention), so causal is ``(-1, 0)`` and a window ``W`` is ``(W - 1, 0)`` (keys ``p - W < p' <=
    p``: the kernel's local mask, also bottom-right). Without ``enable_gqa`` (2.11) K/V heads are
    repeated to the query heads (its documented shapes; the kernel saves the repeated K/V for
    backward: ``H / K`` times the K/V bytes of the varlen call). ``is_causal`` is passed where a
    release has it, ``scale`` where it exists, else the queries are pre-scaled."""
    fn, params = _torch_varlen()
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scale
    else:
        q = q * (scale * q.shape[-1] ** 0.5)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in params:  # a tuple: varlen_attn compares it with (-1, 0) to decide causal
        kw["window_size"] = (window - 1, 0) if window is not None else (-1, 0)
    if "is_causal" in params:
        kw["is_causal"] = True
    return fn(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k, **kw)


def _varlen_path(kernel: str, ctx: ChunkAttentionContext, layer: int, query, key, value, scale: float,
                 window: int | None, dropout: float, softcap: float | None) -> torch.Tensor:
    """One varlen call over the chunk. -> [1, T, H, Dv]."""
    key_S, value_S = ctx.varlen_keys(layer, key, value)
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key_S[0].transpose(0, 1)  # [S, K, D] (K < H handled by the kernel)
    v = value_S[0].transpose(0, 1)
    dv = v.shape[-1]
    q, k, v = _pad_head_dims(q, k, v)
    if kernel == "flash-attn":
        out = _flash_attn_call(q, k, v, ctx, scale, window, dropout, softcap)
    else:
        out = _torch_varlen_call(q, k, v, ctx, scale, window)
    return out[..., :dv].unsqueeze(0)


# ---------------------------------------------------------------------------- kernel choice
#: what each kernel name means
KERNELS: dict[str, str] = {
    "flash-attn": "flash-attn's flash_attn_varlen_func, one varlen call per chunk",
    "torch-varlen": "torch.nn.attention.varlen.varlen_attn, one varlen call per chunk",
    "sdpa-cpu-flash": "SDPA's CPU flash kernel, one call per slice (no T x S mask)",
    "sdpa-per-segment": "torch SDPA, one call per slice (no T x S mask)",
    "eager-per-segment": "the eager formula (soft-capping / sinks), one slice at a time",
}
_USED: dict[tuple[str, str], None] = {}


#: FlashAttention-2's limits, for flash-attn and for torch's varlen_attn (ATen's copy of it): head
#: dimension at most 256 (both), a multiple of 8 (ATen's ``mha_varlen_fwd`` checks it and leaves the
#: padding to SDPA, which varlen_attn does not go through; flash-attn pads itself), and a GPU of
#: compute capability 8.0 (Ampere) or newer
FLASH_MAX_HEAD_DIM = 256
FLASH_MIN_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int | None) -> tuple[int, int] | None:
    """Compute capability of CUDA device ``index`` (``None``: the current one); ``None`` without
    CUDA (a hypothetical device, e.g. :func:`attention_kernel` asked on a CPU machine)."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(index))


def _flash_fits(kernel: str, device: torch.device, head_dim: int | None) -> bool:
    """Whether a FlashAttention-2 varlen kernel takes this device and (padded) head dimension
    (``None``: not known, e.g. for plan statistics)."""
    cap = _cuda_capability(device.index)
    if cap is not None and cap < FLASH_MIN_CAPABILITY:
        return False
    if head_dim is None:
        return True
    return head_dim <= FLASH_MAX_HEAD_DIM and (kernel == "flash-attn" or head_dim % 8 == 0)


def _choose(device: torch.device, dtype: torch.dtype, dropout: float = 0.0, softcap: float | None = None,
            sink: bool = False, window: int | None = None, head_dim: int | None = None) -> str:
    if sink:
        return "eager-per-segment"
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if flash_attn_available() and (softcap is None or "softcap" in _flash_attn_params()) and _flash_fits(
                "flash-attn", device, head_dim):
            return "flash-attn"
        if softcap is None and dropout == 0.0 and torch_varlen_available() and (
                window is None or "window_size" in _torch_varlen()[1]) and _flash_fits("torch-varlen", device, head_dim):
            return "torch-varlen"
    if softcap is not None:
        return "eager-per-segment"
    if device.type == "cpu" and dropout == 0.0:
        return "sdpa-cpu-flash"
    return "sdpa-per-segment"


def attention_kernel(device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """Name of the kernel (a key of :data:`KERNELS`) the backend takes on ``device`` for a
    plain causal chunk (no dropout, soft-capping or sinks) in ``dtype`` (default: bfloat16 on
    CUDA, float32 elsewhere), e.g. for plan statistics."""
    dev = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return _choose(dev, dtype)


def kernels_used() -> list[str]:
    """``"kernel on device type"`` for every kernel that ran in this process, in first-run order."""
    return [f"{k} on {d}" for k, d in _USED]


def _note_kernel(kernel: str, device: torch.device) -> None:
    key = (kernel, device.type)
    if key not in _USED:
        _USED[key] = None
        logger.info("concertina attention on %s: %s (%s)", device.type, kernel, KERNELS[kernel])


# ---------------------------------------------------------------------------- the attention function
def concertina_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    is_causal: bool | None = None,
    concertina_ctx: ChunkAttentionContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function. ``query`` [1, H, T, D], ``key``/``value`` [1, K, T, D] /
    [1, K, T, Dv] (post-rotary); returns ``([1, T, H, Dv], None)``. See the module docstring."""
    ctx = concertina_ctx if concertina_ctx is not None else _CURRENT.get()
    _check_keywords(kwargs, module, ctx is not None)
    if s_aux is not None and sinks is not None:
        raise ValueError(f"{type(module).__name__} (model type {_model_type(module)!r}) passes both s_aux and sinks")
    sink = s_aux if s_aux is not None else sinks
    if ctx is None:
        if _STEP_DEPTH:
            raise RuntimeError(
                f"{type(module).__name__} (model type {_model_type(module)!r}, layer "
                f"{getattr(module, 'layer_idx', '?')}) called the concertina attention without a chunk context while "
                "a pipeline step runs: it would attend across packed sequences and lose earlier slices' K/V")
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                         sink, is_causal, kwargs), None
    sp_attention = getattr(ctx, "sequence_parallel_attention", None)
    if sp_attention is not None:  # Ulysses (runtime/ulysses.py): back here on all tokens of this rank's heads
        return sp_attention(concertina_attention_forward, module, query, key, value, attention_mask=attention_mask,
                            dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                            sink=sink, is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        raise ValueError(
            f"{type(module).__name__} (model type {_model_type(module)!r}) passes an attention_mask inside a "
            "concertina chunk, whose mask the chunk context defines; refusing to ignore it")
    if is_causal is False:
        raise ValueError(
            f"{type(module).__name__} (model type {_model_type(module)!r}) asks for non-causal attention "
            "(is_causal=False); the concertina backend is causal only")
    if query.shape[0] != 1 or query.shape[2] != ctx.num_tokens:
        raise ValueError(
            f"concertina attention expects one packed row of {ctx.num_tokens} tokens, got query {tuple(query.shape)}"
        )
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx; the concertina backend needs it to key K/V")
    amp = autocast_dtype(query.device.type)
    if amp is not None:
        # Under autocast, SDPA would run in the autocast dtype whatever its inputs are (post-rotary
        # query/key are often float32, value already bfloat16). Cast here, before the own K/V are
        # stored, so that stored K/V, later slices and every attention path share one dtype.
        query, key, value = (_autocast_cast(t, amp) for t in (query, key, value))
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window is not None and sliding_window > 0 else None
    kernel = _choose(query.device, query.dtype, dropout, softcap, sink is not None, window,
                     max(query.shape[-1], value.shape[-1]))  # the head dim after _pad_head_dims
    _note_kernel(kernel, query.device)
    ctx.store_own(layer, key, value)
    if kernel in ("flash-attn", "torch-varlen"):
        return _varlen_path(kernel, ctx, layer, query, key, value, scale, window, dropout, softcap), None
    if kernel == "sdpa-cpu-flash":
        segs, pk, pv = _cpu_segments(ctx, layer, window, key.dtype)
        out = _SegmentsCPU.apply(query, key, value, scale, window, segs, len(pk), *pk, *pv)
    elif kernel == "sdpa-per-segment":
        out = _segments_sdpa(ctx, layer, query, key, value, scale, window, dropout)
    else:
        out = _segments_math(ctx, layer, query, key, value, scale, window, dropout, softcap, sink)
    return out.transpose(1, 2).contiguous(), None


def _fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, sink,
              is_causal, kwargs) -> torch.Tensor:
    """No chunk context, no step: HF's SDPA path; the eager formula with HF's mask when the
    layer passes soft-capping or sinks (HF's SDPA refuses the first and ignores the second)."""
    if softcap is None and sink is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)[0]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    allowed = additive = None
    if attention_mask is None:
        if is_causal is not False and query.shape[2] > 1:  # bottom-right: queries are the last tokens
            qn, kn = query.shape[2], key.shape[2]
            allowed = torch.ones(qn, kn, dtype=torch.bool, device=query.device).tril(kn - qn)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        additive = attention_mask
    out = _eager(query, key, value, scale, softcap, _sink_rows(sink, query.shape[1]), dropout, allowed, additive)
    return out.transpose(1, 2).contiguous()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for ``device_type`` (``None`` when autocast is off)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _autocast_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # autocast's own rule for its lower-precision ops: floating tensors except float64
    if t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype:
        return t.to(dtype)
    return t


_REGISTERED = False


def register_attention() -> str:
    """Register the backend (and HF's SDPA mask under the same name); idempotent. Returns its name."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_IMPLEMENTATION, concertina_attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _REGISTERED = True
    return ATTN_IMPLEMENTATION
