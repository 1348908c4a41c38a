"""``concertina_shard_optimizer``: the stage's optimizer state sharded over its ``dp x sp`` ranks
(torch's ``ZeroRedundancyOptimizer``, ``distributed.shard_optimizer``).

Default tier: the planner's static memory follows the sharding (``state_shards = dp x sp``).
Slow tier, one launch of 2 gloo processes (pp=1 x sp=2, option on): ``ConcertinaTrainer`` equals
``Trainer`` on one process after 3 steps, each rank holds the Adam state of only its share of the
parameters (disjoint shares covering the stage), the checkpoint holds the stage's whole state in
the usual per-stage file, and resuming from it (sharded, or with a plain optimizer) is exact.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 3
TRAIN = dict(max_steps=STEPS, weight_decay=0.1)  # two parameter groups (decay, no decay), both sharded
SIZES = dict(concertina_pipeline_size=1, concertina_sequence_parallel_size=2, concertina_max_tokens_per_chunk=16)


def test_static_memory_follows_the_sharding(tmp_path):
    from test_trainer_pipeline import _model

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.distributed import Topology
    from concertina_hf.run_setup import resolve_run

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


def _worker(out: str) -> None:
    import torch

    from test_trainer_pipeline import COMMON, _dataset, _model, _summary

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from concertina_hf.distributed import is_sharded

    args = ConcertinaTrainingArguments(output_dir=out, save_strategy="steps", save_steps=2,
                                       concertina_shard_optimizer=True, **SIZES, **dict(COMMON, **TRAIN))
    trainer = ConcertinaTrainer(model=_model("llama"), args=args, train_dataset=_dataset())
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
    info["rank"] = trainer.topology.rank
    trainer.save_model(os.path.join(out, "final"))
    # resuming from the step-2 checkpoint, sharded and with a plain optimizer (same file format)
    for shard in (True, False):
        resumed = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(), args=ConcertinaTrainingArguments(
            output_dir=f"{out}-resumed-{shard}", save_strategy="no", concertina_shard_optimizer=shard, **SIZES,
            **dict(COMMON, **TRAIN)))
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        assert is_sharded(resumed.optimizer) == shard
        resumed.save_model(os.path.join(out, f"resumed-{shard}"))
        info[f"resumed_losses_{shard}"] = _summary(resumed)["losses"]
    with open(os.path.join(out, f"info-rank{info['rank']}.json"), "w") as fh:
        json.dump(info, fh)
    torch.distributed.barrier()
    resumed.end()


@pytest.mark.slow
def test_sharded_optimizer_sp2_matches_trainer_and_resumes(tmp_path):
    import torch

    from test_trainer_pipeline import _launch, _load, _model, _reference

    _launch(2, "zero", tmp_path, script=__file__)
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
    # the checkpoint: the stage's whole state in its usual file
    saved = torch.load(tmp_path / "checkpoint-2" / "optimizer.stage0-of-1.pt", weights_only=True)
    assert len(saved["state"]) == len(info["params"])
    for shard in ("True", "False"):
        assert info[f"resumed_losses_{shard}"] == pytest.approx(info["losses"], abs=1e-6)
        resumed = _load(tmp_path / f"resumed-{shard}")
        assert max(((resumed[k] - got[k]).norm() / got[k].norm().clamp_min(1e-12)).item() for k in got) < 1e-6


if __name__ == "__main__":
    {"zero": _worker}[sys.argv[1]](sys.argv[2])
