"""Top-k indexed attention (DeepSeek Sparse Attention) in a pipeline chunk.

An ``indexed_attention`` layer (DeepSeek-V3.2, GLM-MoE-DSA) runs, inside its attention module, a
small *indexer* (its own projections ``wq_b``, ``wk``, ``weights_proj``): each query scores the
keys it may see, ``sum_h w_h relu(q_h . k_idx)``, and attends to the ``index_topk`` best of them
only. HF computes the indexer's keys over the whole input (``cache.update_indexer`` appends them
to a key cache) and scores them under the causal mask; the indexer runs under ``torch.no_grad``,
so its parameters get no gradient from the language-model loss, and the selection is a mask on
the attention, through which no gradient flows either.

Here, per slice of the chunk (a *segment*), the indexer scores exactly the keys HF's forward sees
for those queries: its own document's tokens up to each query (causal), never another packed
document's, the earlier slices' keys included. :func:`install` replaces the ``forward`` of each
indexer and attention module of the classes of :data:`INDEXED_ATTENTION` (instance attributes;
the classes are untouched):

- the **indexer** runs HF's own ``forward`` once per segment on the segment's tokens, with a
  boolean causal mask over ``[earlier keys, own keys]`` and a key cache whose ``update_indexer``
  returns the sequence's earlier indexer keys followed by the segment's own; a non-final slice
  keeps its own keys (detached: no gradient crosses the indexer) in the chunk's
  :class:`~.context.KVStore` under the layer key :func:`indexer_layer` (``-1 - layer``), beside
  the layer's K/V and freed with them. It returns a :class:`Selection`: per segment, which of
  its keys each query attends to (causal and among the top ``index_topk`` by score);
- the **attention module** runs HF's own ``forward`` with :data:`UNMASKED` as its
  ``attention_mask`` (the indexer reads ``attention_mask[:, 0]``; the chunk context defines the
  mask); HF then passes the selection as ``indices`` to the attention function, which runs
  :func:`indexed_attention`: per segment, SDPA over ``[earlier K/V, own K/V]`` with the
  selection as its boolean mask, the earlier slices' K/V leaves receiving gradient as for any
  attention layer. A GLM layer whose ``config.indexer_types`` entry is ``"shared"`` reuses the
  selection of the previous ``"full"`` layer (HF's ``prev_topk_indices``), kept per chunk
  while the chunk's context lives; a stage with a ``"shared"`` layer whose ``"full"`` layer lies on
  an earlier stage is refused (:func:`check_stage`: the selection is not sent between stages).

Ties: ``topk`` over float scores. A near-tie can select differently under another summation
order, and exact ties (scores of 0, every head's ``relu`` at 0: likely with few indexer heads)
are broken by the row's width, which differs between a slice's ``C + s`` keys and HF's padded
batch, as it differs between HF's own batch layouts (its loss moves with the padding then).

Not implemented, refused with the feature named: sequence parallelism (Ulysses or placed
chunks), segment-level training (``concertina_segment_*``). Outside a chunk and outside a step,
the modules' own ``forward`` runs; the attention function then applies HF's top-k indices to the
mask itself (:func:`mask_with_indices`), as HF's eager path does.

Cost: per segment one indexer call, its scores ``[s, H_idx, C + s]`` in float32 (HF's, per
sequence), or, above :data:`SCORE_BLOCK_BYTES`, one call for the keys and one per block of
queries; a boolean ``s x (C + s)`` mask for the attention (no varlen kernel: SDPA per segment,
dense under the mask, which it saves for backward in the compute dtype: the cost model's
``planning/mixers.py`` prices it); per non-final slice and layer, ``s x index_head_dim`` indexer
keys kept until the slice's backward; a GLM chunk keeps each ``"full"`` layer's masks while the
chunk lives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .context import ChunkAttentionContext, current_context, step_running
from .segments import pad_head_dims

__all__ = ["INDEXED_ATTENTION", "INDEXED_ATTENTION_TYPES", "INDEXED_LAYER_INPUTS", "NOT_REPRODUCED",
           "SCORE_BLOCK_BYTES", "UNMASKED", "Selection", "check_stage", "indexed_attention", "indexer_layer",
           "install", "mask_with_indices", "refusal", "sequence_parallel_refusal"]

_HF = "transformers.models"
#: model type -> (HF modeling module, attention class, indexer class): the classes run here
INDEXED_ATTENTION = {
    "deepseek_v32": (f"{_HF}.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Attention", "DeepseekV32Indexer"),
    "glm_moe_dsa": (f"{_HF}.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaAttention", "GlmMoeDsaIndexer"),
}
#: model types whose ``indexed_attention`` layers run here
INDEXED_ATTENTION_TYPES = frozenset(INDEXED_ATTENTION)
#: model types with ``indexed_attention`` layers not run here -> what else their forward does
NOT_REPRODUCED = {
    "hy_v4": "its hyper-connections (the hidden states widened to config.hc_mult streams before the decoder layers, "
             "model.model.hc_head after them) run in the model's forward outside the decoder layers, and its "
             "attention adds sinks (s_aux) to the top-k selection",
}
#: decoder-layer inputs the model's forward computes that :func:`install`'s modules supply themselves
#: (GLM's selection of the previous ``"full"`` layer)
INDEXED_LAYER_INPUTS = frozenset({"prev_topk_indices"})


class _Unmasked:
    """The ``attention_mask`` an indexed attention module gets inside a chunk: indexing returns it."""

    def __getitem__(self, item: Any) -> "_Unmasked":
        return self

    def __repr__(self) -> str:
        return "UNMASKED"


#: see :class:`_Unmasked`
UNMASKED = _Unmasked()


@dataclass(frozen=True)
class Selection:
    """Per segment of a chunk, a boolean ``[s, C + s]``: query ``i`` (position ``start + i``) attends to
    key ``j`` (position ``j`` of its sequence): causal and among the indexer's top-k."""

    allowed: tuple[torch.Tensor, ...]


