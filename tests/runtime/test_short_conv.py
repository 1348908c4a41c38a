"""LFM2 short convolutions (``runtime/short_conv.py``) through the runtime, one process (pp=1), for
each class: LFM2, LFM2-MoE (its rotary embedding ``pos_emb``, MoE layers 2 and 3), LFM3 (a sliding
and a global attention layer, convolutions without position embeddings); the final norm is LFM2's
``embedding_norm``.

The models: :mod:`_recurrent_cases` (convolutions at layers 0 and 2, each token reading 3 earlier
inputs); the batch and chunks of :mod:`_linear_attention_cases` (a split slice of 2 tokens, shorter
than the convolution's window). pp=2: ``tests/launch/test_linear_attention_launch.py``.

- **No leak between documents**: in a packed chunk (and in the hybrid chunk, after a split
  sequence's tail) changing one document's tokens, its labels ignored, leaves the loss and every
  gradient bit-identical; with HF's own ``forward`` on the chunk the same check fails.
- **HF's model**: split, hybrid and packed chunks under recompute none / partial / full against
  HF on the right-padded batch, loss 1e-5 and every gradient 1e-4, the convolution weights and
  projections of both convolution layers among them.
- **The self-check** at construction passes.
- **The analytic activation memory** of the convolution layers (``planning/mixers.py``) within
  0.85x-1.05x of the measured peak of saved tensors (a whole sequence and a split one).
- **Refusals**: another short-convolution class in a model type's layer, sequence parallelism and
  segment-level training, each named.
"""

from __future__ import annotations

import copy

import pytest
import torch

import _linear_attention_cases as cases
import _recurrent_cases as recurrent
from concertina_hf.planning import StageLayout
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper



@pytest.fixture(scope="module", params=list(recurrent.SHORT_CONV))
def model(request):
    m = recurrent.build_model(request.param)
    m.case_name = request.param
    return m


def _step(model, plan_chunks, seq_lens, ids, labels, recompute="none"):
    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 1), 0)
    plan = cases.make_plan(w.layout, recompute, plan_chunks, seq_lens)
    res = PipelineExecutor(w).run_step(plan, ids, labels, num_items_in_batch=cases.num_items(labels))
    return res, {k: p.grad for k, p in w.named_parameters() if p.grad is not None}, w


@pytest.mark.parametrize("perturbed", [1, 3])
def test_a_document_does_not_reach_the_others(model, monkeypatch, perturbed):
    """Sequence 1 sits in the hybrid chunk after the split sequence's tail; sequence 3 between two
    documents of the packed chunk. Every other document's loss and gradient stay bit-identical."""
    ids, labels = cases.batch()
    labels[perturbed][:] = -100
    other = [t.clone() for t in ids]
    other[perturbed] = (other[perturbed] + 7) % cases.model_support.VOCAB
    a, ga, _ = _step(model, cases.CHUNKS, cases.SEQ_LENS, ids, labels)
    b, gb, _ = _step(model, cases.CHUNKS, cases.SEQ_LENS, other, labels)
    assert a.loss == b.loss
    assert ga.keys() == gb.keys()
    # routed experts sum over the tokens each receives, in an order the other document's routing
    # changes: equal to rounding; every other gradient bit-identical
    experts = [k for k in ga if ".experts." in k]
    assert [k for k in ga if k not in experts and not torch.equal(ga[k], gb[k])] == []
    assert all(float((ga[k] - gb[k]).norm()) <= 1e-6 * float(ga[k].norm()) for k in experts)
    # the check can fail: HF's forward over the whole chunk convolves across documents
    from concertina_hf.runtime import stage

    monkeypatch.setattr(stage, "install_mixers", lambda model, family: None)
    packed = (((0, 0, 9), (1, 0, 7), (2, 0, 5), (3, 0, 3)),)
    ids, labels = ids[1:], [lab.clone() for lab in labels[1:]]
    labels[0][:] = -100
    other = [(ids[0] + 7) % cases.model_support.VOCAB] + ids[1:]
    a, ga, _ = _step(model, packed, cases.SEQ_LENS[1:], ids, labels)
    b, gb, _ = _step(model, packed, cases.SEQ_LENS[1:], other, labels)
    assert a.loss != b.loss and any(not torch.equal(ga[k], gb[k]) for k in ga)


def test_split_hybrid_and_packed_chunks_equal_hf(model):
    ids, labels = cases.batch()
    ref_loss, ref_grads = cases.padded_reference(model, ids, labels)
    rows, failures = [], []
    for recompute in cases.RECOMPUTE:
        res, _, w = _step(model, cases.CHUNKS, cases.SEQ_LENS, ids, labels, recompute)
        errors = cases.gradient_errors(w.named_parameters(), ref_grads)
        row, bad = cases.check_case(f"{model.case_name} pp=1 recompute {recompute}", res.loss, ref_loss, errors,
                                    mixer_params=recurrent.mixer_params(model.case_name))
        assert row["mixer_params"] == 6, row  # conv, in_proj, out_proj weights of layers 0 and 2
        rows.append(row)
        failures += bad
    for row in rows:
        print(row)
    assert failures == []
    # forward only: the same loss (the carried tails without gradient)
    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 1), 0)
    res = PipelineExecutor(w).run_step(cases.make_plan(w.layout, "none"), ids, labels,
                                       num_items_in_batch=cases.num_items(labels), train=False)
    assert abs(res.loss - ref_loss) / ref_loss < cases.LOSS_TOL


