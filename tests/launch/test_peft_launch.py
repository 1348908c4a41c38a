"""PEFT (LoRA) at pp = 2 on one launch of 2 gloo processes (:func:`_worker_pp2`), against ``Trainer``
+ the same ``PeftModel`` on one process: the checks of ``tests/training/test_peft.py`` with every
stage's adapter gathered into the one saved directory, the optimizer holding state for the
trainable parameters only, the gradient norm counted once, checkpoint + resume.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

peft = pytest.importorskip("peft")

from _helpers import Launch  # noqa: E402
from _peft_cases import CASES, base_model, check_adapter, losses_and_norms, peft_reference, peft_trainer  # noqa: E402


def test_pp2_lora_matches_trainer_with_every_stage_in_the_adapter(launched, tmp_path):
    out = launched("pp2").out
    from concertina_hf.training.manifest import verify_checkpoint

    for case in sorted(CASES):
        d = out / case
        ranks = [json.loads((d / f"info-rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["grad_norms"] == ranks[1]["grad_norms"]
        # each stage trains its own adapters; the optimizer holds state for them only
        assert not set(ranks[0]["trainable"]) & set(ranks[1]["trainable"])
        for r in ranks:
            assert r["optimizer_params"] == r["optimizer_states"] == len(r["trainable"]), r
        ref, ref_model = peft_reference(case, tmp_path / f"ref-{case}")
        ref_trainable = {n.removeprefix("base_model.model.") for n, p in ref_model.named_parameters()
                         if p.requires_grad}
        assert set(ranks[0]["trainable"]) | set(ranks[1]["trainable"]) == ref_trainable
        check_adapter(case, d / "final", ref_model, ranks[0], ref)
        # the saved adapter is exactly what the two stages trained
        loaded = peft.PeftModel.from_pretrained(base_model(), str(d / "final")).state_dict()
        for r in (0, 1):
            for name, tensor in torch.load(d / f"trained-rank{r}.pt").items():
                assert torch.equal(loaded["base_model.model." + name], tensor), (case, r, name)
        names = set(os.listdir(d / "checkpoint-2"))
        assert {"adapter_model.safetensors", "optimizer.stage0-of-2.pt", "optimizer.stage1-of-2.pt"} <= names
        verify_checkpoint(str(d / "checkpoint-2"))
        if case == "default":
            assert ranks[0]["resumed_losses"] == pytest.approx(ranks[0]["losses"], abs=1e-6)
            assert max(r["resumed_max_diff"] for r in ranks) < 1e-6


def _worker_pp2(out: str) -> None:
    for case in sorted(CASES):
        d = os.path.join(out, case)
        trainer = peft_trainer(case, d, save_strategy="steps", save_steps=2)
        assert trainer.topology.pipeline_size == 2
        trainer.train()
        rank = trainer.topology.rank
        info = losses_and_norms(trainer)
        trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
        info["trainable"] = sorted(trainable)
        info["optimizer_params"] = sum(len(g["params"]) for g in trainer.optimizer.param_groups)
        info["optimizer_states"] = len(trainer.optimizer.state_dict()["state"])
        torch.save({n: p.detach().clone() for n, p in trainable.items()}, os.path.join(d, f"trained-rank{rank}.pt"))
        trainer.save_model(os.path.join(d, "final"))
        if case == "default":
            resumed = peft_trainer(case, d + "-resumed")
            resumed.train(resume_from_checkpoint=os.path.join(d, "checkpoint-2"))
            info["resumed_losses"] = losses_and_norms(resumed)["losses"]
            end = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
            info["resumed_max_diff"] = max((end[n] - trainable[n]).abs().max().item() for n in end)
        with open(os.path.join(d, f"info-rank{rank}.json"), "w") as fh:
            json.dump(info, fh)
    trainer.end()


#: the launch (started by the session, read through the ``launched`` fixture)
LAUNCHES = {"pp2": Launch(2, _worker_pp2, timeout=900)}