def indexer_layer(layer: int) -> int:
    """The :class:`~.context.KVStore` layer key of layer ``layer``'s indexer keys."""
    return -1 - layer


def _classes(model_type: str) -> tuple[type, type] | None:
    entry = INDEXED_ATTENTION.get(model_type)
    if entry is None:
        return None
    import importlib

    try:
        mod = importlib.import_module(entry[0])
    except ImportError:
        return None
    attn, idx = getattr(mod, entry[1], None), getattr(mod, entry[2], None)
    return None if attn is None or idx is None else (attn, idx)


def _full_layer(config: Any, layer: int) -> int | None:
    """GLM: the ``"full"`` layer whose selection a ``"shared"`` layer reuses (``None``: not shared)."""
    kinds = getattr(config, "indexer_types", None)
    if not kinds or kinds[layer] != "shared":
        return None
    full = [j for j in range(layer) if kinds[j] == "full"]
    if not full:
        raise ValueError(f"config.indexer_types: layer {layer} is 'shared' with no 'full' layer before it")
    return full[-1]


def check_stage(config: Any, layers: range) -> None:
    """Refuse a stage of ``layers`` (decoder-layer indices) with a ``"shared"`` indexer layer whose
    ``"full"`` layer lies on an earlier stage."""
    for i in layers:
        j = _full_layer(config, i)
        if j is not None and j < layers.start:
            raise ValueError(
                f"model type {config.model_type!r}: decoder layer {i} reuses the top-k selection of layer {j} "
                f"(config.indexer_types {i}: 'shared'), which lies on an earlier pipeline stage (this stage has "
                f"layers {layers.start}..{layers.stop - 1}); the pipeline does not send that selection between "
                f"stages. Use a layout that keeps layers {j}-{i} on one stage (each stage starting at a 'full' "
                "indexer layer), or fewer stages (concertina_pipeline_size)")


def install(model: nn.Module) -> int:
    """Route the indexed attention modules (and their indexers) of ``model`` through the chunk
    context; returns how many attention modules. Idempotent."""
    classes = _classes(str(getattr(getattr(model, "config", None), "model_type", "")))
    if classes is None:
        return 0
    from ..recurrent import install as route  # routes every module of a class through a forward

    attn_cls, idx_cls = classes
    route(model, idx_cls, _indexer_forward)
    return route(model, attn_cls, _attention_forward)


