"""The ``"concertina"`` attention backend: packed, sliced sequences through unmodified HF models.

A chunk is a padding-free concatenation of slices (see :mod:`concertina_hf.planning.types`).
HF attention modules call the function registered in ``AttentionInterface`` under the model's
``config._attn_implementation``; the runtime calls the decoder layers itself and passes a
:class:`ChunkAttentionContext` as the extra keyword ``concertina_ctx``, which HF forwards
unchanged from the decoder layer to the attention function. With it, for each layer:

1. every slice that is not the last of its sequence stores its post-rotary K and V (a view of the
   chunk's keys, still attached to the graph, for its own backward) and a detached leaf alias
   with ``requires_grad`` that later slices read, in the :class:`KVStore` (set-if-absent, so the
   forward replayed by activation checkpointing leaves the originals in place);
2. a slice with context ``C > 0`` attends to the concatenated leaves of its sequence's earlier
   slices (exactly ``C`` tokens) followed by its own keys; the gradient that flows into those
   leaves is what the runtime hands to the earlier slices' backward;
3. the keys are laid out slice by slice (``[prefix_i, own_i]``), so the attention is a varlen
   attention with queries no longer than keys and bottom-right causal alignment:
   - CUDA with ``flash-attn``: ``flash_attn_varlen_func`` on that layout (:func:`_flash_path`);
   - otherwise (CPU, tests): one SDPA call with an explicit mask built from the per-token
     (sequence, position) of queries and keys (:func:`_sdpa_path`): query ``q`` sees key
     ``k`` iff same sequence and ``pos_k <= pos_q`` (and ``pos_q - pos_k < window`` under
     sliding-window attention). The mask is built once per chunk, as an additive float mask
     shared by all layers; a chunk that is one whole sequence needs none (``is_causal``).

Under autocast (``torch.autocast``, e.g. ``bf16=True``), query, key and value are first cast to the
autocast dtype, as SDPA (an autocast op) would cast them in HF's own path: post-rotary query and
key are often float32 (rotary tables in the parameters' dtype) while value is already bfloat16.
Casting before the own K/V are stored gives stored K/V, later slices' leaves, the mask and every
attention path one dtype (and halves the stored K/V of float32 models); the replay of a
checkpointed layer runs under the same autocast state (``torch.utils.checkpoint`` restores it).

Costs: the CPU mask is ``T x S`` floats per chunk (``S = T + sum C``), kept until the chunk's
backward; SDPA on CPU dispatches to its flash kernel, which saves ``q, k, v, out, logsumexp``.
The earlier slices' K/V stay alive (in the store) until their own backward. On CPU a chunk with
context runs through :class:`_ContextAttentionCPU`, which saves those pieces rather than the
concatenated keys; the flash-attn path (and CPU with attention dropout) goes through
``torch.cat``, so autograd also keeps the concatenated ``C + s`` keys of each layer until the
slice's backward (``O(n^2)`` K/V over a chain of ``n`` slices).

Without a context (a plain ``model(...)`` call on a model set to ``"concertina"``) the function
falls back to HF's SDPA path and the mask function registered under the same name is HF's SDPA
mask, so ``generate`` and ordinary evaluation still work.

Shape legend: ``T`` query tokens of the chunk, ``S`` key tokens, ``H`` query heads, ``K`` key/value
heads, ``D`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ChunkAttentionContext",
    "KVStore",
    "SliceSpec",
    "autocast_dtype",
    "concertina_attention_forward",
    "flash_attn_available",
    "register_attention",
]

ATTN_IMPLEMENTATION = "concertina"


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


class ChunkAttentionContext:
    """Token layout of one chunk plus the K/V store; passed to decoder layers as ``concertina_ctx``.

    ``position_ids`` ([1, T]) are ``start + arange(length)`` per slice, so rotary embeddings
    continue across slice boundaries.
    """

    def __init__(self, slices: Sequence[SliceSpec], store: KVStore, device: torch.device | str,
                 requires_grad: bool) -> None:
        self.slices = tuple(slices)
        self.store = store
        self.requires_grad = requires_grad
        self.device = torch.device(device)
        self.num_tokens = sum(s.length for s in self.slices)
        q_seq, q_pos = [], []
        for s in self.slices:
            q_seq.append(torch.full((s.length,), s.seq, dtype=torch.long))
            q_pos.append(torch.arange(s.start, s.start + s.length))
        self.q_seq_T = torch.cat(q_seq).to(self.device)
        self.q_pos_T = torch.cat(q_pos).to(self.device)
        self.position_ids = self.q_pos_T.unsqueeze(0)
        self.has_context = any(s.start > 0 for s in self.slices)
        # key layout, slice by slice: [prefix_i (start_i tokens), own_i]
        k_seq, k_pos, cu_k = [], [], [0]
        for s in self.slices:
            n = s.start + s.length
            k_seq.append(torch.full((n,), s.seq, dtype=torch.long))
            k_pos.append(torch.arange(0, n))
            cu_k.append(cu_k[-1] + n)
        self.k_seq_S = torch.cat(k_seq).to(self.device)
        self.k_pos_S = torch.cat(k_pos).to(self.device)
        self.cu_seqlens_q = torch.tensor([0] + _cumsum([s.length for s in self.slices]), dtype=torch.int32,
                                         device=self.device)
        self.cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=self.device)
        self.max_seqlen_q = max(s.length for s in self.slices)
        self.max_seqlen_k = max(s.start + s.length for s in self.slices)
        self._masks: dict[tuple, torch.Tensor] = {}
        # one whole sequence from its first token: plain causal attention, no mask at all
        self.plain_causal = len(self.slices) == 1 and self.slices[0].start == 0

    def store_own(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep this chunk's non-final slices' K/V (set-if-absent) for their later slices."""
        for s in self.slices:
            if not s.final:
                self.store.put_if_absent(s.seq, s.start, layer, key[:, :, s.offset:s.offset + s.length],
                                         value[:, :, s.offset:s.offset + s.length], self.requires_grad)

    def key_pieces(self, layer: int, dtype: torch.dtype | None = None
                   ) -> tuple[tuple, list[torch.Tensor], list[torch.Tensor]]:
        """The slice-by-slice key layout as pieces: ``("p", i)`` for the ``i``-th earlier-slice
        leaf, ``("o", offset, length)`` for this chunk's own keys; plus the leaves (K, V).

        ``dtype``: the dtype of this chunk's own keys. Leaves stored in another dtype (earlier
        slices run under another autocast state; the runtime never does that within a step) are
        cast to it, through autograd, so their gradient still reaches the leaf."""
        layout, pk, pv = [], [], []
        for s in self.slices:
            if s.start > 0:
                for k_leaf, v_leaf in self.store.prefix_parts(s.seq, s.start, layer):
                    if dtype is not None and k_leaf.dtype != dtype:
                        k_leaf, v_leaf = k_leaf.to(dtype), v_leaf.to(dtype)
                    layout.append(("p", len(pk)))
                    pk.append(k_leaf)
                    pv.append(v_leaf)
            layout.append(("o", s.offset, s.length))
        return tuple(layout), pk, pv

    def keys(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the own K/V and return the keys in the slice-by-slice layout: [1, K, S, D] each."""
        self.store_own(layer, key, value)
        if not self.has_context:
            return key, value
        layout, pk, pv = self.key_pieces(layer, key.dtype)
        return _assemble(layout, key, pk), _assemble(layout, value, pv)

    def mask(self, window: int | None) -> torch.Tensor:
        """Boolean [1, 1, T, S]: True where the query may attend to the key. Built on each call
        and not kept: the context (which checkpoint closures keep alive until backward when
        layers recompute) holds only the additive mask, not ``T * S`` more bytes beside it."""
        q_seq, q_pos = self.q_seq_T[:, None], self.q_pos_T[:, None]
        m = (q_seq == self.k_seq_S[None, :]) & (self.k_pos_S[None, :] <= q_pos)
        if window is not None:
            m &= (q_pos - self.k_pos_S[None, :]) < window
        return m[None, None]

    def additive_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`mask` as 0 / -inf in ``dtype``, built once per chunk: SDPA would otherwise
        convert a boolean mask into a new float tensor in every layer and save each copy for
        backward (``4 * T * S`` bytes per layer); this one is shared by all layers."""
        m = self._masks.get((dtype, window))
        if m is None:
            allowed = self.mask(window)
            m = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            m.masked_fill_(~allowed, float("-inf"))
            del allowed  # only the additive mask stays with the context
            self._masks[(dtype, window)] = m
        return m


def _assemble(layout: tuple, own: torch.Tensor, prefix: Sequence[torch.Tensor]) -> torch.Tensor:
    parts = [prefix[p[1]] if p[0] == "p" else own[:, :, p[1]:p[1] + p[2]] for p in layout]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class _ContextAttentionCPU(torch.autograd.Function):
    """SDPA (CPU flash kernel) over keys assembled from earlier slices' leaves and the chunk's
    own keys, saving the pieces instead of the assembled copy.

    Autograd through ``torch.cat`` + SDPA would keep the concatenated K/V (``C + s`` tokens per
    layer) of every slice with context until its backward, although the pieces are alive
    anyway (own keys in the graph, earlier slices' leaves in the store): with ``n`` slices in
    flight that is ``O(n^2)`` extra K/V. Here the copy is rebuilt in backward, one layer at a
    time, and the key gradient is split back into the pieces (the leaves' share accumulates in
    their ``.grad``, which the runtime hands to the earlier slices' backward).
    """

    @staticmethod
    def forward(ctx, query, key, value, mask, scale, layout, *prefix):
        n = len(prefix) // 2
        k_S = _assemble(layout, key, prefix[:n])
        v_S = _assemble(layout, value, prefix[n:])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, k_S, v_S, 0.0, False, attn_mask=mask, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, mask, *prefix)
        ctx.layout, ctx.scale, ctx.n = layout, scale, n
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, mask, *prefix = ctx.saved_tensors
        n, layout = ctx.n, ctx.layout
        k_S = _assemble(layout, key, prefix[:n])
        v_S = _assemble(layout, value, prefix[n:])
        dq, dk_S, dv_S = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), query, k_S, v_S, out, lse, 0.0, False, attn_mask=mask, scale=ctx.scale)
        dkey, dvalue = torch.zeros_like(key), torch.zeros_like(value)
        dpk: list = [None] * n
        dpv: list = [None] * n
        pos = 0
        for p in layout:
            if p[0] == "p":
                length = prefix[p[1]].shape[2]
                dpk[p[1]] = dk_S[:, :, pos:pos + length]
                dpv[p[1]] = dv_S[:, :, pos:pos + length]
            else:
                length = p[2]
                dkey[:, :, p[1]:p[1] + length] = dk_S[:, :, pos:pos + length]
                dvalue[:, :, p[1]:p[1] + length] = dv_S[:, :, pos:pos + length]
            pos += length
        return (dq, dkey, dvalue, None, None, None, *dpk, *dpv)


