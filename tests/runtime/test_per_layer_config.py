"""Per-layer configs (``config.per_layer_config``): Gemma 4's text model against HF.

A tiny ``gemma4_text`` (:func:`model_support.tiny_config`: sliding layers of head size 16 and 2 K/V
heads, full layers of head size 32, per-layer inputs of 8 per layer) through the runtime's stage
functions, as ``scripts/model_support.py`` checks every type: split, hybrid and packed chunks with
one layer recomputed, ``PipelineExecutor`` on one stage and 2 stages run one after the other,
against HF on each sequence alone (loss 1e-5, gradients 1e-4 relative). The per-layer inputs are
computed on the first stage and travel with the hidden states (:mod:`concertina_hf.runtime.per_layer`);
K/V shared between layers (``num_kv_shared_layers``) on one stage, with the cost model's partition
keeping a layer and its source together; a layout splitting them, and bidirectional attention, are
refused by message.
"""

from __future__ import annotations

import copy
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts"))

import pytest  # noqa: E402
import torch  # noqa: E402

import model_support  # noqa: E402
from concertina_hf.planning import StageLayout  # noqa: E402
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper  # noqa: E402
from concertina_hf.runtime.families import UnsupportedModelError, inspect_model  # noqa: E402

LOSS_TOL, GRAD_TOL = model_support.LOSS_TOL, model_support.GRAD_TOL


def _model(**overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = model_support.tiny_config("gemma4_text", **overrides)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


def _check(model, layout: StageLayout) -> tuple[tuple[float, float], tuple[float, float]]:
    """(pp=1 through PipelineExecutor, ``layout``'s stages one after the other): (loss, gradient)
    relative differences with HF on each sequence alone."""
    ids, labels = model_support.batch()
    n = sum(int((lab[1:] != -100).sum()) for lab in labels)
    model.train()
    ref_loss, ref_grads = model_support.reference(model, ids, labels)
    num_layers = len(model.model.layers)
    one = PipelineWrapper(copy.deepcopy(model), StageLayout.even(num_layers, 1), 0)
    res = PipelineExecutor(one).run_step(model_support.make_plan(one.layout), ids, labels, num_items_in_batch=n)
    pp1 = model_support.compare(res.loss, ref_loss, list(one.named_parameters()), ref_grads)
    stages = [PipelineWrapper(copy.deepcopy(model), layout, s) for s in range(layout.num_stages)]
    loss = model_support.run_sequential(stages, model_support.make_plan(layout), ids, labels, float(n))
    params = [(k, p) for w in stages for k, p in w.named_parameters() if p is not stages[-1].tied_weight]
    stages[0].tied_weight.grad += stages[-1].tied_weight.grad  # as sync_tied_gradients does
    return pp1, model_support.compare(loss, ref_loss, params, ref_grads)


def test_tiny_config_has_layers_of_different_shapes():
    cfg = model_support.tiny_config("gemma4_text")
    assert [cfg.per_layer_config[i].head_dim for i in range(4)] == [16, 32, 16, 32]
    assert cfg.hidden_size_per_layer_input == 8
    family = inspect_model(_model())
    assert family.per_layer_input_size == 8 and family.kv_sources is None and family.shared_kv_states


def test_gemma4_text_equals_hf():
    """check_type (the table's row): pp=1 and pp=2, the self-check included."""
    row = model_support.check_type("gemma4_text")
    assert row["verdict"] == "supported", row
    for loss, grad in (row["pp1"], row["pp2"]):
        assert loss < LOSS_TOL and grad < GRAD_TOL, row


def test_per_layer_inputs_travel_between_stages():
    """Each stage's message: the hidden states and the per-layer inputs of the layers after it."""
    model = _model()
    layout = StageLayout(4, ((0, 1), (1, 3), (3, 4)))
    widths = [(w.in_width, w.out_width) for w in
              (PipelineWrapper(copy.deepcopy(model), layout, s) for s in range(3))]
    assert widths == [(64 + 4 * 8, 64 + 3 * 8), (64 + 3 * 8, 64 + 8), (64 + 8, 64)]
    pp1, pp3 = _check(model, layout)
    assert pp1[0] < LOSS_TOL and pp1[1] < GRAD_TOL, pp1
    assert pp3[0] < LOSS_TOL and pp3[1] < GRAD_TOL, pp3


def test_shared_kv_within_a_stage_equals_hf():
    """6 layers, the last 2 reading the K/V of layers 2 (sliding) and 3 (full), over split slices:
    pp=1, and 2 stages keeping layers 2-5 together; the full layers' values are their keys (attention_k_eq_v)."""
    model = _model(num_hidden_layers=6, num_kv_shared_layers=2, attention_k_eq_v=True,
                   layer_types=["sliding_attention", "full_attention"] * 3)
    assert model.model.layers[3].self_attn.v_proj is None and not hasattr(model.model.layers[5].self_attn, "k_proj")
    family = inspect_model(model)
    assert family.kv_sources == (None, None, None, None, 2, 3)
    from concertina_hf.planning import CostModel, partition_layers

    cost = CostModel.from_hf_config(model.config, dtype_bytes=4)  # the trainer's partition keeps 2-5 together
    assert cost.kv_share_spans == ((2, 5),)
    layout = partition_layers(cost, 2)
    assert layout.layer_ranges == ((0, 2), (2, 6)), layout
    pp1, pp2 = _check(model, layout)
    assert pp1[0] < LOSS_TOL and pp1[1] < GRAD_TOL, pp1
    assert pp2[0] < LOSS_TOL and pp2[1] < GRAD_TOL, pp2


def test_shared_kv_across_stages_is_refused():
    model = _model(num_hidden_layers=6, num_kv_shared_layers=2,
                   layer_types=["sliding_attention", "full_attention"] * 3)
    with pytest.raises(ValueError, match=r"decoder layer 4 reads the K/V of layer 2 \(KV sharing, "
                                         r"config.num_kv_shared_layers\), but the stage layout \[\(0, 3\), \(3, 6\)\] "
                                         r"puts them on two stages.*keeps layers 2-4 on one stage, or fewer stages "
                                         r"\(concertina_pipeline_size\)"):
        PipelineWrapper(model, StageLayout.even(6, 2), 1)


def test_bidirectional_attention_is_refused():
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention='all' makes every layer attend "
                                                    "both ways; the pipeline's attention is causal"):
        inspect_model(_model(use_bidirectional_attention="all"))


