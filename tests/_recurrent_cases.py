"""Models of the short-convolution, lightning-attention and KDA tests (``runtime/short_conv.py``,
``runtime/lightning_attention.py``, ``runtime/kda.py``), shared by the one-process tests
(``tests/runtime/test_short_conv.py``, ``tests/runtime/test_lightning_kda.py``, pp=1) and the launch
(``tests/launch/test_linear_attention_launch.py``, pp=2); the batch, chunks, plans, reference and
bounds are :mod:`_linear_attention_cases`'s.

4 decoder layers, the recurrent layers at 0 and 2 (attention at 1 and 3), float32:

- LFM2, LFM2-MoE (its rotary embedding ``pos_emb``, MoE layers 2 and 3), LFM3 (a sliding and a
  global attention layer, convolutions without position embeddings); ``conv_L_cache`` 4: each token
  reads 3 earlier inputs, more than the batch's 2-token slice;
- MiniMax with blocks of 16 tokens (the split sequence's slices cross block edges away from HF's,
  which start at the sequence's first token), every token to all 4 experts (an expert's matmul then
  has the same rows whatever one document routes: with 2 of 4 the row count changes the other rows'
  rounding on CPU, a difference the no-leak test sees);
- Kimi Linear with 2 heads of 16 and a convolution of width 4.
"""

from __future__ import annotations

import _linear_attention_cases as cases
import torch

LAYERS = dict(layer_types=["linear_attention", "full_attention"] * 2)
CONV_LAYERS = dict(layer_types=["conv", "full_attention"] * 2)
#: case name -> (model type, config overrides, the recurrent layers' parameters reported by name: 3 per layer)
MODELS = {
    "lfm2": ("lfm2", dict(CONV_LAYERS, conv_L_cache=4),
             ("conv.conv.weight", "conv.in_proj.weight", "conv.out_proj.weight")),
    "lfm2_moe": ("lfm2_moe", dict(CONV_LAYERS, conv_L_cache=4, num_dense_layers=2),
                 ("conv.conv.weight", "conv.in_proj.weight", "conv.out_proj.weight")),
    "lfm3": ("lfm3", dict(conv_L_cache=4, layer_types=["conv", "sliding_attention", "conv", "full_attention"]),
             ("conv.conv.weight", "conv.in_proj.weight", "conv.out_proj.weight")),
    "minimax": ("minimax", dict(LAYERS, block_size=16, num_experts_per_tok=4),
                ("self_attn.qkv_proj.weight", "self_attn.output_gate.weight", "self_attn.out_proj.weight")),
    "kimi_linear": ("kimi_linear", dict(LAYERS, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4),
                    ("self_attn.conv1d.weight", "self_attn.forget_gate.A_log", "self_attn.forget_gate.dt_bias")),
}
SHORT_CONV = ("lfm2", "lfm2_moe", "lfm3")
LIGHTNING_KDA = ("minimax", "kimi_linear")


def build_model(name: str, **more):
    """The case's tiny model (eager attention, float32, train mode), ``more`` config overrides on top."""
    from transformers import AutoModelForCausalLM

    model_type, overrides, _ = MODELS[name]
    cfg = cases.model_support.tiny_config(model_type, **{**overrides, **more})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().train()


def mixer_params(name: str) -> tuple[str, ...]:
    return MODELS[name][2]
