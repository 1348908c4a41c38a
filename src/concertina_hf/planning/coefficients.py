"""Where a cost model's coefficients come from: the rates of one GPU and an HF decoder config.

:class:`DeviceSpec` holds one GPU's rates: sustained matmul FLOP/s, memory bandwidth for the
element-wise work, a fixed cost per layer call, the stage-to-stage link, the links of collectives
inside a node and between nodes, and its memory. Its presets (:data:`DEVICE_PRESETS`) are
datasheet figures at a stated efficiency, assumed, not measured.

:func:`analytic_coefficients` reads an HF decoder config and prices one decoder layer, the
embedding and the head in FLOPs and bytes at a device's rates: the coefficients of
:meth:`.cost.CostModel.from_hf_config` (the formulas they enter: :mod:`.cost`).
:func:`check_model_config` is the one check of a config's fields, the planner's, the trainer's and
``concertina plan``'s: a config without ``intermediate_size`` is read as MoE, the width a token
goes through being its routed experts' widths plus the shared experts'.

The other way to a model is measurement: a :class:`ProfileSample` records one decoder layer on one
chunk shape, and :func:`~.fit.fit_profile` fits the coefficients by least squares (samples from
:mod:`concertina_hf.runtime.profiler`).
Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .activations import saved_bytes
from .mixers import hybrid_mixer_terms, indexer_pair_flops, linear_layer_fields
from .types import PlanError

__all__ = ["DEVICE_PRESETS", "ChunkShape", "DeviceSpec", "ProfileSample", "analytic_coefficients",
           "check_model_config", "layer_fields"]

#: the GPUs :meth:`DeviceSpec.preset` (and ``concertina plan --device``) knows, and ``cpu``
DEVICE_PRESETS = ("a800", "h100", "h200", "b200", "cpu")

#: what :func:`analytic_coefficients` reads (GPT-2 / T5-style configs name them otherwise)
_REQUIRED_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "num_hidden_layers")

ChunkShape = tuple[tuple[int, int], ...]
"""A chunk as measured by the profiler: its slices as ``(context, length)`` pairs."""


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Rates of one GPU (a stage of several GPUs: :meth:`~.cost.CostModel.with_parallel`).

    ``flops``: sustained dense matmul FLOP/s (not peak); ``mem_bandwidth``: bytes/s for the
    memory-bound element-wise work; ``kernel_overhead_s``: fixed cost per layer call;
    ``p2p_bandwidth`` / ``p2p_latency_s``: stage-to-stage link (one GPU to the same sp rank of
    the next stage); ``memory_bytes``: capacity. Collectives inside a stage or over the sharded
    state (all-to-all, all-gather, reduce-scatter): ``intra_node_bandwidth`` /
    ``intra_node_latency_s`` between GPUs of one node (bytes/s each GPU sends), and
    ``inter_node_bandwidth`` / ``inter_node_latency_s`` per GPU between nodes of
    ``gpus_per_node`` GPUs.
    """

    flops: float = 150e12
    mem_bandwidth: float = 1.5e12
    kernel_overhead_s: float = 2e-4
    p2p_bandwidth: float = 20e9
    p2p_latency_s: float = 2e-5
    memory_bytes: int = 80 * 2**30
    intra_node_bandwidth: float = 150e9
    intra_node_latency_s: float = 1e-5
    inter_node_bandwidth: float = 20e9
    inter_node_latency_s: float = 2e-5
    gpus_per_node: int = 8

    @classmethod
    def a800(cls) -> "DeviceSpec":
        """An A800-80GB at a typical 50% of its 312 TFLOP/s bf16 peak; NVLink at 400 GB/s
        (about 150 GB/s each GPU sends in an all-to-all), one 200 Gb/s NIC per GPU between nodes
        of 8 (assumed, not measured). A stage of several GPUs:
        ``CostModel.from_hf_config(config, DeviceSpec.a800()).with_parallel(sp=...)``."""
        return cls(
            flops=156e12,
            mem_bandwidth=1.6e12,
            kernel_overhead_s=2e-4,
            p2p_bandwidth=25e9,
            p2p_latency_s=2e-5,
            memory_bytes=80 * 2**30,
            intra_node_bandwidth=150e9,
            intra_node_latency_s=1e-5,
            inter_node_bandwidth=25e9,
            inter_node_latency_s=2e-5,
            gpus_per_node=8,
        )

    # Hopper and Blackwell presets, on a800's conventions: ``flops`` 50% of the datasheet's dense
    # (no sparsity) bf16 Tensor Core peak; ``mem_bandwidth`` 80% of the datasheet's HBM bandwidth
    # (a800: 1.6 of 2.04 TB/s, 78%); ``intra_node_bandwidth`` what a GPU sends in an NVLink
    # all-to-all, 3/8 of the datasheet's total (bidirectional) NVLink bandwidth (a800: 150 of 400
    # GB/s); ``inter_node_bandwidth`` and ``p2p_bandwidth`` one NIC per GPU at its line rate (the
    # stage link may leave the node); latencies and the per-layer overhead as a800's. Assumed, not
    # measured: fit a profile (``concertina_cost_model="profiled"``) for real use.
    @classmethod
    def h100(cls) -> "DeviceSpec":
        """An H100 SXM5 80GB. Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 Tensor
        Core 1,979 TFLOP/s with sparsity, so 989 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900
        GB/s) and NVIDIA DGX H100 datasheet (eight ConnectX-7 400 Gb/s InfiniBand/Ethernet ports,
        one per GPU, 8 GPUs a node). Here: 495 TFLOP/s (50%), 2.68 TB/s (80%), 80 GiB (as a800's
        80 GB), all-to-all 337.5 GB/s (3/8 of 900), 50 GB/s (400 Gb/s) between nodes."""
        return cls(flops=494.5e12, mem_bandwidth=2.68e12, kernel_overhead_s=2e-4, p2p_bandwidth=50e9,
                   p2p_latency_s=2e-5, memory_bytes=80 * 2**30, intra_node_bandwidth=337.5e9,
                   intra_node_latency_s=1e-5, inter_node_bandwidth=50e9, inter_node_latency_s=2e-5, gpus_per_node=8)

    @classmethod
    def h200(cls) -> "DeviceSpec":
        """An H200 SXM 141GB. Sources: NVIDIA H200 Tensor Core GPU datasheet (SXM: BF16 Tensor Core
        1,979 TFLOP/s with sparsity, so 989 dense, as H100; 141 GB HBM3e at 4.8 TB/s; NVLink 900
        GB/s) and NVIDIA DGX H200 datasheet (eight ConnectX-7 400 Gb/s ports, one per GPU, 8 GPUs
        a node). Here: 495 TFLOP/s (50%), 3.84 TB/s (80%), 141e9 bytes (the datasheet's decimal
        GB, 131 GiB: a budget on the safe side; ``--memory-gb`` sets another), all-to-all 337.5
        GB/s (3/8 of 900), 50 GB/s (400 Gb/s) between nodes."""
        return cls(flops=494.5e12, mem_bandwidth=3.84e12, kernel_overhead_s=2e-4, p2p_bandwidth=50e9,
                   p2p_latency_s=2e-5, memory_bytes=141 * 10**9, intra_node_bandwidth=337.5e9,
                   intra_node_latency_s=1e-5, inter_node_bandwidth=50e9, inter_node_latency_s=2e-5, gpus_per_node=8)

    @classmethod
    def b200(cls) -> "DeviceSpec":
        """A B200 (HGX/DGX B200, 8 GPUs a node). Sources: NVIDIA HGX B200 datasheet (8 GPUs: FP16/BF16
        Tensor Core 36 PFLOP/s with sparsity, so 2.25 PFLOP/s dense per GPU; 1.4 TB of HBM3e, 180 GB
        a GPU, and 64 TB/s, 8 TB/s a GPU; fifth-generation NVLink at 1.8 TB/s per GPU) and NVIDIA
        DGX B200 datasheet (1,440 GB of GPU memory; eight ConnectX-7 400 Gb/s ports for the compute
        fabric, one per GPU). Here: 1,125 TFLOP/s (50%), 6.4 TB/s (80%), 180e9 bytes (decimal GB,
        168 GiB), all-to-all 675 GB/s (3/8 of 1.8 TB/s), 50 GB/s (400 Gb/s) between nodes."""
        return cls(flops=1125e12, mem_bandwidth=6.4e12, kernel_overhead_s=2e-4, p2p_bandwidth=50e9,
                   p2p_latency_s=2e-5, memory_bytes=180 * 10**9, intra_node_bandwidth=675e9,
                   intra_node_latency_s=1e-5, inter_node_bandwidth=50e9, inter_node_latency_s=2e-5, gpus_per_node=8)

    @classmethod
    def preset(cls, name: str) -> "DeviceSpec":
        """The preset called ``name`` (one of :data:`DEVICE_PRESETS`)."""
        if name not in DEVICE_PRESETS:
            raise PlanError(f"unknown device preset {name!r}; choose one of {', '.join(DEVICE_PRESETS)}")
        return getattr(cls, name)()

    @classmethod
    def cpu(cls) -> "DeviceSpec":
        """One CPU thread, roughly (refit from measurements for real use)."""
        return cls(flops=3e10, mem_bandwidth=5e9, kernel_overhead_s=5e-5, p2p_bandwidth=2e9,
                   p2p_latency_s=5e-5, memory_bytes=8 * 2**30, intra_node_bandwidth=2e9,
                   intra_node_latency_s=5e-5, inter_node_bandwidth=1e9, inter_node_latency_s=1e-4)


