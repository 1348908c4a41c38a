"""Smoke test of benchmarks/sharded_state.py --quick (ZeroRedundancyOptimizer vs FSDP2 on a stage's
layers, 2 gloo processes): the files and fields it promises, and what must hold on any machine:
both variants compute the same steps (same losses), and each shards the optimizer state (each
rank holds about half of it)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sharded_state_benchmark_quick(tmp_path):
    out = tmp_path / "sharded_state_quick"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "benchmarks/sharded_state.py", "--quick", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["command"].startswith("python benchmarks/sharded_state.py --quick")
    assert "Command:" in out.with_suffix(".md").read_text()
    z, f = res["variants"]["zero"], res["variants"]["fsdp2"]
    assert len(z["losses"]) == len(f["losses"]) == res["config"]["steps"] + res["config"]["warmup"]
    assert res["loss_max_abs_diff"] < 1e-4, (z["losses"], f["losses"])
    assert z["step_s_median"] > 0 and f["step_s_median"] > 0
    # both shard the Adam moments over the two ranks: each holds about half
    for v in (z, f):
        states = [r["optimizer"] for r in v["resident_bytes_per_rank"]]
        assert all(0.3 < s / sum(states) < 0.7 for s in states), states
    # FSDP2 also shards the parameters between steps; ZeRO keeps them whole
    assert all(rf["params"] < 0.7 * rz["params"] for rf, rz in zip(f["resident_bytes_per_rank"],
                                                                   z["resident_bytes_per_rank"]))
