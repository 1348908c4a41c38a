"""Config fields of well-known decoder models, for planning without a checkpoint.

Each preset is the subset of an HF ``LlamaConfig`` that :meth:`~.cost.CostModel.from_hf_config`
reads: the Llama family sizes of the LLaMA paper, and two tiny models for tests and CPU runs
using the bundled 8192-token tokenizer's vocabulary; ``hybrid-7b``: LLaMA-7B's sizes with three
Gated DeltaNet (linear attention) layers to every attention layer, Qwen3-Next's mixer sizes (16 key
heads, 32 value heads of 128, convolution width 4), for the per-layer-kind cost model
(:mod:`.mixers`); ``per-layer-7b``: a per-layer config (``per_layer_config``) in Gemma 4's pattern, five
sliding layers of head size 256, 2 K/V heads and a window of 1024 keys to one full layer of head size
512 and one K/V head, at about LLaMA-7B's width, for the per-layer shapes and windows of the cost model
(:attr:`~.cost.CostModel.layer_scales`, :attr:`~.cost.CostModel.windowed_layers`). ``concertina plan --model-config NAME`` accepts the names.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_PRESETS"]

_GEMMA4_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 5

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-7b": dict(model_type="llama", hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                     num_hidden_layers=32, intermediate_size=11008, vocab_size=32000),
    "llama-13b": dict(model_type="llama", hidden_size=5120, num_attention_heads=40, num_key_value_heads=40,
                      num_hidden_layers=40, intermediate_size=13824, vocab_size=32000),
    "llama-30b": dict(model_type="llama", hidden_size=6656, num_attention_heads=52, num_key_value_heads=52,
                      num_hidden_layers=60, intermediate_size=17920, vocab_size=32000),
    "hybrid-7b": dict(model_type="qwen3_next", hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                      num_hidden_layers=32, intermediate_size=11008, vocab_size=32000,
                      layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8, linear_num_key_heads=16,
                      linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4),
    "per-layer-7b": dict(model_type="gemma4_text", hidden_size=2560, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=256, num_hidden_layers=30, intermediate_size=10240, vocab_size=32000,
                         layer_types=_GEMMA4_TYPES, sliding_window=1024,
                         per_layer_config={i: dict(head_dim=512, num_key_value_heads=1)
                                           for i, t in enumerate(_GEMMA4_TYPES) if t == "full_attention"}),
    "tiny-llama": dict(model_type="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=8, intermediate_size=352, vocab_size=8192),
    "small-llama": dict(model_type="llama", hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                        num_hidden_layers=16, intermediate_size=1408, vocab_size=8192),
}
