"""benchmarks/layout_measured.py without its 4-process run: the candidates are exactly the runnable
layouts of 4 processes for its model, the long-tail distribution has one 16K sequence per step,
and the verdict compares auto's pick with the fastest fixed layout against the measured noise."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_candidates_are_every_runnable_layout_and_one_long_sequence_per_step():
    from layout_measured import FIXED, LONG, SHAPE, distributions
    from concertina_hf.planning.layouts import runnable_layouts

    ok, _ = runnable_layouts({k: SHAPE[k] for k in ("num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads")}, 4)
    assert sorted((l.pp, l.sp, l.dp) for l in ok) == sorted(FIXED)
    corpus = [[i % 50 + 1] * (100 + 37 * i) for i in range(200)]
    d = distributions(corpus, 3, 0, quick=False)
    for i in range(3):
        step = [len(r) for r in d["longtail"]["rows"][8 * i:8 * i + 8]]
        assert step[0] == LONG and max(step[1:]) <= 512, step
    assert len(d["short"]["rows"]) == 48 and max(map(len, d["short"]["rows"])) <= 512


def test_verdict_against_noise():
    from layout_measured import summarize

    def rounds(tps):
        return [{"candidate": c, "timed_tokens": t, "timed_s": 1.0} for c, ts in tps.items() for t in ts]

    pick, other = "pp2 x sp1 x dp2", "pp1 x sp1 x dp4"
    base = {"auto_pick": pick}
    s = summarize(dict(base, rounds=rounds({"auto": [100, 104], pick: [101, 99], other: [90, 91]})))
    assert s["verdict"] == "fastest" and s["fastest_fixed"] == pick
    s = summarize(dict(base, rounds=rounds({"auto": [100, 100], pick: [95, 105], other: [103, 103]})))
    assert s["verdict"] == "within noise" and abs(s["pick_over_fastest"] - 100 / 103) < 1e-9
    s = summarize(dict(base, rounds=rounds({"auto": [100, 100], pick: [100, 100], other: [130, 131]})))
    assert s["verdict"] == "slower"