@dataclass(frozen=True, slots=True)
class ProfileSample:
    """One measurement of a decoder layer on a chunk shape: ``slices`` as ``(context, length)``
    pairs, times in seconds per layer, saved activation bytes per layer."""

    slices: ChunkShape
    fwd_time_s: float
    bwd_time_s: float
    act_bytes: float = 0.0


# ---------------------------------------------------------------------------------- HF configs
def _config_fields(config: Any) -> tuple[Mapping[str, Any], Callable[[str], Any]]:
    """``config`` as a dict, and a reader of its fields (``None`` when absent): a dict's keys, a
    ``PretrainedConfig``'s attributes."""
    c = config if isinstance(config, Mapping) else config.to_dict()

    def get(key: str) -> Any:
        if isinstance(config, Mapping):
            return c.get(key)
        try:  # the config's attribute map (e.g. n_routed_experts for num_local_experts) applies
            return getattr(config, key, None)
        except Exception:  # an attribute a config refuses to give globally (per-layer values)
            return c.get(key)

    return c, get


def _chunked_fields(get: Callable[[str], Any]) -> dict[str, Any]:
    """``chunked_layers`` and ``attention_chunk`` of a config whose ``layer_types`` name
    ``chunked_attention`` layers (``attention_chunk_size`` tokens each); ``{}`` without any."""
    types = get("layer_types")
    chunk = get("attention_chunk_size")
    if not isinstance(types, (list, tuple)) or not chunk or "chunked_attention" not in types:
        return {}
    return dict(chunked_layers=tuple(i for i, t in enumerate(types) if str(t) == "chunked_attention"),
                attention_chunk=int(chunk))


