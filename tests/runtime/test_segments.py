"""Segment-level training (opt-in, ``docs/segments.md``): the executor against a plain-HF segment reference.

The reference runs each long sequence segment by segment through the HF model with
``past_key_values`` (a :class:`~transformers.DynamicCache` built from the earlier segments' K/V),
cut to the K/V tail and detached beyond the previous segment under ``segment_gradient="previous"``,
positions continued (``position_ids``) and HF's mask built from the cache (``cache_position``).
"""

from __future__ import annotations

import copy

import pytest

from _runtime_cases import SEQ_LENS, batch, compare_grads, make_plan, reference, tiny_model
from _segment_reference import GRAD_TOL, LOSS_TOL, S, segment_plan, segment_reference

from concertina_hf.planning import PlanError, StageLayout
from concertina_hf.planning.segments import SegmentOptions, check_segment_plan
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

def every_recompute_mismatches(kind, model, ids, labels, opts, ref_loss, ref_grads) -> list[str]:
    """One stage, hand-made segment plans under each recompute setting: what differs from the reference."""
    layout = StageLayout.even(4, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    failures = []
    for rec in ("none", "partial", "full"):
        w.zero_grad(set_to_none=True)
        res = ex.run_step(segment_plan(layout, opts, rec), ids, labels)
        if not abs(res.loss - ref_loss) < LOSS_TOL * abs(ref_loss):
            failures.append(f"{kind} {rec}: loss {res.loss} vs {ref_loss}")
        failures += [f"{kind} {rec}: {b}" for b in compare_grads(w, ref_grads, GRAD_TOL)]
    return failures


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_data(request):
    model = tiny_model(request.param, num_layers=4)
    ids, labels = batch()
    return request.param, model, ids, labels


def test_reference_without_limits_is_hf():
    """The segment reference with an unbounded tail and full gradient is ordinary training."""
    model = tiny_model("llama", num_layers=2)
    ids, labels = batch()
    ref_loss, ref_grads = reference(model, ids, labels)
    loss, grads = segment_reference(model, ids, labels, SegmentOptions(S))
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
    for k, g in ref_grads.items():
        assert float((grads[k] - g).norm() / g.norm()) < 1e-4, k


CASES = [("full", None), ("full", 5), ("previous", None), ("previous", 5), ("previous", 12), ("full", 0),
         ("none", 5), ("none", None)]


@pytest.mark.parametrize("gradient,tail", CASES)
def test_one_stage_matches_the_segment_reference(model_and_data, gradient, tail):
    kind, model, ids, labels = model_and_data
    opts = SegmentOptions(S, gradient, tail)
    ref_loss, ref_grads = segment_reference(model, ids, labels, opts)
    full_loss, _ = reference(model, ids, labels)
    if (gradient, tail) != ("full", None):  # the objective differs from ordinary training
        assert abs(ref_loss - full_loss) > 1e-4 * abs(full_loss) or gradient != "full"  # else: gradients only
    assert every_recompute_mismatches(kind, model, ids, labels, opts, ref_loss, ref_grads) == []


def test_eval_drops_kv_outside_the_tail(model_and_data):
    kind, model, ids, labels = model_and_data
    opts = SegmentOptions(S, "previous", 5)
    ref_loss, _ = segment_reference(model, ids, labels, opts)
    layout = StageLayout.even(4, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    res = PipelineExecutor(w).run_step(segment_plan(layout, opts, "none"), ids, labels, train=False)
    assert abs(res.loss - ref_loss) < LOSS_TOL * abs(ref_loss)


def test_plans_not_cut_at_segments_are_refused():
    layout = StageLayout.even(4, 1)
    import dataclasses

    from _runtime_cases import CHUNKINGS

    plan = make_plan(SEQ_LENS, CHUNKINGS["split"], layout)
    bad = dataclasses.replace(plan, knobs=SegmentOptions(S).knobs())
    with pytest.raises(PlanError, match="segment_tokens=8"):
        check_segment_plan(bad)
    assert check_segment_plan(plan) is None
    with pytest.raises(PlanError, match="segment_gradient"):
        SegmentOptions(S, "older")
    with pytest.raises(PlanError, match="segment_kv_tail"):
        SegmentOptions(S, "full", -1)


@pytest.mark.parametrize("kernel", ["sdpa-per-segment", "eager-per-segment"])
@pytest.mark.parametrize("opts", [SegmentOptions(S, "previous", 12), SegmentOptions(S, "previous", 5, (1, 2))],
                         ids=["tail", "global-heads"])
def test_other_kernels_follow_the_segment_semantics(model_and_data, kernel, opts, monkeypatch):
    from concertina_hf.runtime.attention import kernels

    kind, model, ids, labels = model_and_data
    monkeypatch.setattr(kernels, "choose_kernel", lambda *a, **k: kernel)
    ref_loss, ref_grads = segment_reference(model, ids, labels, opts)
    layout = StageLayout.even(4, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    res = PipelineExecutor(w).run_step(segment_plan(layout, opts, "partial"), ids, labels)
    assert abs(res.loss - ref_loss) < LOSS_TOL * abs(ref_loss)
    assert compare_grads(w, ref_grads, GRAD_TOL) == []


@pytest.mark.parametrize("strategy", ["adaptive", "packed", "split"])
def test_planner_cuts_at_segments_and_the_plan_runs(strategy):
    from _runtime_cases import tiny_config

    from concertina_hf.planning import CostModel
    from concertina_hf.planning.strategies import plan_step

    model = tiny_model("llama", num_layers=4)
    ids, labels = batch()
    layout = StageLayout.even(4, 1)
    cost = CostModel.from_hf_config(tiny_config("llama", 4), dtype_bytes=4)
    opts = SegmentOptions(S, "previous", 5)
    plan = plan_step(list(SEQ_LENS), cost, layout, 0, strategy, max_tokens_per_chunk=24, segment=opts)
    assert check_segment_plan(plan) == opts
    assert plan.knob("segment_gradient") == "previous" and plan.knob("segment_kv_tail") == 5
    off = plan_step(list(SEQ_LENS), cost, layout, 0, strategy, max_tokens_per_chunk=24)
    assert off.knob("segment_tokens") is None
    ref_loss, ref_grads = segment_reference(model, ids, labels, opts)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    res = PipelineExecutor(w).run_step(plan, ids, labels)
    assert abs(res.loss - ref_loss) < LOSS_TOL * abs(ref_loss)
    assert compare_grads(w, ref_grads, GRAD_TOL) == []


GLOBAL_CASES = [("previous", 5, (1,)), ("full", 3, (0, 3)), ("previous", 0, (2,)), ("none", 5, (1,))]


@pytest.mark.parametrize("gradient,tail,heads", GLOBAL_CASES)
def test_global_heads_match_the_per_head_reference(model_and_data, gradient, tail, heads):
    """Global heads read every earlier token (before the tail detached), the others the tail: equal to
    the plain-HF reference with a per-head mask, every recompute setting; a different objective from
    the tail alone."""
    kind, model, ids, labels = model_and_data
    opts = SegmentOptions(S, gradient, tail, heads)
    ref_loss, ref_grads = segment_reference(model, ids, labels, opts)
    tail_loss, _ = segment_reference(model, ids, labels, SegmentOptions(S, gradient, tail))
    assert abs(ref_loss - tail_loss) > 1e-4 * abs(tail_loss)
    assert every_recompute_mismatches(kind, model, ids, labels, opts, ref_loss, ref_grads) == []
    layout = StageLayout.even(4, 1)  # forward only: the store keeps only the global heads' K/V outside the tail
    res = PipelineExecutor(PipelineWrapper(copy.deepcopy(model), layout, 0)).run_step(
        segment_plan(layout, opts, "none"), ids, labels, train=False)
    assert abs(res.loss - ref_loss) < LOSS_TOL * abs(ref_loss)


def test_global_heads_refusals():
    with pytest.raises(PlanError, match="segment_global_heads needs a K/V tail"):
        SegmentOptions(S, "previous", None, (0,))
    with pytest.raises(PlanError, match="segment_global_heads"):
        SegmentOptions(S, "previous", 4, (-1,))
    model = tiny_model("llama", num_layers=2)
    ids, labels = batch()
    layout = StageLayout.even(2, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    heads = model.config.num_attention_heads
    with pytest.raises(RuntimeError, match="concertina_segment_global_heads"):
        PipelineExecutor(w).run_step(segment_plan(layout, SegmentOptions(S, "full", 4, (heads,))), ids, labels)


def test_gradient_none_backwards_each_segment_before_the_next_forward():
    """Under segment_gradient="none" no gradient crosses a segment boundary: the planner's schedule is
    textbook 1F1B over the segments (at pp=1, each segment's backward before the next one's forward),
    the plan runs equal to the reference, and the K/V store holds only the tail between segments."""
    from _runtime_cases import tiny_config

    from concertina_hf.planning import CostModel
    from concertina_hf.planning.strategies import plan_step

    model = tiny_model("llama", num_layers=4)
    ids, labels = batch()
    layout = StageLayout.even(4, 1)
    cost = CostModel.from_hf_config(tiny_config("llama", 4), dtype_bytes=4)
    opts = SegmentOptions(S, "none", 5)
    plan = plan_step(list(SEQ_LENS), cost, layout, 0, "no-recompute", max_tokens_per_chunk=24, segment=opts)
    chain = [ci for ci, _ in plan.slices_of(0)]
    order = [(a.kind.value, a.chunk) for a in plan.schedule[0] if a.chunk in chain]
    assert order == [(k, c) for c in chain for k in ("F", "B")], order
    ref_loss, ref_grads = segment_reference(model, ids, labels, opts)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    res = PipelineExecutor(w).run_step(plan, ids, labels)
    assert abs(res.loss - ref_loss) < LOSS_TOL * abs(ref_loss)
    assert compare_grads(w, ref_grads, GRAD_TOL) == []
    chained = plan_step(list(SEQ_LENS), cost, layout, 0, "no-recompute", max_tokens_per_chunk=24,
                        segment=SegmentOptions(S, "previous", 5))
    order = [(a.kind.value, a.chunk) for a in chained.schedule[0] if a.chunk in chain]
    assert order[:len(chain)] == [("F", c) for c in chain]  # "previous": the whole chain forward first
