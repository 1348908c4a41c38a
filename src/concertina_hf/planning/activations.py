"""What the runtime keeps for backward, per token, counted from an HF decoder config.

:func:`saved_bytes` is the activation memory of the analytic cost model
(:func:`~.coefficients.analytic_coefficients`): every tensor autograd saves in a decoder layer, in
the head and per stage, each storage once, in the dtype it is saved in. Per decoder layer:

- **norms** (RMSNorm upcasts to float32): the float32 input (a copy when the stream is not
  float32), the rsqrt per row, the normalized states (in the input dtype, or float32 in the
  Gemma / OLMo2 style), per :data:`NORM_KINDS`; their output is what the next matmuls save;
- **matmul inputs**: a norm's output is saved once in the compute dtype, or, under autocast (a
  float32 stream into bf16 matmuls), cast and saved once per matmul reading it (q, k and v; gate
  and up);
- **attention** (the runtime's kernels, :data:`KERNEL_KINDS`): the fused kernels (SDPA's CPU
  flash kernel, the varlen kernels on CUDA) save the post-rotary q, k, v, the output and the
  float32 logsumexp per head; the varlen kernels keep a slice's concatenated ``[earlier, own]``
  keys (per context token: ``context``); the eager formula (soft-capped scores, sinks) keeps
  the queries, K/V repeated to the query heads, a copy of the output and, per (query, key) entry
  of each slice's ``s x (C + s)`` block, the float32 probabilities, their compute-dtype copy, the
  soft-capped scores and a one-byte mask (``pair``); MLA's q / kv low-rank paths and norms, its
  values a view of ``kv_b_proj``'s output (which stays alive whole); query/key norms
  (:data:`QK_NORMS`);
- **the MLP**: a gated MLP saves four tensors of its width (gate, act(gate), up, their product:
  :data:`PLAIN_MLP` two); an MoE layer per routed row (``num_experts_per_tok`` per token) the
  gathered input, the expert's intermediates and output, its routing weight and indices, plus
  the router's scores and the shared experts (HF's expert loops run outside autocast: the
  stream's dtype); a model with dense and MoE layers counts the larger kind for every layer;
- the residual adds save nothing.

Per stage: the rotary tables (float32 in some models whatever the dtype: counted so), per rotary
kind; on the last stage the final norm, the LM head's input and the loss's float32 log-probabilities
(and the soft-capped logits); a stage's output held until its backward (every stage but the last),
and its input when the first norm saves a float32 copy rather than the input itself.

Checked against the runtime on CPU in float32, bfloat16 and under bf16 autocast: a decoder layer
within 0.85-1.05 of its count for 58 of the 73 model types ``docs/supported_models.md`` lists as
supported (``tests/runtime/test_analytic_memory.py`` keeps the families of the test matrix within
those bounds). The tables name what differs from Llama's layer; a model type outside them is counted
as Llama. The other 15 keep more than counted (their own activations, routers or attention): afmoe,
apertus, apertus1p5_text, aria_text, axk1, bitnet, ernie4_5_moe, flint, hunyuan_v1_dense (under
autocast), hunyuan_v1_moe, jetmoe, kolibri1, laguna, mimo_v2_flash, minimax_m3_vl_text; profile
them (``concertina_cost_model="profiled"``).

Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .mixers import indexed_pair_bytes

__all__ = ["KERNEL_KINDS", "SavedBytes", "saved_bytes"]

#: how a model type's norms save (besides their output), ``w`` the width, ``d`` the bytes of the
#: input's dtype: ``"rms"`` Llama's (``weight * normed.to(input dtype)``): float32 input, rsqrt,
#: normed in the input dtype, ``4w + 4 + d w``; ``"rms_fp32"`` Gemma's and OLMo2's (the weight
#: applied in float32): ``8w + 4``; ``"rms_plain"`` without a weight: ``4w + 4``; ``"layernorm"``
#: (``nn.LayerNorm``: input, mean, rstd): ``d w + 8``; ``"layernorm_fp32"`` on a float32 copy
#: (OLMo's): ``4w + 8``; ``"cohere"`` (the centred input twice, rsqrt, float32 normed): ``12w + 4``
NORM_KINDS = {
    "gemma": "rms_fp32", "gemma2": "rms_fp32", "gemma3_text": "rms_fp32", "vaultgemma": "rms_fp32",
    "olmo2": "rms_fp32", "olmo3": "rms_fp32", "flex_olmo": "rms_fp32", "helium": "rms_fp32", "gpt_oss": "rms_fp32",
    "nanochat": "rms_plain",
    "stablelm": "layernorm", "starcoder2": "layernorm", "jais2": "layernorm", "nemotron": "layernorm",
    "phimoe": "layernorm", "olmo": "layernorm_fp32",
    "cohere": "cohere", "cohere2": "cohere", "cohere2_moe": "cohere",
}
#: (norms before the blocks, norms after them) where a layer is not Llama's (2, 0): Gemma2/3 and
#: GLM-4 norm the blocks' outputs too, OLMo2 and EXAONE 4 only them, Cohere runs attention and
#: MLP in parallel on one norm
NORM_PLACES = {"gemma2": (2, 2), "gemma3_text": (2, 2), "glm4": (2, 2), "hyperclovax": (2, 2),
               "olmo2": (0, 2), "olmo3": (0, 2), "flex_olmo": (0, 2), "exaone4": (0, 2), "exaone_moe": (0, 2),
               "cohere": (1, 0), "cohere2": (1, 0), "cohere2_moe": (1, 0)}
#: query/key norms: ``"head"`` (per head) or ``"full"`` (over all heads at once); and the config
#: flags that switch them on elsewhere
QK_NORMS = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "nanochat": "head", "exaone4": "head",
            "exaone_moe": "head", "hunyuan_v1_dense": "head", "hunyuan_v1_moe": "head", "hy_v3": "head",
            "mellum": "head", "olmo2": "full", "olmo3": "full", "flex_olmo": "full", "olmoe": "full",
            "minimax_m2": "full"}
QK_NORM_FLAGS = ("qk_layernorm", "use_qk_norm")
#: MLPs without a gate: up, activation, down (the activation's input and output)
PLAIN_MLP = frozenset({"arcee", "jais2", "nanochat", "nemotron", "starcoder2"})
#: one projection for q, k and v (v a view of its output, which stays alive whole), and one for
#: the MLP's gate and up (PHI3_FUSED: both)
FUSED_QKV = frozenset({"phi3", "phimoe"})
PHI3_FUSED = frozenset({"phi3"})
#: tensors of the expert width each routed row keeps, where not a gated MLP's four (gpt-oss's
#: clamped SwiGLU)
EXPERT_INTERMEDIATES = {"gpt_oss": 7}
#: routers computed in float32 on a float32 copy of their input
ROUTER_FP32 = frozenset({"axk1", "deepseek_v2", "deepseek_v3", "dots1", "ernie4_5_moe", "exaone_moe", "flint",
                         "glm4_moe", "glm4_moe_lite", "hy_v3", "kolibri1", "longcat_flash", "mimo_v2_flash",
                         "sarvam_mla", "sarvam_moe", "solar_open"})
#: model types whose attention passes ``config.attn_logit_softcapping`` to the kernel (Gemma3 has
#: the attribute and does not), and those with attention sinks: both run the eager formula
SOFTCAPPED_ATTENTION = frozenset({"gemma2", "vaultgemma"})
SINKS = frozenset({"gpt_oss"})
#: rotary tables beyond one cos and one sin of the rotary width (repeated or interleaved copies)
ROTARY_COPIES = {"ernie4_5": 4, "ernie4_5_moe": 4, "glm": 4, "glm4": 4, "helium": 4, "ministral3": 1.125}
#: one rotary per layer type (:class:`concertina_hf.runtime.families.ModelFamily`'s
#: ``rotary_layer_types``)
ROTARY_PER_LAYER_TYPE = frozenset({"gemma3_text", "olmo3", "lfm3"})
#: the final norm applied to the embeddings too (``runtime.families.NORM_BEFORE_LAYERS``)
NORM_BEFORE_LAYERS = frozenset({"nanochat"})

#: the runtime's attention kernels (``concertina_hf.runtime.attention.kernels.KERNELS``) as the
#: count sees them: ``"fused"`` saves q, k, v, the output and the logsumexp; ``"concat"`` too,
#: with a slice's ``[earlier slices, own]`` keys concatenated (per context token); ``"eager"`` the
#: score blocks besides
KERNEL_KINDS = {"flash-attn": "concat", "torch-varlen": "concat", "sdpa-per-segment": "concat",
                "sdpa-cpu-flash": "fused", "eager-per-segment": "eager"}


@dataclass(frozen=True)
class SavedBytes:
    """Bytes per token the runtime keeps until backward (module docstring): ``layer`` a saved
    decoder layer, ``head`` the last stage's final norm, LM head and loss, ``stage`` once per
    stage (rotary tables), ``output`` a stage's output, ``layer_input`` a recomputed layer's
    input, ``kv`` the K/V a non-final slice keeps per layer, ``context`` per saved layer and
    context token of a slice with context, ``pair`` per saved layer and entry of a slice's
    ``s x (C + s)`` score block (the eager kernel). And what a backward holds beyond them for a
    moment, per token: ``layer_bwd`` a decoder layer's (the incoming gradient and the gradients of
    the MLP's intermediates, or of q, k, v and the output), ``pair_bwd`` per score entry of a
    slice (the eager kernel's probabilities' and scores' gradients), ``head_bwd`` the head's (the
    log-probabilities' and logits' gradients); ``logits_grad`` the logits' gradient still held
    while the LM head computes its weight gradient."""

    layer: float
    head: float
    stage: float
    output: float
    layer_input: float
    kv: float
    context: float
    pair: float
    layer_bwd: float = 0.0
    pair_bwd: float = 0.0
    head_bwd: float = 0.0
    logits_grad: float = 0.0


def default_kernel(get: Callable[[str], Any]) -> str:
    """The kernel :func:`saved_bytes` assumes when none is named: the eager formula for soft-capped
    scores and sinks (every kernel the runtime has takes them so on CPU, and sinks on CUDA too), else
    a varlen kernel (the CUDA one, which keeps more than the CPU kernel for slices with context)."""
    kind = str(get("model_type") or "")
    if kind in SINKS or (kind in SOFTCAPPED_ATTENTION and get("attn_logit_softcapping")):
        return "eager-per-segment"
    return "flash-attn"


def saved_bytes(get: Callable[[str], Any], dtype_bytes: int, compute_dtype_bytes: int | None = None,
                attention_kernel: str | None = None) -> SavedBytes:
    """Bytes per token the runtime saves (module docstring). ``get`` reads a config field (``None``
    when absent); ``dtype_bytes``: the parameters' dtype, which the residual stream keeps;
    ``compute_dtype_bytes``: the matmuls' (autocast's dtype; default ``dtype_bytes``);
    ``attention_kernel``: a key of :data:`KERNEL_KINDS` (default :func:`default_kernel`)."""
    kind = str(get("model_type") or "")
    r = int(dtype_bytes)
    a = int(compute_dtype_bytes or dtype_bytes)
    h = int(get("hidden_size"))
    n_heads = int(get("num_attention_heads"))
    n_kv = int(get("num_key_value_heads") or n_heads)
    head_dim = int(get("head_dim") or h // n_heads)
    norm = NORM_KINDS.get(kind, "rms")
    softcap = get("attn_logit_softcapping") if kind in SOFTCAPPED_ATTENTION else None
    kernel = KERNEL_KINDS.get(attention_kernel or default_kernel(get), "concat")

    def norm_bytes(w: int, rows: int = 1, d: int = r) -> float:
        """One norm of width ``w`` (``rows`` statistics per token) over elements of ``d`` bytes."""
        if norm == "rms":
            return 4 * w + 4 * rows + d * w
        if norm in ("rms_fp32", "cohere"):
            return (12 if norm == "cohere" else 8) * w + 4 * rows
        if norm == "rms_plain":
            return 4 * w + 4 * rows
        return (4 if norm == "layernorm_fp32" else d) * w + 8 * rows

    def fed(w: int, readers: int) -> float:
        """A tensor of width ``w`` read by ``readers`` matmuls: saved once in the compute dtype, or
        once per matmul when autocast casts a stream of another dtype for each."""
        return a * w * (readers if a != r else 1)

    pre, post = NORM_PLACES.get(kind, (2, 0))
    if kind == "stablelm" and get("use_parallel_residual"):
        pre = 1
    if get("use_sandwich_norm"):  # LFM3: a norm after each block too
        post = 2
    # ------------------------------------------------------------------ attention
    attn = 0.0
    if get("kv_lora_rank"):  # MLA
        rope = int(get("qk_rope_head_dim") or 0)
        nope = int(get("qk_nope_head_dim") or 0)
        dv = int(get("v_head_dim") or rope + nope)
        q_lora, kv_lora = int(get("q_lora_rank") or 0), int(get("kv_lora_rank"))
        q_dim = k_dim = n_heads * (rope + nope)
        v_dim = n_heads * dv
        if q_lora:  # q_a_proj's output through its norm into q_b_proj
            attn += norm_bytes(q_lora, 1, a) + a * q_lora
        # kv_a_proj's output (compressed K/V and the rotary key) is its norm's input; the values
        # are a view of kv_b_proj's output (no-rotary keys and values)
        attn += max(0, a * (kv_lora + rope) - 4 * kv_lora) + norm_bytes(kv_lora, 1, a) + a * kv_lora
        v_kept = n_heads * (nope + dv)
        readers = 2  # the q (or q_a) and kv_a projections
        rot_dim = rope
    else:
        dv = head_dim
        q_dim, k_dim = n_heads * head_dim, n_kv * head_dim
        v_dim = k_dim
        v_kept = v_dim + (q_dim + k_dim if kind in FUSED_QKV else 0)
        readers = 1 if kind in PHI3_FUSED else 3
        rope_params = get("rope_parameters")
        factor = get("partial_rotary_factor") or (
            rope_params.get("partial_rotary_factor") if isinstance(rope_params, dict) else None)
        rot_dim = int(head_dim * float(factor or 1.0))
    qk = QK_NORMS.get(kind) or ("head" if any(get(f) for f in QK_NORM_FLAGS) else None)
    if qk:  # over the projections' outputs; per head: statistics per head
        rows_q, rows_k = (n_heads, n_kv) if qk == "head" else (1, 1)
        attn += norm_bytes(q_dim, rows_q, a) + norm_bytes(k_dim, rows_k, a)
    rep = n_heads / n_kv
    context = pair = 0.0
    if kernel == "eager":
        # queries, K/V repeated to the query heads, the output's copy; per score entry the
        # float32 probabilities, their compute-dtype copy, the soft-capped scores, the mask
        keys = a * (k_dim + v_dim) * rep
        attn += a * q_dim + keys + a * n_heads * dv + (4 * n_heads if kind in SINKS else 0)
        pair = n_heads * (4 + (a if a != 4 else 0) + (a if softcap else 0)) + 1
        context = keys
    else:  # q, k, v (its storage), the output, the float32 logsumexp per head
        attn += a * (q_dim + k_dim + v_kept + n_heads * dv) + 4 * n_heads
        if kernel == "concat":
            context = a * (k_dim + v_dim)
    # ------------------------------------------------------------------ MLP
    dense_width = get("intermediate_size")
    experts = int(get("num_local_experts") or get("num_experts") or get("n_routed_experts") or 0)
    top_k = int(get("num_experts_per_tok") or 0)
    plain = kind in PLAIN_MLP

    def mlp(w: int) -> float:
        return a * (2 if plain else 4) * w

    kinds = []  # (bytes, matmuls reading the norm's output, the width a token's MLP gradients take)
    if experts and top_k:
        width = int(get("moe_intermediate_size") or dense_width or 0)
        gated_shared = int(get("shared_expert_intermediate_size") or 0)  # Qwen2-MoE's, behind a sigmoid
        shared = gated_shared or width * int(get("n_shared_experts") or get("num_shared_experts") or 0)
        e = max(a, r)  # HF's expert loops run outside autocast
        row = e * (2 * h + EXPERT_INTERMEDIATES.get(kind, 4) * width) + 4 + 4 * 8  # weight, indices
        moe = top_k * row + 8 * experts + 16 * top_k + 16  # and the router's scores, top-k, sums
        if kind in ROUTER_FP32 and r != 4:
            moe += 4 * h
        if shared:
            moe += mlp(shared)
        if gated_shared:
            moe += a * h + 4
        kinds.append((moe, 1 + (2 if shared else 0) + (1 if gated_shared else 0),
                      e * top_k * width + a * shared))
        if dense_width and (int(get("first_k_dense_replace") or 0) or get("mlp_only_layers")):
            kinds.append((mlp(int(dense_width)), 2, a * int(dense_width)))
    else:
        width = int(dense_width or get("moe_intermediate_size") or 0)
        kinds.append((mlp(width), 1 if plain or kind in PHI3_FUSED else 2, a * width))
    # ------------------------------------------------------------------ a layer
    if pre == 2:
        layer = max(2 * norm_bytes(h) + fed(h, readers) + attn + fed(h, n) + m for m, n, _ in kinds)
    elif pre == 1:  # one norm feeds attention and MLP
        layer = max(norm_bytes(h) + fed(h, readers + n) + attn + m for m, n, _ in kinds)
    else:  # the projections read the stream itself
        layer = max(fed(h, readers) + attn + fed(h, n) + m for m, n, _ in kinds)
    layer += post * norm_bytes(h)
    # a layer's backward: the incoming gradient, and the gradients of two intermediates of the
    # MLP's width (gate's and up's) or of q, k, v and the output
    layer_bwd = r * h + max(max(2 * g for _, _, g in kinds), a * (2 * q_dim + k_dim + v_dim))
    # ------------------------------------------------------------------ stage and head
    types = get("layer_types")
    rotaries = len(set(types)) if kind in ROTARY_PER_LAYER_TYPE and isinstance(types, (list, tuple)) else 1
    stage = rotaries * 2 * 4 * rot_dim * ROTARY_COPIES.get(kind, 1)
    if kind in NORM_BEFORE_LAYERS:  # (the first stage's; counted on every stage)
        stage += norm_bytes(h)
    if r != 4 and pre and norm != "layernorm":
        # a stage's input, held until its backward, when the first norm saves a float32 copy of
        # it instead (the first stage's embedding output is not held; counted on every stage)
        stage += r * h
    vocab = int(get("vocab_size"))
    capped = a * vocab if get("final_logit_softcapping") else 0
    head = norm_bytes(h) + fed(h, 1) + 4 * vocab + capped
    # the head's backward: the log-probabilities' gradient and the float32 logits' (both float32),
    # the compute-dtype logits' when another, the soft-capping's; then the LM head's input gradient
    head_bwd = 8 * vocab + (a * vocab if a != 4 else 0) + capped + 2 * r * h
    return SavedBytes(layer=float(layer), head=float(head), stage=float(stage), output=float(r * h),
                      layer_input=float(r * h), kv=float(a * (k_dim + v_kept)), context=float(context),
                      pair=float(pair) + indexed_pair_bytes(get, a), layer_bwd=float(layer_bwd),
                      pair_bwd=float(n_heads * (8 + (a if a != 4 else 0))) if pair else 0.0,
                      head_bwd=float(head_bwd), logits_grad=float(a * vocab))