def _active_moe_width(get: Any) -> int | None:
    """The MLP width a token goes through in a config without ``intermediate_size`` (MoE only):
    its routed experts' widths plus the shared experts'."""
    moe = get("moe_intermediate_size")
    if not moe:
        return None
    shared = get("shared_expert_intermediate_size") or moe * int(get("n_shared_experts") or 0)
    return int(moe) * max(1, int(get("num_experts_per_tok") or 1)) + int(shared)


def _mlp_width(get: Callable[[str], Any]) -> Any:
    return get("intermediate_size") or _active_moe_width(get)


def _check_fields(c: Mapping[str, Any], get: Callable[[str], Any]) -> None:
    inter = _mlp_width(get)
    missing = [k for k in _REQUIRED_CONFIG_KEYS if get(k) is None and not (k == "intermediate_size" and inter)]
    if missing:
        raise ValueError(
            f"the config of model type {c.get('model_type', '?')!r} has no {', '.join(missing)}: the cost model "
            "(and ConcertinaTrainer) needs a decoder-only causal LM laid out like Llama (model.model.embed_tokens "
            "/ .layers / .norm and lm_head; see docs/supported_models.md)"
        )


def check_model_config(config: Any) -> None:
    """Raise ``ValueError`` naming the fields :func:`analytic_coefficients` needs and ``config``
    (a ``PretrainedConfig`` or a dict) lacks: ``hidden_size``, ``num_attention_heads``,
    ``vocab_size``, ``num_hidden_layers``, and ``intermediate_size`` unless the config is MoE
    (``moe_intermediate_size``: the active experts' width stands for it)."""
    c, get = _config_fields(config)
    layers = layer_fields(config)
    _check_fields(c, layers[0] if layers else get)


