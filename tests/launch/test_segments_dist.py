"""Segment-level training at pp = 2 and 4, one gloo process per stage, against the plain-HF
segment reference (loss 1e-5, each stage's gradients 1e-4): hand-made segment plans under every
recompute setting and the adaptive planner's segment plans, llama and qwen2, global heads included, and
forward-only steps."""

from __future__ import annotations

import pytest

import _dist_segments
from _helpers import Launch, reports as read_reports

LAUNCHES = {f"pp{n}": Launch(n, _dist_segments.worker) for n in (2, 4)}


@pytest.mark.parametrize("num_stages", [2, 4])
def test_segment_training_matches_the_segment_reference(num_stages, launched):
    reports = read_reports(launched(f"pp{num_stages}").out, num_stages)
    failures = [f for r in reports for f in r["failures"]]
    assert failures == []
    assert all(r["cases"] == 2 * (7 * 4 + 2) for r in reports)
