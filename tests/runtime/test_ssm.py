"""Mamba2 (SSD) layers through the runtime, one process (pp=1), for each class
(:data:`_ssm_cases.MODELS`: Granite-4.0 hybrid, Bamba, Falcon-H1, Nemotron-H; Jamba's Mamba (1)).

- **No leak between documents**: in a packed chunk (and in the hybrid chunk, after a split
  sequence's tail) changing one document's tokens, its labels ignored, leaves the loss and every
  gradient bit-identical; with HF's own ``forward`` on the chunk (the mixer not routed through the
  chunk context) the same check fails.
- **HF's model**: split, hybrid and packed chunks (:mod:`_ssm_cases`) under recompute none /
  partial / full against HF on the right-padded batch, loss 1e-5 and every gradient 1e-4;
  ``A_log``, ``dt_bias``, ``D`` and the convolution weights of both Mamba2 layers among them; a
  forward-only step gives the same loss.
- **The self-check** at construction passes for it.
- **The analytic activation memory** of the Mamba2 layers (``planning/mixers.py``, HF's torch
  scan) within 0.85x-1.05x of the measured peak of saved tensors (whole, split and short sequences);
  each type's sizes read under its own config names; Jamba's Mamba (1) layers and Falcon-H1's hybrid
  layers likewise.
- **The profiler** (``build_probe`` on the HF model) measures their chunks.
- **Refusals**: the state space models not run (Mamba2's backbone layout, Zamba2's shared block,
  Mamba 1) are refused naming the feature; sequence
  parallelism and segment-level training are refused by the mixer, naming the feature, and sequence
  parallelism already when the executor is built and by the automatic layout.
"""

from __future__ import annotations

import copy

import pytest
import torch

import _ssm_cases as cases
from concertina_hf.planning import StageLayout
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper


@pytest.fixture(scope="module", params=list(cases.MODELS))
def model(request):
    m = cases.build_model(request.param)
    m.case_name = request.param
    return m


def _step(model, plan_chunks, seq_lens, ids, labels, recompute="none"):
    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 1), 0)
    plan = cases.make_plan(w.layout, recompute, plan_chunks, seq_lens)
    res = PipelineExecutor(w).run_step(plan, ids, labels, num_items_in_batch=cases.num_items(labels))
    return res, {k: p.grad for k, p in w.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("perturbed", [1, 3])
def test_a_document_does_not_reach_the_others(model, monkeypatch, perturbed):
    """Sequence 1 sits in the hybrid chunk after the split sequence's tail; sequence 3 between two
    documents of the packed chunk. Every other document's loss and gradient stay bit-identical."""
    ids, labels = cases.batch()
    labels[perturbed][:] = -100
    other = [t.clone() for t in ids]
    other[perturbed] = (other[perturbed] + 7) % cases.model_support.VOCAB
    a, ga = _step(model, cases.CHUNKS, cases.SEQ_LENS, ids, labels)
    b, gb = _step(model, cases.CHUNKS, cases.SEQ_LENS, other, labels)
    assert a.loss == b.loss
    assert ga.keys() == gb.keys()
    # routed experts sum over the tokens each receives, in an order that the other document's routing
    # changes: equal to rounding; every other gradient bit-identical
    experts = [k for k in ga if ".experts." in k]
    assert [k for k in ga if k not in experts and not torch.equal(ga[k], gb[k])] == []
    assert all(float((ga[k] - gb[k]).norm()) <= 1e-6 * float(ga[k].norm()) for k in experts), \
        {k: float((ga[k] - gb[k]).norm() / ga[k].norm()) for k in experts}
    # the check can fail: HF's forward over the whole chunk carries state from one document to the next
    from concertina_hf.runtime import stage

    monkeypatch.setattr(stage, "install_mixers", lambda model, family: None)
    packed = (((0, 0, 9), (1, 0, 7), (2, 0, 5), (3, 0, 3)),)
    ids, labels = ids[1:], [lab.clone() for lab in labels[1:]]
    labels[0][:] = -100
    other = [(ids[0] + 7) % cases.model_support.VOCAB] + ids[1:]
    a, ga = _step(model, packed, cases.SEQ_LENS[1:], ids, labels)
    b, gb = _step(model, packed, cases.SEQ_LENS[1:], other, labels)
    assert a.loss != b.loss and any(not torch.equal(ga[k], gb[k]) for k in ga)


def test_split_hybrid_and_packed_chunks_equal_hf(model):
    ids, labels = cases.batch()
    ref_loss, ref_grads = cases.padded_reference(model, ids, labels)
    rows, failures = [], []
    for recompute in cases.RECOMPUTE:
        w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 1), 0)
        plan = cases.make_plan(w.layout, recompute)
        res = PipelineExecutor(w).run_step(plan, ids, labels, num_items_in_batch=cases.num_items(labels))
        errors = cases.gradient_errors(w.named_parameters(), ref_grads)
        row, bad = cases.check_case(f"{model.case_name} pp=1 recompute {recompute}", res.loss, ref_loss, errors)
        assert row["mixer_params"] == 4 * len(cases.MAMBA_LAYERS[model.case_name]), row  # A_log, dt_bias, D, conv
        rows.append(row)
        failures += bad
    for row in rows:
        print(row)
    assert failures == []
    # forward only: the same loss (the carried states without gradient, freed at the last slice)
    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 1), 0)
    res = PipelineExecutor(w).run_step(cases.make_plan(w.layout, "none"), ids, labels,
                                       num_items_in_batch=cases.num_items(labels), train=False)
    assert abs(res.loss - ref_loss) / ref_loss < cases.LOSS_TOL


