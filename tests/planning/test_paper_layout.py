"""benchmarks/paper_layout.py's breakdown of a simulated step over the ideal bound (pure planning).

``time_breakdown`` splits the step per GPU into the useful compute the ideal bound counts and
what each strategy adds (bubble, all-to-alls, recompute, ZeRO-3 gathers, per-call overhead,
per-step sync): the parts must add up to the simulated step exactly, the useful part must be the
bound itself (both spread the same work over the same 32 GPUs), and each strategy may only pay
for what it does (no ZeRO-3 for the pipeline, no per-step sync for sp-only).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

GIB = 2**30


@pytest.mark.parametrize("model,pp,sp", [("llama-13b", 4, 8), ("llama-30b", 8, 4)])
def test_time_breakdown_adds_up_to_the_simulated_step(model, pp, sp):
    from paper_layout import PARTS, time_breakdown
    from concertina_hf.planning.presets import MODEL_PRESETS
    from concertina_hf.planning import CostModel, DeviceSpec, ideal_step_time, partition_layers, plan_step, simulate

    cost = CostModel.from_hf_config(MODEL_PRESETS[model], DeviceSpec.a800()).with_parallel(sp=sp)
    layout = partition_layers(cost, pp)
    lens = [98304, 30000, 16384, 9000, 5000, 4096, 3000, 2048, 1500, 1024, 800, 512, 300, 128] * 2
    ideal = ideal_step_time(lens, cost, layout)
    parts = {}
    for name, knobs in (("adaptive", {}), ("sp-only", {}), ("sp-only all rc", {"recompute_layers": cost.num_layers})):
        plan = plan_step(lens, cost, layout, 80 * GIB, name.split()[0], solver="greedy", **knobs)
        sim = simulate(plan, cost)
        b = time_breakdown(plan, sim, cost, ideal)
        assert set(b) == {"useful", *PARTS}
        assert sum(b.values()) == pytest.approx(sim.step_time_s / ideal, rel=1e-9), name
        # the idle part is the simulator's own (busy time per stage / group, recomputed here part by part)
        idle = sum(sim.stage_bubble_s) / len(sim.stage_bubble_s) - sim.sync_time_s
        assert b["bubble"] == pytest.approx(idle / ideal, rel=1e-6, abs=1e-9), name
        assert b["useful"] == pytest.approx(1.0, rel=1e-9), name  # the same work over the same 32 GPUs
        assert min(b.values()) >= -1e-9, (name, b)
        assert b["a2a"] > 0, name
        parts[name] = b
    assert parts["adaptive"]["zero3"] == pytest.approx(0.0, abs=1e-12)
    assert parts["sp-only"]["sync"] == 0.0 and parts["adaptive"]["sync"] > 0  # sharded state: gathered once a step
    # every layer recomputed costs at least what the fewest layers that fit cost
    assert parts["sp-only all rc"]["recompute"] > parts["sp-only"]["recompute"]
