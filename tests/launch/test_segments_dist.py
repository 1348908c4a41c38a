"""Segment-level training at pp = 2 and 4, one gloo process per stage, against the plain-HF
segment reference (loss 1e-5, each stage's gradients 1e-4): hand-made segment plans under every
recompute setting and the adaptive planner's segment plans, llama and qwen2, global heads included, and
forward-only steps."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch.multiprocessing as mp

import _dist_segments
from _helpers import free_port


@pytest.mark.parametrize("num_stages", [2, 4])
def test_segment_training_matches_the_segment_reference(num_stages, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mp.spawn(_dist_segments.worker, args=(num_stages, free_port(), str(tmp_path)), nprocs=num_stages, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(num_stages)]
    failures = [f for r in reports for f in r["failures"]]
    assert failures == []
    assert all(r["cases"] == 2 * (7 * 4 + 2) for r in reports)