def test_the_self_check_passes(model):
    from concertina_hf.training.self_check import check_model, probe_layers

    m = copy.deepcopy(model)
    assert probe_layers(m) >= 2  # a Mamba2 layer and an attention layer
    check_model(m)


def test_what_is_not_built_is_refused(model):
    from transformers import Mamba2Config, MambaConfig, Zamba2Config

    from concertina_hf.runtime.ssm import mamba1_forward

    from concertina_hf.runtime.attention import ChunkAttentionContext, KVStore, SliceSpec
    from concertina_hf.runtime.families import UnsupportedModelError, check_config, inspect_model
    from concertina_hf.runtime.ssm import MIXERS, mamba2_forward

    for cfg, name, feature in ((Mamba2Config(), "mamba2", "its layout is model.backbone"),
                               (Zamba2Config(), "zamba2", "one shared transformer block"),
                               (MambaConfig(), "mamba", "its Mamba .1. mixer is not one")):
        with pytest.raises(UnsupportedModelError, match=f"model type '{name}'.*{feature}"):
            check_config(cfg)
    family = inspect_model(model)
    assert family.ssm and not family.linear_attention
    mixer = next(m for m in model.model.layers[0].modules() if type(m).__name__.endswith(("Mixer", "MambaLayer")))
    forward = mamba1_forward if MIXERS[model.config.model_type].version == 1 else mamba2_forward
    x = torch.zeros(1, 4, model.config.hidden_size)
    spec = [SliceSpec(0, 0, 4, 0, True)]
    with pytest.raises(ValueError, match="segment-level training .* not implemented for Mamba2"):
        forward(mixer, x, ChunkAttentionContext(spec, KVStore(gradient="previous"), "cpu", True))

    class Sharded(ChunkAttentionContext):
        pass

    with pytest.raises(ValueError, match="Mamba2 .SSD. layers run with sequence parallel size 1 only"):
        forward(mixer, x, Sharded(spec, KVStore(), "cpu", True))


