"""The budget rule of the 4-process sequence-parallel benchmark (benchmarks/measured_sp.py): one
activation budget per GPU for every layout (pp=2 x sp=2's own figure), and the adaptive planner
plans every layout's batch under it (analytic cost model, one process). Its ``--quick`` run end to
end: ``tests/benchmarks/test_measured_sp.py``.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_budget_rule_and_plans_for_every_layout():
    from transformers import AutoConfig

    from _sp_worker import activation_budget, layout_costs
    from measured import model_config
    from measured_sp import LAYOUTS, PRESETS
    from concertina_hf.planning import CostModel, partition_layers, plan_step

    length = 512
    config = model_config(PRESETS["quick"]["model"], length)
    assert config["num_attention_heads"] % 4 == 0  # pp=1 x sp=4 needs whole heads per rank
    cost = CostModel.from_hf_config(AutoConfig.for_model(**config), dtype_bytes=4)
    costs = layout_costs(cost, list(LAYOUTS))
    assert [c.sp for c in costs] == [2, 4, 1] and all(c.state_shards == 1 for c in costs)
    stage_layouts = [partition_layers(c, lay["pp"]) for c, lay in zip(costs, LAYOUTS)]
    lens = [length, 200, 120, 64, 40]
    # pp=2 x sp=2's own figure, raised (10% steps) where a layout cannot plan a batch: the benchmark's
    # batch, and a sequence twice the figure's length, which some layout cannot plan under it
    rule = activation_budget(costs, stage_layouts, length, 0.5, [lens])
    longer = activation_budget(costs, stage_layouts, length, 0.5, [[2 * length]])
    assert longer["raised"] > 0
    for r in (rule, longer):
        assert r["budget"] == pytest.approx(r["per_layout"][0]["at_frac"] * 1.1 ** r["raised"])
    assert activation_budget(costs, stage_layouts, length, 0.5)["raised"] == 0  # no batch: the figure itself
    for p in rule["per_layout"]:
        ends = (max(p["full_recompute"]), max(p["no_recompute"]))
        assert min(ends) <= p["at_frac"] <= max(ends)
    # sp shares a sequence's activations: one whole sequence per GPU costs less at sp=4 than at sp=1
    assert max(rule["per_layout"][1]["no_recompute"]) < max(rule["per_layout"][2]["no_recompute"])
    for c, sl, lay in zip(costs, stage_layouts, LAYOUTS):
        static = [c.static_memory(sl, s) for s in range(sl.num_stages)]
        budgets = [int(st + rule["budget"]) for st in static]
        plan = plan_step(lens, c, sl, budgets, "adaptive", solver="greedy")
        assert all(pk <= b for pk, b in zip(plan.predicted.peak_memory_bytes, budgets)), lay
        assert plan.knob("sp") is None  # the layout's own stage size is in the cost model, not the plan
