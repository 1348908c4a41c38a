"""``concertina_shard_optimizer``: the stage's optimizer state sharded over its ``dp x sp`` ranks
(torch's ``ZeroRedundancyOptimizer``, ``sharded_optimizer.shard_optimizer``), checkpointed with
``torch.distributed.checkpoint`` (each rank writes its share, ``sharded_optimizer.save_optimizer_shards``).

Default tier: the planner's static memory follows the sharding (``state_shards = dp x sp``); a
sharded checkpoint's manifest requires every rank's shard file.
``tests/launch/test_sharded_optimizer_launch.py`` runs this file's :func:`_worker` on 2 gloo
processes (pp=1 x sp=2, option on): ``ConcertinaTrainer`` equals
``Trainer`` on one process, each rank holds the Adam state of only its share of the parameters
(disjoint shares covering the stage), the checkpoint holds one DCP shard file per rank (sealed
and verified by the manifest, a damaged shard refused by name), and resuming from it is exact:
at the same layout, with a plain optimizer (every rank reads the whole state), at dp=2 x sp=1
(the shares read over the replicas' group), and sharded from the plain run's own checkpoint; resuming at pp=2 is refused before the first step on
every rank, naming ``concertina_pipeline_size``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

STEPS = 4
# two parameter groups (decay, no decay), both sharded; a linear schedule (the resumed step's
# learning rate must be the saved one); 2 rows per micro-batch: one replica of sp=2 or two of 1
TRAIN = dict(max_steps=STEPS, weight_decay=0.1, per_device_train_batch_size=2, train_sampling_strategy="sequential")
SIZES = dict(concertina_pipeline_size=1, concertina_sequence_parallel_size=2, concertina_max_tokens_per_chunk=16)
# the same global batch over two replicas of one process each
DP2 = dict(concertina_pipeline_size=1, concertina_data_parallel_size=2, concertina_max_tokens_per_chunk=16)


def test_static_memory_follows_the_sharding(tmp_path):
    from test_trainer_pipeline import _model

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.run_setup import resolve_run

    topo = Topology(4, 0, 1, 2, 0, 0, sequence_parallel_size=2)  # dp=2 x pp=1 x sp=2, as a rank sees it
    costs = {}
    for on in (False, True):
        args = ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_pipeline_size=1,
                                           concertina_shard_optimizer=on, report_to=[])
        setup = resolve_run(args, _model("llama"), topo)
        costs[on] = (setup.cost_model.state_shards, setup.cost_model.static_memory(setup.layout, 0))
    params = sum(p.numel() for p in _model("llama").parameters())
    assert costs[False] == (1, pytest.approx(16 * params))  # fp32 weight, gradient, two Adam moments
    # weights and gradients whole, the Adam moments over the 4 ranks of the stage
    assert costs[True] == (4, pytest.approx((8 + 8 / 4) * params))


def test_manifest_requires_every_shard_file(tmp_path):
    """A sharded checkpoint is sealed only with each stage's DCP metadata and every rank's shard."""
    from transformers.trainer import TRAINER_STATE_NAME

    from concertina_hf.training.manifest import CheckpointError, sharded_optimizer_name, write_manifest

    names = [TRAINER_STATE_NAME, "concertina.json", "config.json", "model.safetensors", "scheduler.pt",
             "rng_state_0.pth", "rng_state_1.pth", "concertina_rng_0.pt", "concertina_rng_1.pt"]
    for n in names:
        (tmp_path / n).write_text("{}")
    shards = tmp_path / sharded_optimizer_name(0, 1)
    shards.mkdir()
    for n in (".metadata", "__0_0.distcp"):
        (shards / n).write_bytes(b"x")
    layout = dict(world_size=2, pipeline_size=1, data_parallel_size=1, sequence_parallel_size=2, layer_ranges=[[0, 4]],
                  save_only_model=False, shard_optimizer=True, optimizer_shards=2)
    with pytest.raises(CheckpointError, match=r"optimizer.stage0-of-1.dcp/__1_0.distcp"):
        write_manifest(str(tmp_path), global_step=1, layout=layout)
    (shards / "__1_0.distcp").write_bytes(b"y")
    files = write_manifest(str(tmp_path), global_step=1, layout=layout)["files"]
    assert {"optimizer.stage0-of-1.dcp/__0_0.distcp", "optimizer.stage0-of-1.dcp/__1_0.distcp",
            "optimizer.stage0-of-1.dcp/.metadata"} <= set(files)


def _worker(out: str) -> None:
    import torch

    from test_trainer_pipeline import COMMON, _dataset, _model, _summary

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from concertina_hf.training.sharded_optimizer import is_sharded

    def args(output_dir, sizes=SIZES, shard=True, **kw):
        return ConcertinaTrainingArguments(output_dir=output_dir, concertina_shard_optimizer=shard,
                                           **sizes, **dict(COMMON, **dict(TRAIN, **kw)))

    trainer = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(),
                                args=args(out, save_strategy="steps", save_steps=1))
    trainer.train()
    info = _summary(trainer)
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
        resumed = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(),
                                    args=args(f"{out}-resumed-{case}", **dict(dict(save_strategy="no"), **kw)))
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2") if case != "from_plain" else
                      os.path.join(f"{out}-resumed-plain", "checkpoint-3"))
        assert is_sharded(resumed.optimizer) == kw.get("shard", True)
        resumed.save_model(os.path.join(out, f"resumed-{case}"))
        info[f"resumed_losses_{case}"] = _summary(resumed)["losses"]
    # another pipeline size: refused before the first step, on every rank (the abort watch, which
    # would end this process once a rank failed, stopped first: the refusal is what is tested)
    from concertina_hf.runtime.distributed import _AbortWatch

    torch.distributed.barrier()
    _AbortWatch.current.stop()
    refused = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(), args=args(
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


if __name__ == "__main__":
    {"zero": _worker}[sys.argv[1]](sys.argv[2])
