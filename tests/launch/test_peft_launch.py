"""PEFT (LoRA) at pp = 2 on one launch of 2 gloo processes: the workers are
``tests/training/test_peft.py`` run by torchrun (its docstring lists the checks).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

peft = pytest.importorskip("peft")

import test_peft  # noqa: E402
from _helpers import torchrun  # noqa: E402
from test_peft import CASES, _base, _check_adapter, _reference  # noqa: E402


def test_pp2_lora_matches_trainer_with_every_stage_in_the_adapter(tmp_path):
    torchrun(2, test_peft.__file__, "pp2", tmp_path, timeout=900)
    from concertina_hf.training.manifest import verify_checkpoint

    for case in sorted(CASES):
        d = tmp_path / case
        ranks = [json.loads((d / f"info-rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["grad_norms"] == ranks[1]["grad_norms"]
        # each stage trains its own adapters; the optimizer holds state for them only
        assert not set(ranks[0]["trainable"]) & set(ranks[1]["trainable"])
        for r in ranks:
            assert r["optimizer_params"] == r["optimizer_states"] == len(r["trainable"]), r
        ref, ref_model = _reference(case, tmp_path / f"ref-{case}")
        ref_trainable = {n.removeprefix("base_model.model.") for n, p in ref_model.named_parameters()
                         if p.requires_grad}
        assert set(ranks[0]["trainable"]) | set(ranks[1]["trainable"]) == ref_trainable
        _check_adapter(case, d / "final", ref_model, ranks[0], ref)
        # the saved adapter is exactly what the two stages trained
        loaded = peft.PeftModel.from_pretrained(_base(), str(d / "final")).state_dict()
        for r in (0, 1):
            for name, tensor in torch.load(d / f"trained-rank{r}.pt").items():
                assert torch.equal(loaded["base_model.model." + name], tensor), (case, r, name)
        names = set(os.listdir(d / "checkpoint-2"))
        assert {"adapter_model.safetensors", "optimizer.stage0-of-2.pt", "optimizer.stage1-of-2.pt"} <= names
        verify_checkpoint(str(d / "checkpoint-2"))
        if case == "default":
            assert ranks[0]["resumed_losses"] == pytest.approx(ranks[0]["losses"], abs=1e-6)
            assert max(r["resumed_max_diff"] for r in ranks) < 1e-6
