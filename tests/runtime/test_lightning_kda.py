"""MiniMax lightning attention (``runtime/lightning_attention.py``) and Kimi Linear's Kimi Delta
Attention (``runtime/kda.py``) through the runtime, one process (pp=1).

The models: :mod:`_recurrent_cases` (the recurrent layers at 0 and 2, full attention at 1 and 3, MoE
MLPs; MiniMax's blocks of 16 tokens, Kimi's convolution reading 3 earlier inputs); the batch and
chunks of :mod:`_linear_attention_cases` (a split slice of 2 tokens, shorter than the convolution's
window). pp=2: ``tests/launch/test_linear_attention_launch.py``.

- **No leak between documents**: in a packed chunk (and in the hybrid chunk, after a split
  sequence's tail) changing one document's tokens, its labels ignored, leaves the loss and every
  gradient bit-identical (routed experts to rounding); with HF's own ``forward`` the check fails.
- **HF's model**: split, hybrid and packed chunks under recompute none / partial / full against HF on
  the right-padded batch, loss 1e-5 and every gradient 1e-4, the recurrent layers' own parameters
  among them.
- **The self-check** at construction passes.
- **The analytic activation memory** of the recurrent layers (``planning/mixers.py``) within
  0.85x-1.05x of the measured peak of saved tensors.
- **Refusals**: sequence parallelism and segment-level training, each named by the mixer.
"""

from __future__ import annotations

import copy

import pytest
import torch

import _linear_attention_cases as cases
import _recurrent_cases as recurrent
from concertina_hf.planning import StageLayout
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

@pytest.fixture(scope="module", params=list(recurrent.LIGHTNING_KDA))
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
    documents of the packed chunk."""
    ids, labels = cases.batch()
    labels[perturbed][:] = -100
    other = [t.clone() for t in ids]
    other[perturbed] = (other[perturbed] + 7) % cases.model_support.VOCAB
    a, ga, _ = _step(model, cases.CHUNKS, cases.SEQ_LENS, ids, labels)
    b, gb, _ = _step(model, cases.CHUNKS, cases.SEQ_LENS, other, labels)
    assert a.loss == b.loss
    assert ga.keys() == gb.keys()
    experts = [k for k in ga if ".experts." in k]
    assert [k for k in ga if k not in experts and not torch.equal(ga[k], gb[k])] == []
    assert all(float((ga[k] - gb[k]).norm()) <= 1e-6 * float(ga[k].norm()) for k in experts)
    # the check can fail: HF's forward over the whole chunk carries state from one document to the next
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
        assert row["mixer_params"] == 6, row  # three parameters of layers 0 and 2
        rows.append(row)
        failures += bad
    for row in rows:
        print(row)
    assert failures == []
    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 1), 0)
    res = PipelineExecutor(w).run_step(cases.make_plan(w.layout, "none"), ids, labels,
                                       num_items_in_batch=cases.num_items(labels), train=False)
    assert abs(res.loss - ref_loss) / ref_loss < cases.LOSS_TOL


def test_the_self_check_passes(model):
    from concertina_hf.training.self_check import check_model

    check_model(copy.deepcopy(model))


def test_what_is_not_built_is_refused(model):
    from concertina_hf.runtime.attention import ChunkAttentionContext, KVStore, SliceSpec
    from concertina_hf.runtime.families import UnsupportedModelError, inspect_model
    from concertina_hf.runtime.kda import kda_forward
    from concertina_hf.runtime.lightning_attention import lightning_forward

    family = inspect_model(model)
    lightning = model.case_name == "minimax"
    assert (family.lightning_attention, family.kda) == (lightning, not lightning)
    forward, name = (lightning_forward, "lightning-attention") if lightning else (kda_forward, "Kimi Delta Attention")
    m = copy.deepcopy(model)  # an attention module where the layer type says linear_attention: not HF's class
    m.model.layers[0].self_attn = m.model.layers[1].self_attn
    wrong, right = type(m.model.layers[1].self_attn).__name__, type(model.model.layers[0].self_attn).__name__
    with pytest.raises(UnsupportedModelError, match=f"decoder layer 0's self_attn is a {wrong}, not HF's {right}"):
        inspect_model(m)
    mixer = model.model.layers[0].self_attn
    x = torch.zeros(1, 4, model.config.hidden_size)
    spec = [SliceSpec(0, 0, 4, 0, True)]
    with pytest.raises(ValueError, match=f"segment-level training .* not implemented for {name}"):
        forward(mixer, x, ChunkAttentionContext(spec, KVStore(gradient="previous"), "cpu", True))

    class Sharded(ChunkAttentionContext):
        pass

    with pytest.raises(ValueError, match=f"{name} .* sequence parallel size 1 only"):
        forward(mixer, x, Sharded(spec, KVStore(), "cpu", True))


@pytest.mark.parametrize("name, tokens, split", [("minimax", 512, False), ("minimax", 512, True),
                                                 ("kimi_linear", 256, True)])
def test_analytic_activation_memory_within_bounds(name, tokens, split):
    """The analytic cost model's activation memory (``planning/mixers.py``: lightning_layer_fields with
    blocks of 64, kda_layer_fields on HF's torch scan) against the step's measured peak of saved
    tensors, one stage, float32: within 0.85x-1.05x of the prediction, the bounds of
    ``tests/runtime/test_analytic_memory.py``; a split sequence keeps the earlier slice's state."""
    from transformers import AutoModelForCausalLM

    from concertina_hf.planning import CostModel, DeviceSpec

    more = dict(block_size=64) if name == "minimax" else dict(linear_head_dim=32)
    model_type, overrides, _ = recurrent.MODELS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cases.model_support.tiny_config(model_type, **{**overrides, **more}))
    model = model.float()
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
    print(name, tokens, split, res.peak_activation_bytes, int(predicted), round(ratio, 3))
    assert 0.85 <= ratio <= 1.05, (res.peak_activation_bytes, predicted, ratio)


def test_layout_auto_leaves_sequence_parallelism_out(model, tmp_path):
    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.planning.layouts import Layout
    from concertina_hf.training import auto_layout

    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    refused = auto_layout._runtime_refusals(args, model, 4)
    assert set(refused) == {Layout(1, 2, 2), Layout(2, 2, 1), Layout(1, 4, 1)}
    name = "lightning-attention" if model.case_name == "minimax" else "Kimi Delta Attention"
    assert all(f"{name} (" in why and "sequence parallel size 1 only" in why for why in refused.values())


def test_a_profile_the_probe_cannot_run_is_refused_naming_the_analytic_model(tmp_path):
    """``concertina_cost_model='profiled'`` on Kimi Linear: the profiler's probe cannot run its
    attention (different query / key and value head sizes), so construction stops naming the setting
    that plans without it."""
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_cost_model="profiled", report_to=[],
                                       use_cpu=True, max_steps=1)
    with pytest.raises(ValueError, match="concertina_cost_model='profiled': profiling model type 'kimi_linear' failed "
                                         r"\(.*\); set concertina_cost_model='analytic'"):
        ConcertinaTrainer(model=recurrent.build_model("kimi_linear"), args=args, train_dataset=cases.dataset())
