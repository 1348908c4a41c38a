"""The benchmark of the PyTorch-native peer (``benchmarks/torch_pipelining_peer.py``) in its
tiniest run; its packing and stage modules on one process: ``tests/runtime/test_peer_stages.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_torch_pipelining_peer_benchmark_tiny(tmp_path):
    out = tmp_path / "peer_tiny"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "benchmarks/torch_pipelining_peer.py", "--tiny", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert "Schedule1F1B" in out.with_suffix(".md").read_text()
    (ctx,) = res["contexts"]
    assert set(ctx["runs"]) == {"adaptive", "adaptive unbounded", "project pp=1", "peer concertina",
                                "peer concertina+ckpt", "peer sdpa", "peer sdpa+ckpt"}
    for name, c in ctx["loss_check"].items():
        assert c["ok"] and c["rel_diff"] <= 1e-4, name
    for name, r in ctx["runs"].items():
        assert r["tokens_per_s"]["min"] > 0, name
        assert all(b > 0 for b in r["alloc_peak_bytes"]), name
    assert any(t["target"] for t in ctx["ratios"])
