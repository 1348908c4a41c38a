"""Atomic, verified checkpoints on one process: what a save leaves, and what resume refuses.

One short run (4 steps, a checkpoint every 2) is made once; each test damages a copy of it the
way a killed rank, a failing disk or a hand edit would, and checks that resume refuses the
damaged checkpoint naming the file (``resume_from_checkpoint=PATH``) or falls back, with a
warning, to the newest one that verifies (``resume_from_checkpoint=True``). The tests go through
the Trainer's API, so they also describe what a user sees.
"""

from __future__ import annotations

import xxhash
import json
import logging
import os
import re
import shutil

import pytest
import torch

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
from _models import tiny_dataset, tiny_model

ARGS = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=4, learning_rate=2e-3,
            logging_steps=1, report_to=[], save_strategy="steps", save_steps=2, disable_tqdm=True, seed=3,
            max_grad_norm=0.5, concertina_max_tokens_per_chunk=24, concertina_overlap_planning=False)



def _trainer(output_dir, **overrides) -> ConcertinaTrainer:
    return ConcertinaTrainer(model=tiny_model(), train_dataset=tiny_dataset(),
                             args=ConcertinaTrainingArguments(output_dir=str(output_dir), **dict(ARGS, **overrides)))


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _flip_byte(path, where=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run's folder (checkpoint-2, checkpoint-4) and its losses."""
    out = tmp_path_factory.mktemp("run")
    trainer = _trainer(out)
    trainer.train()
    return out, _losses(trainer)


@pytest.fixture
def run_copy(run, tmp_path):
    shutil.copytree(run[0], tmp_path / "run")
    return tmp_path / "run"


def test_checkpoint_is_written_aside_and_sealed_by_a_manifest(run):
    out, _ = run
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == ["checkpoint-2", "checkpoint-4"]  # no tmp-
    for step in (2, 4):
        ckpt = out / f"checkpoint-{step}"
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["global_step"] == step
        assert manifest["world_size"] == manifest["pipeline_size"] == 1 and manifest["layer_ranges"] == [[0, 4]]
        others = sorted(n for n in os.listdir(ckpt) if n != "manifest.json")
        assert sorted(manifest["files"]) == others  # every file, the model and each shard included
        assert {"model.safetensors", "optimizer.stage0-of-1.pt", "scheduler.pt", "rng_state.pth",
                "trainer_state.json"} <= set(others)
        for name, rec in manifest["files"].items():
            data = (ckpt / name).read_bytes()
            assert rec == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}, name
        # written last: nothing in the folder is newer than the manifest
        assert all(os.stat(ckpt / n).st_mtime_ns <= os.stat(ckpt / "manifest.json").st_mtime_ns for n in others)


def test_the_manifest_is_written_in_the_staging_folder_then_renamed(tmp_path, monkeypatch):
    from concertina_hf.training import checkpoint

    seen = []
    real = checkpoint.write_manifest

    def spy(directory, **kw):
        # every rank's files are there, under the temporary name; checkpoint-N does not exist yet
        seen.append((os.path.basename(directory), sorted(os.listdir(directory)),
                     os.path.exists(os.path.join(tmp_path, f"checkpoint-{kw['global_step']}"))))
        return real(directory, **kw)

    monkeypatch.setattr(checkpoint, "write_manifest", spy)
    _trainer(tmp_path, max_steps=2).train()
    (name, files, final_existed), = seen
    assert name == "tmp-checkpoint-2" and not final_existed
    assert {"model.safetensors", "optimizer.stage0-of-1.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json"} <= set(files)
    assert os.path.isfile(tmp_path / "checkpoint-2" / "manifest.json")
    assert not os.path.exists(tmp_path / "tmp-checkpoint-2")


