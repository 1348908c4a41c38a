"""Smoke test of the measured benchmark (benchmarks/measured.py) in its tiniest setting.

One run (~30-60 s on 2 busy cores): a profiled cost model, two pipeline ranks on gloo running
adaptive, packed and split, and plain ``transformers.Trainer`` with and without checkpointing,
all on the same stdlib batches. Checks the files and fields the README and run_all.py promise,
and one number that must hold whatever the machine: the pipeline's first-step loss equals the
Trainer's (same weights, same batch).
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


def run_quick(script: str, out: pathlib.Path) -> tuple[dict, str]:
    """``python benchmarks/<script> --quick --out <out>`` in a subprocess (the package from ``src``):
    its JSON record, whose command it checks, and its markdown."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["command"].startswith(f"python benchmarks/{script} --quick"), res["command"]
    return res, out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_measured_benchmark_tiny(tmp_path):
    out = tmp_path / "measured_tiny"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "benchmarks/measured.py", "--tiny", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("measured_tiny.md", "measured_tiny.json", "measured_tiny.png", "gantt_measured_tiny.png"):
        assert (tmp_path / name).is_file() and (tmp_path / name).stat().st_size > 0, name
    import measured

    res = json.loads((tmp_path / "measured_tiny.json").read_text())
    assert res["cost_model"]["source"] == "profiled"
    (ctx,) = res["contexts"]
    assert ctx["max_len"] == 256
    runs = ctx["runs"]
    assert runs["adaptive"]["strategy"] == "adaptive"
    assert set(ctx["best"]) == {"packed", "split"}
    for name, r in runs.items():
        assert r["tokens_per_s"]["min"] > 0, name
        assert r["predicted_step_s"]["median"] > 0, name
        assert len(r["meter_peak_bytes"]) == 2 and all(b > 0 for b in r["meter_peak_bytes"]), name
        assert all(b > 0 for b in r["memory_batch_alloc_peak_bytes"]), name
        # issue 13: the allocated activation peak (parameters, their views and gradients left
        # out) never above the activation budget, and within 5% of the plan's prediction on
        # every stage, either way (measured: -0.9% to +0.1%, seeds 0-2). Before: one CI run's adaptive plan
        # peaked +16.7% on stage 0 (the embedding's and LM head's weight gradients, not modelled
        # per backward, and gloo send buffers kept until the step's end; tests/test_memory_model.py)
        # (the memory batch's own plan: the tracker runs on that step only; tests/test_measured_memory_pairs.py)
        for s, got, pred in measured.memory_peak_pairs(r):
            assert got <= ctx["activation_budget_bytes"], (name, s, got, ctx["activation_budget_bytes"])
            assert got <= 1.05 * pred and pred <= 1.05 * got, (name, s, got, pred, got / pred)
        assert r["plan_wait_s"]["max"] >= 0, name
        # where each stage's step went: parts >= 0 summing (medians of each) to about the step time
        for s, b in enumerate(r["stage_breakdown"]):
            parts = [b[k] for k in ("plan_wait", "compute", "comm_wait", "other", "optimizer")]
            assert min(parts) >= 0 and b["compute"] > 0 and b["comm_wait"] > 0, (name, s, b)
            assert abs(sum(parts) - b["step"]) <= 0.25 * b["step"], (name, s, b)
    assert set(ctx["trainer"]) == {"trainer", "trainer+ckpt"}
    for r in ctx["trainer"].values():
        assert r["tokens_per_s_stats"]["median"] > 0 and r["alloc_peak_bytes"] > 0
    # checkpointing must lower the Trainer's allocated activation peak
    assert ctx["trainer"]["trainer+ckpt"]["alloc_peak_bytes"] < ctx["trainer"]["trainer"]["alloc_peak_bytes"]
    # same initial weights and batch: the pipeline's loss is the Trainer's
    assert ctx["loss_check"]["rel_diff"] < 1e-4, ctx["loss_check"]
    assert ctx["gantt"]["actions"] and ctx["gantt"]["plan"]
    names = {t["target"] for t in res["targets"]}
    assert any("best packed" in n for n in names) and any("Trainer" in n for n in names)
    assert {"max allocated activation peak / budget (every run and stage)",
            "allocated activation peak vs predicted (every run and stage)"} <= names
    assert all(isinstance(t["met"], bool) for t in res["targets"])
    md = (tmp_path / "measured_tiny.md").read_text()
    assert "## Targets" in md and "## Context 256 tokens" in md and "| comm wait |" in md


def test_runtime_overhead_quick(tmp_path):
    """benchmarks/runtime_overhead.py --quick (a few seconds): every variant timed, the files
    written with their command, and the unmetered step saves the same tensors (counted by an
    outer hook) as the metered one would hook."""
    import runtime_overhead

    res = runtime_overhead.main(["--quick", "--out", str(tmp_path / "ro")])
    (s,) = res["settings"]
    assert all(s["median_s"][k] > 0 for k in runtime_overhead.VARIANTS)
    assert s["saved_tensors_per_step"] > 0 and s["chunks"] == 5 and s["tokens"] == 5 * 32
    assert (tmp_path / "ro.md").read_text().startswith("# Runtime overhead")
    rec = json.loads((tmp_path / "ro.json").read_text())
    assert rec["command"].startswith("python benchmarks/runtime_overhead.py --quick") and "load_average" in rec


def test_chunk_cap_quick(tmp_path):
    """benchmarks/chunk_cap.py --quick (tiny model, ~10 s): both plans of each batch run, the capped
    one within the profiled range, the uncapped one beyond it (one chunk per step at pp=1)."""
    res, md = run_quick("chunk_cap.py", tmp_path / "cc")
    assert "load_average" in res
    cap = res["max_chunk_tokens"]
    rows = {(r["batch"], r["plan"]): r for r in res["rows"]}
    assert {p for _, p in rows} == {"capped", "uncapped"}
    assert all(r["largest_chunk"] <= cap for (_, p), r in rows.items() if p == "capped")
    assert any(r["largest_chunk"] > cap for (_, p), r in rows.items() if p == "uncapped")
    assert "| capped |" in md


def test_predicted_gap_quick(tmp_path):
    """benchmarks/predicted_gap.py --quick (pure planning on measured_quick.json's batches, a few
    seconds): every context planned, the measured ratios carried over, the bound never below the
    plan's own ratio (a plan's step is at least its slowest stage's busy time less recompute)."""
    import predicted_gap

    rec = predicted_gap.main(["--quick", "--out", str(tmp_path / "pg")])
    src = json.loads((ROOT / "benchmarks" / "results" / "measured_quick.json").read_text())
    assert [c["max_len"] for c in rec["contexts"]] == [c["max_len"] for c in src["contexts"]]
    for c, s in zip(rec["contexts"], src["contexts"]):
        assert c["split"]["measured_ratio"] == s["ratios"]["adaptive_over_split"]
        for strategy in ("split", "packed"):
            assert 0 < c[strategy]["predicted_ratio"] <= c[strategy]["bound_ratio"] * (1 + 1e-9)
        for lo, step in zip(c["adaptive_losses"], c["adaptive_s"]):
            assert lo["bound_s"] + lo["bubble_s"] + lo["recompute_s"] == pytest.approx(step, rel=1e-9)
    assert (tmp_path / "pg.md").read_text().startswith("<!-- made by: python benchmarks/predicted_gap.py --quick")
    assert "load_average" in json.loads((tmp_path / "pg.json").read_text())
