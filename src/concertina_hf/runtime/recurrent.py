"""What the recurrent and convolutional mixers routed through the chunk context share.

Gated DeltaNet (:mod:`.linear_attention`), Mamba (:mod:`.ssm`), short convolutions
(:mod:`.short_conv`), lightning attention (:mod:`.lightning_attention`) and KDA (:mod:`.kda`) each
replace the ``forward`` of their HF mixer modules (an instance attribute; the class is untouched)
with one that reads the chunk context the runtime sets around each decoder-layer call
(:func:`~.attention.context.current_context`, or the ``concertina_ctx`` keyword), as the
attention backend does:

- :func:`install` routes every module of the HF class through such a ``forward``;
- :func:`routed` builds it: outside a chunk and outside a step (a plain ``model(...)``,
  ``generate``) the module's own ``forward`` runs; inside a step without a chunk context it raises
  (the state would cross packed sequences and miss earlier slices); inside a chunk a cache or an
  attention mask is refused (the chunk context defines the documents) and the mixer's own chunk
  function runs;
- :func:`chunk_refusal` names what such a mixer does not run: a chunk sharded over a stage's
  ranks, and segment-level training (a store that reads earlier slices detached or within a tail).
"""

from __future__ import annotations

import importlib
import inspect
import types
from typing import Any, Callable

import torch
from torch import nn

from .attention.context import ChunkAttentionContext, current_context, step_running

__all__ = ["chunk_refusal", "hf_class", "install", "routed"]


def hf_class(module: str, name: str) -> type | None:
    """The class ``name`` of the HF modeling module ``module`` (``None``: not in the installed
    transformers)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def install(model: nn.Module, cls: type | None, forward: Callable) -> int:
    """Route every module of ``model`` of exactly the class ``cls`` through ``forward`` (a function
    of the module, :func:`routed`'s); returns how many. Idempotent."""
    if cls is None:
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is cls:
            if not isinstance(mod.__dict__.get("forward"), types.MethodType):
                mod.forward = types.MethodType(forward, mod)
            n += 1
    return n


_SIGNATURES: dict[type, inspect.Signature] = {}


def routed(run: Callable[[nn.Module, torch.Tensor, Any], Any], crosses: str = "its state") -> Callable:
    """A mixer's ``forward`` (module docstring) that runs ``run(module, hidden_states, ctx)`` inside a
    chunk. ``crosses``: what would cross packed sequences without a chunk context, for the error."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.pop("concertina_ctx", None)
        ctx = ctx if ctx is not None else current_context()
        if ctx is None:
            if step_running():
                raise RuntimeError(
                    f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')}) ran without a chunk context "
                    f"while a pipeline step runs: {crosses} would cross packed sequences and miss earlier slices")
            return type(self).forward(self, hidden_states, *args, **kwargs)
        given = dict(kwargs)
        if args:  # the HF forward's own names of positional arguments
            sig = _SIGNATURES.get(type(self))
            if sig is None:
                sig = _SIGNATURES[type(self)] = inspect.signature(type(self).forward)
            given.update(sig.bind_partial(self, hidden_states, *args).arguments)
        if any(given.get(k) is not None for k in ("cache", "cache_params", "past_key_values", "attention_mask")):
            raise ValueError(f"{type(self).__name__} got a cache or an attention_mask inside a concertina chunk, "
                             "whose documents the chunk context defines")
        return run(self, hidden_states, ctx)

    return forward


def chunk_refusal(ctx: Any, layers: str, passed: str = "the recurrent state passed between them",
                  carries: str = "their recurrent state carries every earlier token") -> str | None:
    """Why ``layers`` (their name, e.g. ``"Mamba2 (SSD)"``) cannot run on ``ctx`` (``None``: they
    can): a context other than one chunk on one rank (sequence parallelism, which would need
    ``passed``), or a segment-level store (``carries`` says why)."""
    if type(ctx) is not ChunkAttentionContext:
        return (f"{layers} layers run with sequence parallel size 1 only (a chunk sharded over a stage's ranks "
                f"would need {passed}); set concertina_sequence_parallel_size=1")
    store = ctx.store
    if store.gradient != "full" or store.kv_tail is not None or store.global_heads:
        return (f"segment-level training (concertina_segment_*) is not implemented for {layers} layers: "
                f"{carries}; train without the segment options")
    return None
