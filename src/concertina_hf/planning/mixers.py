"""Analytic costs of the decoder layers that are not attention: Gated DeltaNet (linear attention).

A config's ``layer_types`` names each decoder layer's kind; ``linear_attention`` layers (the Gated
DeltaNet of Qwen3-Next, Qwen3.5, OLMo Hybrid, Lara-Mini: ``concertina_hf.runtime.linear_attention``)
are priced here, the others as attention layers (:mod:`.coefficients`). What differs:

- **time**: linear in tokens with no context term (a slice reads a fixed-size state, not its
  earlier tokens' K/V), plus a per-segment overhead: each slice of a chunk is one scan call from
  its own initial state (HF's ``torch_chunk_gated_delta_rule``, the runtime's per-document scan),
  whose last scan chunk of ``SCAN_CHUNK`` tokens is padded (half of one on average) and which
  launches its own kernels;
- **activation memory per token**: the projections, the convolution, the scan's, and the gated
  norm's float32 internals; the MLP and the norms as an attention layer's
  (:func:`~.activations.saved_bytes`'s layer less its attention part). The scan's depends on the
  kernel HF maps ``torch_chunk_gated_delta_rule`` to (:data:`SCAN_KERNELS`): flash-linear-attention's
  on CUDA (``"fla"``, with the CUDA attention kernels) saves q, k, v, the decays, ``beta`` and one
  ``SCAN_CHUNK``-wide matrix per token and head and recomputes the rest in backward; HF's torch
  reference (``"torch"``, on CPU) saves float32 queries and keys repeated to the value heads
  (before and after their L2 norm, padded, decayed; per scan chunk again in the loop's products),
  ``beta``-weighted keys, the solved values and keys, the new values, five ``SCAN_CHUNK``-wide
  matrices per token (the pairwise decays, the triangular system before and after the decays, the
  intra-chunk scores likewise) and a ``[Hv, Dk, Dv]`` float32 state per scan chunk: measured on
  CPU (``tests/runtime/test_linear_attention.py``) within the bounds of the attention layers';
- **carry per split slice**: a non-final slice keeps, per linear layer, its final state
  (``Hv x Dk x Dv`` float32) and the convolution's last ``k - 1`` inputs (``conv_dim`` wide) for
  the next slice, whatever its length (an attention layer keeps K/V per token), and their
  gradients while the later slices run backward.

Pure Python; no torch.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["LINEAR_KIND", "SCAN_CHUNK", "SCAN_KERNELS", "layer_kinds", "linear_layer_fields", "scan_kernel"]

#: a layer kind of :attr:`~.cost.CostModel.layer_kinds` (the other: ``"attention"``)
LINEAR_KIND = "linear"
#: HF's torch scan's chunk (``torch_chunk_gated_delta_rule(chunk_size=64)``)
SCAN_CHUNK = 64
#: a scan call's fixed cost, in layer calls (``DeviceSpec.kernel_overhead_s``): its own launches
#: (initial state, padding, masks, casts) against a whole layer's
SEGMENT_CALL_SHARE = 0.5
#: the scan kernels the analytic model knows
SCAN_KERNELS = ("fla", "torch")


def scan_kernel(attention_kernel: str | None) -> str:
    """The scan kernel alongside the runtime's attention kernel (``None``: the CUDA default, as
    :func:`~.activations.default_kernel`): flash-linear-attention with the CUDA attention kernel
    ``flash-attn``, HF's torch reference with the others (CPU)."""
    return "fla" if attention_kernel in (None, "flash-attn") else "torch"


def layer_kinds(get: Callable[[str], Any]) -> tuple[str, ...]:
    """Each decoder layer's kind from ``config.layer_types`` (``linear_attention``: linear, any
    other: attention); empty when no layer is linear (an attention model's cost model unchanged)."""
    types = get("layer_types")
    if not isinstance(types, (list, tuple)) or "linear_attention" not in types:
        return ()
    return tuple(LINEAR_KIND if str(t) == "linear_attention" else "attention" for t in types)


