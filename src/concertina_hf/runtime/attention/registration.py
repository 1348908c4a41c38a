"""The backend's registration in HF's ``AttentionInterface`` under the name ``"concertina"``.

HF attention modules call the function registered under the model's
``config._attn_implementation``; :func:`register_attention` registers
:func:`~.forward.concertina_attention_forward` there and HF's SDPA mask in
``AttentionMaskInterface`` under the same name (the mask of the fallback path).
"""

from __future__ import annotations

from .forward import concertina_attention_forward

__all__ = ["ATTN_IMPLEMENTATION", "register_attention"]

ATTN_IMPLEMENTATION = "concertina"
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