def test_the_self_check_passes(model):
    from concertina_hf.training.self_check import check_model

    check_model(copy.deepcopy(model))


def test_what_is_not_built_is_refused(model):
    from transformers.models.lfm3.modeling_lfm3 import Lfm3ShortConv

    from concertina_hf.runtime.attention import ChunkAttentionContext, KVStore, SliceSpec
    from concertina_hf.runtime.families import UnsupportedModelError, inspect_model
    from concertina_hf.runtime.short_conv import short_conv_forward

    family = inspect_model(model)
    assert family.short_conv and family.final_norm == "embedding_norm"
    assert family.rotary == ("pos_emb" if model.case_name == "lfm2_moe" else "rotary_emb")
    if model.case_name != "lfm3":  # another class of short convolution than the model type's
        m = copy.deepcopy(model)
        m.model.layers[2].conv = Lfm3ShortConv(m.config, 2)
        with pytest.raises(UnsupportedModelError, match="decoder layer 2's conv is a Lfm3ShortConv, not HF's Lfm2"):
            inspect_model(m)
    mixer = model.model.layers[0].conv
    x = torch.zeros(1, 4, model.config.hidden_size)
    spec = [SliceSpec(0, 0, 4, 0, True)]
    with pytest.raises(ValueError, match="segment-level training .* not implemented for short-convolution"):
        short_conv_forward(mixer, x, ChunkAttentionContext(spec, KVStore(gradient="previous"), "cpu", True))

    class Sharded(ChunkAttentionContext):
        pass

    with pytest.raises(ValueError, match="short-convolution .* sequence parallel size 1 only"):
        short_conv_forward(mixer, x, Sharded(spec, KVStore(), "cpu", True))


@pytest.mark.parametrize("model_type, tokens, split", [("lfm2", 1024, False), ("lfm3", 512, False),
                                                       ("lfm2", 512, True)])
def test_analytic_activation_memory_within_bounds(model_type, tokens, split):
    """The analytic cost model's activation memory (``planning/mixers.py``'s short convolutions, LFM3's
    norms after each block) against the step's measured peak of saved tensors, one stage, float32,
    hidden size 256: within 0.85x-1.05x of the prediction, the bounds of
    ``tests/runtime/test_analytic_memory.py``; a split sequence keeps the earlier slice's tail."""
    from transformers import AutoModelForCausalLM

    from concertina_hf.planning import CostModel, DeviceSpec

    torch.manual_seed(0)
    cfg = cases.model_support.tiny_config(model_type, hidden_size=256, intermediate_size=384)
    model = AutoModelForCausalLM.from_config(cfg).float()
    layout = StageLayout.even(model.config.num_hidden_layers, 1)
    half = tokens // 2
    spec = (((0, 0, half),), ((0, half, tokens - half),)) if split else (((0, 0, tokens),),)
    plan = cases.make_plan(layout, "none", spec, (tokens,))
    ids = [torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))]
    res = PipelineExecutor(PipelineWrapper(model, layout, 0)).run_step(plan, ids)
    cost = CostModel.from_hf_config(model.config, DeviceSpec.cpu(), dtype_bytes=4, attention_kernel="sdpa-cpu-flash")
    assert cost.layer_kinds.count("linear") == 2
    predicted = sum(cost.act_memory(layout, 0, c) for c in plan.chunks)
    ratio = res.peak_activation_bytes / predicted
    print(model_type, tokens, split, res.peak_activation_bytes, int(predicted), round(ratio, 3))
    assert 0.85 <= ratio <= 1.05, (res.peak_activation_bytes, predicted, ratio)


def test_the_cost_model_prices_the_convolutions_by_kind():
    """A ``conv`` layer of an LFM2 config is linear: no context term, a small cost per slice, a
    ``(k - 1) x hidden`` tail per split slice and no K/V."""
    from concertina_hf.planning import CostModel, DeviceSpec, Slice
    from concertina_hf.planning.mixers import layer_kinds

    cfg = cases.model_support.tiny_config("lfm2", hidden_size=256)
    cost = CostModel.from_hf_config(cfg, DeviceSpec.preset("h100"), dtype_bytes=2)
    assert cost.layer_kinds == ("linear", "attention") * 2
    assert cost.lin_state_bytes == 2 * (cfg.conv_L_cache - 1) * 256
    early, late = [Slice(0, 0, 4096)], [Slice(0, 60000, 4096)]
    assert cost.linear_layer_time(late) == cost.linear_layer_time(early) < cost.layer_fwd_time(late)
    # a slice costs a small launch, not a scan call
    assert 0 < cost.lin_beta_segment < 0.1 * min(cost.linear_layer_time(early), cost.beta)
    # "conv" names a short convolution only in a config that has one
    assert layer_kinds({"layer_types": ["conv", "full_attention"]}.get) == ()


def test_layout_auto_leaves_sequence_parallelism_out(model, tmp_path):
    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.planning.layouts import Layout
    from concertina_hf.training import auto_layout

    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    refused = auto_layout._runtime_refusals(args, model, 4)
    assert set(refused) == {Layout(1, 2, 2), Layout(2, 2, 1), Layout(1, 4, 1)}
    assert all("short-convolution (LFM2 conv) layers run with sequence parallel size 1 only" in why
               for why in refused.values())
