"""Smoke test of benchmarks/stage_contention.py --quick (tiny model, two gloo ranks, ~15 s).

Checks the files and fields the benchmark promises, and what holds on any machine: a rank waiting
for its neighbour the executor's way (``StageComm.exchange``: ``batch_isend_irecv`` then
``Work.wait``) sleeps in the wait, it does not poll (its CPU seconds are a small share of the
wait's wall seconds), so a waiting stage never takes a core from the computing one.
"""

from __future__ import annotations

from test_benchmarks_smoke import run_quick


def test_stage_contention_quick(tmp_path):
    res, md = run_quick("stage_contention.py", tmp_path / "sc")
    assert len(res["cores"]) == 2 and len(res["loadavg"]) == 2 and "| layers |" in md
    s = res["summary"]
    for what in ("layers", "head", "embed"):
        for peer in ("sleep", "recv", "layers", "head"):
            row = s[what][peer]
            assert row["wall_s"] > 0 and row["cpu_s"] > 0 and row["passes"] >= 3, (what, peer, row)
        assert s[what]["sleep"]["wall_over_sleep"] == 1.0
    # a polling wait would burn about a core (share ~1); a blocking one a few thousandths
    assert 0 <= s["recv_peer_cpu_share"] < 0.05, s["recv_peer_cpu_share"]
