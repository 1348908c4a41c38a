"""``ConcertinaTrainer`` at pp = 2 against ``Trainer`` for one model per failure class
(StableLM, Granite, Gemma2): the workers are ``tests/runtime/test_model_families.py`` run by
torchrun on 2 CPU ranks; loss within 1e-5 and every parameter within 1e-3 (relative to its update).
"""

from __future__ import annotations

import json

import test_model_families
from _helpers import torchrun
from test_model_families import ARCHS, COMMON, _dataset, _model


def test_pp2_matches_trainer_for_one_model_per_failure_class(tmp_path):
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

    torchrun(2, test_model_families.__file__, "pp2", tmp_path)
    for arch in ARCHS:
        ref = Trainer(model=_model(arch), args=TrainingArguments(output_dir=str(tmp_path / f"ref-{arch}"), **COMMON),
                      train_dataset=_dataset(), data_collator=DataCollatorWithFlattening())
        start = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
        ref.train()
        want = [h["loss"] for h in ref.state.log_history if "loss" in h]
        info = json.loads((tmp_path / arch / "info-rank0.json").read_text())
        assert len(info["losses"]) == len(want) == 3, (arch, info, want)
        assert all(n > 0 for n in info["split"]), (arch, info["split"])  # the long sequences were split
        assert max(abs(a - b) / abs(b) for a, b in zip(info["losses"], want)) < 1e-5, (arch, info["losses"], want)
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / arch / "final")).state_dict()
        final = ref.model.state_dict()
        worst = max((float((got[k] - final[k]).norm() / (final[k] - start[k]).norm().clamp_min(1e-12)), k)
                    for k in final if k in got and (final[k] - start[k]).norm() > 0)
        assert worst[0] < 1e-3, (arch, worst)  # relative to the update