@pytest.mark.parametrize("tokens, split", [(1024, False), (700, True), (300, False)])
def test_analytic_activation_memory_within_bounds(tokens, split):
    """The analytic cost model's activation memory (``planning/mixers.py``, HF's torch scan) against
    the step's measured peak of saved tensors, one stage, float32, Granite-4.0 hybrid with dense
    MLPs (2 Mamba2 and 2 attention layers; 8 heads of 64, ``d_state`` 128, scan chunk 256 as HF's
    default): measured within 0.85x-1.05x of the prediction, the bounds of
    ``tests/runtime/test_analytic_memory.py``; a whole sequence of four scan chunks, a split one
    (two calls each padded to their chunk, the earlier slice's state and convolution tail kept) and
    a short one (one padded chunk)."""
    from transformers import AutoModelForCausalLM

    from concertina_hf.planning import CostModel, DeviceSpec

    cfg = cases.model_support.tiny_config(
        "granitemoehybrid", hidden_size=256, intermediate_size=512, shared_intermediate_size=512, num_local_experts=0,
        mamba_n_heads=8, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4,
        mamba_chunk_size=256, layer_types=cases.LAYER_TYPES)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    layout = StageLayout.even(cfg.num_hidden_layers, 1)
    half = tokens // 2
    spec = (((0, 0, half),), ((0, half, tokens - half),)) if split else (((0, 0, tokens),),)
    plan = cases.make_plan(layout, "none", spec, (tokens,))
    ids = [torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))]
    res = PipelineExecutor(PipelineWrapper(model, layout, 0)).run_step(plan, ids)
    cost = CostModel.from_hf_config(model.config, DeviceSpec.cpu(), dtype_bytes=4, attention_kernel="sdpa-cpu-flash")
    assert cost.layer_kinds == ("linear", "attention") * 2 and cost.lin_scan_chunk == 256
    predicted = sum(cost.act_memory(layout, 0, c) for c in plan.chunks)
    ratio = res.peak_activation_bytes / predicted
    print(tokens, split, res.peak_activation_bytes, int(predicted), round(ratio, 3))
    assert 0.85 <= ratio <= 1.05, (res.peak_activation_bytes, predicted, ratio)


@pytest.mark.parametrize("name", ["granitemoehybrid", "bamba", "nemotron_h"])
def test_the_cost_model_reads_each_types_sizes(name):
    """``planning/mixers.py`` prices the Mamba2 layers of each type from its own config names: its
    Mamba2 layers are the linear kind, and a split slice keeps ``H x head_dim x d_state`` float32 and
    ``k - 1`` convolution inputs per Mamba2 layer (float32 here)."""
    from concertina_hf.planning import CostModel

    model_type, overrides = cases.MODELS[name]
    cfg = cases.model_support.tiny_config(model_type, **{**cases.SIZES, **overrides})
    cost = CostModel.from_hf_config(cfg, dtype_bytes=4)
    assert [i for i, k in enumerate(cost.layer_kinds) if k == "linear"] == list(cases.MAMBA_LAYERS[name])
    heads, head_dim, d_state, groups, width = 4, 32, 16, 2, 4  # _ssm_cases.SIZES, under each type's names
    conv_dim = heads * head_dim + 2 * groups * d_state
    assert cost.lin_state_bytes == 4 * heads * head_dim * d_state + 4 * (width - 1) * conv_dim
    assert cost.lin_scan_chunk == 0  # the CUDA kernel's: no padding kept per scan call


def test_sequence_parallelism_is_refused_before_a_step(model, tmp_path):
    """The executor's check at construction (``families.recurrent_sp_refusal``) and
    ``concertina_layout='auto'`` leave every ``sp > 1`` out, naming the feature and the setting."""
    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.planning.layouts import Layout
    from concertina_hf.runtime.families import recurrent_sp_refusal
    from concertina_hf.training import auto_layout

    why = recurrent_sp_refusal(model.config, 2)
    assert f"model type {model.config.model_type!r}: Mamba2 (SSD) layers run with sequence parallel size 1 only" in why
    assert "concertina_sequence_parallel_size=1" in why and recurrent_sp_refusal(model.config, 1) is None
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    refused = auto_layout._runtime_refusals(args, model, 4)
    assert set(refused) == {Layout(1, 2, 2), Layout(2, 2, 1), Layout(1, 4, 1)}
    assert all("Mamba2 (SSD) layers run with sequence parallel size 1 only" in r for r in refused.values())


