"""Analytic costs of the decoder layers that are not attention: Gated DeltaNet (linear attention), Mamba2,
LFM2's short convolutions, MiniMax's lightning attention, Kimi Delta Attention (the last three:
:func:`short_conv_layer_fields`, :func:`lightning_layer_fields`, :func:`kda_layer_fields`, one kind
``linear`` with their own coefficients).

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

**Mamba2 (SSD) layers** (``concertina_hf.runtime.ssm``: a config with ``mamba_d_state`` whose
``layer_types`` name them ``linear_attention``, Bamba and Granite-4.0 hybrid) are the same kind,
priced by :func:`ssm_layer_fields`: linear in tokens with a per-slice overhead; HF's torch chunked
scan (``mamba2_chunk_scan``, on CPU) saves per token the projection, three convolution-wide tensors,
three ``chunk``-wide float32 score matrices per head (the decays ``L``, ``C B^T`` and its masked copy),
five float32 ``d_state``-wide tensors per head (``B`` and ``C`` repeated to the heads, padded, decayed,
their copies for the batched products), eight float32 ``intermediate``-wide ones (the scan's and the
gated norm's) and two ``[H, head_dim, d_state]`` float32 states per scan chunk; per scan call one more
state (its initial one) and the padding of its last chunk (:attr:`~.cost.CostModel.lin_act_bytes_per_slice`,
:attr:`~.cost.CostModel.lin_pad_bytes_per_token`); measured on CPU (``tests/runtime/test_ssm.py``)
within the attention layers' bounds. On CUDA (``mamba_chunk_scan_combined``) the scan saves its inputs,
its output and the decays' cumulative sums. A non-final slice keeps ``H x head_dim x d_state`` float32
and the convolution's last ``k - 1`` inputs (``conv_dim`` wide). Jamba's Mamba (1) layers (a config
with ``mamba_dt_rank``) run the runtime's torch selective scan on every device, a loop over tokens:
per token two ``intermediate x d_state`` float32 tensors (the decays, the decayed inputs) and the
step's state, per slice its initial state; a non-final slice keeps ``intermediate x d_state`` float32.

**Top-k indexed attention** (``indexed_attention`` layers: ``concertina_hf.runtime.attention.indexed``)
is attention priced as such plus :func:`indexer_pair_flops` (the indexer's forward-only score per
query and key) in ``alpha_attn`` and :func:`indexed_pair_bytes` (the selection, saved as a mask per
score entry) in the saved bytes per entry: the runtime's attention is dense under that mask.

Pure Python; no torch.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["LINEAR_KIND", "SCAN_CHUNK", "SCAN_KERNELS", "hybrid_mixer_terms", "indexed_pair_bytes", "indexer_pair_flops",
           "layer_kinds", "linear_layer_fields", "scan_kernel",
           "kda_layer_fields", "lightning_layer_fields", "short_conv_layer_fields", "ssm_layer_fields"]

#: a layer kind of :attr:`~.cost.CostModel.layer_kinds` (the other: ``"attention"``)
LINEAR_KIND = "linear"
#: HF's torch scan's chunk (``torch_chunk_gated_delta_rule(chunk_size=64)``)
SCAN_CHUNK = 64
#: a scan call's fixed cost, in layer calls (``DeviceSpec.kernel_overhead_s``): its own launches
#: (initial state, padding, masks, casts) against a whole layer's
SEGMENT_CALL_SHARE = 0.5
#: the scan kernels the analytic model knows
SCAN_KERNELS = ("fla", "torch")
#: the ``config.layer_types`` entry of LFM2's short convolutions
SHORT_CONV_LAYER_TYPE = "conv"
#: a slice's fixed cost in a short-convolution layer, in layer calls (``DeviceSpec.kernel_overhead_s``):
#: the zeros of its head, one of a layer's ~20 launches (the concatenations and the convolution are one
#: call over the chunk)
SHORT_CONV_SLICE_SHARE = 0.05


def scan_kernel(attention_kernel: str | None) -> str:
    """The scan kernel alongside the runtime's attention kernel (``None``: the CUDA default, as
    :func:`~.activations.default_kernel`): flash-linear-attention with the CUDA attention kernel
    ``flash-attn``, HF's torch reference with the others (CPU)."""
    return "fla" if attention_kernel in (None, "flash-attn") else "torch"


