"""Which kernel a call takes (:func:`choose_kernel`), and which ones ran (:func:`kernels_used`).

By device, dtype and the features a call asks for (:data:`KERNELS` names them):

- CPU: SDPA's flash kernel per segment (``sdpa-cpu-flash``, :mod:`.cpu`);
- CUDA, half precision: ``flash_attn_varlen_func`` when flash-attn is installed, else torch's
  ``varlen_attn`` when present, one call over the chunk (:mod:`.varlen`);
- CUDA otherwise (float32, a feature the varlen kernel lacks: dropout for ``varlen_attn``, or
  what FlashAttention-2 does not take: a GPU older than compute capability 8.0, a head dimension
  over 256, for ``varlen_attn`` one that is not a multiple of 8) and CPU with dropout: SDPA per
  segment (``sdpa-per-segment``, :mod:`.segments`);
- soft-capping a varlen kernel does not implement, and attention sinks: the eager formula per
  segment (``eager-per-segment``), on any device.

Each kernel is logged once when it first runs (:func:`note_kernel`). The varlen kernels'
availability is read through the :mod:`.varlen` module at call time.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import varlen

__all__ = ["FLASH_MAX_HEAD_DIM", "FLASH_MIN_CAPABILITY", "KERNELS", "attention_kernel", "choose_kernel",
           "kernels_used", "note_kernel"]

logger = logging.getLogger(__name__)


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


def choose_kernel(device: torch.device, dtype: torch.dtype, dropout: float = 0.0, softcap: float | None = None,
                  sink: bool = False, window: int | None = None, head_dim: int | None = None) -> str:
    """The kernel (a key of :data:`KERNELS`) for a call with these features (see the module
    docstring); ``head_dim``: the padded head dimension (``None``: not known)."""
    if sink:
        return "eager-per-segment"
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if varlen.flash_attn_available() and (softcap is None or "softcap" in varlen.flash_attn_params()) and (
                _flash_fits("flash-attn", device, head_dim)):
            return "flash-attn"
        if softcap is None and dropout == 0.0 and varlen.torch_varlen_available() and (
                window is None or "window_size" in varlen.torch_varlen()[1]) and _flash_fits(
                "torch-varlen", device, head_dim):
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
    return choose_kernel(dev, dtype)


def kernels_used() -> list[str]:
    """``"kernel on device type"`` for every kernel that ran in this process, in first-run order."""
    return [f"{k} on {d}" for k, d in _USED]


def note_kernel(kernel: str, device: torch.device) -> None:
    """Log ``kernel`` the first time it runs on this device type (:func:`kernels_used` lists it)."""
    key = (kernel, device.type)
    if key not in _USED:
        _USED[key] = None
        logger.info("concertina attention on %s: %s (%s)", device.type, kernel, KERNELS[kernel])
