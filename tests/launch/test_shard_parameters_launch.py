"""``concertina_shard_parameters`` on one launch of 4 gloo processes (pp=1 x sp=2 x dp=2, option on,
:func:`_worker`): equal to ``Trainer`` on one process with the global batch, every rank holding only
its half of every parameter, gradient and Adam moment (the bytes the planner predicts), full HF
weights saved, and resuming from the step-2 checkpoint exact. The one-process checks:
``tests/training/test_shard_parameters.py``.
"""

from __future__ import annotations

import json
import os

import pytest

from _helpers import Launch
from _models import load_saved, train_reference, worst_relative

STEPS = 3
TRAIN = dict(max_steps=STEPS, weight_decay=0.1, train_sampling_strategy="sequential")
SIZES = dict(concertina_pipeline_size=1, concertina_sequence_parallel_size=2, concertina_data_parallel_size=2,
             concertina_max_tokens_per_chunk=16)


def test_shard_parameters_sp2_dp2_matches_trainer_and_resumes(launched, tmp_path):
    out = launched("zero3").out
    ranks = [json.loads((out / f"info-rank{r}.json").read_text()) for r in range(4)]
    # one process with both replicas' sequences per step
    ref_info, ref_state = train_reference("llama", tmp_path / "ref", per_device_train_batch_size=6,
                                     **TRAIN)
    info = ranks[0]
    assert all(r["losses"] == info["losses"] for r in ranks)
    assert len(info["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(info["losses"], ref_info["losses"])) < 1e-5, (info, ref_info)
    assert max(abs(a - b) for a, b in zip(info["grad_norms"], ref_info["grad_norms"])) < 1e-4
    worst, name = worst_relative(ref_state, load_saved(out / "final"))  # full HF weights, the update within 1e-3
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
    got, resumed = load_saved(out / "final"), load_saved(out / "resumed")
    assert max(((resumed[k] - got[k]).norm() / got[k].norm().clamp_min(1e-12)).item() for k in got) < 1e-6


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


def _worker(out: str) -> None:
    from _models import COMMON, logged, tiny_dataset, tiny_model

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    def args(output_dir, **kw):
        return ConcertinaTrainingArguments(output_dir=output_dir, concertina_shard_parameters=True,
                                           **SIZES, **dict(COMMON, **dict(TRAIN, **kw)))

    trainer = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(),
                                args=args(out, save_strategy="steps", save_steps=1))
    trainer.train()
    info = logged(trainer)
    t = trainer.topology
    info["topology"] = [t.rank, t.stage, t.replica, t.sp_rank]
    info.update(_state_bytes(trainer))
    info["predicted_state_bytes"] = trainer.cost_model.sharded_state_memory(trainer.layout, 0)
    trainer.save_model(os.path.join(out, "final"))
    resumed = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), args=args(f"{out}-resumed",
                                                                                           save_strategy="no"))
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed.save_model(os.path.join(out, "resumed"))
    info["resumed_losses"] = logged(resumed)["losses"]
    with open(os.path.join(out, f"info-rank{t.rank}.json"), "w") as fh:
        json.dump(info, fh)
    resumed.end()


#: the launch (started by the session, read through the ``launched`` fixture)
LAUNCHES = {"zero3": Launch(4, _worker)}