@pytest.mark.parametrize("split", [False, True])
def test_analytic_activation_memory_of_mamba1_within_bounds(split):
    """Jamba's Mamba (1) layers (``planning/mixers.py``: the runtime's torch selective scan, a loop
    over tokens keeping each step's state): a 300-token sequence, whole or split in two, through 4
    Mamba layers (dense MLPs, intermediate 512, ``d_state`` 16), float32: the measured peak of saved
    tensors within 0.85x-1.05x of the prediction."""
    from transformers import AutoModelForCausalLM

    from concertina_hf.planning import CostModel, DeviceSpec

    cfg = cases.model_support.tiny_config(
        "jamba", hidden_size=256, intermediate_size=512, mamba_d_state=16, mamba_expand=2, mamba_dt_rank=16,
        mamba_d_conv=4, attn_layer_period=100, attn_layer_offset=99, num_experts=1)  # no attention layer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    layout = StageLayout.even(cfg.num_hidden_layers, 1)
    tokens = 300
    spec = (((0, 0, 150),), ((0, 150, 150),)) if split else (((0, 0, tokens),),)
    plan = cases.make_plan(layout, "none", spec, (tokens,))
    ids = [torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))]
    res = PipelineExecutor(PipelineWrapper(model, layout, 0)).run_step(plan, ids)
    cost = CostModel.from_hf_config(model.config, DeviceSpec.cpu(), dtype_bytes=4, attention_kernel="sdpa-cpu-flash")
    assert cost.layer_kinds == ("linear",) * 4
    predicted = sum(cost.act_memory(layout, 0, c) for c in plan.chunks)
    ratio = res.peak_activation_bytes / predicted
    print(split, res.peak_activation_bytes, int(predicted), round(ratio, 3))
    assert 0.85 <= ratio <= 1.05, (res.peak_activation_bytes, predicted, ratio)


def test_the_profiler_measures_a_packed_chunk(model):
    """``build_probe`` on the HF model itself (Nemotron-H and Jamba have no rotary embedding): the
    saved bytes of a packed chunk through the first two layers, the Mamba layers routed as the stage's."""
    from concertina_hf.runtime.probe import build_probe

    probe = build_probe(copy.deepcopy(model), num_layers=2)
    assert probe.chunk_bytes(((0, 40), (0, 24)), False, 0) > probe.chunk_bytes(((0, 40),), False, 0) > 0


@pytest.mark.parametrize("tokens, split", [(512, False), (300, True)])
def test_analytic_activation_memory_of_falcon_h1_within_bounds(tokens, split):
    """Falcon-H1's layers (a Mamba2 beside the attention, ``planning/mixers.hybrid_mixer_terms``
    priced into the attention layer with its per-slice, padding and split-state terms): 8 heads of
    64, ``d_state`` 128, scan chunk 256, float32; two scan chunks whole, and a sequence split in two
    slices each padded to its chunk: the measured peak within 0.85x-1.05x of the prediction."""
    from transformers import AutoModelForCausalLM

    from concertina_hf.planning import CostModel, DeviceSpec

    cfg = cases.model_support.tiny_config(
        "falcon_h1", hidden_size=256, intermediate_size=512, mamba_n_heads=8, mamba_d_head=64, mamba_d_ssm=512,
        mamba_d_state=128, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    layout = StageLayout.even(cfg.num_hidden_layers, 1)
    half = tokens // 2
    spec = (((0, 0, half),), ((0, half, tokens - half),)) if split else (((0, 0, tokens),),)
    plan = cases.make_plan(layout, "none", spec, (tokens,))
    ids = [torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))]
    res = PipelineExecutor(PipelineWrapper(model, layout, 0)).run_step(plan, ids)
    cost = CostModel.from_hf_config(model.config, DeviceSpec.cpu(), dtype_bytes=4, attention_kernel="sdpa-cpu-flash")
    assert cost.layer_kinds == () and cost.hybrid_scan_chunk == 256
    predicted = sum(cost.act_memory(layout, 0, c) for c in plan.chunks)
    ratio = res.peak_activation_bytes / predicted
    print(tokens, split, res.peak_activation_bytes, int(predicted), round(ratio, 3))
    assert 0.85 <= ratio <= 1.05, (res.peak_activation_bytes, predicted, ratio)
