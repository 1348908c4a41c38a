"""The cost model's fitted range caps the planner's chunks.

The time model is linear in tokens and causal pairs; on CPU, chunks larger than every profiled
one ran up to 1.6x their prediction (``benchmarks/results/pipeline_efficiency.md``: pp=1's
one-chunk plans). A profiled model records its largest chunk (``max_chunk_tokens``) and
``plan_step`` builds no larger chunk for any pipeline strategy, unless the step needs it (chunk
and slice limits). Pure Python, no torch (the profiler's side is in ``test_profiler.py``).
"""

import dataclasses

import pytest

from concertina_hf.planning import CostModel, DeviceSpec, StageLayout, plan_step
from concertina_hf.planning.strategies.common import MAX_SLICES, max_chunks

MODEL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688,
             vocab_size=8192, num_hidden_layers=8)
BASE = CostModel.from_hf_config(MODEL, DeviceSpec.cpu(), dtype_bytes=4)
LENS = [3000, 2048, 700, 600, 500, 400, 300, 200]
CAP = 1024


def _layout(pp):
    return StageLayout(8, ((0, 8),) if pp == 1 else ((0, 4), (4, 8)))


def test_uncapped_model_builds_larger_chunks():
    """The premise: without the field (saved models, analytic ones) pp=1 packs big chunks."""
    assert BASE.max_chunk_tokens == 0
    plan = plan_step(LENS, BASE, _layout(1), 0, "adaptive")
    assert max(c.num_tokens for c in plan.chunks) > CAP


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("strategy", ["adaptive", "no-recompute", "full-recompute", "split", "packed"])
def test_plans_respect_the_fitted_cap(strategy, pp):
    cost = dataclasses.replace(BASE, max_chunk_tokens=CAP)
    plan = plan_step(LENS, cost, _layout(pp), 0, strategy)
    for c in plan.chunks:
        # packed never cuts a sequence: one longer than the cap stays whole, alone
        alone_longer = strategy == "packed" and len(c.slices) == 1 and LENS[c.slices[0].seq] > CAP
        assert c.num_tokens <= CAP or alone_longer, (strategy, c)


def test_caller_cap_below_the_model_cap_wins_and_above_is_lowered():
    cost = dataclasses.replace(BASE, max_chunk_tokens=CAP)
    low = plan_step(LENS, cost, _layout(1), 0, "adaptive", max_tokens_per_chunk=512)
    assert max(c.num_tokens for c in low.chunks) <= 512
    high = plan_step(LENS, cost, _layout(1), 0, "adaptive", max_tokens_per_chunk=8192)
    assert max(c.num_tokens for c in high.chunks) <= CAP


def test_a_step_too_large_for_the_cap_is_planned_not_refused():
    """More chunks than a plan may have at the model's cap: the cap gives way (a caller's cap
    would be refused, naming the smallest that works)."""
    cost = dataclasses.replace(BASE, max_chunk_tokens=16)
    layout = _layout(2)
    lens = [4096] * 12  # 3072 chunks of 16 tokens > the 2048 a plan may have
    plan = plan_step(lens, cost, layout, 0, "adaptive")
    assert plan.num_chunks <= max_chunks(layout)
    assert max(len([c for c in plan.chunks if any(s.seq == q for s in c.slices)]) for q in range(12)) <= MAX_SLICES


def test_cap_scales_with_sp_and_old_models_load_uncapped():
    cost = dataclasses.replace(BASE, max_chunk_tokens=CAP)
    assert cost.with_parallel(sp=2).max_chunk_tokens == 2 * CAP
    assert cost.with_parallel(sp=2).with_parallel(sp=1).max_chunk_tokens == CAP
    old = {k: v for k, v in BASE.to_dict().items() if k != "max_chunk_tokens"}
    assert CostModel.from_dict(old).max_chunk_tokens == 0
    assert CostModel.from_dict(cost.to_dict()) == cost


# ------------------------------------------------------------------ per-call embedding / head times
def test_relative_line_holds_at_small_chunks_where_through_origin_does_not():
    """The embedding's dense weight gradient costs the same at any chunk size: a line through the
    origin fitted on large chunks misses it at the small chunks pp=2 plans use."""
    from concertina_hf.planning.fit import relative_line, through_origin

    toks = [64, 256, 1024, 4096]
    secs = [1.8e-3 + 4e-7 * t for t in toks]  # the embedding of the 10M Llama, roughly
    a, b = relative_line(toks, secs)
    assert a == pytest.approx(1.8e-3, rel=1e-6) and b == pytest.approx(4e-7, rel=1e-6)
    k = through_origin(toks[-2:], secs[-2:])  # the former fit: two large sizes, no constant
    assert k * 256 < 0.5 * secs[1]
    # a line through the origin when the constant would be negative; noise weighs alike at every size
    a, b = relative_line([100, 200, 400], [1.0, 2.2, 4.6])
    assert a == 0 and b > 0


