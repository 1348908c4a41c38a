"""Cases of the Mamba2 (SSD) tests (``runtime/ssm.py``), shared by the one-process test
(``tests/runtime/test_ssm.py``, pp=1) and the launch (``tests/launch/test_linear_attention_launch.py``, pp=2).

A tiny model per Mamba2 class (:data:`MODELS`: Granite-4.0 hybrid with MoE layers and rotary-free
attention, Bamba with its final norm ``final_layernorm`` and partial rotary, Falcon-H1 with a Mamba2
beside the attention in every layer and its mup multipliers, Nemotron-H with its own module names,
no rotary embedding, an MoE and an MLP block without token mixer, Jamba's Mamba (1) (its own scan,
its ``dt_proj.bias`` for ``dt_bias``); 4 decoder layers, Mamba2 at layers 0
and 2 and attention at 1 and 3 (Falcon-H1: both in each, :data:`MAMBA_LAYERS`), 4 heads of 32 over
2 groups, ``d_state`` 16, scan chunk 32, convolution width 4: each token reads 3 earlier inputs,
float32, ``initializer_range`` 0.2). The batch, the chunks (split at tokens 50, 52 and 101 of a
150-token sequence: none a multiple of 32, the 2-token slice shorter than the convolution's
window), the recompute settings, the reference (HF on the right-padded batch) and the bounds
(loss 1e-5, every gradient 1e-4) are those of :mod:`_linear_attention_cases`; the Mamba2 layers'
``A_log``, ``dt_bias`` (Jamba: ``dt_proj.bias``), ``D`` and convolution weights are reported by name.
"""

from __future__ import annotations

import functools

import torch

import _linear_attention_cases

from _linear_attention_cases import (CHUNKS, GRAD_TOL, LOSS_TOL, RECOMPUTE, SEQ_LENS, batch, gradient_errors,  # noqa: F401
                                     make_plan, model_support, num_items, padded_reference)

#: the Mamba2 layers' own parameters every case reports by name
MIXER_PARAMS = (".A_log", ".dt_bias", ".dt_proj.bias", ".D", ".conv1d.weight")
LAYER_TYPES = ["linear_attention", "full_attention"] * 2
SIZES = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_expand=2, mamba_d_conv=4,
             mamba_chunk_size=32)
#: Falcon-H1's mup multipliers (input, projection sections, outputs, keys, logits), none 1
FALCON_H1_MUP = dict(ssm_multipliers=[0.5, 2.0, 1.5, 0.7, 3.0], ssm_in_multiplier=0.8, lm_head_multiplier=0.5,
                     key_multiplier=1.3, attention_in_multiplier=0.9, ssm_out_multiplier=1.2,
                     attention_out_multiplier=0.7)
#: case name -> (model type, config overrides): one per Mamba2 class
MODELS = {
    "granitemoehybrid": ("granitemoehybrid", dict(layer_types=LAYER_TYPES)),
    "bamba": ("bamba", dict(attn_layer_indices=[1, 3])),  # its layer_types derive from these
    # every layer a Mamba2 beside attention, its mup multipliers far from 1, the gate without a norm
    "falcon_h1": ("falcon_h1", dict(mamba_d_ssm=128, **FALCON_H1_MUP)),
    # its own names for the same sizes; layers: Mamba2, MoE, attention, MLP (the default pattern "ME*-")
    "nemotron_h": ("nemotron_h", dict(mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2,
                                      conv_kernel=4, chunk_size=32)),
    # Mamba (1): Mamba at layers 0 and 2 (attention every second layer from 1), dt rank 8; dense MLPs (its
    # MoE's expert batches change with the other documents' routing: every gradient then differs by ~1e-7,
    # which the leak test's bit-identity would count)
    "jamba": ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_dt_rank=8)),
}
#: case name -> the decoder layers holding a Mamba2
MAMBA_LAYERS = {"granitemoehybrid": (0, 2), "bamba": (0, 2), "falcon_h1": (0, 1, 2, 3), "nemotron_h": (0,),
                "jamba": (0, 2)}


def build_model(name: str = "granitemoehybrid"):
    from transformers import AutoModelForCausalLM

    model_type, overrides = MODELS[name]
    cfg = model_support.tiny_config(model_type, **{**SIZES, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().train()
    from concertina_hf.runtime.ssm import mixer_class

    cls = mixer_class(model_type)
    assert [i for i, layer in enumerate(model.model.layers) if any(type(m) is cls for m in layer.modules())] == list(
        MAMBA_LAYERS[name])
    return model


#: :func:`_linear_attention_cases.check_case`, the Mamba layers' parameters reported by name
check_case = functools.partial(_linear_attention_cases.check_case, mixer_params=MIXER_PARAMS)
