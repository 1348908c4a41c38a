"""The benchmark of the PyTorch-native peer (``benchmarks/torch_pipelining_peer.py``) in its
tiniest run; its packing and stage modules on one process: ``tests/runtime/test_peer_stages.py``.
"""

from __future__ import annotations

import json
import pathlib
import sys

from _helpers import Command

ROOT = pathlib.Path(__file__).resolve().parents[2]


#: the job (a command, started by the session in the background, read through ``launched``)
LAUNCHES = {"tiny": Command(sys.executable, "benchmarks/torch_pipelining_peer.py", "--tiny", "--out", "{out}/peer_tiny",
                            cwd=ROOT, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=600)}


def test_torch_pipelining_peer_benchmark_tiny(launched):
    run = launched("tiny")
    out = run.out / "peer_tiny"
    assert run.codes == [0], run.stderr[0][-6000:]
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
