"""The planner under segment-level training (issue 24): cuts at segments, and the simulator's time and
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


def test_tail_and_previous_lower_time_and_memory():
    cost = _cost()
    layout = partition_layers(cost, 2)
    lens = [65536, 2000, 3000]

    def run(opts):
        plan = plan_step(lens, cost, layout, 0, "no-recompute", segment=opts)
        stats = simulate(plan, cost).stats()
        return stats.step_time_s, max(stats.peak_memory_bytes)

    full_t, full_m = run(SegmentOptions(4096))  # ordinary training's objective, cut at segments
    prev_t, prev_m = run(SegmentOptions(4096, "previous"))
    tail_t, tail_m = run(SegmentOptions(4096, "previous", 4096))
    assert prev_t == pytest.approx(full_t) and prev_m < full_m  # one K/V gradient buffer per chain
    assert tail_t < 0.8 * full_t and tail_m < prev_m  # attention to min(C, W) earlier keys
