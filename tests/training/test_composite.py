"""A composite (multimodal) checkpoint trained on text, on one process: ``ConcertinaTrainer`` trains
the language model of a vision-language checkpoint (Gemma3, Mistral3, Qwen3.5, Llama 4) as ``Trainer`` trains
the whole composite on text, and saves the checkpoint in its own layout.

The composite and the reference: ``tests/_composite_cases.py``; the concertina run reads the
directory by stage and splits the long sequences into chunks. The same at pp=2:
``tests/launch/test_composite_launch.py``.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import AutoModelForImageTextToText, Gemma3ForConditionalGeneration

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
from concertina_hf.runtime.composite import text_view
from concertina_hf.runtime.families import UnsupportedModelError

from _composite_cases import SETTINGS, TYPES, composite_key, saved_tensors, settings, tiny_composite, \
    trainer_reference
from _models import losses_of, tiny_dataset


def _rel(a, b):
    return ((a - b).norm() / a.norm().clamp_min(1e-12)).item()


def _source(tmp_path_factory, model_type: str) -> str:
    out = str(tmp_path_factory.mktemp(f"{model_type}-composite"))
    tiny_composite(model_type).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _source(tmp_path_factory, "gemma3")


@pytest.mark.parametrize("model_type", TYPES)
def test_language_model_trains_as_trainer_and_saves_the_composite(tmp_path_factory, tmp_path, model_type):
    source = _source(tmp_path_factory, model_type)
    ref = trainer_reference(source, str(tmp_path / "ref"), model_type)
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path / "run"), concertina_max_tokens_per_chunk=16,
                                       **settings(model_type))
    trainer = ConcertinaTrainer(model=source, args=args, train_dataset=tiny_dataset())
    assert not any("vision" in k or "multi_modal" in k for k in trainer.model.state_dict())
    trainer.train()
    losses, norms = losses_of(trainer), [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4
    assert max(abs(a - b) for a, b in zip(losses, ref["losses"])) < 1e-5
    assert max(abs(a - b) / b for a, b in zip(norms, ref["grad_norms"])) < 1e-4
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["concertina/chunks_split"] + h["concertina/chunks_hybrid"] > 0 for h in logs)
    state = {composite_key(k, model_type): v for k, v in trainer.model.state_dict().items()}
    # each parameter relative to its norm; Qwen3.5's Gated DeltaNet: 1e-3 (the bound of
    # tests/launch/test_linear_attention_launch.py), since Adam's normalised step turns the float differences
    # of the scan's near-zero A_log and dt_bias gradients into visible ones
    worst = max(_rel(ref["state"][k], v) for k, v in state.items())
    assert worst < (1e-3 if model_type == "qwen3_5" else 1e-4), worst

    # saved in the composite's layout: same tensor names, the vision tower and projector byte for byte
    out = str(tmp_path / "final")
    trainer.save_model(out)
    before, after = saved_tensors(source), saved_tensors(out)
    assert set(after) == set(before)
    towers = [k for k in before if "language_model." not in k and not k.startswith("lm_head.")]
    assert towers and all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]) for k in towers)
    loaded = AutoModelForImageTextToText.from_pretrained(out)
    assert type(loaded).__name__ == type(tiny_composite(model_type)).__name__
    assert loaded.config.text_config._attn_implementation != "concertina"
    got = loaded.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())

    # a batch with an image is refused, naming it (not trained as text)
    rows = [dict(r, pixel_values=torch.zeros(3, 16, 16).tolist()) for r in tiny_dataset(6)]
    trainer.train_dataset = datasets.Dataset.from_list(rows)
    with pytest.raises(ValueError, match="a batch with pixel_values: ConcertinaTrainer trains the language model "
                                         f"of the composite model type '{model_type}' on text only"):
        next(iter(trainer.get_train_dataloader()))
    trainer.end()


def test_model_object_saves_the_checkpoints_names(source, tmp_path):
    """A composite object: the names save_pretrained gives, its towers' tensors unchanged."""
    model = Gemma3ForConditionalGeneration.from_pretrained(source)
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path / "run"), **dict(SETTINGS, max_steps=1))
    trainer = ConcertinaTrainer(model=model, args=args, train_dataset=tiny_dataset(6))
    trainer.train()
    out = str(tmp_path / "final")
    trainer.save_model(out)
    before, after = saved_tensors(source), saved_tensors(out)
    assert set(after) == set(before)
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("language_model."))
    assert not all(torch.equal(before[k], after[k]) for k in before if k.startswith("language_model."))
    Gemma3ForConditionalGeneration.from_pretrained(out)
    trainer.end()


def test_logit_work_the_composite_does_not_do_is_refused():
    model = tiny_composite()
    model.config.text_config.final_logit_softcapping = 30.0
    with pytest.raises(UnsupportedModelError, match="text_config.final_logit_softcapping is 30.0, which the "
                                                    "composite's forward does not apply"):
        text_view(model)
