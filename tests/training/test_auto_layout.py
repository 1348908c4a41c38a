"""concertina_layout="auto" on one process: the choice from a sample of the data (no process
group: ``choose_layout`` is pure in its inputs), fixed sizes kept, a checkpoint's recorded layout
kept and one of another number of processes refused. The 4-process run against Trainer is
tests/launch/test_auto_layout_launch.py."""

from __future__ import annotations

import json
import random

import pytest

from test_trainer_pipeline import _model


def _rows(n, long_every=0, seed=0):
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"input_ids": [rng.randrange(64) for _ in range(900 if long_every and i % long_every == 0
                                                         else rng.randrange(5, 20))]} for i in range(n)])


def _args(tmp_path, **kw):
    from concertina_hf import ConcertinaTrainingArguments

    return ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[],
                                       **dict(dict(concertina_layout="auto", per_device_train_batch_size=2), **kw))


def test_choice_is_deterministic_and_keeps_fixed_sizes(tmp_path):
    from concertina_hf.training.auto_layout import SAMPLE_STEPS, choose_layout, sample_steps
    from concertina_hf.training.collator import LengthAwareCollator

    data, collate = _rows(200, long_every=8), LengthAwareCollator()
    args = _args(tmp_path)
    steps = sample_steps(data, collate, 8, args)
    assert len(steps) == SAMPLE_STEPS and all(len(s) == 8 for s in steps)
    assert steps == sample_steps(data, collate, 8, args)  # seeded: the same rows on every rank
    a = choose_layout(args, _model("llama"), 4, data, collate)
    b = choose_layout(args, _model("llama"), 4, data, collate)
    assert a == b and a.source == "auto" and a.pp * a.sp * a.dp == 4 and a.steps_sampled == SAMPLE_STEPS
    ok = [r for r in a.table if r["step_time_s"] is not None]
    assert ok[0]["layout"] == f"pp{a.pp} x sp{a.sp} x dp{a.dp}" and ok[0]["ratio"] == 1.0
    assert all(r["ratio"] >= 1.0 for r in ok) and len(ok) >= 4, a.table
    assert "chose pp=" in a.table_text()
    fixed = choose_layout(_args(tmp_path, concertina_pipeline_size=2), _model("llama"), 4, data, collate)
    assert fixed.pp == 2 and all(r["layout"].startswith("pp2 ") for r in fixed.table if r["step_time_s"])
    # sequential sampling reads the first rows in order
    seq = sample_steps(data, collate, 8, _args(tmp_path, train_sampling_strategy="sequential"), steps=2)
    assert seq == [[len(r["input_ids"]) for r in data.select(range(i, i + 8))] for i in (0, 8)]


def test_resume_keeps_the_recorded_layout_and_refuses_another_world_size(tmp_path):
    from concertina_hf.training.auto_layout import choose_layout

    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "concertina.json").write_text(json.dumps(
        {"pipeline_size": 2, "sequence_parallel_size": 1, "data_parallel_size": 2}))
    args = _args(tmp_path, resume_from_checkpoint=str(ckpt))
    kept = choose_layout(args, _model("llama"), 4, _rows(40), None)
    assert (kept.pp, kept.sp, kept.dp, kept.source) == (2, 1, 2, "checkpoint")
    with pytest.raises(ValueError, match=r"written by 4 processes \(pp=2 x sp=1 x dp=2\), this run has 2: .*"
                                         r"resume with 4 processes"):
        choose_layout(args, _model("llama"), 2, _rows(40), None)


def test_auto_needs_training_data_and_a_known_mode(tmp_path):
    from concertina_hf.training.auto_layout import choose_layout

    with pytest.raises(ValueError, match="concertina_layout='auto' chooses the layout from the training data"):
        choose_layout(_args(tmp_path), _model("llama"), 2, None, None)
    with pytest.raises(ValueError, match="concertina_layout='sometimes': choose 'manual'"):
        _args(tmp_path, concertina_layout="sometimes")
