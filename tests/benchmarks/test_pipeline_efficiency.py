"""Smoke test of benchmarks/pipeline_efficiency.py --quick (tiny model, 256 tokens, ~15 s).

Two gloo ranks run the project's pp=1 (rank 0 alone) and pp=2 adaptive, unbounded and under the
binding budget, interleaved. Checks the files and fields the benchmark promises, and what must hold
on any machine: pp=1 and the first pp=2 job of the warm-up round start from the same weights on the
same batch, so their losses are equal (the two pp=2 jobs share one pipeline's weights, trained in
turn); every stage's breakdown sums to its step; the gap decomposition's planned parts (embedding,
layers, head, recompute) sum to the simulator's busy time of each stage.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_quick(script: str, out: pathlib.Path) -> tuple[dict, str]:
    """``python benchmarks/<script> --quick --out <out>`` in a subprocess (the package from ``src``):
    its JSON record, whose command and shared header it checks, and its markdown. (The one-off
    studies under ``benchmarks/studies/`` check themselves: ``--check``, out of the test suite.)"""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["command"].startswith(f"python benchmarks/{script} --quick"), res["command"]
    assert res["header"]["command"] == res["command"] and len(res["header"]["load_after"]) == 3
    return res, out.with_suffix(".md").read_text()


def test_pipeline_efficiency_quick(tmp_path):
    res, md = _run_quick("pipeline_efficiency.py", tmp_path / "pe")
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
