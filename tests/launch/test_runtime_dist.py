"""Multi-process runtime tests: 2 and 4 gloo ranks, one process per pipeline stage.

One launch per pipeline size; every rank checks many cases (two models, every chunking and
recompute setting, two pipeline groups, a prefetching schedule, the planner's adaptive plans,
evaluation, the full state dict, bf16 autocast, tied input/output embeddings, and with 4 ranks two
pipelines on subgroups) against the single-process HF reference, loss and its own stage's
gradients.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch.multiprocessing as mp

import _dist_runtime
from _helpers import free_port


@pytest.mark.parametrize("num_stages", [2, 4])
def test_pipeline_matches_hf(num_stages, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mp.spawn(_dist_runtime.worker, args=(num_stages, free_port(), str(tmp_path)), nprocs=num_stages, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(num_stages)]
    for r in reports:
        print(f"rank {r['rank']}: {r['cases']} cases; measured vs predicted activation peak (bytes):")
        for name, measured, predicted in r["memory"]:
            print(f"  {name:<24} {measured:>9} {predicted:>11.0f}  x{measured / predicted:.2f}")
    for r in reports:
        for kind, name, stage, loss_err, err, err_fp32 in r["amp"]:
            print(f"  autocast {kind} {name:<16} stage {stage}: loss rel err {loss_err:.1e}, grad rel err {err:.1e} "
                  f"(vs float32 reference {err_fp32:.1e})")
    failures = [f for r in reports for f in r["failures"]]
    assert failures == []
    assert all(r["cases"] >= 2 * 11 + 2 * 2 + 3 for r in reports)
    assert all(len(r["amp"]) >= 4 for r in reports)