def layer_kinds(get: Callable[[str], Any]) -> tuple[str, ...]:
    """Each decoder layer's kind from ``config.layer_types`` (``linear_attention``, and ``conv`` in a
    config with ``conv_L_cache`` (LFM2's short convolutions): linear, any other: attention); empty
    when no layer is linear (an attention model's cost model unchanged)."""
    types = get("layer_types")
    linear = {"linear_attention"} | ({SHORT_CONV_LAYER_TYPE} if get("conv_L_cache") is not None else set())
    if not isinstance(types, (list, tuple)) or not linear & {str(t) for t in types}:
        return ()
    return tuple(LINEAR_KIND if str(t) in linear else "attention" for t in types)


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
    if get("block_size") is not None and get("linear_attn_alpha_factor") is not None:  # MiniMax's lightning
        return lightning_layer_fields(get, flops, mem_bandwidth, kernel_overhead_s, dtype_bytes, compute_dtype_bytes,
                                      attention_layer_bytes, mlp_width)
    if get("linear_num_heads") is not None and get("linear_head_dim") is not None:  # Kimi Delta Attention
        return kda_layer_fields(get, flops, mem_bandwidth, kernel_overhead_s, dtype_bytes, compute_dtype_bytes,
                                attention_layer_bytes, mlp_width, attention_kernel)
    if get("conv_L_cache") is not None:  # LFM2's short convolutions
        return short_conv_layer_fields(get, flops, mem_bandwidth, kernel_overhead_s, dtype_bytes,
                                       compute_dtype_bytes, attention_layer_bytes, mlp_width)
    if get("mamba_d_state") is not None or get("ssm_state_size") is not None:  # the linear_attention layers are Mamba2's
        return ssm_layer_fields(get, flops, mem_bandwidth, kernel_overhead_s, dtype_bytes, compute_dtype_bytes,
                                attention_layer_bytes, mlp_width, attention_kernel)
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
        lin_a2a_bytes_per_token=float(a * (conv_dim + 2 * hv + value_dim)),
    )


def indexer_pair_flops(get: Callable[[str], Any]) -> float:
    """Top-k indexed attention (``indexed_attention`` layers, ``concertina_hf.runtime.attention.indexed``):
    the indexer's FLOPs per score entry, in the units of an attention layer's ``2 * q_dim`` (the
    analytic ``alpha_attn`` times the device's FLOPs), averaged over the decoder layers; 0 without
    such layers. The indexer scores each (query, key) entry forward only (HF runs it without
    gradient), ``2 * H_idx * (D_idx + 1)`` FLOPs, where ``alpha_attn`` prices two entries and twice
    more in backward: a sixth of that per entry. The attention itself runs dense over the keys, the
    selection as its mask (no sparse kernel), so costs an attention layer's. GLM's ``"shared"``
    layers reuse another layer's selection and run no indexer."""
    types = list(get("layer_types") or ())
    if "indexed_attention" not in types:
        return 0.0
    kinds = list(get("indexer_types") or ())
    running = sum(1 for i, t in enumerate(types) if t == "indexed_attention"
                  and (i >= len(kinds) or kinds[i] != "shared"))
    heads, dim = int(get("index_n_heads") or 0), int(get("index_head_dim") or 0)
    return 2.0 * heads * (dim + 1) / 6.0 * running / len(types)


def indexed_pair_bytes(get: Callable[[str], Any], compute_bytes: int) -> float:
    """Bytes an ``indexed_attention`` layer saves per score entry of a slice (``s x (C + s)``): the
    selection, which SDPA keeps as a mask of the compute dtype for backward (averaged over the
    layers), and GLM's boolean selection per ``"full"`` layer while the chunk lives; 0 without."""
    types = list(get("layer_types") or ())
    if "indexed_attention" not in types:
        return 0.0
    kinds = list(get("indexer_types") or ())
    full = sum(1 for i, t in enumerate(types) if t == "indexed_attention" and i < len(kinds) and kinds[i] == "full")
    return (compute_bytes * sum(t == "indexed_attention" for t in types) + full) / len(types)


