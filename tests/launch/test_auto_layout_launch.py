"""``concertina_layout="auto"`` on 4 gloo processes against ``Trainer`` on one process with 4 x the
per-device batch, whatever layout it picks (the decision itself: tests/training/test_auto_layout.py).

One launch (this file's :func:`_worker`) runs, on 4 ranks: ``auto`` (3 steps, a checkpoint per
step; it picks pp=2 x dp=2 here), ``auto`` with ``concertina_sequence_parallel_size=2`` fixed (the rest
chosen: pp=2 x sp=2, one replica reading 4 processes' micro-batches), and a run built with
``resume_from_checkpoint=checkpoint-1`` in its arguments (it keeps the recorded layout and
resumes). Checked: every rank picked the same layout; losses within 1e-5 and each parameter's
update within 1e-3 (relative) of ``Trainer``'s after 3 steps, for both picks; the resumed run's
steps 2 and 3 equal the uninterrupted run's; ``concertina.json`` records the choice. Then, in the
pytest process, the 4-process checkpoint resumed by one process under ``auto`` is refused at
construction naming both sizes.
"""

from __future__ import annotations

import json
import os

import pytest

from _helpers import Launch
from _models import load_saved, logged, tiny_dataset, tiny_model

COMMON = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-3,
              logging_steps=1, report_to=[], disable_tqdm=True, seed=3, max_grad_norm=0.5)


def _args(out, **kw):
    from concertina_hf import ConcertinaTrainingArguments

    return ConcertinaTrainingArguments(output_dir=out, concertina_layout="auto", concertina_max_tokens_per_chunk=16,
                                       **dict(COMMON, **kw))


def _worker(out: str) -> None:
    from concertina_hf import ConcertinaTrainer

    info = {}
    for name, kw in (("auto", dict(save_strategy="steps", save_steps=1)),
                     ("auto_sp2", dict(save_strategy="no", concertina_sequence_parallel_size=2))):
        trainer = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), args=_args(f"{out}/{name}", **kw))
        t = trainer.topology
        trainer.train()
        trainer.save_model(f"{out}/{name}/final")
        info[name] = dict(logged(trainer), choice=list(trainer.layout_choice.sizes),
                          topology=[t.pipeline_size, t.sequence_parallel_size, t.data_parallel_size],
                          source=trainer.layout_choice.source)
    ckpt = f"{out}/auto/checkpoint-1"
    resumed = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(),
                                args=_args(f"{out}/resumed", save_strategy="no", resume_from_checkpoint=ckpt))
    resumed.train(resume_from_checkpoint=ckpt)
    info["resumed"] = dict(logged(resumed), choice=list(resumed.layout_choice.sizes),
                           source=resumed.layout_choice.source,
                           steps={h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h})
    with open(os.path.join(out, f"info-rank{trainer.topology.rank}.json"), "w") as fh:
        json.dump(info, fh)
    resumed.end()


def _reference(out):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    ref = Trainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), data_collator=DataCollatorWithFlattening(),
                  args=TrainingArguments(output_dir=str(out), save_strategy="no",
                                         **dict(COMMON, per_device_train_batch_size=4)))
    ref.train()
    return logged(ref), {k: v.detach().clone() for k, v in ref.model.state_dict().items()}


def test_auto_layout_on_4_processes_equals_trainer_with_4x_the_batch(launched, tmp_path):
    out = launched("auto").out
    ranks = [json.loads((out / f"info-rank{r}.json").read_text()) for r in range(4)]
    want, ref_state = _reference(tmp_path / "ref")
    init = tiny_model("llama").state_dict()
    for name in ("auto", "auto_sp2"):
        picks = {tuple(r[name]["choice"]) for r in ranks}
        assert len(picks) == 1, (name, picks)  # every rank picked the same layout, and runs it
        pick = picks.pop()
        assert all(tuple(r[name]["topology"]) == pick for r in ranks) and pick[0] * pick[1] * pick[2] == 4
        assert name != "auto_sp2" or pick[1] == 2, pick
        assert all(r[name]["losses"] == ranks[0][name]["losses"] for r in ranks)
        got = ranks[0][name]["losses"]
        assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, want["losses"])) < 1e-5, (name, pick, got, want)
        final = load_saved(out / name / "final")
        worst = max((((final[k] - init[k]) - (ref_state[k] - init[k])).norm()
                     / (ref_state[k] - init[k]).norm().clamp_min(1e-12)).item() for k in ref_state)
        assert worst < 1e-3, (name, pick, worst)
    # resume: the recorded layout, and the uninterrupted run's steps 2 and 3
    meta = json.loads((out / "auto" / "checkpoint-1" / "concertina.json").read_text())
    choice = ranks[0]["auto"]["choice"]
    assert meta["layout_choice"]["source"] == "auto" and meta["layout_choice"]["table"]
    assert [meta["pipeline_size"], meta["sequence_parallel_size"], meta["data_parallel_size"]] == choice
    # the sequence-parallel mode it runs with (the default 'auto' under the analytic cost model: Ulysses)
    assert meta["layout_choice"]["sequence_parallel_mode"] == (None if choice[1] == 1 else "ulysses"), meta
    for r in ranks:
        assert r["resumed"]["choice"] == choice and r["resumed"]["source"] == "checkpoint"
        steps = r["resumed"]["steps"]
        assert all(abs(steps[str(s)] - r["auto"]["losses"][s - 1]) < 1e-5 for s in (2, 3)), (steps, r["auto"])
    # one process resuming the 4-process checkpoint under auto: refused at construction, with the reason
    from concertina_hf import ConcertinaTrainer

    pp, sp, dp = choice
    with pytest.raises(ValueError, match=rf"written by 4 processes \(pp={pp} x sp={sp} x dp={dp}\), this run has 1: "
                                         r".*resume with 4 processes"):
        ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), args=_args(
            str(tmp_path / "one"), resume_from_checkpoint=str(out / "auto" / "checkpoint-1")))


#: the launch (started by the session, read through the ``launched`` fixture)
LAUNCHES = {"auto": Launch(4, _worker)}
