"""Resume at another number of processes, end to end (the decision over every pair of layouts is
tests/training/test_resume_layouts.py): refused before the first step, on every rank, naming both
``dp x pp x sp`` layouts.

One launch of 2 gloo processes (this file's :func:`_worker`): a run at dp=2 writes a checkpoint
per step; resumed from step 1 at sp=2 (the same 2 processes, data- and sequence-parallel sizes
exchanged), steps 2 and 3 have the uninterrupted dp=2 run's losses (step 3's loss shows the
restored optimizer state). Then, from a checkpoint of one process written by the test, runs at
dp=2, sp=2 and pp=2 are each refused on both ranks with no step taken. The test then resumes the
dp=2 checkpoint on one process: refused too.
"""

from __future__ import annotations

import json
import os

import pytest

from _helpers import run_ranks
from _models import tiny_dataset, tiny_model

COMMON = dict(report_to=[], disable_tqdm=True, max_steps=2, per_device_train_batch_size=2, logging_steps=1,
              concertina_max_tokens_per_chunk=16, train_sampling_strategy="sequential")
RESUMED = {"dp2": dict(concertina_data_parallel_size=2), "sp2": dict(concertina_sequence_parallel_size=2),
           "pp2": dict(concertina_pipeline_size=2)}


def _args(out, **kw):
    from concertina_hf import ConcertinaTrainingArguments

    return ConcertinaTrainingArguments(output_dir=out, **dict(COMMON, **kw))


def _worker(one_process_checkpoint: str, out: str) -> None:
    from concertina_hf import ConcertinaTrainer
    from concertina_hf.runtime.distributed import _AbortWatch

    dp2 = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), args=_args(
        out, save_strategy="steps", save_steps=1, concertina_data_parallel_size=2, per_device_train_batch_size=1,
        max_steps=3))
    dp2.train()
    # the same global batch on one replica of two sequence-parallel ranks
    sp2 = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), args=_args(
        f"{out}-sp2-resumed", save_strategy="no", concertina_sequence_parallel_size=2, max_steps=3))
    sp2.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
    info = {"losses": {name: {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}
                       for name, t in (("dp2", dp2), ("sp2_resumed", sp2))}}
    # the refusals below end every rank through the abort flag: stopped, the refusal is what is tested
    _AbortWatch.current.stop()
    for case, sizes in RESUMED.items():
        trainer = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(),
                                    args=_args(f"{out}-{case}", save_strategy="no", **sizes))
        try:
            trainer.train(resume_from_checkpoint=one_process_checkpoint)
            info[case] = {"error": None}
        except ValueError as e:
            info[case] = {"error": str(e)}
        info[case]["steps"] = trainer.state.global_step
    with open(os.path.join(out, f"info-rank{dp2.topology.rank}.json"), "w") as fh:
        json.dump(info, fh)
    dp2.end()


def test_resume_at_another_number_of_processes_is_refused_naming_both_layouts(tmp_path):
    from concertina_hf import ConcertinaTrainer

    one = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(),
                            args=_args(str(tmp_path / "one"), save_strategy="steps", save_steps=1))
    one.train()
    one.end()
    run_ranks(2, _worker, str(tmp_path / "one" / "checkpoint-1"), str(tmp_path / "dp2"), logs=tmp_path / "logs")
    for rank in range(2):
        info = json.loads((tmp_path / "dp2" / f"info-rank{rank}.json").read_text())
        dp2, resumed = info["losses"]["dp2"], info["losses"]["sp2_resumed"]
        # (step 1's entry is the checkpoint's own log history)
        assert {"2", "3"} <= set(resumed) and all(abs(resumed[s] - dp2[s]) < 1e-5 for s in resumed), info["losses"]
        for case, now in (("dp2", "dp=2 x pp=1 x sp=1"), ("sp2", "dp=1 x pp=1 x sp=2"), ("pp2", "dp=1 x pp=2 x sp=1")):
            assert info[case]["steps"] == 0, (rank, case, info)
            assert f"(checkpoint: dp=1 x pp=1 x sp=1, this run: {now})" in (info[case]["error"] or ""), (rank, info)
    back = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), args=_args(str(tmp_path / "back")))
    with pytest.raises(ValueError, match=r"\(checkpoint: dp=2 x pp=1 x sp=1, this run: dp=1 x pp=1 x sp=1\)"):
        back.train(resume_from_checkpoint=str(tmp_path / "dp2" / "checkpoint-1"))
    assert back.state.global_step == 0
    back.end()

