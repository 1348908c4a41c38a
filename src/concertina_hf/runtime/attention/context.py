"""A chunk's token layout, the K/V its slices carry to later slices, and how the context reaches attention.

:class:`ChunkAttentionContext` describes one chunk, a padding-free concatenation of slices
(:class:`SliceSpec`, see :mod:`concertina_hf.planning.types`): per slice ``i`` (a *segment*) its
queries at positions ``start_i .. start_i + s_i - 1`` and its keys ``[prefix_i, own_i]``, where
``prefix_i`` is the K/V its sequence's earlier slices left in the :class:`KVStore` (``C_i =
start_i`` tokens) and ``own_i`` the slice's own keys; as ``position_ids`` and as the varlen layout
(``cu_seqlens_q`` / ``cu_seqlens_k``). :func:`segment_mask` is which of those keys a segment's
queries see: key ``p' <= p`` for the query at ``p`` (causal, aligned bottom-right: queries shorter
than keys) and, under a sliding window ``W``, ``p - p' < W``. A chunked-attention layer (Llama 4)
runs on :meth:`ChunkAttentionContext.chunked`, the slices cut at their documents' chunk edges into
pieces whose keys start at their chunk's edge (:mod:`.chunked`).

The store keeps, per ``(sequence, slice start, layer)``, a non-final slice's post-rotary K and V
(a view of the chunk's keys, still attached to the graph, for its own backward) and a detached
leaf alias with ``requires_grad`` that later slices attend to (set-if-absent, so the forward
replayed by activation checkpointing leaves the originals in place); the gradient that flows into
those leaves is what the runtime hands to the earlier slices' backward.

Delivery: the runtime calls the decoder layers itself and passes the context as the keyword
``concertina_ctx`` (which most layers forward unchanged to the attention function) and in a
context variable set around each layer call (:func:`chunk_context`), so it also arrives through
layers that drop their ``**kwargs`` (StableLM, Nemotron). The variable is set *inside* the
function that activation checkpointing wraps, so the forward that non-reentrant checkpointing
replays during backward (possibly in autograd's device thread) sees it too. While the runtime
runs a step (:func:`step_active`, a process-wide flag read by :func:`step_running`) an attention
call that finds no context raises instead of silently attending over the whole chunk.

Cost: the earlier slices' K/V stay alive (in the store) until their own backward.

Segment-level training (opt-in, :mod:`concertina_hf.planning.segments`: slices are segments):
``KVStore(gradient="previous")`` hands later slices the immediately preceding slice's leaves and
only detached aliases of older ones (no gradient, no gradient buffers for them);
``KVStore(gradient="none")`` keeps detached K/V only (no gradient crosses a slice boundary), and the
runtime then drops, in training too, what no later slice's tail reaches, not at a slice's backward;
``KVStore(kv_tail=W)`` makes a slice starting at ``start`` attend to earlier keys at positions
``>= start - W`` only (``prefix`` cuts, the varlen ``cu_seqlens_k`` shrink), and a forward-only
step drops entries no later slice's tail reaches. ``KVStore(global_heads=...)`` (query heads): those
heads also read the keys before the tail, detached (:meth:`KVStore.global_prefix`); a forward-only
step then keeps, of a dropped entry, the K/V heads those query heads use (detached). A checkpointed
layer's replay reads the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

__all__ = ["ChunkAttentionContext", "KVEntry", "KVStore", "SliceSpec", "chunk_context", "current_context",
           "segment_mask", "step_active", "step_running"]


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
class KVEntry:
    """One slice's K/V on one layer, as :class:`KVStore` keeps it."""

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

    def __init__(self, gradient: str = "full", kv_tail: int | None = None,
                 global_heads: Sequence[int] = ()) -> None:
        # seq -> layer -> {start: entry}
        self._kv: dict[int, dict[int, dict[int, KVEntry]]] = {}
        # global heads (query heads reading every earlier key, detached) and, once attention told
        # the head counts (:meth:`head_groups`), the K/V heads they use; seq -> layer -> {start:
        # (k, v)}: those K/V heads of entries dropped outside the tail (forward only), detached
        self.global_heads = tuple(sorted(int(h) for h in global_heads))
        self._groups: tuple[int, int, tuple[int, ...], tuple[int, ...]] | None = None
        self._old: dict[int, dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
        if gradient not in ("full", "previous", "none"):
            raise ValueError(f"segment gradient must be 'full', 'previous' or 'none' (got {gradient!r})")
        if kv_tail is not None and int(kv_tail) < 0:
            raise ValueError(f"the K/V tail must be at least 0 tokens (got {kv_tail})")
        # segment-level training (opt-in; docs/segments.md): under "previous" only the immediately
        # preceding slice's leaves receive gradient, older ones are read detached; ``kv_tail`` W:
        # a slice starting at ``start`` attends to earlier keys at positions >= start - W only
        self.gradient = gradient
        self.kv_tail = None if kv_tail is None else int(kv_tail)

    def put_if_absent(self, seq: int, start: int, layer: int, k: torch.Tensor, v: torch.Tensor,
                      requires_grad: bool) -> None:
        per_start = self._kv.setdefault(seq, {}).setdefault(layer, {})
        if start in per_start:  # the replay of a checkpointed layer: keep the originals
            return
        if self.gradient == "none":  # read detached only: keep no graph (the entry outlives its backward)
            k, v = k.detach(), v.detach()
            requires_grad = False
        k_leaf = k.detach().requires_grad_(requires_grad)
        v_leaf = v.detach().requires_grad_(requires_grad)
        per_start[start] = KVEntry(k, v, k_leaf, v_leaf)

    def prefix_parts(self, seq: int, context: int, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Leaves ``(K, V)`` ([1, K, s, D]) of the slices of ``seq`` before token ``context``, in order."""
        per_start = self._kv.get(seq, {}).get(layer, {})
        starts = [s for s in sorted(per_start) if s < context]
        parts = [per_start[s] for s in starts]
        have = sum(e.k_leaf.shape[2] for e in parts)
        # under a K/V tail, entries no later slice reaches may have been dropped (forward only)
        first = starts[0] if starts else context
        if first + have != context or (first > 0 and (self.kv_tail is None or first > context - self.kv_tail)):
            raise RuntimeError(
                f"K/V of sequence {seq} before token {context} on layer {layer} is incomplete "
                f"({have} tokens stored): an earlier slice did not run forward on this stage first"
            )
        if self.gradient == "previous" and len(parts) > 1:  # older segments: read, no gradient buffers
            return [(e.k_leaf.detach(), e.v_leaf.detach()) for e in parts[:-1]] + [(parts[-1].k_leaf, parts[-1].v_leaf)]
        return [(e.k_leaf, e.v_leaf) for e in parts]

    def leaves(self, seq: int, start: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The leaves ``(K, V)`` of the slice of ``seq`` at ``start`` on ``layer``, or ``None``."""
        e = self._kv.get(seq, {}).get(layer, {}).get(start)
        return None if e is None else (e.k_leaf, e.v_leaf)

    def previous(self, seq: int, start: int, layer: int) -> KVEntry | None:
        """The entry of the last slice of ``seq`` before token ``start`` on ``layer`` (``None``: none
        stored). A recurrent layer keeps its state there (:mod:`concertina_hf.runtime.linear_attention`)."""
        per_start = self._kv.get(seq, {}).get(layer, {})
        earlier = [s for s in per_start if s < start]
        return per_start[max(earlier)] if earlier else None

    def prefix(self, seq: int, context: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`prefix_parts` concatenated: [1, K, context, D] each."""
        parts = self.prefix_parts(seq, context, layer)
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

    def head_groups(self, heads: int, kv_heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """For a layer of ``heads`` query and ``kv_heads`` K/V heads: the global query heads' K/V
        heads (sorted) and, per global query head, the index of its K/V head among those."""
        if self._groups is None or self._groups[:2] != (heads, kv_heads):
            bad = [h for h in self.global_heads if h >= heads]
            if bad:
                raise ValueError(f"concertina_segment_global_heads {list(self.global_heads)}: the model has "
                                 f"{heads} attention heads (indices 0..{heads - 1}); {bad} do not exist")
            rep = heads // kv_heads
            kv = tuple(sorted({h // rep for h in self.global_heads}))
            self._groups = (heads, kv_heads, kv, tuple(kv.index(h // rep) for h in self.global_heads))
        return self._groups[2], self._groups[3]

    def global_prefix(self, seq: int, lo: int, hi: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global heads' K/V heads (:meth:`head_groups`) of ``seq`` at positions ``[lo, hi)``,
        detached: [1, Kg, hi - lo, D] each (read from the entries, or what :meth:`drop_before` kept)."""
        kv = self._groups[2]
        parts = [(s, k, v) for s, (k, v) in self._old.get(seq, {}).get(layer, {}).items()]
        parts += [(s, e.k_leaf.detach()[:, kv], e.v_leaf.detach()[:, kv])
                  for s, e in self._kv.get(seq, {}).get(layer, {}).items()]
        ks, vs, have = [], [], 0
        for s, k, v in sorted(parts, key=lambda p: p[0]):
            a, b = max(lo, s), min(hi, s + k.shape[2])
            if a < b:
                ks.append(k[:, :, a - s:b - s])
                vs.append(v[:, :, a - s:b - s])
                have += b - a
        if have != hi - lo:
            raise RuntimeError(f"K/V of the global heads of sequence {seq} at positions [{lo}, {hi}) on layer {layer} "
                               f"is incomplete ({have} tokens stored)")
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def entries(self, seq: int, start: int) -> list[KVEntry]:
        """This slice's entries on every layer of the stage (layer order)."""
        layers = self._kv.get(seq, {})
        return [layers[l][start] for l in sorted(layers) if start in layers[l]]

    def entries_before(self, seq: int, start: int) -> list[tuple[int, KVEntry]]:
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

    def drop_before(self, seq: int, position: int) -> None:
        """Drop the entries of ``seq`` whose tokens all lie before ``position`` (outside every later
        slice's K/V tail; forward only: a training step keeps them for their own backward)."""
        layers = self._kv.get(seq)
        if not layers:
            return
        for per_start in layers.values():
            for s in [s for s, e in per_start.items() if s + e.k.shape[2] <= position]:
                self.retire(seq, s)
        if seq in self._kv and all(not p for p in self._kv[seq].values()):
            del self._kv[seq]

    def retire(self, seq: int, start: int) -> None:
        """Free a slice's entries (every layer) that no later slice's tail reaches, keeping, with
        global heads, their K/V heads (detached copies) for those heads' reads."""
        for layer, per_start in self._kv.get(seq, {}).items():
            e = per_start.pop(start, None)
            if e is not None and self.global_heads and self._groups is not None:  # the global heads still read it
                kv = self._groups[2]
                self._old.setdefault(seq, {}).setdefault(layer, {})[start] = (e.k.detach()[:, kv].clone(),
                                                                              e.v.detach()[:, kv].clone())

    def free_seq(self, seq: int) -> None:
        self._kv.pop(seq, None)
        self._old.pop(seq, None)

    def clear(self) -> None:
        self._kv.clear()
        self._old.clear()

    def tensors(self) -> list[torch.Tensor]:
        """Every stored tensor, with the leaves' gradients (for memory accounting)."""
        out = []
        for layers in self._kv.values():
            for per_start in layers.values():
                for e in per_start.values():
                    out += [e.k, e.v]
                    out += [g for g in (e.k_leaf.grad, e.v_leaf.grad) if g is not None]
        for layers in self._old.values():
            for per_start in layers.values():
                for k, v in per_start.values():
                    out += [k, v]
        return out

    def __len__(self) -> int:
        return sum(len(p) for layers in self._kv.values() for p in layers.values())


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


def step_running() -> bool:
    """Whether a runtime step runs (:func:`step_active`) in this process, in any thread."""
    return _STEP_DEPTH > 0


class ChunkAttentionContext:
    """Token layout of one chunk plus the K/V store; delivered to decoder layers as
    ``concertina_ctx`` and through :func:`chunk_context`.

    ``position_ids`` ([1, T]) are ``start + arange(length)`` per slice, so rotary embeddings
    continue across slice boundaries. ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32) describe the
    varlen layout: slice ``i`` is segment ``i``, its keys ``[prefix_i, own_i]``.
    """

    def __init__(self, slices: Sequence[SliceSpec], store: KVStore, device: torch.device | str,
                 requires_grad: bool, attention_chunk: int | None = None) -> None:
        self.slices = tuple(slices)
        self.store = store
        self.requires_grad = requires_grad
        self.device = torch.device(device)
        #: chunked attention's chunk size (:meth:`chunked`: the slices are then pieces within one chunk each)
        self.attention_chunk = attention_chunk
        self._chunked: dict[int, ChunkAttentionContext] = {}
        self.num_tokens = sum(s.length for s in self.slices)
        pos = [torch.arange(s.start, s.start + s.length) for s in self.slices] or [torch.zeros(0, dtype=torch.long)]
        self.position_ids = torch.cat(pos).to(self.device).unsqueeze(0)  # [1, 0]: no slice (a placed chunk's empty rank)
        self.has_context = any(s.start > _chunk_lo(s.start, attention_chunk) for s in self.slices)
        self.cu_seqlens_q = torch.tensor([0] + _cumsum([s.length for s in self.slices]), dtype=torch.int32,
                                         device=self.device)
        keys = [s.start - max(_tail_lo(s.start, store.kv_tail), _chunk_lo(s.start, attention_chunk)) + s.length
                for s in self.slices]
        self.cu_seqlens_k = torch.tensor([0] + _cumsum(keys), dtype=torch.int32, device=self.device)
        self.max_seqlen_q = max((s.length for s in self.slices), default=0)
        self.max_seqlen_k = max(keys, default=0)

    def chunked(self, chunk: int) -> "ChunkAttentionContext":
        """The context of a chunked-attention layer (chunk size ``chunk``): each slice cut at the
        chunk edges of its document (positions ``k * chunk``) into pieces, each one segment whose
        queries see the keys of their own chunk only: a piece starting on an edge its own keys
        (causal), a slice's first piece starting inside a chunk also the earlier slices' keys from
        that chunk's edge on. Reads the store (the own K/V are stored by this context, with the
        slices), never writes it; built once per chunk size."""
        view = self._chunked.get(chunk)
        if view is None:
            pieces = []
            for s in self.slices:
                a, end = s.start, s.start + s.length
                while a < end:
                    b = min((a // chunk + 1) * chunk, end)
                    pieces.append(SliceSpec(s.seq, a, b - a, s.offset + a - s.start, s.final))
                    a = b
            view = ChunkAttentionContext(pieces, self.store, self.device, self.requires_grad, attention_chunk=chunk)
            self._chunked[chunk] = view
        return view

    def store_own(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep this chunk's non-final slices' K/V (set-if-absent) for their later slices."""
        if self.attention_chunk is not None:
            raise RuntimeError("a chunked-attention view reads the K/V store; its context stores the slices' K/V")
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
        lo = max(_window_lo(s.start, window), _tail_lo(s.start, self.store.kv_tail),
                 _chunk_lo(s.start, self.attention_chunk))
        if s.start == 0 or (self.attention_chunk is not None and lo >= s.start):
            return [], 0, lo
        kept, cut = [], 0
        stored = self.store.prefix_parts(s.seq, s.start, layer)
        p0 = s.start - sum(k.shape[2] for k, _ in stored)  # > 0 once a K/V tail dropped older entries
        for k_leaf, v_leaf in stored:
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


def _chunk_lo(start: int, chunk: int | None) -> int:
    """Position of the first key a segment starting at ``start`` sees under chunked attention:
    its chunk's edge (a segment of :meth:`ChunkAttentionContext.chunked` lies within one chunk)."""
    return 0 if chunk is None else (start // chunk) * chunk


def _tail_lo(start: int, tail: int | None) -> int:
    """Position of the first earlier key a segment starting at ``start`` may see under a K/V tail."""
    return 0 if tail is None else max(0, start - tail)


def segment_mask(start: int, length: int, lo: int, window: int | None, device: torch.device
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
