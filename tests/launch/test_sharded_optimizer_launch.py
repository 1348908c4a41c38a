"""``concertina_shard_optimizer`` on one launch of 2 gloo processes (pp=1 x sp=2, option on,
:func:`_worker`): ``ConcertinaTrainer`` equals ``Trainer`` on one process, each rank holds the Adam
state of only its share of the parameters, the checkpoint holds one DCP shard file per rank, and
resuming from it is exact at the same layout, with a plain optimizer, at dp=2 x sp=1 and from the
plain run's checkpoint; resuming at pp=2 is refused on every rank (the list in
``tests/training/test_sharded_optimizer.py``'s docstring, with its one-process checks).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from _helpers import Launch
from _models import load_saved, tiny_model, train_reference

STEPS = 4
# two parameter groups (decay, no decay), both sharded; a linear schedule (the resumed step's
# learning rate must be the saved one); 2 rows per micro-batch: one replica of sp=2 or two of 1
TRAIN = dict(max_steps=STEPS, weight_decay=0.1, per_device_train_batch_size=2, train_sampling_strategy="sequential")
SIZES = dict(concertina_pipeline_size=1, concertina_sequence_parallel_size=2, concertina_max_tokens_per_chunk=16)
# the same global batch over two replicas of one process each
DP2 = dict(concertina_pipeline_size=1, concertina_data_parallel_size=2, concertina_max_tokens_per_chunk=16)



def test_sharded_optimizer_sp2_matches_trainer_checkpoints_and_resumes(launched, tmp_path):
    from concertina_hf.training.manifest import CheckpointError, verify_checkpoint

    out = launched("zero").out
    ranks = [json.loads((out / f"info-rank{r}.json").read_text()) for r in range(2)]
    ref_info, ref_state = train_reference("llama", tmp_path / "ref", **TRAIN)
    info = ranks[0]
    assert all(r["losses"] == info["losses"] for r in ranks)
    assert len(info["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(info["losses"], ref_info["losses"])) < 1e-5, (info, ref_info)
    init = tiny_model("llama").state_dict()
    got = load_saved(out / "final")
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
    ckpt = out / "checkpoint-2"
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
    plain_file = out.parent / f"{out.name}-resumed-plain" / "checkpoint-3" / "optimizer.stage0-of-1.pt"
    assert plain_file.is_file()  # a plain optimizer's checkpoint: one file per stage
    for case in ("same", "plain", "dp2", "from_plain"):
        for r in ranks:
            assert r[f"resumed_losses_{case}"] == pytest.approx(info["losses"], abs=1e-5), (case, r)
        resumed = load_saved(out / f"resumed-{case}")
        worst = max(((resumed[k] - got[k]).norm() / got[k].norm().clamp_min(1e-12)).item() for k in got)
        assert worst < (1e-6 if case != "dp2" else 1e-5), (case, worst)
    for r in ranks:  # refused on every rank, before a step, naming the setting
        assert r["pp2_error"] and "concertina_pipeline_size=1" in r["pp2_error"], r["pp2_error"]
        assert r["pp2_steps"] == 0


def _worker(out: str) -> None:
    import torch

    from _models import COMMON, logged, tiny_dataset, tiny_model

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from concertina_hf.training.sharded_optimizer import is_sharded

    def args(output_dir, sizes=SIZES, shard=True, **kw):
        return ConcertinaTrainingArguments(output_dir=output_dir, concertina_shard_optimizer=shard,
                                           **sizes, **dict(COMMON, **dict(TRAIN, **kw)))

    trainer = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(),
                                args=args(out, save_strategy="steps", save_steps=1))
    trainer.train()
    info = logged(trainer)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    # the Adam moments this rank holds: the parameters of its share only
    assert is_sharded(trainer.optimizer)
    local = trainer.optimizer.optim.state
    info["state_params"] = sorted(names[id(p)] for p in local)
    info["state_elements"] = sum(t.numel() for s in local.values() for k, t in s.items() if k != "step")
    info["params"] = sorted(names.values())
    info["param_elements"] = sum(p.numel() for p in trainer.model.parameters())
    rank = info["rank"] = trainer.topology.rank
    trainer.save_model(os.path.join(out, "final"))
    # resuming from the step-2 checkpoint: sharded at the same layout, with a plain optimizer, and
    # sharded over two replicas (dp=2 x sp=1, one row per replica and micro-batch: the same steps)
    # (which saves plain checkpoints, save_steps=1 as the resumed state says, from whose step 3 a
    # sharded run resumes in turn)
    cases = {"same": dict(), "plain": dict(shard=False, save_strategy="steps", save_steps=1),
             "dp2": dict(sizes=DP2, per_device_train_batch_size=1), "from_plain": dict()}
    for case, kw in cases.items():
        resumed = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(),
                                    args=args(f"{out}-resumed-{case}", **dict(dict(save_strategy="no"), **kw)))
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2") if case != "from_plain" else
                      os.path.join(f"{out}-resumed-plain", "checkpoint-3"))
        assert is_sharded(resumed.optimizer) == kw.get("shard", True)
        resumed.save_model(os.path.join(out, f"resumed-{case}"))
        info[f"resumed_losses_{case}"] = logged(resumed)["losses"]
    # another pipeline size: refused before the first step, on every rank (the abort watch, which
    # would end this process once a rank failed, stopped first: the refusal is what is tested)
    from concertina_hf.runtime.distributed import _AbortWatch

    torch.distributed.barrier()
    _AbortWatch.current.stop()
    refused = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), args=args(
        f"{out}-resumed-pp2", save_strategy="no", sizes=dict(concertina_pipeline_size=2,
                                                               concertina_max_tokens_per_chunk=16)))
    try:
        refused.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        info["pp2_error"] = None
    except ValueError as e:
        info["pp2_error"] = str(e)
    info["pp2_steps"] = refused.state.global_step
    with open(os.path.join(out, f"info-rank{rank}.json"), "w") as fh:
        json.dump(info, fh)
    refused.end()


#: the launch (started by the session, read through the ``launched`` fixture)
LAUNCHES = {"zero": Launch(2, _worker)}
