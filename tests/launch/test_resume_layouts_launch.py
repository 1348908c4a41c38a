"""Resume at another number of processes, end to end (the decision over every pair of layouts is
tests/training/test_resume_layouts.py): refused before the first step, on every rank, naming both
``dp x pp x sp`` layouts.

One launch of 2 gloo processes (this file's :func:`_worker`): a run at dp=2 writes a checkpoint;
then, from a checkpoint of one process written by the test, runs at dp=2, sp=2 and pp=2 are
each refused on both ranks with no step taken. The test then resumes the dp=2 checkpoint on one
process: refused too.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from _helpers import torchrun
from test_trainer_pipeline import _dataset, _model

COMMON = dict(report_to=[], disable_tqdm=True, max_steps=2, per_device_train_batch_size=2,
              concertina_max_tokens_per_chunk=16, train_sampling_strategy="sequential")
RESUMED = {"dp2": dict(concertina_data_parallel_size=2), "sp2": dict(concertina_sequence_parallel_size=2),
           "pp2": dict(concertina_pipeline_size=2)}


def _args(out, **kw):
    from concertina_hf import ConcertinaTrainingArguments

    return ConcertinaTrainingArguments(output_dir=out, **dict(COMMON, **kw))


def _worker(one_process_checkpoint: str, out: str) -> None:
    from concertina_hf import ConcertinaTrainer
    from concertina_hf.runtime.distributed import _AbortWatch

    dp2 = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(), args=_args(
        out, save_strategy="steps", save_steps=1, concertina_data_parallel_size=2, per_device_train_batch_size=1))
    dp2.train()
    # the refusals below end every rank through the abort flag: stopped, the refusal is what is tested
    _AbortWatch.current.stop()
    info = {}
    for case, sizes in RESUMED.items():
        trainer = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(),
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

    one = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(),
                            args=_args(str(tmp_path / "one"), save_strategy="steps", save_steps=1))
    one.train()
    one.end()
    torchrun(2, __file__, tmp_path / "one" / "checkpoint-1", tmp_path / "dp2")
    for rank in range(2):
        info = json.loads((tmp_path / "dp2" / f"info-rank{rank}.json").read_text())
        for case, now in (("dp2", "dp=2 x pp=1 x sp=1"), ("sp2", "dp=1 x pp=1 x sp=2"), ("pp2", "dp=1 x pp=2 x sp=1")):
            assert info[case]["steps"] == 0, (rank, case, info)
            assert f"(checkpoint: dp=1 x pp=1 x sp=1, this run: {now})" in (info[case]["error"] or ""), (rank, info)
    back = ConcertinaTrainer(model=_model("llama"), train_dataset=_dataset(), args=_args(str(tmp_path / "back")))
    with pytest.raises(ValueError, match=r"\(checkpoint: dp=2 x pp=1 x sp=1, this run: dp=1 x pp=1 x sp=1\)"):
        back.train(resume_from_checkpoint=str(tmp_path / "dp2" / "checkpoint-1"))
    assert back.state.global_step == 0
    back.end()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
