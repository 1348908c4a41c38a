"""``concertina_shard_optimizer`` on one launch of 2 gloo processes (pp=1 x sp=2): the workers
are ``tests/training/test_sharded_optimizer.py`` run by torchrun (its docstring lists the checks).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

import test_sharded_optimizer
from _helpers import torchrun
from test_sharded_optimizer import STEPS, TRAIN
from test_trainer_pipeline import _load, _model, _reference


def test_sharded_optimizer_sp2_matches_trainer_checkpoints_and_resumes(tmp_path):
    from concertina_hf.training.manifest import CheckpointError, verify_checkpoint

    torchrun(2, test_sharded_optimizer.__file__, "zero", tmp_path)
    ranks = [json.loads((tmp_path / f"info-rank{r}.json").read_text()) for r in range(2)]
    ref_info, ref_state = _reference("llama", tmp_path / "ref", **TRAIN)
    info = ranks[0]
    assert all(r["losses"] == info["losses"] for r in ranks)
    assert len(info["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(info["losses"], ref_info["losses"])) < 1e-5, (info, ref_info)
    init = _model("llama").state_dict()
    got = _load(tmp_path / "final")
    worst = max((((got[k] - init[k]) - (ref_state[k] - init[k])).norm()
                 / (ref_state[k] - init[k]).norm().clamp_min(1e-12)).item() for k in ref_state)
    assert worst < 1e-3, worst
    # each rank holds the two Adam moments of its share: disjoint shares covering the stage
    shares = [set(r["state_params"]) for r in ranks]
    assert shares[0] and shares[1] and not shares[0] & shares[1] and shares[0] | shares[1] == set(info["params"])
    assert sum(r["state_elements"] for r in ranks) == 2 * info["param_elements"]
    print("Adam state elements per rank:", [r["state_elements"] for r in ranks], "of", 2 * info["param_elements"])
    assert all(r["state_elements"] < 1.5 * info["param_elements"] for r in ranks), [r["state_elements"] for r in ranks]
    # the checkpoint: one DCP shard file per rank (each about its share), no consolidated file;
    # all of them in the manifest, which verifies, and a damaged shard is refused by name
    ckpt = tmp_path / "checkpoint-2"
    dcp_dir = ckpt / "optimizer.stage0-of-1.dcp"
    assert sorted(os.listdir(dcp_dir)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "optimizer.stage0-of-1.pt").exists()
    # each rank's file holds the Adam moments of its share, and only those
    from torch.distributed.checkpoint import FileSystemReader

    where = {idx.fqn: info.relative_path for idx, info in FileSystemReader(str(dcp_dir)).read_metadata()
             .storage_data.items() if idx.fqn.endswith((".exp_avg", ".exp_avg_sq"))}
    assert len(where) == 2 * len(info["params"])
    for r, share in enumerate(shares):
        assert {k for k, f in where.items() if f == f"__{r}_0.distcp"} == {
            f"state.{n}.{m}" for n in share for m in ("exp_avg", "exp_avg_sq")}
    manifest = verify_checkpoint(str(ckpt))
    assert manifest["optimizer_shards"] == 2 and manifest["shard_optimizer"] is True
    assert {f"optimizer.stage0-of-1.dcp/{n}" for n in (".metadata", "__0_0.distcp", "__1_0.distcp")} <= set(
        manifest["files"])
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    with open(damaged / "optimizer.stage0-of-1.dcp" / "__1_0.distcp", "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"__1_0.distcp does not match"):
        verify_checkpoint(str(damaged))
    # resumed at step 2: the uninterrupted run's last two steps and weights
    plain_file = tmp_path.parent / f"{tmp_path.name}-resumed-plain" / "checkpoint-3" / "optimizer.stage0-of-1.pt"
    assert plain_file.is_file()  # a plain optimizer's checkpoint: one file per stage
    for case in ("same", "plain", "dp2", "from_plain"):
        for r in ranks:
            assert r[f"resumed_losses_{case}"] == pytest.approx(info["losses"], abs=1e-5), (case, r)
        resumed = _load(tmp_path / f"resumed-{case}")
        worst = max(((resumed[k] - got[k]).norm() / got[k].norm().clamp_min(1e-12)).item() for k in got)
        assert worst < (1e-6 if case != "dp2" else 1e-5), (case, worst)
    for r in ranks:  # refused on every rank, before a step, naming the setting
        assert r["pp2_error"] and "concertina_pipeline_size=1" in r["pp2_error"], r["pp2_error"]
        assert r["pp2_steps"] == 0
