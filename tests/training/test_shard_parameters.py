"""``concertina_shard_parameters``: each stage's parameters, gradients and optimizer state sharded
over its ``sp`` ranks with torch's FSDP2 (``runtime.param_sharding.shard_stage``), the replicas'
shards all-reduced once a step.

Default tier: the planner's static memory under parameter sharding (``zero3``: everything over
``dp x sp``) as the trainer's cost model holds it. ``tests/launch/test_shard_parameters_launch.py``
runs on 4 gloo processes (pp=1 x sp=2 x dp=2, option on): equal to
``Trainer`` on one process with the global batch, every rank holding only its half of every
parameter, gradient and Adam moment (the bytes the planner predicts), full HF weights saved, and
resuming from the step-2 checkpoint exact.
"""

from __future__ import annotations

import pytest

def test_static_memory_under_parameter_sharding(tmp_path):
    from _models import tiny_model

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.run_setup import resolve_run

    topo = Topology(4, 0, 1, 2, 0, 0, sequence_parallel_size=2)  # dp=2 x pp=1 x sp=2, as a rank sees it
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_pipeline_size=1,
                                       concertina_shard_parameters=True, report_to=[])
    cost = resolve_run(args, tiny_model("llama"), topo).cost_model
    # over the stage's sp ranks (the replicas run different chunks: their gradients are all-reduced once a step)
    assert (cost.state_shards, cost.zero3) == (2, True)
    assert cost.sharded_state_memory(resolve_run(args, tiny_model("llama"), topo).layout, 0) == pytest.approx(
        16 * sum(p.numel() for p in tiny_model("llama").parameters()) / 2)


def test_parameter_sharding_refused_on_a_pipeline(tmp_path):
    from _models import tiny_model

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.run_setup import resolve_run

    topo = Topology(4, 0, 2, 1, 0, 0, sequence_parallel_size=2)  # pp=2 x sp=2
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_pipeline_size=2,
                                       concertina_shard_parameters=True, report_to=[])
    with pytest.raises(ValueError, match=r"concertina_shard_parameters=True runs at concertina_pipeline_size=1 only"):
        resolve_run(args, tiny_model("llama"), topo)
