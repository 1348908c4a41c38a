"""Whole-doc / per-doc placements inside a stage (issue 23, :mod:`concertina_hf.runtime.context_parallel`)
on real gloo launches: pp=1 x sp=2, pp=2 x sp=2 and pp=1 x sp=4, one launch each running every
plan of ``_dist_context.py`` on five tiny models (Llama, one K/V head, 6 heads / 3 K/V heads, MLA,
sinks with a sliding window) against the single-process HF model: loss 1e-5, every gradient of
the stage 1e-4 after the sum over sp, forward-only loss and gathered logits; Ulysses chunks on
heads Ulysses cannot split are refused naming ``concertina_sequence_parallel_mode``. Prints each
rank's measured activation peak per plan.
"""

from __future__ import annotations

import json

import pytest

from _helpers import free_port


@pytest.mark.parametrize("pp,sp", [(1, 2), (2, 2), (1, 4)])
def test_placed_chunks_match_hf(pp, sp, tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    import _dist_context

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    world = pp * sp
    mp.spawn(_dist_context.worker, args=(world, free_port(), str(tmp_path), pp, sp), nprocs=world, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in reports:
        print(f"rank {r['rank']}: {len(r['cases'])} cases; activation peak per plan (bytes; llama: the planner's "
              "prediction of the stage):")
        for kind, name, stage, _, peak, predicted in r["peaks"]:
            vs = "" if predicted is None else f"  predicted {predicted:>9.0f}  measured/predicted x{peak / predicted:.2f}"
            print(f"  {kind:<22} {name:<24} stage {stage} {peak:>9}{vs}")
    failures = [f for r in reports for f in r["failures"]]
    assert failures == []
    models = 5
    for r in reports:  # every model x plan ran, was refused (Ulysses chunks, 6 heads) or skipped (the same), + eval
        assert len(r["cases"]) + len(r["refusals"]) + len(r["skipped"]) == models * r["plans"] + models, r
        assert len(r["refusals"]) == 1 and all(k.startswith("llama H=6") for k in r["skipped"])
        assert r["plans"] == len(_dist_context.PLANS) + 3
