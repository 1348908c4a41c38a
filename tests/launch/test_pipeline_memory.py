"""Activation memory of a four-stage pipeline, measured against the cost model."""

from __future__ import annotations

import json

from _helpers import free_port


def test_allocated_peak_of_every_pp4_stage_within_its_prediction(tmp_path, monkeypatch):
    """pp=4 (gloo, one launch), ``measured_sp.py``'s layout (1, 3, 3, 1 layers), one 2048-token
    sequence in 32 equal or 24 shrinking slices, no recompute: every stage's allocated activation
    peak (``AllocationTracker``, parameters and gradients left out) is at most its profiled
    prediction and within 8% of it (measured x0.964 to x0.979). The model counts the gradients of
    the keys and values a late slice attended to, held during each layer's backward (about 3 KB
    per key of a hidden-256 Llama, more than a short slice's own activations), and a chunk's rotary
    tables once per stage, not spread over the profiled layers: without them the one-layer first
    stage reads x1.10 to x1.12, the others x1.01 to x1.03 (the benchmark's 8K context: x1.09 and
    x1.02)."""
    import torch.multiprocessing as mp

    import _dist_pipeline_memory as dpm

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    profile = dpm.memory_profile()
    mp.spawn(dpm.worker, args=(4, free_port(), str(tmp_path), profile), nprocs=4, join=True)
    rows = [row for r in range(4) for row in json.loads((tmp_path / f"mem{r}.json").read_text())]
    assert all(row[0] != "crash" for row in rows), [row[1] for row in rows if row[0] == "crash"]
    assert len(rows) == 4 * len(dpm.slicings())
    for name, stage, peak, predicted in sorted(rows):
        print(f"{name:<10} stage {stage}: allocated {peak / 2**20:7.3f} MiB  predicted {predicted / 2**20:7.3f} MiB  "
              f"x{peak / predicted:.3f}")
    for name, stage, peak, predicted in rows:
        assert 0.92 * predicted <= peak <= predicted, (name, stage, peak, predicted)
