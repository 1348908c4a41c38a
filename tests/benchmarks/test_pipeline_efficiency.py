"""Smoke test of benchmarks/pipeline_efficiency.py --quick (tiny model, 256 tokens, ~15 s).

Two gloo ranks run the project's pp=1 (rank 0 alone) and pp=2 adaptive, unbounded and under the
binding budget, interleaved. Checks the files and fields the benchmark promises, and what must hold
on any machine: pp=1 and the first pp=2 job of the warm-up round start from the same weights on the
same batch, so their losses are equal (the two pp=2 jobs share one pipeline's weights, trained in
turn); every stage's breakdown sums to its step; the gap decomposition's planned parts (embedding,
layers, head, recompute) sum to the simulator's busy time of each stage.
"""

from __future__ import annotations

from test_benchmarks_smoke import run_quick


def test_pipeline_efficiency_quick(tmp_path):
    res, md = run_quick("pipeline_efficiency.py", tmp_path / "pe")
    assert "load_average" in res and "| 256 | pp=2 budget |" in md
    (c,) = res["contexts"]
    assert len(c["parallel_capacity"]) == 2
    jobs = c["jobs"]
    assert set(jobs) == {"pp=1", "pp=2 unbounded", "pp=2 budget"}
    assert jobs["pp=1"]["pp"] == 1 and len(jobs["pp=1"]["stage_breakdown"]) == 1
    a, b = jobs["pp=1"]["losses"][0], jobs["pp=2 unbounded"]["losses"][0]
    assert abs(a - b) <= 1e-5 * abs(a), (a, b)
    for name, j in jobs.items():
        for b in j["stage_breakdown"]:
            parts = sum(b[k] for k in ("plan_wait", "compute", "comm_wait", "other", "optimizer"))
            assert abs(parts - b["step"]) <= 0.02 * b["step"] + 1e-3, (name, b)
            assert 0 < b["cpu_share"] <= 1.05, (name, b)
        if j["pp"] == 2:
            assert len(j["stage_breakdown"]) == 2 and j["biggest_losses"]
            assert 0 < j["planned_over_2x_pp1"] and 0 < j["over_2x_pp1"]
            assert set(j["planned_losses"]) == {"chunk_overhead", "imbalance", "bubble"}
            assert j["planned_losses"]["imbalance"] >= 0 and j["planned_losses"]["bubble"] >= 0
    assert {t["job"] for t in res["targets"]} == {"pp=2 unbounded", "pp=2 budget"}
    # the gap decomposition: the planned parts of each stage add up to the simulator's busy time,
    # the factors multiply to the measured over planned speedup on the busier stage's terms
    for name, g in c["gap"].items():
        for parts, planned in zip(g["planned_parts_s"], g["planned_compute_s"]):
            assert abs(sum(parts.values()) - planned) <= 1e-9 + 1e-9 * planned, (name, parts, planned)
        assert all(f > 0 for f in g["compute_factor"] + g["cpu_factor"]), (name, g)
        if g["pp"] == 2:
            assert g["planned_parts_s"][0]["embed"] > 0 and g["planned_parts_s"][0]["head"] == 0
            assert g["planned_parts_s"][1]["head"] > 0 and g["planned_parts_s"][1]["embed"] == 0
            assert g["speedup_measured_over_planned"] > 0 and g["stage0_cpu_vs_pp1"] > 0