def linear_layer_fields(get: Callable[[str], Any], flops: float, mem_bandwidth: float, kernel_overhead_s: float,
                        dtype_bytes: int, compute_dtype_bytes: int | None, attention_layer_bytes: float,
                        mlp_width: int, attention_kernel: str | None = None) -> dict[str, Any]:
    """The :class:`~.cost.CostModel` fields of a config's linear layers (``{}``: none). Reads
    ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
    ``linear_value_head_dim``, ``linear_conv_kernel_dim`` (HF's defaults where absent: 16, 32,
    128, 128, 4), ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``.
    ``attention_layer_bytes``: what an attention layer of the config saves per token;
    ``attention_kernel``: the runtime's (:func:`scan_kernel`)."""
    kinds = layer_kinds(get)
    if not kinds:
        return {}
    r = int(dtype_bytes)
    a = int(compute_dtype_bytes or dtype_bytes)
    h = int(get("hidden_size"))
    hk = int(get("linear_num_key_heads") or 16)
    hv = int(get("linear_num_value_heads") or 32)
    dk = int(get("linear_key_head_dim") or 128)
    dv = int(get("linear_value_head_dim") or 128)
    width = int(get("linear_conv_kernel_dim") or 4)
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    c = SCAN_CHUNK
    # parameters: q, k, v, z, b, a projections, the depthwise convolution, the output projection,
    # A_log, dt_bias, the gated norm; the MLP and two norms as an attention layer's
    mixer_params = h * (conv_dim + value_dim + 2 * hv) + conv_dim * width + value_dim * h + 2 * hv + dv
    params = mixer_params + 3 * h * mlp_width + 2 * h
    # the scan's FLOPs per token and value head: two C-wide products with the keys (the triangular
    # system, the intra-chunk scores), the two triangular solves (C/2 rows on average, values and
    # keys), the scores times the new values, the state's read (queries, decayed keys) and update
    scan_flops = hv * 2 * (2 * c * dk + c * (dv + dk) + c * dv + 3 * dk * dv)
    # what the scan saves per token, besides the projections' (module docstring); the bytes it
    # moves: the torch reference writes and reads its float32 tensors, the fused kernel its inputs
    # and the per-chunk states it recomputes in backward, about three passes
    if scan_kernel(attention_kernel) == "torch":
        scan_bytes = 4 * hv * (8 * dk + 7 * dv + 6 + 5 * c + dk * dv / c)
        moved = 2 * scan_bytes
    else:
        scan_bytes = a * (2 * key_dim + value_dim + hv + hv * c) + 4 * (hv + 2 * hk)
        moved = 3 * (scan_bytes + 4 * hv * dk * dv / c)
    mixer_bytes = (a * (conv_dim + value_dim + 2 * hv)  # projection outputs (conv input, gate, b, a)
                   + a * conv_dim  # the convolution's output (its activation's input)
                   + scan_bytes
                   + 16 * value_dim + 4 * hv  # the gated norm's float32 tensors (input, normed, gate's copy, ...)
                   + a * value_dim + a * h)  # the output projection's input; the mixer's input
    # an attention layer's q, k, v, output, log-sum-exp and its input, which a linear layer has not
    n_heads = int(get("num_attention_heads"))
    n_kv = int(get("num_key_value_heads") or n_heads)
    head_dim = int(get("head_dim") or h // n_heads)
    attention_part = a * (2 * n_heads * head_dim + 2 * n_kv * head_dim) + 4 * n_heads + a * h
    act = max(0.0, attention_layer_bytes - attention_part) + mixer_bytes
    elementwise = r * (10 * h + 4 * mlp_width) + moved  # norms, residuals, MLP; the scan's tensors
    per_token_scan = scan_flops / flops + moved / mem_bandwidth
    return dict(
        layer_kinds=kinds,
        lin_alpha_tok=2.0 * params / flops + scan_flops / flops + elementwise / mem_bandwidth,
        lin_beta_segment=SEGMENT_CALL_SHARE * kernel_overhead_s + (c / 2) * per_token_scan,
        lin_act_bytes_per_token=float(act),
        lin_state_bytes=float(4 * hv * dk * dv + a * (width - 1) * conv_dim),
        lin_layer_params=int(params),
    )
