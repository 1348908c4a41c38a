"""The failure guard's reach (one process; the multi-process behaviour is tests/launch/test_fault_catalogue.py):
every call listed in ``GUARDED_CALLS`` is guarded, on ``ConcertinaTrainer`` and on its subclasses'
overrides, without hiding a subclass's MRO; ``push_to_hub`` saves (its collective part) before it
touches the Hub."""

from __future__ import annotations

import os

import pytest
from huggingface_hub.errors import OfflineModeIsEnabled

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
from concertina_hf.training.trainer import GUARDED_CALLS
from _models import tiny_dataset, tiny_model


def test_every_listed_call_is_guarded_also_in_a_subclass():
    class Sub(ConcertinaTrainer):
        def evaluate(self, *a, **kw):
            return super().evaluate(*a, **kw)

    for name, what in GUARDED_CALLS.items():
        expected = "ConcertinaTrainer construction" if name == "__init__" else what
        assert getattr(ConcertinaTrainer, name).fails_together == expected, name
    assert Sub.evaluate.fails_together == "evaluate" and Sub.__init__.fails_together == "ConcertinaTrainer construction"
    from concertina_hf.integrations.trl import ConcertinaSFTTrainer  # TRL's own overrides stay reachable
    assert ConcertinaSFTTrainer.__init__.fails_together == "ConcertinaSFTTrainer construction"


def test_push_to_hub_saves_before_it_touches_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], max_steps=1, save_strategy="no",
                                       per_device_train_batch_size=2, disable_tqdm=True)
    trainer = ConcertinaTrainer(model=tiny_model(), args=args, train_dataset=tiny_dataset(4))
    saves = []
    save_model = trainer.checkpointer.save_model
    trainer.checkpointer.save_model = lambda *a, **kw: (saves.append(a[0]), save_model(*a, **kw))[1]
    with pytest.raises(OfflineModeIsEnabled):  # the Hub's own error, unchanged
        trainer.push_to_hub()
    assert saves == [str(tmp_path)] and os.path.exists(os.path.join(tmp_path, "config.json"))
    assert "_saved_for_push" not in trainer.__dict__  # the next save_model(_internal_call=True) saves
    trainer.save_model(_internal_call=True)
    assert len(saves) == 2
    trainer.end()
