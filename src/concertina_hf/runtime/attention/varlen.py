"""The CUDA varlen adapters: one kernel call over the whole chunk in the varlen layout.

:func:`varlen_path` lays the chunk's queries ``[T, H, D]`` and its keys ``[S, K, D]`` (slice by
slice, ``[prefix_i, own_i]``: :meth:`~.context.ChunkAttentionContext.varlen_keys`) out with the
context's ``cu_seqlens`` and calls ``flash_attn_varlen_func`` (flash-attn) or torch's
``torch.nn.attention.varlen.varlen_attn``; both align causal and window masks bottom-right
(queries shorter than keys). Keywords are chosen by signature: ``window_size``, ``enable_gqa``,
``scale``, ``is_causal`` differ across torch releases (:func:`torch_varlen`), ``softcap`` across
flash-attn releases (:func:`flash_attn_params`).

Cost: the varlen keys are concatenated through ``torch.cat``, so autograd keeps the ``C + s`` keys
of each layer until the slice's backward.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from .context import ChunkAttentionContext
from .segments import pad_head_dims

__all__ = ["flash_attn_available", "flash_attn_params", "torch_varlen", "torch_varlen_available", "varlen_path"]


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
def flash_attn_params() -> frozenset:
    """The keyword names of the installed ``flash_attn_varlen_func`` (empty without flash-attn)."""
    fn = _flash_attn_fn()
    try:
        return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()
    except (TypeError, ValueError):
        return frozenset()


@functools.lru_cache(maxsize=None)
def torch_varlen() -> tuple[Callable, frozenset] | None:
    """torch's ``varlen_attn`` and its parameter names, or ``None`` (absent, or no causal mode)."""
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
    return torch_varlen() is not None


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
    fn, params = torch_varlen()
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


def varlen_path(kernel: str, ctx: ChunkAttentionContext, layer: int, query, key, value, scale: float,
                window: int | None, dropout: float, softcap: float | None) -> torch.Tensor:
    """One varlen call over the chunk. -> [1, T, H, Dv]."""
    key_S, value_S = ctx.varlen_keys(layer, key, value)
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key_S[0].transpose(0, 1)  # [S, K, D] (K < H handled by the kernel)
    v = value_S[0].transpose(0, 1)
    dv = v.shape[-1]
    q, k, v = pad_head_dims(q, k, v)
    if kernel == "flash-attn":
        out = _flash_attn_call(q, k, v, ctx, scale, window, dropout, softcap)
    else:
        out = _torch_varlen_call(q, k, v, ctx, scale, window)
    return out[..., :dv].unsqueeze(0)