def sequence_parallel_refusal(config: Any, sp: int) -> str | None:
    """Why a stage of ``sp`` ranks cannot run ``config``'s indexed attention (``None``: it can, or it has none)."""
    types = getattr(config, "layer_types", None) or ()
    if sp <= 1 or "indexed_attention" not in types:
        return None
    return (f"model type {getattr(config, 'model_type', '?')!r}: indexed (top-k sparse) attention runs with sequence "
            "parallel size 1 only (the indexer of a chunk sharded over a stage's ranks would score a share of the "
            "keys); set concertina_sequence_parallel_size=1")


def refusal(ctx: Any) -> str | None:
    """Why indexed attention cannot run in ``ctx`` (``None``: it can)."""
    if type(ctx) is not ChunkAttentionContext:
        return ("indexed (top-k sparse) attention runs with sequence parallel size 1 only (the indexer of a chunk "
                "sharded over a stage's ranks would score a share of the keys); set "
                "concertina_sequence_parallel_size=1")
    store = ctx.store
    if store.gradient != "full" or store.kv_tail is not None or store.global_heads:
        return ("segment-level training (concertina_segment_*) is not implemented for indexed (top-k sparse) "
                "attention: its indexer selects among every earlier key; train without the segment options")
    return None


_SELECTIONS: "weakref.WeakKeyDictionary[ChunkAttentionContext, dict[int, Selection]]" = weakref.WeakKeyDictionary()


def _context(self: nn.Module, kwargs: dict) -> ChunkAttentionContext | None:
    ctx = kwargs.get("concertina_ctx")
    ctx = ctx if ctx is not None else current_context()
    if ctx is None and step_running():
        raise RuntimeError(f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')}) ran without a chunk "
                           "context while a pipeline step runs: its indexer would select keys across packed sequences")
    if ctx is not None:
        why = refusal(ctx)
        if why is not None:
            raise ValueError(why)
    return ctx


def _attention_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    ctx = _context(self, kwargs)
    if ctx is None:
        return type(self).forward(self, *args, **kwargs)
    if args[2:3] or kwargs.get("attention_mask") is not None:
        raise ValueError(f"{type(self).__name__} got an attention_mask inside a concertina chunk, whose mask the "
                         "chunk context defines")
    kwargs["attention_mask"] = UNMASKED
    full = _full_layer(self.config, self.layer_idx)
    if full is not None:
        sel = _SELECTIONS.get(ctx, {}).get(full)
        if sel is None:
            raise RuntimeError(f"layer {self.layer_idx} reuses the top-k selection of layer {full}, which has not run "
                               "on this chunk on this stage")
        kwargs["prev_topk_indices"] = sel
    return type(self).forward(self, *args, **kwargs)


#: at most this many bytes of the indexer's float32 scores (``[rows, H_idx, keys]``) in one call: a
#: segment's queries are scored in blocks of rows when all of them would take more (HF scores a
#: sequence's queries at once)
SCORE_BLOCK_BYTES = 1 << 28


