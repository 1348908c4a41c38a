"""Model families: what the runtime refuses at construction, and what it reproduces outside the layers.

- **Refusals** (:func:`concertina_hf.runtime.families.inspect_model`, run first by
  ``ConcertinaTrainer``): other layouts (GPT-2, BERT, T5), composite configs, mixers that are not
  attention (by ``config.layer_types`` and by module structure), the router auxiliary loss,
  decoder layers fed by the model's forward; each message names the model type and the feature.
  ``CostModel.from_hf_config`` names the missing keys instead of a ``KeyError``.
- **Outside the layers** (Granite's multipliers, Cohere's ``logit_scale``, Gemma2's final
  soft-capping, Gemma3's per-layer-type rotary, nanochat's norm before the layers): the runtime's
  stage functions (``PipelineExecutor`` on one stage, and 2 stages run one after the other) give
  HF's loss and gradients per sequence at realistic weight scales; with the feature switched off
  in the stage, the same check fails (the test can fail).
- **pp = 2**: ``tests/launch/test_model_families_launch.py`` runs on 2 ranks ``ConcertinaTrainer`` against ``Trainer`` for StableLM (a layer that drops
  ``**kwargs``: context delivery), Granite (multipliers) and Gemma2 (attention and final
  soft-capping), 3 steps, float32: loss within 1e-5 and every parameter within 1e-3 (relative).

The numerical checks are those of ``scripts/model_support.py`` (which writes
``docs/supported_models.md`` for every model type).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts"))

import pytest  # noqa: E402
import torch  # noqa: E402

import model_support  # noqa: E402
from concertina_hf.runtime.families import UnsupportedModelError, check_config, inspect_model  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def _build(model_type: str, **overrides):
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:  # newer than the installed transformers (beam, dory: not in 5.17)
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_support.tiny_config(model_type, **overrides))


# ---------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("model_type, expected", [
    ("gpt2", "it has no `model.embed_tokens` (model has: transformer, lm_head)"),
    ("gpt_neox", "it has no `model.embed_tokens`"),
    ("bert", "it has no `model.embed_tokens`"),
    ("falcon", "it has no `model.embed_tokens`"),
    ("phi", "it has no `model.norm` (model.model has: embed_tokens, layers, rotary_emb, embed_dropout, "
            "final_layernorm)"),
    ("persimmon", "it has no `model.norm` (model.model has: embed_tokens, layers, final_layernorm, rotary_emb)"),
    ("granite_swa", "model.model.rotary_embs (ModuleList) run(s) in the model's forward outside the decoder layers"),
    ("beam", "takes attention_scaling, which the model's forward computes"),
    ("dory", "n_recurrent_loops"),
])
def test_other_layouts_are_refused_naming_the_model_type(model_type, expected):
    model = _build(model_type)
    with pytest.raises(UnsupportedModelError) as err:
        inspect_model(model)
    msg = str(err.value)
    assert f"model type {model_type!r}" in msg and expected in msg and "model.model.embed_tokens / .layers" in msg, msg


def test_config_level_refusals():
    from transformers import Gemma3Config, LlamaConfig, MixtralConfig, T5Config

    other_mixer = LlamaConfig()  # layers of a kind no implemented mixer runs for this model type
    other_mixer.layer_types = ["linear_attention"] * other_mixer.num_hidden_layers
    cases = [
        (T5Config(), "model type 't5'", "encoder-decoder"),
        (Gemma3Config(), "model type 'gemma3'",
         "a composite config with text_config, vision_config (several models in one) is not supported; train its "
         "text model"),
        (other_mixer, "model type 'llama'", "config.layer_types has 'linear_attention' layers"),
        (MixtralConfig(output_router_logits=True), "model type 'mixtral'", "output_router_logits=True adds the router"),
    ]
    for cfg, name, expected in cases:
        with pytest.raises(UnsupportedModelError) as err:
            check_config(cfg)
        assert name in str(err.value) and expected in str(err.value), str(err.value)
    check_config(MixtralConfig(output_router_logits=False))  # HF computes no auxiliary loss then


def test_a_convolutional_mixer_inside_a_layer_is_refused():
    """Structure, not a model list: a token-mixing Conv1d in any decoder layer."""
    model = _build("llama")
    model.model.layers[2].mlp.conv = torch.nn.Conv1d(64, 64, 3, groups=64)
    with pytest.raises(UnsupportedModelError, match="decoder layer 2 mixes tokens with a convolution .mlp.conv."):
        inspect_model(model)
    del model.model.layers[2].mlp.conv
    model.model.layers[1].mamba = model.model.layers[1].self_attn
    del model.model.layers[1].self_attn
    with pytest.raises(UnsupportedModelError, match="decoder layer 1 .LlamaDecoderLayer. has no self_attn"):
        inspect_model(model)


def test_the_trainer_refuses_before_anything_else_runs(tmp_path):
    """GPT-2: the refusal comes from the constructor's first check, before process groups, the cost
    model (whose config keys GPT-2 does not have) or the self-check."""
    from transformers import GPT2Config, T5Config

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from concertina_hf.planning import CostModel

    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[])
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2' .GPT2LMHeadModel.: it has no"):
        ConcertinaTrainer(model=_build("gpt2"), args=args)
    mixtral = _build("mixtral", output_router_logits=True)
    with pytest.raises(UnsupportedModelError, match="model type 'mixtral' .* output_router_logits=True"):
        ConcertinaTrainer(model=mixtral, args=args)
    with pytest.raises(ValueError, match="config of model type 'gpt2' has no intermediate_size: the cost model"):
        CostModel.from_hf_config(GPT2Config())  # (its attribute map gives n_embd as hidden_size)
    with pytest.raises(ValueError, match="config of model type 't5' has no intermediate_size"):
        CostModel.from_hf_config(T5Config())


def test_cost_model_of_configs_named_otherwise():
    """MoE configs without intermediate_size (the active experts' width), attribute maps (e.g.
    n_routed_experts), and a config counting other layers than the model holds (refused first)."""
    from concertina_hf.planning import CostModel
    from concertina_hf.training.run_setup import check_model_family

    solar = model_support.tiny_config("solar_open")  # moe 48 x 2 routed per token + 1 shared expert of 48
    assert CostModel.from_hf_config(solar, dtype_bytes=4).layer_params == \
        CostModel.from_hf_config(dict(solar.to_dict(), intermediate_size=3 * 48), dtype_bytes=4).layer_params
    longcat = _build("longcat_flash")  # its tiny config: 4 and 2 (transformers 5.24); 56 and 28 (5.17)
    counted, held = longcat.config.num_hidden_layers, len(longcat.model.layers)
    assert counted == 2 * held
    with pytest.raises(UnsupportedModelError, match=f"model type 'longcat_flash': config.num_hidden_layers is {counted} "
                                                    f"but model.model.layers holds {held} decoder layers"):
        check_model_family(longcat)


# ---------------------------------------------------------------------------------- outside the layers
#: (model type, config overrides, what the stage must reproduce)
OUTSIDE = [
    ("granite", {}, "embedding_multiplier"),
    ("cohere", {}, "logit_scale"),
    ("gemma2", {}, "final_logit_softcapping"),
    ("gemma3_text", {"final_logit_softcapping": None}, "rotary_layer_types"),
    ("nanochat", {}, "norm_before_layers"),
]


@pytest.mark.parametrize("model_type, overrides, feature", OUTSIDE)
def test_work_outside_the_layers_equals_hf_per_sequence(model_type, overrides, feature):
    """The stage functions (pp=1 through PipelineExecutor, and 2 stages in turn) against HF on each
    sequence alone: loss 1e-5, every gradient 1e-4 (relative), at initializer_range 0.2."""
    family = inspect_model(_build(model_type, **overrides))
    assert getattr(family, feature) not in (None, False), family
    row = model_support.check_type(model_type, **overrides)
    assert row["verdict"] == "supported", row
    for loss, grad in (row["pp1"], row["pp2"]):
        assert loss < LOSS_TOL and grad < GRAD_TOL, row


def test_features_are_read_from_the_config():
    granite = inspect_model(_build("granite", embedding_multiplier=7.0, logits_scaling=5.0))
    assert (granite.embedding_multiplier, granite.logits_scaling, granite.logits_scaling_multiplies) == (7.0, 5.0, False)
    assert inspect_model(_build("cohere", logit_scale=0.125)).logit_scale == 0.125
    gemma3 = inspect_model(_build("gemma3_text"))
    assert gemma3.rotary_layer_types == ("sliding_attention", "full_attention") * 2
    assert inspect_model(_build("llama")) == type(gemma3)(model_type="llama")  # nothing outside the layers


@pytest.mark.parametrize("model_type, field", [("granite", "embedding_multiplier"), ("cohere", "logit_scale"),
                                               ("gemma2", "final_logit_softcapping"),
                                               ("gemma3_text", "rotary_layer_types")])
def test_without_the_feature_the_check_fails(monkeypatch, model_type, field):
    """The same check with the stage ignoring the feature: a mismatch (the equivalence test can fail)."""
    import dataclasses

    from concertina_hf.runtime import families, stage

    def ignoring(model, *args, **kwargs):
        return dataclasses.replace(families.inspect_model(model, *args, **kwargs), **{field: None})

    monkeypatch.setattr(stage, "inspect_model", ignoring)
    overrides = {"final_logit_softcapping": None} if model_type == "gemma3_text" else {}
    if field == "rotary_layer_types":  # one rotary for all layers: the default table (the sliding one's theta differs)
        monkeypatch.setattr(families.ModelFamily, "position_embeddings",
                            lambda self, rotary, h, pos, layers: [rotary(h, pos, "full_attention")] * len(layers))
    row = model_support.check_type(model_type, **overrides)
    assert row["verdict"] == "MISMATCH", row