def analytic_coefficients(
    config: Any,
    device: DeviceSpec | None = None,
    dtype_bytes: int = 2,
    static_bytes_per_param: float | None = None,
    compute_dtype_bytes: int | None = None,
    attention_kernel: str | None = None,
) -> dict[str, Any]:
    """The fields of an analytic :class:`~.cost.CostModel` of an HF decoder config (a
    ``PretrainedConfig`` or a dict) on ``device`` (default :class:`DeviceSpec`'s defaults).

    Reads ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size``, ``vocab_size``, ``num_hidden_layers``, ``head_dim`` (optional),
    ``tie_word_embeddings`` (:func:`check_model_config`), and for the activation bytes what
    :func:`~.activations.saved_bytes` reads. ``static_bytes_per_param`` defaults to 16 (bf16
    weights and grads, fp32 master weights and two Adam moments) for 2-byte dtypes, 16 for fp32
    (weights, grads and two moments), plus the weight copies autocast keeps for a step when
    ``compute_dtype_bytes`` (the autocast dtype's bytes; default ``dtype_bytes``: no autocast) is
    smaller. ``attention_kernel``: the runtime's kernel on the device
    (``concertina_hf.runtime.attention.kernels.choose_kernel``; default
    :func:`~.activations.default_kernel`).
    """
    c, get = _config_fields(config)
    layers = layer_fields(config)  # per-layer configs: the model's attention layer is layer 0's
    if layers:
        get = layers[0]
    _check_fields(c, get)
    dev = device or DeviceSpec()
    h = int(get("hidden_size"))
    n_heads = int(get("num_attention_heads"))
    n_kv = int(get("num_key_value_heads") or n_heads)
    head_dim = int(get("head_dim") or h // n_heads)
    inter = int(_mlp_width(get))
    vocab = int(get("vocab_size"))
    n_layers = int(get("num_hidden_layers"))
    q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim
    b = dtype_bytes
    alpha_attn, alpha_tok, layer_params = _layer_terms(get, dev, b)
    # what autograd saves per token, each storage once in its dtype (activations.py)
    saved = saved_bytes(get, b, compute_dtype_bytes, attention_kernel)
    static = 16.0 if static_bytes_per_param is None else static_bytes_per_param
    if compute_dtype_bytes and compute_dtype_bytes < b:
        static += compute_dtype_bytes  # autocast's weight copies, kept for the step
    # Gemma 4's per-layer inputs (runtime/per_layer.py): the first stage's per-layer embedding
    # (vocab_size_per_layer_input x L x D) and projection (hidden x L x D), looked up and projected per
    # token; the messages between stages carry the later layers' L x D, half of them on average
    ple = int(get("hidden_size_per_layer_input") or 0) * n_layers
    ple_params = (int(get("vocab_size_per_layer_input") or vocab) + h) * ple + ple // max(1, n_layers)
    embed_params = vocab * h + ple_params
    head_params = (0 if get("tie_word_embeddings") else vocab * h) + h
    # weight gradients before accumulation (CostModel.transient_memory): a layer's largest matrix,
    # the LM head's and the embedding's dense one (tied or not: each backward makes its own)
    layer_grad = b * h * max(inter, q_dim)
    # Falcon-H1: a Mamba2 beside each layer's attention, priced into the attention layer (mixers.py)
    hybrid = hybrid_mixer_terms(get, dev.flops, dev.mem_bandwidth, b, compute_dtype_bytes, attention_kernel)
    alpha_tok += hybrid.pop("alpha_tok", 0.0)
    layer_params += int(hybrid.pop("layer_params", 0))
    hybrid_bytes = hybrid.pop("act_bytes_per_token", 0.0)
    return dict(
        num_layers=n_layers,
        alpha_attn=alpha_attn,
        alpha_tok=alpha_tok,
        beta=dev.kernel_overhead_s,
        bwd_factor=2.0,
        embed_time_per_token=b * (h + ple) / dev.mem_bandwidth + 2.0 * h * ple / dev.flops,
        head_time_per_token=2.0 * h * vocab / dev.flops + 3 * 4 * vocab / dev.mem_bandwidth,
        act_bytes_per_token=saved.layer + hybrid_bytes,
        ckpt_bytes_per_token=saved.layer_input,
        kv_bytes_per_token=saved.kv,
        context_bytes_per_token=saved.context,
        attn_bytes_per_pair=saved.pair,
        # the final norm, the LM head's input, the loss's float32 log-probabilities
        logits_bytes_per_token=saved.head,
        output_bytes_per_token=saved.output,
        hidden_bytes_per_token=b * (h + ple / 2),
        bwd_transient_bytes=layer_grad,
        bwd_transient_slope=2 * b * h,
        bwd_transient_bytes_per_token=saved.layer_bwd,
        bwd_transient_bytes_per_pair=saved.pair_bwd,
        head_bwd_transient_bytes_per_token=saved.head_bwd,
        head_bwd_transient_bytes=b * vocab * h,
        # the logits' gradient and the hidden-state gradients while the LM head's weight gradient exists
        head_bwd_transient_slope=saved.logits_grad + 2 * b * h,
        embed_bwd_transient_bytes=b * (vocab * h + ple_params),
        embed_bwd_bytes_per_token=b * h,  # the embedding output's gradient
        # a slice with context, backward: dK and dV of its keys at the query heads' width
        # (the kernel's, before the K/V heads' sum) and their sum
        bwd_context_bytes_per_token=b * 2 * (q_dim + kv_dim),
        stage_bytes_per_token=saved.stage,  # the rotary tables of the chunk
        ids_bytes_per_token=8.0,  # int64 token ids (embedding) and targets (loss)
        layer_params=layer_params,
        embed_params=embed_params,
        head_params=head_params,
        static_bytes_per_param=static,
        p2p_bandwidth=dev.p2p_bandwidth,
        p2p_latency_s=dev.p2p_latency_s,
        source="analytic",
        a2a_bytes_per_token=b * 2 * (q_dim + kv_dim),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        dtype_bytes=b,
        intra_node_bandwidth=dev.intra_node_bandwidth,
        intra_node_latency_s=dev.intra_node_latency_s,
        inter_node_bandwidth=dev.inter_node_bandwidth,
        inter_node_latency_s=dev.inter_node_latency_s,
        gpus_per_node=dev.gpus_per_node,
        # chunked-attention layers (Llama 4) named by config.layer_types: attention within the chunk (cost.py)
        **_chunked_fields(get),
        # linear-attention (Gated DeltaNet) layers named by config.layer_types, priced apart (mixers.py)
        **linear_layer_fields(get, dev.flops, dev.mem_bandwidth, dev.kernel_overhead_s, b, compute_dtype_bytes,
                              saved.layer, inter, attention_kernel),
        # per-layer configs: each attention layer's shape against layer 0's (CostModel.layer_scales)
        **_layer_scales(layers, dev, b, compute_dtype_bytes, attention_kernel),
        **_kv_share_spans(get),
        **hybrid,  # its per-slice, padding and split-state terms (CostModel.hybrid_*)
        **_window_fields(get),
    )


def _window_fields(get: Callable[[str], Any]) -> dict[str, Any]:
    """``windowed_layers`` and ``attention_window`` of a config whose ``layer_types`` name
    ``sliding_attention`` layers (``sliding_window`` keys each); ``{}`` without any."""
    types = get("layer_types")
    window = get("sliding_window")
    if not isinstance(types, (list, tuple)) or not window or "sliding_attention" not in types:
        return {}
    return dict(windowed_layers=tuple(i for i, t in enumerate(types) if str(t) == "sliding_attention"),
                attention_window=int(window))


def _kv_share_spans(get: Callable[[str], Any]) -> dict[str, Any]:
    """``{"kv_share_spans": ((a, L - 1),)}`` for a config whose last ``num_kv_shared_layers`` layers
    read the K/V of the last earlier layer of their type (Gemma 4: HF's ``kv_sharing_modes``), ``a``
    the first such source; ``{}`` without KV sharing."""
    n_shared = int(get("num_kv_shared_layers") or 0)
    n_layers = int(get("num_hidden_layers"))
    types = get("layer_types")
    first = n_layers - n_shared
    if not n_shared or first <= 0 or not isinstance(types, (list, tuple)):
        return {}
    sources = [max(i for i in range(first) if types[i] == t) for t in set(types[first:n_layers])
               if t in types[:first]]
    return {"kv_share_spans": ((min(sources), n_layers - 1),)} if sources else {}


def _layer_terms(get: Callable[[str], Any], dev: DeviceSpec, b: int) -> tuple[float, float, int]:
    """``(alpha_attn, alpha_tok, parameters)`` of one attention layer of the config ``get`` reads."""
    h = int(get("hidden_size"))
    n_heads = int(get("num_attention_heads"))
    n_kv = int(get("num_key_value_heads") or n_heads)
    head_dim = int(get("head_dim") or h // n_heads)
    inter = int(_mlp_width(get))
    q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim
    layer_params = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * inter + 2 * h
    # matmul FLOPs per token: 2 per weight; attention: QK^T and AV, 2 FLOPs each per
    # (query, key, head_dim) -> 4 * q_dim per pair; attn_pairs counts pairs twice.
    alpha_attn = (2.0 * q_dim + indexer_pair_flops(get)) / dev.flops  # an indexed layer's indexer too (mixers.py)
    elementwise_bytes = b * (10 * h + 4 * inter)  # norms, residuals, rotary, activation
    alpha_tok = 2.0 * layer_params / dev.flops + elementwise_bytes / dev.mem_bandwidth
    return alpha_attn, alpha_tok, layer_params


def layer_fields(config: Any) -> list[Callable[[str], Any]]:
    """Per decoder layer, a reader of its config fields, for a per-layer config (HF's
    ``config.per_layer_config``, in a dict the ``per_layer_config`` entry of HF's ``to_dict()``:
    ``{layer index: {field: value}}``, the layer's values over the global ones); empty otherwise."""
    c, get = _config_fields(config)
    raw = c.get("per_layer_config")
    if not isinstance(raw, Mapping) or not raw:
        return []
    overrides = {int(k): dict(v) for k, v in raw.items()}
    view = None if isinstance(config, Mapping) else getattr(config, "per_layer_config", None)

    def reader(i: int) -> Callable[[str], Any]:
        own = overrides.get(i, {})

        def read(key: str) -> Any:
            if key in own:
                return own[key]
            if view is not None:  # HF's view of layer i: the global value of a field no layer varies
                try:
                    return getattr(view[i], key, None)
                except Exception:
                    pass
            return get(key)
        return read

    return [reader(i) for i in range(int(get("num_hidden_layers")))]


def _layer_scales(layers: list[Callable[[str], Any]], dev: DeviceSpec, b: int, compute_dtype_bytes: int | None,
                  attention_kernel: str | None) -> dict[str, Any]:
    """``{"layer_scales": ...}``: each layer's ``(alpha_attn, alpha_tok, saved bytes, K/V bytes,
    parameters)`` over layer 0's; ``{}`` when every layer has layer 0's."""
    if not layers:
        return {}
    rows = []
    for get in layers:
        attn, tok, params = _layer_terms(get, dev, b)
        saved = saved_bytes(get, b, compute_dtype_bytes, attention_kernel)
        rows.append((attn, tok, saved.layer, saved.kv, float(params)))
    base = rows[0]
    scales = tuple(tuple(x / y if y else 1.0 for x, y in zip(row, base)) for row in rows)
    return {} if all(row == (1.0,) * 5 for row in scales) else {"layer_scales": scales}
