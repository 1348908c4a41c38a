"""The 4-process sequence-parallel benchmark (benchmarks/measured_sp.py).

Default tier: its budget rule (one activation budget per GPU for every layout: pp=2 x sp=2's
own figure) and that the adaptive planner plans every layout's batch under it
(pure planning, analytic cost model). Slow tier: ``--quick`` end to end (4 gloo processes, three
meshes, ~30 s on 2 busy cores): files and fields, the warm-up loss of every layout equal to the
single-process HF model's, measured activation peaks under the budget.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
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
    # pp=2 x sp=2's own figure, raised (10% steps) where a layout cannot plan the batch: pp=4 x sp=1's
    # last GPU holds the logits of a whole sequence (vocabulary 8192 vs hidden 64 here)
    rule = activation_budget(costs, stage_layouts, length, 0.5, [lens])
    assert rule["raised"] > 0
    assert rule["budget"] == pytest.approx(rule["per_layout"][0]["at_frac"] * 1.1 ** rule["raised"])
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


def test_measured_sp_quick(tmp_path):
    out = tmp_path / "measured_sp_quick"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "benchmarks/measured_sp.py", "--quick", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("measured_sp_quick.md", "measured_sp_quick.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    res = json.loads((tmp_path / "measured_sp_quick.json").read_text())
    (ctx,) = res["contexts"]
    runs = ctx["runs"]
    assert set(runs) == {"pp2xsp2", "pp1xsp4", "pp4xsp1"}
    assert len(ctx["cores_probe"]) == 2 and all(x > 0 for x in ctx["cores_probe"])
    assert ctx["a2a_fit"]["pp4xsp1"] is None
    for name, r in runs.items():
        assert r["tokens_per_s"]["min"] > 0, name
        # same initial weights, same batch: every layout's loss is the single-process HF model's
        assert r["loss_rel_diff"] < 1e-4, (name, r["warmup_loss"], ctx["reference_loss"])
        assert len(r["memory_batch_alloc_peak_bytes"]) == 4
        for k, (got, pred) in enumerate(zip(r["memory_batch_alloc_peak_bytes"],
                                            r["memory_batch_predicted_act_peak_bytes"])):
            assert 0 < got <= ctx["activation_budget_bytes"], (name, k, got, ctx["activation_budget_bytes"])
            assert pred > 0, (name, k)
    assert runs["pp1xsp4"]["stage_of_rank"] == [0, 0, 0, 0] and runs["pp4xsp1"]["stage_of_rank"] == [0, 1, 2, 3]
    assert runs["pp2xsp2"]["pp2xsp2_over_this"] == 1.0
    assert ctx["loss_ok"]
    md = (tmp_path / "measured_sp_quick.md").read_text()
    assert "share" in md and "Cores probe" in md and "| pp1xsp4 |" in md and "## Summary" in md
    # the markdown is rewritten from the JSON alone, unchanged
    (tmp_path / "measured_sp_quick.md").unlink()
    from measured_sp import main

    main(["--from-json", str(tmp_path / "measured_sp_quick.json")])
    assert (tmp_path / "measured_sp_quick.md").read_text() == md
