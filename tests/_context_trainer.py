"""Worker of ``tests/launch/test_context_launch.py::test_trainer_pp2_sp2_with_planner_modes`` on 4
CPU ranks: ``ConcertinaTrainer`` at pp=2 x sp=2 with ``concertina_sequence_parallel_mode='auto'``
(the planner chooses Ulysses / whole-doc / per-doc per chunk, from a measured cost model loaded
from a file) for 3 steps on ``_models``' model and data, then evaluation with run_clm's metrics and
``predict()``; the modes of every chunk the executor ran are recorded. Each rank writes
``<out>/info-rank<r>.json``; the reference is ``_models.train_reference``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 3


def main(out: str) -> None:
    from _models import COMMON, logged, metrics_and_predictions, tiny_dataset, tiny_model

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from concertina_hf.planning import CostModel, DeviceSpec
    from concertina_hf.planning.sharding import chunk_mode

    model = tiny_model("llama")
    # a measured cost model, loaded ('profiled' with a file: the same plans on every run): CPU rates
    # with the collective times this machine's gloo fit gave (benchmarks/results/flashcp_measured.md)
    cost = dataclasses.replace(CostModel.from_hf_config(model.config, DeviceSpec.cpu(), dtype_bytes=4),
                               intra_node_latency_s=1e-3, all_gather_latency_s=2.3e-3,
                               reduce_scatter_latency_s=1.1e-2)
    path = os.path.join(out, "cost_model.json")
    with open(path, "w") as fh:
        json.dump(cost.to_dict(), fh)
    args = ConcertinaTrainingArguments(output_dir=out, save_strategy="no", concertina_pipeline_size=2,
                                       concertina_sequence_parallel_size=2, concertina_max_tokens_per_chunk=16,
                                       concertina_sequence_parallel_mode="auto", concertina_cost_model="profiled",
                                       concertina_cost_model_path=path, **dict(COMMON, max_steps=STEPS))
    trainer = ConcertinaTrainer(model=model, args=args, train_dataset=tiny_dataset(),
                                eval_dataset=tiny_dataset(8, seed=1))
    modes: list[str] = []
    run_step = trainer.executor.run_step

    def recording(plan, *a, **kw):
        modes.extend(chunk_mode(c) for c in plan.chunks)
        return run_step(plan, *a, **kw)

    trainer.executor.run_step = recording
    trainer.train()
    info = logged(trainer)
    info["train_modes"] = sorted(set(modes))
    info["eval_loss"] = trainer.evaluate()["eval_loss"]
    t = trainer.topology
    info.update(metrics_and_predictions(trainer, os.path.join(out, f"logits-rank{t.rank}.pt")))
    info["modes"] = sorted(set(modes))
    with open(os.path.join(out, f"info-rank{t.rank}.json"), "w") as f:
        json.dump(info, f)