def test_save_model_hashes_only_the_files_it_wrote(tmp_path, monkeypatch):
    """Other processes write their RNG states and optimizer files into the checkpoint while the
    main process saves the model: the main process hashes only what save_model wrote (a CI run at
    pp=2 x sp=2 sealed a half-written rng_state_1.pth, refused at resume as damaged)."""
    import inspect

    from concertina_hf.training.checkpoint import StageCheckpointer

    hashed_by = []
    real = StageCheckpointer._hash_in_background

    def spy(self, directory, names):
        hashed_by.append((inspect.stack()[1].function, list(names)))
        return real(self, directory, names)

    monkeypatch.setattr(StageCheckpointer, "_hash_in_background", spy)
    _trainer(tmp_path, max_steps=2).train()
    by_save_model = [n for caller, names in hashed_by if caller == "save_model" for n in names]
    assert "model.safetensors" in by_save_model and "concertina.json" in by_save_model, hashed_by
    assert not [n for n in by_save_model if n.startswith(("rng_state", "concertina_rng", "optimizer"))], hashed_by


def test_a_manifest_of_sha256_digests_still_verifies(run_copy):
    """Checkpoints sealed before the XXH3 manifest (SHA-256 per file) verify, and still catch damage."""
    import hashlib

    from concertina_hf.training.manifest import CheckpointError, verify_checkpoint

    ckpt = run_copy / "checkpoint-4"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {n: {"size": r["size"], "sha256": hashlib.sha256((ckpt / n).read_bytes()).hexdigest()}
                         for n, r in manifest["files"].items()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(str(ckpt))["global_step"] == 4
    _flip_byte(ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its sha256 digest"):
        verify_checkpoint(str(ckpt))


def _delete(name):
    return lambda ckpt: (ckpt / name).unlink(missing_ok=True)  # missing_ok: the code before manifests


def _edit_global_step(ckpt):
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["global_step"] = 1  # same length: only the hash can tell
    (ckpt / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def _truncate(name, keep):
    def damage(ckpt):
        data = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(data[: int(len(data) * keep)])
    return damage


DAMAGE = {
    "flipped byte in model.safetensors": ("model.safetensors", lambda c: _flip_byte(c / "model.safetensors")),
    "flipped byte in the optimizer shard": ("optimizer.stage0-of-1.pt",
                                            lambda c: _flip_byte(c / "optimizer.stage0-of-1.pt", 0.9)),
    "edited global_step": ("trainer_state.json", _edit_global_step),
    "truncated model.safetensors": ("model.safetensors", _truncate("model.safetensors", 0.6)),
    "missing scheduler.pt": ("scheduler.pt", _delete("scheduler.pt")),
    "missing rng state": ("rng_state.pth", _delete("rng_state.pth")),
    "missing optimizer shard": ("optimizer.stage0-of-1.pt", _delete("optimizer.stage0-of-1.pt")),
    "no manifest": ("manifest.json", _delete("manifest.json")),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_from_a_damaged_checkpoint_is_refused_naming_the_file(run_copy, tmp_path, case):
    name, damage = DAMAGE[case]
    ckpt = run_copy / "checkpoint-4"
    damage(ckpt)
    trainer = _trainer(tmp_path / "resumed")
    with pytest.raises(ValueError, match=re.escape(str(ckpt / name))):
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 0  # nothing was loaded


@pytest.mark.parametrize("case", ["checkpoint-4 without a manifest", "checkpoint-4 without trainer_state.json",
                                  "checkpoint-4 without its optimizer shard", "leftover tmp-checkpoint-6"])
def test_resume_true_skips_incomplete_newer_checkpoints_with_a_warning(run, run_copy, caplog, case):
    ckpt = run_copy / "checkpoint-4"
    if case == "checkpoint-4 without a manifest":  # the main process killed before sealing it
        _delete("manifest.json")(ckpt)
        skipped, reason = "checkpoint-4", "manifest.json"
    elif case == "checkpoint-4 without trainer_state.json":  # killed before trainer_state.json
        os.remove(ckpt / "trainer_state.json")
        _delete("manifest.json")(ckpt)
        skipped, reason = "checkpoint-4", "manifest.json"
    elif case == "checkpoint-4 without its optimizer shard":  # a stage killed before its shard
        os.remove(ckpt / "optimizer.stage0-of-1.pt")
        skipped, reason = "checkpoint-4", "optimizer.stage0-of-1.pt"
    else:  # a later save killed half-way, and checkpoint-4 damaged as well: back to checkpoint-2
        shutil.copytree(ckpt, run_copy / "tmp-checkpoint-6")
        _delete("manifest.json")(run_copy / "tmp-checkpoint-6")
        _flip_byte(ckpt / "model.safetensors")
        skipped, reason = "tmp-checkpoint-6", "unfinished save"
    trainer = _trainer(run_copy)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert f"{run_copy / skipped}" in warned and reason in warned, warned
    assert "resuming from " + str(run_copy / "checkpoint-2") in warned
    # resumed from step 2: the last two steps re-run, on the same trajectory as the first run
    assert trainer.state.global_step == 4
    assert _losses(trainer) == pytest.approx(run[1], abs=1e-6)
    # and the re-run's checkpoint-4 replaced the damaged one, sealed
    from concertina_hf.training.manifest import verify_checkpoint

    assert verify_checkpoint(str(ckpt))["global_step"] == 4


def test_resume_true_without_any_verified_checkpoint_is_refused(run_copy):
    for step in (2, 4):
        _delete("manifest.json")(run_copy / f"checkpoint-{step}")
    with pytest.raises(ValueError, match="(?s)no verified checkpoint .*checkpoint-4.*checkpoint-2"):
        _trainer(run_copy).train(resume_from_checkpoint=True)


def test_missing_state_files_are_errors_even_without_the_manifest(run_copy, tmp_path):
    """The loading hooks themselves refuse a missing scheduler, RNG file or optimizer shard,
    instead of Trainer's silent defaults (a restarted LR schedule, unseeded RNG)."""
    ckpt = run_copy / "checkpoint-2"
    trainer = _trainer(tmp_path / "t")
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    for name, load in (("scheduler.pt", trainer._load_optimizer_and_scheduler),
                       ("rng_state.pth", trainer._load_rng_state),
                       ("optimizer.stage0-of-1.pt", trainer._load_optimizer_and_scheduler)):
        os.rename(ckpt / name, ckpt / (name + ".away"))
        with pytest.raises(ValueError, match=re.escape(name)):
            load(str(ckpt))
        os.rename(ckpt / (name + ".away"), ckpt / name)


@pytest.mark.parametrize("keep", [0.6, 0.001])  # the tensors cut short; the header itself cut
def test_truncated_safetensors_name_the_file(run_copy, tmp_path, keep):
    ckpt = run_copy / "checkpoint-2"
    _truncate("model.safetensors", keep)(ckpt)
    trainer = _trainer(tmp_path / "t")
    with pytest.raises(ValueError, match=re.escape(str(ckpt / "model.safetensors"))):
        trainer.checkpointer.load_stage_weights(trainer.model, str(ckpt))


def test_save_total_limit_and_best_model_keep_working(tmp_path):
    trainer = ConcertinaTrainer(
        model=tiny_model(), train_dataset=tiny_dataset(), eval_dataset=tiny_dataset(6, seed=1),
        args=ConcertinaTrainingArguments(output_dir=str(tmp_path), **dict(
            ARGS, eval_strategy="steps", eval_steps=2, save_total_limit=1, load_best_model_at_end=True,
            metric_for_best_model="loss", greater_is_better=False)))
    trainer.train()
    from concertina_hf.training.manifest import verify_checkpoint

    kept = sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n)
    best = os.path.basename(trainer.state.best_model_checkpoint)
    assert best in kept and set(kept) <= {"checkpoint-2", "checkpoint-4"}, kept
    for name in kept:
        verify_checkpoint(str(tmp_path / name))
    # the best model's weights were loaded at the end
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / best / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in trainer.model.state_dict().items())
