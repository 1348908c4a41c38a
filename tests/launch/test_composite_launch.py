"""A composite (multimodal) checkpoint trained on text at pp=2, loaded and saved by stage, on one
launch of 2 gloo processes (:func:`_worker`), against ``Trainer`` on the composite on one process
(``tests/_composite_cases.py``).

Each rank reads exactly its stage's text tensors (the bytes read by construction are its stage's
parameters; no tensor of the vision tower or projector), trains as ``Trainer`` does, and the
stages' shards together are the composite's checkpoint: the source's tensor names, the towers'
tensors byte for byte (carried by stage 0's rank), loaded by ``Gemma3ForConditionalGeneration``;
a run resumed from its checkpoint reaches the same weights.
"""

from __future__ import annotations

import json
import os

import torch

from _composite_cases import SETTINGS, composite_key, saved_tensors, tiny_composite, trainer_reference
from _helpers import run_ranks

KW = dict(concertina_pipeline_size=2, concertina_max_tokens_per_chunk=16, concertina_self_check=False,
          save_strategy="steps", save_steps=2)


def _rel(a, b):
    return ((a - b).norm() / a.norm().clamp_min(1e-12)).item()


def test_pp2_composite_by_stage_matches_trainer_and_saves_the_composite(tmp_path):
    source = str(tmp_path / "source")
    tiny_composite().save_pretrained(source)
    run_ranks(2, _worker, source, str(tmp_path), logs=tmp_path / "logs", timeout=900)
    from transformers import Gemma3ForConditionalGeneration

    from concertina_hf.training.manifest import verify_checkpoint

    ranks = [json.loads((tmp_path / f"info-rank{r}.json").read_text()) for r in (0, 1)]
    ref = trainer_reference(source, str(tmp_path / "ref"))
    for r in ranks:
        assert r["read_bytes"] == r["stage_bytes"] > 0, r
        assert not any("vision" in k or "multi_modal" in k for k in r["keys"])
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) < 1e-5
        assert max(abs(a - b) / b for a, b in zip(r["grad_norms"], ref["grad_norms"])) < 1e-4
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 4

    out = str(tmp_path / "run" / "final")
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    before, after = saved_tensors(source), saved_tensors(out)
    assert set(after) == set(before)
    towers = [k for k in before if not k.startswith("language_model.")]
    assert towers and all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]) for k in towers)
    got = Gemma3ForConditionalGeneration.from_pretrained(out).state_dict()
    for r in (0, 1):
        trained = torch.load(tmp_path / f"trained-rank{r}.pt")
        for k, v in trained.items():
            assert torch.equal(got[composite_key(k)], v), k
            assert _rel(ref["state"][composite_key(k)], v) < 1e-4, k
        resumed = torch.load(tmp_path / f"resumed-rank{r}.pt")
        assert max((resumed[k] - trained[k]).abs().max().item() for k in trained) < 1e-6
    verify_checkpoint(str(tmp_path / "run" / "checkpoint-2"))


def _worker(source: str, out: str) -> None:
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from concertina_hf.training import stage_loading

    from _models import losses_of, tiny_dataset

    read = []
    readinto = stage_loading._readinto

    def counted(fh, tensor, nbytes, path):
        read.append(nbytes)
        return readinto(fh, tensor, nbytes, path)

    stage_loading._readinto = counted
    args = ConcertinaTrainingArguments(output_dir=os.path.join(out, "run"), **dict(SETTINGS, **KW))
    trainer = ConcertinaTrainer(model=source, args=args, train_dataset=tiny_dataset())
    rank = trainer.topology.rank
    params = dict(trainer.model.named_parameters())
    info = {"read_bytes": sum(read), "stage_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "keys": sorted(trainer.model.state_dict())}
    trainer.train()
    info["losses"] = losses_of(trainer)
    info["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]
    torch.save({k: p.detach().clone() for k, p in params.items()}, os.path.join(out, f"trained-rank{rank}.pt"))
    trainer.save_model(os.path.join(out, "run", "final"))
    args = ConcertinaTrainingArguments(output_dir=os.path.join(out, "resumed"), **dict(SETTINGS, **KW))
    resumed = ConcertinaTrainer(model=source, args=args, train_dataset=tiny_dataset())
    resumed.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
    torch.save({k: p.detach().clone() for k, p in resumed.model.named_parameters()},
               os.path.join(out, f"resumed-rank{rank}.pt"))
    with open(os.path.join(out, f"info-rank{rank}.json"), "w") as fh:
        json.dump(info, fh)
    resumed.end()
