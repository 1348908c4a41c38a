"""Activation memory of a four-stage pipeline, measured against the cost model."""

from __future__ import annotations

from _helpers import reports as read_reports, run_ranks


def test_allocated_peak_of_every_pp4_stage_within_its_prediction(tmp_path):
    """pp=4 (gloo, one launch), ``measured_sp.py``'s layout (1, 3, 3, 1 layers), one 2048-token
    sequence in 32 equal or 24 shrinking slices, no recompute: every stage's allocated activation
    peak (``AllocationTracker``, parameters and gradients left out) is at most its profiled
    prediction and within 8% of it (measured x0.964 to x0.979). The model counts the gradients of
    the keys and values a late slice attended to, held during each layer's backward (about 3 KB
    per key of a hidden-256 Llama, more than a short slice's own activations), and a chunk's rotary
    tables once per stage, not spread over the profiled layers: without them the one-layer first
    stage reads x1.10 to x1.12, the others x1.01 to x1.03 (the benchmark's 8K context: x1.09 and
    x1.02)."""
    import _dist_pipeline_memory as dpm

    profile = dpm.memory_profile()
    run_ranks(4, dpm.worker, str(tmp_path), profile, logs=tmp_path / "logs")
    reports = read_reports(tmp_path, 4)
    rows = [row for r in reports for row in r["rows"]]
    assert [f for r in reports for f in r["failures"]] == []
    assert len(rows) == 4 * len(dpm.slicings())
    for name, stage, peak, predicted in sorted(rows):
        print(f"{name:<10} stage {stage}: allocated {peak / 2**20:7.3f} MiB  predicted {predicted / 2**20:7.3f} MiB  "
              f"x{peak / predicted:.3f}")
    for name, stage, peak, predicted in rows:
        assert 0.92 * predicted <= peak <= predicted, (name, stage, peak, predicted)
