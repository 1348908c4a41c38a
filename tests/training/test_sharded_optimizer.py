"""``concertina_shard_optimizer``: the stage's optimizer state sharded over its ``dp x sp`` ranks
(torch's ``ZeroRedundancyOptimizer``, ``sharded_optimizer.shard_optimizer``), checkpointed with
``torch.distributed.checkpoint`` (each rank writes its share, ``sharded_optimizer.save_optimizer_shards``).

Default tier: the planner's static memory follows the sharding (``state_shards = dp x sp``); a
sharded checkpoint's manifest requires every rank's shard file.
``tests/launch/test_sharded_optimizer_launch.py`` runs on 2 gloo
processes (pp=1 x sp=2, option on): ``ConcertinaTrainer`` equals
``Trainer`` on one process, each rank holds the Adam state of only its share of the parameters
(disjoint shares covering the stage), the checkpoint holds one DCP shard file per rank (sealed
and verified by the manifest, a damaged shard refused by name), and resuming from it is exact:
at the same layout, with a plain optimizer (every rank reads the whole state), at dp=2 x sp=1
(the shares read over the replicas' group), and sharded from the plain run's own checkpoint; resuming at pp=2 is refused before the first step on
every rank, naming ``concertina_pipeline_size``.
"""

from __future__ import annotations

import pytest

def test_static_memory_follows_the_sharding(tmp_path):
    from _models import tiny_model

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.run_setup import resolve_run

    topo = Topology(4, 0, 1, 2, 0, 0, sequence_parallel_size=2)  # dp=2 x pp=1 x sp=2, as a rank sees it
    costs = {}
    for on in (False, True):
        args = ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_pipeline_size=1,
                                           concertina_shard_optimizer=on, report_to=[])
        setup = resolve_run(args, tiny_model("llama"), topo)
        costs[on] = (setup.cost_model.state_shards, setup.cost_model.static_memory(setup.layout, 0))
    params = sum(p.numel() for p in tiny_model("llama").parameters())
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
