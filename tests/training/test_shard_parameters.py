"""``concertina_shard_parameters``: each stage's parameters, gradients and optimizer state sharded
over its ``sp`` ranks with torch's FSDP2 (``runtime.param_sharding.shard_stage``), the replicas'
shards all-reduced once a step.

Default tier: the planner's static memory under parameter sharding (``zero3``: everything over
``dp x sp``) as the trainer's cost model holds it. ``tests/launch/test_shard_parameters_launch.py``
runs this file's :func:`_worker` on 4 gloo processes (pp=1 x sp=2 x dp=2, option on): equal to
``Trainer`` on one process with the global batch, every rank holding only its half of every
parameter, gradient and Adam moment (the bytes the planner predicts), full HF weights saved, and
resuming from the step-2 checkpoint exact.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

STEPS = 3
TRAIN = dict(max_steps=STEPS, weight_decay=0.1, train_sampling_strategy="sequential")
SIZES = dict(concertina_pipeline_size=1, concertina_sequence_parallel_size=2, concertina_data_parallel_size=2,
             concertina_max_tokens_per_chunk=16)


def _state_bytes(trainer) -> dict:
    """This rank's bytes of parameters, gradients and Adam moments (its shards)."""
    from concertina_hf.runtime.param_sharding import local_tensor

    params = [p for p in trainer.model.parameters()]
    out = {"param_bytes": sum(local_tensor(p).numel() * p.element_size() for p in params),
           "grad_bytes": sum(local_tensor(p).numel() * p.element_size() for p in params if p.requires_grad),
           "optim_bytes": sum(local_tensor(t).numel() * t.element_size() for s in trainer.optimizer.state.values()
                              for k, t in s.items() if k != "step")}
    out["elements"] = sum(p.numel() for p in params)  # the DTensors' global sizes
    return out


def test_static_memory_under_parameter_sharding(tmp_path):
    from test_trainer_pipeline import _model

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.run_setup import resolve_run

    topo = Topology(4, 0, 1, 2, 0, 0, sequence_parallel_size=2)  # dp=2 x pp=1 x sp=2, as a rank sees it
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_pipeline_size=1,
                                       concertina_shard_parameters=True, report_to=[])
    cost = resolve_run(args, _model("llama"), topo).cost_model
    # over the stage's sp ranks (the replicas run different chunks: their gradients are all-reduced once a step)
    assert (cost.state_shards, cost.zero3) == (2, True)
    assert cost.sharded_state_memory(resolve_run(args, _model("llama"), topo).layout, 0) == pytest.approx(
        16 * sum(p.numel() for p in _model("llama").parameters()) / 2)


def test_parameter_sharding_refused_on_a_pipeline(tmp_path):
    from test_trainer_pipeline import _model

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.run_setup import resolve_run

    topo = Topology(4, 0, 2, 1, 0, 0, sequence_parallel_size=2)  # pp=2 x sp=2
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_pipeline_size=2,
                                       concertina_shard_parameters=True, report_to=[])
    with pytest.raises(ValueError, match=r"concertina_shard_parameters=True runs at concertina_pipeline_size=1 only"):
        resolve_run(args, _model("llama"), topo)


def _worker(out: str) -> None:
    from test_trainer_pipeline import COMMON, _dataset, _model, _summary

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    def args(output_dir, **kw):
        return ConcertinaTrainingArguments(output_dir=output_dir, concertina_shard_parameters=True,
                                           **SIZES, **dict(COMMON, **dict(TRAIN, **kw)))

    trainer = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(),
                                args=args(out, save_strategy="steps", save_steps=1))
    trainer.train()
    info = _summary(trainer)
    t = trainer.topology
    info["topology"] = [t.rank, t.stage, t.replica, t.sp_rank]
    info.update(_state_bytes(trainer))
    info["predicted_state_bytes"] = trainer.cost_model.sharded_state_memory(trainer.layout, 0)
    trainer.save_model(os.path.join(out, "final"))
    resumed = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(), args=args(f"{out}-resumed",
                                                                                           save_strategy="no"))
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed.save_model(os.path.join(out, "resumed"))
    info["resumed_losses"] = _summary(resumed)["losses"]
    with open(os.path.join(out, f"info-rank{t.rank}.json"), "w") as fh:
        json.dump(info, fh)
    resumed.end()


if __name__ == "__main__":
    {"zero3": _worker}[sys.argv[1]](sys.argv[2])
