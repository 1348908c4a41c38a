"""A depthwise causal convolution over a pipeline chunk, per document, its tail carried across slices.

The short convolutions of recurrent mixers (Gated DeltaNet's over ``q | k | v``
(:mod:`.linear_attention`), LFM2's over ``B * x`` (:mod:`.short_conv`)) read, for each token, the
``width = kernel - 1`` inputs before it. HF runs them over the whole input; in a chunk,
:func:`per_document_conv` runs one convolution call over the chunk with each slice preceded by its
own ``width`` earlier inputs:

- zeros at a document start, so no token of one document reads another's (the first ``width``
  tokens included);
- for a later slice of a split sequence, the tail its previous slice left in the chunk's
  :class:`~.attention.KVStore` (``KVEntry.v_leaf``, a detached leaf whose gradient the executor
  hands back to the earlier slice's backward);
- a non-final slice's own tail: the sequence's last ``width`` pre-convolution inputs up to the
  slice's end (a slice shorter than ``width`` takes the rest from the tail it received), attached
  to its graph, which the caller stores (with its recurrent state, if any) as ``KVEntry.v``.

Cost: one convolution call over ``T + width * slices`` columns; per non-final slice
``width * channels`` values kept until its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .attention.context import ChunkAttentionContext, KVEntry

__all__ = ["DocumentConv", "per_document_conv"]


@dataclass
class DocumentConv:
    """What :func:`per_document_conv` returns."""

    out: torch.Tensor  #: the convolution's output on the chunk's own tokens, ``[1, C, T]``
    carried: dict[int, KVEntry]  #: slice index -> the entry its sequence's previous slice stored
    tails: dict[int, torch.Tensor]  #: slice index -> its tail ``[1, C, width]`` (non-final slices)


def per_document_conv(mixed: torch.Tensor, ctx: ChunkAttentionContext, layer: int, width: int,
                      conv: Callable[[torch.Tensor], torch.Tensor], state: str = "state") -> DocumentConv:
    """``conv`` (a causal convolution ``[1, C, n] -> [1, C, n]`` reading ``width`` earlier columns,
    zeros before the first) over ``mixed`` ``[1, C, T]``, each slice of ``ctx`` after its own
    ``width`` earlier inputs (module docstring). ``state``: how a missing entry is named in the error."""
    channels = mixed.shape[1]
    carried: dict[int, KVEntry] = {}
    tails: dict[int, torch.Tensor] = {}
    parts, spans, at = [], [], 0
    for i, s in enumerate(ctx.slices):
        own = mixed[:, :, s.offset:s.offset + s.length]
        if s.start == 0:
            head = mixed.new_zeros(1, channels, width)
        else:
            prev = ctx.store.previous(s.seq, s.start, layer)
            if prev is None:
                raise RuntimeError(f"the {state} of sequence {s.seq} before token {s.start} on layer {layer} is "
                                   "missing: an earlier slice did not run forward on this stage first")
            carried[i] = prev
            head = prev.v_leaf.to(own.dtype)
        parts += [head, own]
        spans.append((at + width, at + width + s.length))
        at += width + s.length
        if not s.final:  # the sequence's last `width` pre-convolution inputs, for the next slice
            tails[i] = torch.cat([head, own], dim=-1)[:, :, head.shape[-1] + s.length - width:]
    out = conv(torch.cat(parts, dim=-1))
    return DocumentConv(torch.cat([out[:, :, lo:hi] for lo, hi in spans], dim=-1), carried, tails)
