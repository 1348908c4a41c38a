"""The planner under segment-level training: cuts at segments, and the simulator's time and
memory under the options (a K/V tail bounds attention pairs, saved context and the attention backward's
key gradients; "previous" keeps one K/V gradient buffer per chain instead of every earlier slice's)."""

from __future__ import annotations

import pytest

from concertina_hf.planning import CostModel, DeviceSpec, PlanError, partition_layers, plan_step
from concertina_hf.planning.presets import MODEL_PRESETS
from concertina_hf.planning.segments import SegmentOptions, check_segment_plan, segment_cuts
from concertina_hf.planning.simulate import simulate


def _cost():
    return CostModel.from_hf_config(MODEL_PRESETS["llama-7b"], DeviceSpec.a800())


@pytest.mark.parametrize("strategy", ["adaptive", "packed", "split", "no-recompute", "full-recompute"])
def test_every_sequence_longer_than_s_is_cut_into_its_segments(strategy):
    cost = _cost()
    layout = partition_layers(cost, 4)
    lens = [70000, 9000, 4096, 4097, 300, 1200]
    try:
        plan = plan_step(lens, cost, layout, 0, strategy, segment=SegmentOptions(4096, "previous", 2048))
    except PlanError as e:  # a strategy that cannot take the cuts says so
        pytest.skip(str(e))
    check_segment_plan(plan)
    for seq, n in enumerate(lens):
        assert [s.length for _, s in plan.slices_of(seq)] == (segment_cuts(n, 4096) if n > 4096 else [n])


def _no_recompute_run(lens):
    """``opts -> (step time, peak memory)`` of the no-recompute plan of ``lens`` on 2 stages (its
    prediction checked against its simulation)."""
    cost = _cost()
    layout = partition_layers(cost, 2)

    def run(opts):
        plan = plan_step(lens, cost, layout, 0, "no-recompute", segment=opts)
        stats = simulate(plan, cost).stats()
        assert stats == plan.predicted
        return stats.step_time_s, max(stats.peak_memory_bytes)
    return run


def test_tail_and_previous_lower_time_and_memory():
    run = _no_recompute_run([65536, 2000, 3000])

    full_t, full_m = run(SegmentOptions(4096))  # ordinary training's objective, cut at segments
    prev_t, prev_m = run(SegmentOptions(4096, "previous"))
    tail_t, tail_m = run(SegmentOptions(4096, "previous", 4096))
    assert prev_t == pytest.approx(full_t) and prev_m < full_m  # one K/V gradient buffer per chain
    assert tail_t < 0.8 * full_t and tail_m < prev_m  # attention to min(C, W) earlier keys


def test_adaptive_uses_the_freedom_the_options_give():
    """The strategies plan under the segment options: at the same budget, a K/V tail
    needs less recompute and a shorter step than full attention, and gradient "none" (each segment
    backwarded right after its forward) none at all; each plan's prediction is its simulation."""
    cost = _cost()
    layout = partition_layers(cost, 4)
    # a budget under which gradient "none" needs no recompute (80 GiB does not do)
    lens, budget = [65536, 4000, 3000, 9000], 85 * 2**30

    def run(opts):
        plan = plan_step(lens, cost, layout, budget, "adaptive", segment=opts)
        assert simulate(plan, cost).stats() == plan.predicted
        return sum(map(sum, plan.recompute)), plan.predicted.step_time_s

    full_r, full_t = run(SegmentOptions(8192))
    tail_r, tail_t = run(SegmentOptions(8192, "previous", 8192))
    none_r, none_t = run(SegmentOptions(8192, "none", 8192))
    assert tail_r < full_r and tail_t < 0.7 * full_t
    assert none_r == 0 < full_r and none_t < tail_t
    # below what any chained schedule can hold (every segment in flight: 40 GiB on the last
    # stage, static memory and every layer recomputed), "none" still plans
    with pytest.raises(PlanError, match="cannot fit"):
        plan_step(lens, cost, layout, 36 * 2**30, "adaptive", segment=SegmentOptions(8192, "previous", 8192))
    plan = plan_step(lens, cost, layout, 36 * 2**30, "adaptive", segment=SegmentOptions(8192, "none", 8192))
    assert max(plan.predicted.peak_memory_bytes) <= 36 * 2**30


def test_global_heads_cost_between_the_tail_and_full_attention():
    """Global heads attend to every earlier key and keep their K/V whole: time between the tail alone and
    full attention, time and memory growing with their share of the heads (the runtime keeps, per saved
    layer, a copy of their keys and values before the tail for the backward)."""
    run = _no_recompute_run([65536, 2000, 3000])

    full_t, full_m = run(SegmentOptions(4096, "previous"))
    tail_t, tail_m = run(SegmentOptions(4096, "previous", 4096))
    four_t, four_m = run(SegmentOptions(4096, "previous", 4096, tuple(range(4))))
    half_t, half_m = run(SegmentOptions(4096, "previous", 4096, tuple(range(16))))
    assert tail_t < four_t < half_t < full_t and tail_m < four_m < half_m
    cost = _cost()
    assert cost.to_dict() == CostModel.from_dict(cost.to_dict()).to_dict()
    assert "segment_global_fraction" not in cost.to_dict()