def test_cost_model_reads_each_layer():
    """The analytic cost model of the HF config: the full layers (head size 32) at twice the sliding
    layers' attention FLOPs per pair and K/V bytes; the same from the config's dict."""
    from concertina_hf.planning import CostModel

    cfg = model_support.tiny_config("gemma4_text")
    cost = CostModel.from_hf_config(cfg, dtype_bytes=4)
    assert [row[0] for row in cost.layer_scales] == [1.0, 2.0, 1.0, 2.0]
    assert [row[3] for row in cost.layer_scales] == [1.0, 2.0, 1.0, 2.0]
    assert CostModel.from_hf_config(cfg.to_dict(), dtype_bytes=4) == cost


@pytest.mark.parametrize("model_type, cls", [("gemma4", "Gemma4ForConditionalGeneration"),
                                             ("gemma4_unified", "Gemma4UnifiedForConditionalGeneration")])
def test_composite_gemma4_trains_its_language_model_as_its_forward(model_type, cls):
    """Gemma 4's composites on text (runtime/composite.py): the language model through the pipeline
    against the composite's own forward, which soft-caps the logits as the text type's does."""
    row = model_support.check_type(model_type, final_logit_softcapping=2.0)
    assert row["verdict"] == "supported" and row["class"] == cls, row
    for loss, grad in (row["pp1"], row["pp2"]):
        assert loss < LOSS_TOL and grad < GRAD_TOL, row


def test_the_profiler_refuses_per_layer_inputs():
    from concertina_hf.runtime.probe import build_probe

    model = _model()
    for target in (model, PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 2), 1)):
        with pytest.raises(ValueError, match="the profiler does not measure layers fed per-layer inputs or shared "
                                             "K/V .*set concertina_cost_model='analytic'"):
            build_probe(target)


def test_sequence_parallel_checks_each_layers_heads():
    """Ulysses' head rule on every layer of a per-layer config (the global K/V heads would pass)."""
    from transformers import Gemma4TextConfig

    from concertina_hf.runtime.per_layer import layer_heads
    from concertina_hf.runtime.ulysses import SequenceParallel

    cfg = Gemma4TextConfig(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=6, head_dim=8, layer_types=["sliding_attention", "full_attention"],
                           attention_k_eq_v=True, num_global_key_value_heads=3, global_head_dim=16)
    assert layer_heads(cfg) == [(6, 6), (6, 3)]
    sp = SequenceParallel.__new__(SequenceParallel)
    sp.size = 3
    assert sp.check_model(cfg) == 1
    sp.size = 2
    with pytest.raises(ValueError, match="concertina_sequence_parallel_size=2 and the model's num_key_value_heads=3"):
        sp.check_model(cfg)


def test_cost_model_counts_the_per_layer_inputs():
    """The first stage's per-layer embedding and projection in its parameters, and the messages
    between stages at the hidden size plus half the layers' per-layer inputs."""
    from concertina_hf.planning import CostModel

    cfg = model_support.tiny_config("gemma4_text")
    cost = CostModel.from_hf_config(cfg, dtype_bytes=4)
    plain = CostModel.from_hf_config(model_support.tiny_config("gemma4_text", hidden_size_per_layer_input=0),
                                     dtype_bytes=4)
    model = _model()
    ple = sum(p.numel() for n, p in model.model.named_parameters() if n.split(".")[0] in
              ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"))
    assert cost.embed_params - plain.embed_params == ple
    assert cost.hidden_bytes_per_token == 4 * (64 + 4 * 8 / 2)
