"""The ``"concertina"`` attention backend: packed, sliced sequences through unmodified HF models.

A chunk is a padding-free concatenation of slices (see :mod:`concertina_hf.planning.types`).
HF attention modules call the function registered in ``AttentionInterface`` under the model's
``config._attn_implementation`` (:mod:`.registration`); the runtime calls the decoder layers
itself (:meth:`PipelineWrapper.run_layers <concertina_hf.runtime.stage.PipelineWrapper.run_layers>`)
and delivers the chunk's :class:`ChunkAttentionContext` to it (:mod:`.context`).

The attention, per slice ``i`` of the chunk (a *segment*): the slice's queries (positions
``start_i .. start_i + s_i - 1``) attend to keys ``[prefix_i, own_i]``, where ``prefix_i`` is the
K/V its sequence's earlier slices left in the :class:`KVStore` (``C_i = start_i`` tokens) and
``own_i`` the slice's own keys: query at position ``p`` sees key at ``p' <= p`` (causal, aligned
bottom-right: queries shorter than keys) and, under a sliding window ``W``, ``p - p' < W``; under
chunked attention (Llama 4), ``p' // c == p // c`` for chunks of ``c`` tokens (:mod:`.chunked`). With it,
for each layer (:func:`concertina_attention_forward`, :mod:`.forward`):

1. every slice that is not the last of its sequence stores its post-rotary K and V in the
   :class:`KVStore`, with a detached leaf alias that later slices read;
2. a slice with context ``C > 0`` attends to the leaves of its sequence's earlier slices followed
   by its own keys; the gradient that flows into those leaves is what the runtime hands to the
   earlier slices' backward;
3. the kernel :func:`attention_kernel` names for a device runs (:mod:`.kernels` chooses; each is
   logged once when it first runs and :func:`kernels_used` lists those that ran): SDPA's flash
   kernel per segment on CPU (:mod:`.cpu`), a varlen kernel on CUDA in half precision
   (:mod:`.varlen`), SDPA or the eager formula per segment otherwise (:mod:`.segments`). No
   ``T x S`` mask exists on any path.

Keywords HF layers pass are implemented or listed (:data:`IGNORED_KEYWORDS`,
:data:`NEUTRAL_KEYWORDS`); any other raises (:mod:`.keywords`).

Modules, each one job: :mod:`.context` (token layout, K/V store, context delivery),
:mod:`.keywords` (the keyword policy), :mod:`.segments` (per-segment autograd paths),
:mod:`.cpu` (the CPU kernel), :mod:`.varlen` (the CUDA varlen adapters), :mod:`.kernels` (the
kernel choice), :mod:`.forward` (the attention function), :mod:`.registration` (HF's
``AttentionInterface``), :mod:`.chunked` (chunked attention and Llama 4's query temperature).

Shape legend: ``T`` query tokens of the chunk, ``S`` key tokens (``T`` plus the contexts), ``s``
/ ``C`` a segment's queries / context, ``H`` query heads, ``K`` key/value heads, ``D`` head dim.
"""

from .context import ChunkAttentionContext, KVStore, SliceSpec, chunk_context, current_context, step_active
from .forward import autocast_dtype, concertina_attention_forward
from .kernels import KERNELS, attention_kernel, kernels_used
from .keywords import IGNORED_KEYWORDS, NEUTRAL_KEYWORDS
from .registration import ATTN_IMPLEMENTATION, register_attention
from .varlen import flash_attn_available, torch_varlen_available

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