def _cumsum(xs: Sequence[int]) -> list[int]:
    out, t = [], 0
    for x in xs:
        t += x
        out.append(t)
    return out


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def _sdpa_path(module: Any, query: torch.Tensor, key_S: torch.Tensor, value_S: torch.Tensor,
               ctx: ChunkAttentionContext, dropout: float, scaling: float | None,
               window: int | None) -> torch.Tensor:
    """query [1, H, T, D], keys [1, K, S, D] -> [1, T, H, D]."""
    gqa = query.shape[1] != key_S.shape[1]
    if ctx.plain_causal and (window is None or window >= ctx.num_tokens):
        out = F.scaled_dot_product_attention(query, key_S, value_S, dropout_p=dropout, scale=scaling,
                                             is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(query, key_S, value_S, attn_mask=ctx.additive_mask(window, query.dtype),
                                             dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def _flash_path(module: Any, query: torch.Tensor, key_S: torch.Tensor, value_S: torch.Tensor,
                ctx: ChunkAttentionContext, dropout: float, scaling: float | None,
                window: int | None) -> torch.Tensor:
    """flash-attn varlen: each slice is one varlen segment whose keys are ``[prefix, own]``;
    flash-attn >= 2.1 aligns the causal mask bottom-right when queries are shorter than keys."""
    from flash_attn import flash_attn_varlen_func

    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key_S[0].transpose(0, 1)  # [S, K, D] (flash-attn handles K < H natively)
    v = value_S[0].transpose(0, 1)
    out = flash_attn_varlen_func(
        q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
        dropout_p=dropout, softmax_scale=scaling, causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
    )
    return out.unsqueeze(0)  # [1, T, H, D]


def concertina_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    concertina_ctx: ChunkAttentionContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function. ``query`` [1, H, T, D], ``key``/``value`` [1, K, T, D]
    (post-rotary); returns ``([1, T, H, D], None)``."""
    if concertina_ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    ctx = concertina_ctx
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
    use_flash = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and flash_attn_available()
    if not use_flash and ctx.has_context and query.device.type == "cpu" and dropout == 0.0:
        ctx.store_own(layer, key, value)
        layout, pk, pv = ctx.key_pieces(layer, key.dtype)
        out = _ContextAttentionCPU.apply(query, key, value, ctx.additive_mask(sliding_window, query.dtype),
                                         scaling, layout, *pk, *pv)
        return out.transpose(1, 2).contiguous(), None
    key_S, value_S = ctx.keys(layer, key, value)
    path = _flash_path if use_flash else _sdpa_path
    return path(module, query, key_S, value_S, ctx, dropout, scaling, sliding_window), None


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
