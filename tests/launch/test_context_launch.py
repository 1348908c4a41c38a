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
        print(f"rank {r['rank']}: {len(r['cases'])} cases; activation peak per plan (bytes):")
        for kind, name, _, peak in r["peaks"]:
            print(f"  {kind:<22} {name:<22} {peak:>9}")
    failures = [f for r in reports for f in r["failures"]]
    assert failures == []
    models, plans = 5, len(_dist_context.PLANS)
    refused = 1  # Ulysses chunks of llama H=6 K=3 (sp=2: 3 K/V heads; sp=4: 6 heads)
    assert all(len(r["cases"]) == models * plans - refused + models for r in reports), [len(r["cases"]) for r in reports]
    assert all(len(r["refusals"]) == refused for r in reports)
