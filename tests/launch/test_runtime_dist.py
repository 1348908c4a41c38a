"""Multi-process runtime tests: 2 and 4 gloo ranks, one process per pipeline stage.

One launch per pipeline size; every rank checks many cases (two models, every chunking and
recompute setting, two pipeline groups, a prefetching schedule, the planner's adaptive plans,
evaluation, the full state dict, bf16 autocast, tied input/output embeddings, and with 4 ranks two
pipelines on subgroups) against the single-process HF reference, loss and its own stage's
gradients.
"""

from __future__ import annotations

import pytest

import _dist_runtime
from _helpers import Launch, reports as read_reports

LAUNCHES = {f"pp{n}": Launch(n, _dist_runtime.worker) for n in (2, 4)}


@pytest.mark.parametrize("num_stages", [2, 4])
def test_pipeline_matches_hf(num_stages, launched):
    reports = read_reports(launched(f"pp{num_stages}").out, num_stages)
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
