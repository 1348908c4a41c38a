"""benchmarks/segments.py at a small scale: under segment gradient "none" with a K/V tail the measured
activation peak stays flat when the sequence doubles, while full attention's doubles; and the paper-scale
simulation keeps "none" within its budget where the chained options cannot fit."""

from __future__ import annotations

import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))


def test_gradient_none_bounds_the_measured_peak():
    import segments

    rows = segments.measure([2048, 4096], 512, 512)
    grow = segments.growth(rows, "peak_activation_bytes")
    assert grow["tail/none"] <= segments.TARGET_TAIL, grow
    assert grow["full"] >= segments.TARGET_FULL and grow["tail/previous"] >= segments.TARGET_FULL, grow
    sim = segments.simulate_paper([262144], 8192, 8192, 80.0)
    by = {r["option"]: r for r in sim}
    assert "infeasible" in by["tail/previous"]["adaptive"] and "infeasible" in by["full"]["adaptive"]
    assert max(by["tail/none"]["adaptive"]["peak_gib"]) <= 80.0