def _attention_part(get: Callable[[str], Any], a: int, h: int) -> float:
    """What an attention layer saves per token that a recurrent layer has not: q, k, v, output,
    log-sum-exp and its input."""
    n_heads = int(get("num_attention_heads"))
    n_kv = int(get("num_key_value_heads") or n_heads)
    head_dim = int(get("head_dim") or h // n_heads)
    return a * (2 * n_heads * head_dim + 2 * n_kv * head_dim) + 4 * n_heads + a * h


def ssm_layer_fields(get: Callable[[str], Any], flops: float, mem_bandwidth: float, kernel_overhead_s: float,
                     dtype_bytes: int, compute_dtype_bytes: int | None, attention_layer_bytes: float,
                     mlp_width: int, attention_kernel: str | None = None) -> dict[str, Any]:
    """The :class:`~.cost.CostModel` fields of a config's Mamba2 layers (the ``linear_attention``
    entries of ``layer_types``; ``{}``: none), as :func:`linear_layer_fields`. Reads ``hidden_size``,
    ``mamba_n_heads``, ``mamba_d_head`` (``"auto"``: the intermediate size over the heads),
    ``mamba_d_state``, ``mamba_n_groups``, ``mamba_expand``, ``mamba_d_conv``, ``mamba_chunk_size``
    (HF's defaults where absent: 128, 64, 256, 1, 2, 4, 256), Falcon-H1's ``mamba_d_ssm`` (the
    intermediate size) and Nemotron-H's names (``mamba_num_heads``, ``mamba_head_dim``,
    ``ssm_state_size``, ``n_groups``, ``conv_kernel``, ``chunk_size``: heads times head size wide)."""
    kinds = layer_kinds(get)
    if not kinds:
        return {}
    if get("mamba_dt_rank") is not None:  # Jamba's Mamba (1)
        return _mamba1_layer_fields(get, kinds, flops, mem_bandwidth, kernel_overhead_s, dtype_bytes,
                                    compute_dtype_bytes, attention_layer_bytes, mlp_width)
    r = int(dtype_bytes)
    a = int(compute_dtype_bytes or dtype_bytes)
    h = int(get("hidden_size"))
    m = _mamba2_mixer(get, a, attention_kernel)
    params = m["params"] + 3 * h * mlp_width + 2 * h  # the MLP and two norms as an attention layer's
    act = max(0.0, attention_layer_bytes - _attention_part(get, a, h)) + m["bytes"]
    elementwise = r * (10 * h + 4 * mlp_width) + m["moved"]
    per_token_scan = m["flops"] / flops + m["moved"] / mem_bandwidth
    c = m["chunk"]
    return dict(
        layer_kinds=kinds,
        lin_alpha_tok=2.0 * params / flops + m["flops"] / flops + elementwise / mem_bandwidth,
        lin_beta_segment=SEGMENT_CALL_SHARE * kernel_overhead_s + (c / 2) * per_token_scan,
        lin_act_bytes_per_token=float(act),
        lin_state_bytes=float(m["state"] + m["tail"]),
        lin_layer_params=int(params),
        lin_act_bytes_per_slice=float(m["per_slice"]),
        lin_scan_chunk=c if m["pad_bytes"] else 0,
        lin_pad_bytes_per_token=float(m["pad_bytes"]),
    )


def hybrid_mixer_terms(get: Callable[[str], Any], flops: float, mem_bandwidth: float, dtype_bytes: int,
                       compute_dtype_bytes: int | None, attention_kernel: str | None = None) -> dict[str, float]:
    """What the Mamba2 beside each layer's attention (Falcon-H1's ``hybrid`` layers: ``layer_types``
    ``hybrid`` and ``mamba_d_state``) adds to an attention layer's coefficients: ``alpha_tok`` (its
    projections and scan per token), ``act_bytes_per_token`` (what it saves per token, as a Mamba2
    layer's mixer: :func:`ssm_layer_fields`), ``layer_params``, and the :class:`~.cost.CostModel`
    fields ``hybrid_*`` (per slice, per padded token, per split chunk); ``{}`` for other configs."""
    types = get("layer_types")
    if get("mamba_d_state") is None or not isinstance(types, (list, tuple)) or "hybrid" not in types:
        return {}
    a = int(compute_dtype_bytes or dtype_bytes)
    m = _mamba2_mixer(get, a, attention_kernel)
    return dict(alpha_tok=2.0 * m["params"] / flops + m["flops"] / flops + m["moved"] / mem_bandwidth,
                act_bytes_per_token=float(m["bytes"]), layer_params=float(m["params"]),
                hybrid_act_bytes_per_slice=float(m["per_slice"]),
                hybrid_scan_chunk=m["chunk"] if m["pad_bytes"] else 0,
                hybrid_pad_bytes_per_token=float(m["pad_bytes"]), hybrid_state_bytes=float(m["state"] + m["tail"]))


def _mamba2_mixer(get: Callable[[str], Any], a: int, attention_kernel: str | None) -> dict[str, Any]:
    """A Mamba2 mixer's own terms (:func:`ssm_layer_fields`): parameters, scan FLOPs and bytes moved
    per token, bytes saved per token, per slice and per padded token, its scan chunk, the state and
    the convolution tail a split slice keeps."""
    h = int(get("hidden_size"))
    heads = int(get("mamba_n_heads") or get("mamba_num_heads") or 128)
    head_dim = get("mamba_d_head") or get("mamba_head_dim")
    if get("mamba_d_ssm"):  # Falcon-H1's own width
        inter = int(get("mamba_d_ssm"))
    elif get("mamba_num_heads") and head_dim not in (None, "auto"):  # Nemotron-H: heads x head size
        inter = heads * int(head_dim)
    else:
        inter = int(float(get("mamba_expand") or 2) * h)
    p = inter // heads if head_dim in (None, "auto") else int(head_dim)
    n = int(get("mamba_d_state") or get("ssm_state_size") or 256)
    g = int(get("mamba_n_groups") or get("n_groups") or 1)
    width = int(get("mamba_d_conv") or get("conv_kernel") or 4)
    c = int(get("mamba_chunk_size") or get("chunk_size") or 256)
    conv_dim = inter + 2 * g * n
    # parameters: the input projection (gate, x B C, dt), the depthwise convolution, A_log, dt_bias,
    # D, the gated norm, the output projection
    mixer_params = h * (inter + conv_dim + heads) + conv_dim * (width + 1) + 3 * heads + inter + inter * h
    # the scan's FLOPs per token and head: the chunk's C B^T and its product with x (full chunk-wide
    # einsums), the chunk state's update and its read
    scan_flops = heads * 2 * (c * (n + p) + 2 * n * p)
    state = 4 * heads * p * n
    if scan_kernel(attention_kernel) == "torch":
        # module docstring: the score matrices, the d_state-wide and intermediate-wide float32
        # tensors, two states per scan chunk, small per-head tensors
        scan_bytes = 4 * (3 * heads * c + 5 * heads * n + 4 * inter + 6 * heads) + 2 * state / c
        pad_bytes = 4 * (3 * heads * c + 5 * heads * n + 3 * inter)
        per_slice = state
        moved = 2 * scan_bytes
    else:
        scan_bytes = a * (2 * inter + 2 * g * n + heads) + 4 * heads
        pad_bytes = per_slice = 0.0
        moved = 3 * (scan_bytes + state / c)
    mixer_bytes = (a * h + a * (inter + conv_dim + heads)  # its input, the projection
                   + 3 * a * conv_dim  # the convolution's input, its output before and after the activation
                   + scan_bytes
                   + (4 * (4 * inter + g) if get("mamba_rms_norm") is not False else 8 * inter)  # gated norm / gate
                   + a * inter)  # the output projection's input
    return dict(params=mixer_params, flops=scan_flops, moved=moved, bytes=mixer_bytes, state=state,
                per_slice=per_slice, pad_bytes=pad_bytes, chunk=c, tail=a * (width - 1) * conv_dim)


def short_conv_layer_fields(get: Callable[[str], Any], flops: float, mem_bandwidth: float, kernel_overhead_s: float,
                            dtype_bytes: int, compute_dtype_bytes: int | None, attention_layer_bytes: float,
                            mlp_width: int) -> dict[str, Any]:
    """The :class:`~.cost.CostModel` fields of a config's LFM2 short convolutions (the ``conv``
    entries of ``layer_types``; ``{}``: none), as :func:`linear_layer_fields`. Reads ``hidden_size``,
    ``conv_L_cache`` (the convolution's width ``k``), ``conv_bias``.

    A layer: ``in_proj`` (``hidden -> 3 hidden``: ``B, C, x``), ``B * x`` through a depthwise causal
    convolution of width ``k``, ``C`` times its output, ``out_proj``; one convolution call over the
    chunk (``concertina_hf.runtime.short_conv``). Time: its matmuls and the convolution, linear in
    tokens; per slice its head's ``k - 1`` columns and a few launches (:data:`SHORT_CONV_SLICE_SHARE`).
    Saved per token: its input, ``in_proj``'s output (``B``, ``C``, ``x``: one tensor), the
    convolution's input and output, ``out_proj``'s input (7 ``hidden``-wide tensors); the MLP and the
    norms as an attention layer's. A non-final slice keeps the convolution's last ``k - 1`` inputs."""
    kinds = layer_kinds(get)
    if not kinds:
        return {}
    r = int(dtype_bytes)
    a = int(compute_dtype_bytes or dtype_bytes)
    h = int(get("hidden_size"))
    k = int(get("conv_L_cache") or 3)
    bias = bool(get("conv_bias"))
    mixer_params = 4 * h * h + k * h + (5 * h if bias else 0)
    params = mixer_params + 3 * h * mlp_width + 2 * h
    conv_flops = 2 * k * h + 2 * h  # the convolution, the two gates
    act = max(0.0, attention_layer_bytes - _attention_part(get, a, h)) + 7 * a * h
    elementwise = r * (10 * h + 4 * mlp_width) + r * 6 * h  # norms, residuals, MLP; the gates, the convolution
    per_token = (2.0 * params + conv_flops) / flops + elementwise / mem_bandwidth
    return dict(
        layer_kinds=kinds,
        lin_alpha_tok=per_token,
        lin_beta_segment=SHORT_CONV_SLICE_SHARE * kernel_overhead_s + (k - 1) * (conv_flops / flops + 2 * r * h
                                                                                  / mem_bandwidth),
        lin_act_bytes_per_token=float(act),
        lin_state_bytes=float(a * (k - 1) * h),
        lin_layer_params=int(params),
    )


def lightning_layer_fields(get: Callable[[str], Any], flops: float, mem_bandwidth: float, kernel_overhead_s: float,
                           dtype_bytes: int, compute_dtype_bytes: int | None, attention_layer_bytes: float,
                           mlp_width: int) -> dict[str, Any]:
    """The :class:`~.cost.CostModel` fields of MiniMax's lightning-attention layers (the
    ``linear_attention`` entries of its ``layer_types``; ``{}``: none), as :func:`linear_layer_fields`.
    Reads ``hidden_size``, ``num_attention_heads``, ``head_dim``, ``block_size`` (HF's default where absent: 256).

    A layer (``concertina_hf.runtime.lightning_attention``, HF's block recurrence per slice): the
    ``qkv`` projection and its SiLU, per block of ``B`` tokens the decayed ``Q K^T`` and its product with
    ``V``, the queries against the ``[H, D, D]`` state and the state's update, the RMS norm over the
    heads, the sigmoid output gate and ``out_proj``. Saved per token (measured on CPU with saved-tensor
    hooks: within 2%): its input, the SiLU's input and output (``3 H D`` each), the decayed queries and
    keys, the norm's input, normed values and output, the gate, the gated values (``H D`` each; the norm's
    two in float32), the block's decayed scores (``H B``) and the state once per block (``H D^2 / B``).
    A non-final slice keeps the state."""
    kinds = layer_kinds(get)
    if not kinds:
        return {}
    r = int(dtype_bytes)
    a = int(compute_dtype_bytes or dtype_bytes)
    h = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    d = int(get("head_dim") or h // heads)
    b = int(get("block_size") or 256)
    hd = heads * d
    params = 5 * h * hd + hd + 3 * h * mlp_width + 2 * h
    scan_flops = 4 * heads * (b * d + d * d)  # intra-block Q K^T and its V product; the state's read and update
    act = (max(0.0, attention_layer_bytes - _attention_part(get, a, h))
           + a * (h + 11 * hd + heads * b + heads * d * d / b) + 8 * hd + 4)
    moved = a * (8 * hd + 2 * heads * b)
    elementwise = r * (10 * h + 4 * mlp_width) + moved
    return dict(
        layer_kinds=kinds,
        lin_alpha_tok=(2.0 * params + scan_flops) / flops + elementwise / mem_bandwidth,
        # a slice's last block is partial (half a block of the per-token work on average) and its own launches
        lin_beta_segment=SEGMENT_CALL_SHARE * kernel_overhead_s + (b / 2) * scan_flops / flops,
        lin_act_bytes_per_token=float(act),
        lin_state_bytes=float(a * heads * d * d),
        lin_layer_params=int(params),
    )


def kda_layer_fields(get: Callable[[str], Any], flops: float, mem_bandwidth: float, kernel_overhead_s: float,
                     dtype_bytes: int, compute_dtype_bytes: int | None, attention_layer_bytes: float,
                     mlp_width: int, attention_kernel: str | None = None) -> dict[str, Any]:
    """The :class:`~.cost.CostModel` fields of Kimi Linear's Kimi Delta Attention layers (the
    ``linear_attention`` entries of its ``layer_types``; ``{}``: none), as :func:`linear_layer_fields`.
    Reads ``hidden_size``, ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim`` (HF's
    defaults where absent: 32, 128, 4).

    A layer (``concertina_hf.runtime.kda``): the ``q, k, v`` projections through one depthwise
    convolution, a low-rank forget gate per channel, ``beta`` per head, the gated delta rule over a
    ``[H, D, D]`` float32 state in chunks of ``C = SCAN_CHUNK`` tokens, a low-rank output gate, the gated
    norm and ``o_proj``. HF's torch reference (``chunk_kimi_delta_attention``, on CPU) saves per token and
    head, in float32, three ``C x D`` products (the per-channel decay mask, the keys' products within a
    chunk before the triangular system and the queries' within the loop), about 30 ``D``-wide tensors
    (the projections, their float32, normalised, padded, weighted and decayed copies, the new values) and
    the ``C^2 / 3`` entries the triangular solve's row clones keep, plus per token the gates' low-rank
    inputs (measured with saved-tensor hooks: within 1%). flash-linear-attention's ``chunk_kda`` (CUDA)
    saves its inputs and one ``C``-wide matrix per head, as the Gated DeltaNet's. A non-final slice keeps
    the state and the convolution's last ``k - 1`` inputs (``3 H D`` wide)."""
    kinds = layer_kinds(get)
    if not kinds:
        return {}
    r = int(dtype_bytes)
    a = int(compute_dtype_bytes or dtype_bytes)
    h = int(get("hidden_size"))
    heads = int(get("linear_num_heads") or 32)
    d = int(get("linear_head_dim") or 128)
    width = int(get("linear_conv_kernel_dim") or 4)
    c = SCAN_CHUNK
    hd = heads * d
    # q, k, v, the convolution, the forget gate (h -> D -> H D, dt_bias, A_log), beta, the output gate
    # (h -> D -> H D), the gated norm, o_proj; the MLP and two norms as an attention layer's
    mixer_params = 3 * h * hd + 3 * hd * width + 2 * (h * d + d * hd) + hd + heads + h * heads + d + hd * h
    params = mixer_params + 3 * h * mlp_width + 2 * h
    # per token and head: the decay mask and the two C-wide D-wide products, the triangular solve,
    # the state's read and update
    scan_flops = heads * 2 * (3 * c * d + c * c / 2 + c * d + 3 * d * d)
    if scan_kernel(attention_kernel) == "torch":
        scan_bytes = 4 * heads * ((3 * c + 30) * d + c * c / 3 + 115)
        moved = 2 * scan_bytes
    else:
        scan_bytes = a * (4 * hd + heads + heads * c) + 4 * 3 * heads
        moved = 3 * (scan_bytes + 4 * heads * d * d / c)
    act = max(0.0, attention_layer_bytes - _attention_part(get, a, h)) + a * h + 4 * (2 * d + 12) + scan_bytes
    elementwise = r * (10 * h + 4 * mlp_width) + moved
    per_token_scan = scan_flops / flops + moved / mem_bandwidth
    return dict(
        layer_kinds=kinds,
        lin_alpha_tok=2.0 * params / flops + scan_flops / flops + elementwise / mem_bandwidth,
        lin_beta_segment=SEGMENT_CALL_SHARE * kernel_overhead_s + (c / 2) * per_token_scan,
        lin_act_bytes_per_token=float(act),
        lin_state_bytes=float(4 * heads * d * d + a * (width - 1) * 3 * hd),
        lin_layer_params=int(params),
    )


def _mamba1_layer_fields(get: Callable[[str], Any], kinds: tuple[str, ...], flops: float, mem_bandwidth: float,
                         kernel_overhead_s: float, dtype_bytes: int, compute_dtype_bytes: int | None,
                         attention_layer_bytes: float, mlp_width: int) -> dict[str, Any]:
    """:func:`ssm_layer_fields` of Jamba's Mamba (1) layers: ``mamba_expand``, ``mamba_d_state``,
    ``mamba_dt_rank``, ``mamba_d_conv`` (module docstring)."""
    r = int(dtype_bytes)
    a = int(compute_dtype_bytes or dtype_bytes)
    h = int(get("hidden_size"))
    inter = int(float(get("mamba_expand") or 2) * h)
    n = int(get("mamba_d_state") or 16)
    rank = int(get("mamba_dt_rank") or 256)
    width = int(get("mamba_d_conv") or 4)
    # parameters: in_proj (x and gate), the convolution, x_proj (dt, B, C), dt_proj, A_log, D, the
    # dt / B / C norms, out_proj; the MLP and two norms as an attention layer's
    mixer_params = (h * 2 * inter + inter * (width + 1) + inter * (rank + 2 * n) + rank * inter + inter
                    + inter * n + inter + rank + 2 * n + inter * h)
    params = mixer_params + 3 * h * mlp_width + 2 * h
    state = 4 * inter * n
    scan_flops = 8 * inter * n  # the decays, the decayed inputs, the state's update and its read, per token
    scan_bytes = 3 * state  # the decays, the decayed inputs, the step's state (float32)
    mixer_bytes = (a * h + a * 2 * inter  # its input, the projection (x and gate)
                   + 2 * a * inter  # the convolution's input and output before the activation
                   + 3 * 4 * inter + 4 * inter  # dt and its softplus, the scan's output, x in float32
                   + 2 * a * inter  # x_proj's and out_proj's inputs
                   + 4 * (4 * n + rank)  # B and C before and after their norms, dt's norm
                   + scan_bytes)
    act = max(0.0, attention_layer_bytes - _attention_part(get, a, h)) + mixer_bytes
    moved = 2 * scan_bytes
    elementwise = r * (10 * h + 4 * mlp_width) + moved
    return dict(
        layer_kinds=kinds,
        lin_alpha_tok=2.0 * params / flops + scan_flops / flops + elementwise / mem_bandwidth,
        lin_beta_segment=SEGMENT_CALL_SHARE * kernel_overhead_s,
        lin_act_bytes_per_token=float(act),
        lin_state_bytes=float(state + a * (width - 1) * inter),
        lin_layer_params=int(params),
        lin_act_bytes_per_slice=float(state),
    )