class _IndexerKeys:
    """The key cache HF's indexer ``forward`` reads in one call on a segment's queries: ``keys`` when
    given (the sequence's earlier indexer keys, then the segment's own, from an earlier call); else
    the call's own keys are the segment's, kept in :attr:`own`, after ``prefix``, or alone when
    ``probe`` (that call scores one key: it is for the keys)."""

    def __init__(self, prefix: torch.Tensor | None = None, keys: torch.Tensor | None = None,
                 probe: bool = False) -> None:
        self.prefix, self.keys, self.probe = prefix, keys, probe
        self.own: torch.Tensor | None = None

    def update_indexer(self, k: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if self.keys is not None:
            return self.keys.to(k.dtype)
        self.own = k
        if self.probe:
            return k[:, :1]
        return k if self.prefix is None else torch.cat([self.prefix.to(k.dtype), k], dim=1)


def _indexer_forward(self: nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any = None,
                     position_ids: torch.Tensor | None = None, cache: Any = None, **kwargs: Any) -> Any:
    ctx = current_context()
    if ctx is None or attention_mask is not UNMASKED:
        if step_running():
            raise RuntimeError(f"{type(self).__name__} (layer {self.layer_idx}) ran without a chunk context while a "
                               "pipeline step runs")
        return type(self).forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                                  cache=cache, **kwargs)
    if cache is not None:
        raise ValueError(f"{type(self).__name__} got a cache inside a concertina chunk (the runtime runs without one)")
    layer = self.layer_idx
    cos, sin = position_embeddings
    allowed = []

    def score(a: int, b: int, mask: torch.Tensor, keys: _IndexerKeys) -> torch.Tensor:  # chunk tokens [a, b)
        pos = None if position_ids is None else position_ids[:, a:b]
        return type(self).forward(self, hidden_states[:, a:b], q_resid[:, a:b], (cos[:, a:b], sin[:, a:b]),
                                  mask[None], pos, cache=keys)[0].long()  # [b - a, topk]

    for s in ctx.slices:
        prefix = None
        if s.start > 0:
            prefix = ctx.store.prefix(s.seq, s.start, indexer_layer(layer))[0].squeeze(1)  # [1, C, D]
        causal = torch.ones(s.length, s.start + s.length, dtype=torch.bool, device=hidden_states.device
                            ).tril(s.start)
        chosen = torch.zeros_like(causal)
        rows = max(1, SCORE_BLOCK_BYTES // (4 * int(getattr(self, "n_heads", 1)) * causal.shape[1]))
        first = _IndexerKeys(prefix, probe=rows < s.length)
        top = score(s.offset, s.offset + s.length, causal[:, :1] if first.probe else causal, first)
        if first.probe:  # the keys from that call, the queries' scores in blocks of rows
            keys = first.own if prefix is None else torch.cat([prefix.to(first.own.dtype), first.own], dim=1)
            for a in range(0, s.length, rows):
                b = min(a + rows, s.length)
                chosen[a:b].scatter_(-1, score(s.offset + a, s.offset + b, causal[a:b], _IndexerKeys(keys=keys)),
                                     True)
        else:
            chosen.scatter_(-1, top, True)
        if not s.final:  # [1, s, D] as [1, 1, s, D], the store's token axis
            own = first.own.detach().unsqueeze(1)
            ctx.store.put_if_absent(s.seq, s.start, indexer_layer(layer), own, own, False)
        allowed.append(chosen & causal)
    sel = Selection(tuple(allowed))
    if getattr(self.config, "indexer_types", None):  # GLM: later "shared" layers reuse it
        _SELECTIONS.setdefault(ctx, {})[layer] = sel
    return sel


def indexed_attention(ctx: ChunkAttentionContext, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, scale: float, dropout: float, selection: Selection) -> torch.Tensor:
    """Attention of each segment over ``[earlier K/V, own K/V]`` under ``selection`` (the own K/V
    already stored). ``query`` [1, H, T, D]; -> [1, T, H, Dv]."""
    if len(selection.allowed) != len(ctx.slices):
        raise RuntimeError(f"a top-k selection of {len(selection.allowed)} segments for a chunk of {len(ctx.slices)}")
    gqa = query.shape[1] != key.shape[1]
    dv = value.shape[-1]
    outs = []
    for s, allowed in zip(ctx.slices, selection.allowed):
        k, v, _ = ctx.segment_kv(s, layer, key, value, None)
        q, k, v = pad_head_dims(query[:, :, s.offset:s.offset + s.length], k, v)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale,
                                           enable_gqa=gqa)
        outs.append(o[..., :dv])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous()


def mask_with_indices(attention_mask: torch.Tensor | None, indices: torch.Tensor, num_keys: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """HF's eager-path mask of top-k ``indices`` ([B, S, k]) over ``num_keys`` keys: the
    unselected keys masked in ``attention_mask`` (boolean: ``False``; additive: dtype's minimum)."""
    b, s = indices.shape[:2]
    unselected = indices.new_ones((b, s, num_keys), dtype=torch.bool).scatter(-1, indices.long(), False)[:, None]
    if attention_mask is None:
        causal = torch.ones(s, num_keys, dtype=torch.bool, device=indices.device).tril(num_keys - s)
        return causal & ~unselected
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~unselected
    return attention_mask.masked_fill(unselected, torch.finfo(dtype).min)