def test_per_call_times_on_the_end_stages_only():
    cost = dataclasses.replace(BASE, embed_time_per_call=2e-3, head_time_per_call=1e-3)
    layout = _layout(2)
    plan = plan_step([300, 200], cost, layout, 0, "packed", token_budget=512)
    chunk = plan.chunks[0]
    for s, extra in ((0, 2e-3), (1, 1e-3)):
        assert cost.fwd_time(layout, s, chunk) == pytest.approx(BASE.fwd_time(layout, s, chunk) + extra)
        assert cost.bwd_time(layout, s, chunk) == pytest.approx(BASE.bwd_time(layout, s, chunk) + cost.bwd_factor * extra)
    # the simulated step carries them once per chunk and stage, forward and backward
    from concertina_hf.planning import simulate

    more = simulate(plan, cost).step_time_s - simulate(plan, BASE).step_time_s
    assert more >= (1 + cost.bwd_factor) * 1e-3 * plan.num_chunks * 0.99
    old = {k: v for k, v in BASE.to_dict().items() if not k.endswith("_time_per_call")}
    assert CostModel.from_dict(old).embed_time_per_call == CostModel.from_dict(old).head_time_per_call == 0


def test_head_time_interpolates_measured_points():
    """The head's time per token is no line on CPU (114-120 us per token from 256 to 896 tokens,
    132-151 from 1024): the profile keeps its measured points and the model interpolates them."""
    import json

    pts = ((256.0, 0.010), (512.0, 0.019), (1024.0, 0.047))
    cost = dataclasses.replace(BASE, head_time_per_token=4e-5, head_time_per_call=5e-4, head_time_points=pts)
    assert cost.head_time(512) == pytest.approx(0.019)
    assert cost.head_time(768) == pytest.approx(0.033)
    assert cost.head_time(2048) == pytest.approx(0.047 + 4e-5 * 1024)  # beyond: the per-token rate
    assert cost.head_time(128) == pytest.approx(0.010 - 4e-5 * 128)
    assert BASE.head_time(512) == pytest.approx(BASE.head_time_per_token * 512)
    layout = _layout(2)
    plan = plan_step([512], cost, layout, 0, "packed", token_budget=512)
    (chunk,) = plan.chunks
    no_head = dataclasses.replace(cost, head_time_per_token=0.0, head_time_per_call=0.0, head_time_points=())
    assert cost.fwd_time(layout, 1, chunk) - no_head.fwd_time(layout, 1, chunk) == pytest.approx(0.019)
    assert cost.fwd_time(layout, 0, chunk) == no_head.fwd_time(layout, 0, chunk)
    # saved as JSON and loaded back; a stage of 2 GPUs runs the head on half the tokens each
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    assert cost.with_parallel(sp=2).head_time(1024) == pytest.approx(0.019)


def test_online_refit_scales_the_head_points_it_fits():
    """The refit's one factor on the embedding and head applies to every term the model prices
    them with (points and per-call constants too): actions timed at 1.5x the start model's head
    and embedding give a model that predicts them."""
    from concertina_hf.planning import simulate
    from concertina_hf.planning.fit import action_samples, refit_cost_model

    pts = ((64.0, 0.003), (256.0, 0.011), (1024.0, 0.05))
    start = dataclasses.replace(BASE, head_time_per_token=4e-5, head_time_per_call=5e-4, embed_time_per_call=1e-3,
                                head_time_points=pts)
    truth = dataclasses.replace(start, embed_time_per_token=1.5 * start.embed_time_per_token, head_time_per_token=6e-5,
                                head_time_per_call=7.5e-4, embed_time_per_call=1.5e-3,
                                head_time_points=tuple((t, 1.5 * v) for t, v in pts))
    layout = _layout(2)
    plan = plan_step([700, 500, 300, 200, 120, 90], truth, layout, 0, "packed", token_budget=256)
    acts = [(a, t0, t1) for a, (t0, t1) in simulate(plan, truth).action_times.items()]
    new = refit_cost_model(start, layout, action_samples(plan, acts), floor_fraction=0.0)
    assert new is not None
    assert new.head_time(500) == pytest.approx(truth.head_time(500), rel=0.02)
    assert new.embed_time_per_call == pytest.approx(truth.embed_time_per_call, rel=0.02)
