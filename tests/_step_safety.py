"""What the step-safety tests share (one process: ``tests/training/test_step_safety.py``; pp = 2:
``tests/launch/test_step_safety_launch.py``): models at a realistic weight scale, a model made
wrong on purpose (its attention bypasses the chunk context), a NaN injected in a layer's output
at one optimizer step, and a snapshot of a model's weights.
"""

from __future__ import annotations

import copy

import torch

DROPOUT = 0.3
NAN_STEP = 2  # the optimizer step whose forward gets a NaN


def realistic(model):
    """Weights at a realistic scale (init 0.2): with HF's tiny init, scaling and soft-capping are
    nearly the identity and a wrong model could pass."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model


def realistic_model(kind="llama", **overrides):
    """A 4-layer tiny Llama or Qwen2 (``_runtime_cases.tiny_config``, ``overrides`` on it) at the
    realistic weight scale."""
    from _runtime_cases import tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(kind, num_layers=4)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return realistic(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))


def snapshot(model):
    """A copy of the model's state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class NaNAt:
    """A forward hook making a decoder layer's output NaN during optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step, self.active, self.fired = step, False, 0

    def __call__(self, module, args, out):
        if not self.active:
            return None
        self.fired += 1
        if isinstance(out, tuple):
            return (out[0] * float("nan"),) + tuple(out[1:])
        return out * float("nan")


def bypassing_layer(model):
    """Layer 1's attention reads a config of its own naming plain SDPA: like a recurrent or
    convolutional mixer, it never sees the chunk context."""
    cfg = copy.copy(model.config)
    cfg._attn_implementation = "sdpa"
    model.model.layers[1].self_attn.config = cfg
    return model
