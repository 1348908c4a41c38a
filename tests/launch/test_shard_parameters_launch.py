"""``concertina_shard_parameters`` on one launch of 4 gloo processes (pp=1 x sp=2 x dp=2): the
workers are ``tests/training/test_shard_parameters.py`` run by torchrun (its docstring lists the checks).
"""

from __future__ import annotations

import json

import pytest

import test_shard_parameters
from _helpers import torchrun
from test_trainer_pipeline import _load, _reference, _worst_rel


def test_shard_parameters_sp2_dp2_matches_trainer_and_resumes(tmp_path):
    torchrun(4, test_shard_parameters.__file__, "zero3", tmp_path)
    ranks = [json.loads((tmp_path / f"info-rank{r}.json").read_text()) for r in range(4)]
    # one process with both replicas' sequences per step
    ref_info, ref_state = _reference("llama", tmp_path / "ref", per_device_train_batch_size=6,
                                     **test_shard_parameters.TRAIN)
    info = ranks[0]
    assert all(r["losses"] == info["losses"] for r in ranks)
    assert len(info["losses"]) == test_shard_parameters.STEPS
    assert max(abs(a - b) for a, b in zip(info["losses"], ref_info["losses"])) < 1e-5, (info, ref_info)
    assert max(abs(a - b) for a, b in zip(info["grad_norms"], ref_info["grad_norms"])) < 1e-4
    worst, name = _worst_rel(ref_state, _load(tmp_path / "final"))  # full HF weights, the update within 1e-3
    assert worst < 1e-3, (name, worst)
    # the two sp ranks of each replica hold half of each tensor each: their shards cover the stage once
    total = info["elements"] * 4
    for replica in (0, 1):
        mine = [r for r in ranks if r["topology"][2] == replica]
        assert sum(r["param_bytes"] for r in mine) == total and sum(r["grad_bytes"] for r in mine) == total
        assert sum(r["optim_bytes"] for r in mine) == 2 * total
    for r in ranks:  # the planner's static memory (no gathered layer): within FSDP2's uneven rows
        held = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        assert held == pytest.approx(r["predicted_state_bytes"], rel=0.05), (held, r["predicted_state_bytes"])
    # resumed at step 2: the uninterrupted run's step 3 and weights
    for r in ranks:
        assert r["resumed_losses"] == pytest.approx(info["losses"], abs=1e-6), r["resumed_losses"]
    got, resumed = _load(tmp_path / "final"), _load(tmp_path / "resumed")
    assert max(((resumed[k] - got[k]).norm() / got[k].norm().clamp_min(1e-12)).item() for k in got) < 1e-6
