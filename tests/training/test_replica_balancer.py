"""The replica balancer (``concertina_balance_replicas``, the default) on one step of a long and many
short sequences over 2 replicas, with the planner a real run's rank 0 builds: the replica holding
the long one runs fewer sequences, every sequence runs exactly once, and the predicted step time
beats the count split's. Two replicas training balanced against ``Trainer``:
``tests/launch/test_trainer_pipeline.py``.
"""

from __future__ import annotations

from _models import tiny_config


def test_the_balancer_gives_the_replica_with_the_long_sequence_fewer_sequences():
    """One step of a long and many short sequences over 2 replicas: the replica holding the long
    one runs fewer sequences; every sequence runs exactly once; the predicted step time beats the
    count split's (the split is the planner's own, made on rank 0 of a real run)."""
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.planning import CostModel, DeviceSpec, StageLayout, balance_replicas
    from concertina_hf.training.run_setup import RunSetup
    from concertina_hf.training.step_planner import StepPlanner
    from concertina_hf.training.step_reader import ReplicaBalancer

    cost = CostModel.from_hf_config(tiny_config("llama").to_dict(), DeviceSpec.cpu(), dtype_bytes=4)
    setup = RunSetup(cost_model=cost, layout=StageLayout(4, ((0, 4),)), budgets=(0,), device_memory_bytes=0,
                     strategy="adaptive", solver="greedy", solver_time_limit_s=1.0, max_tokens_per_chunk=256)
    balancer = ReplicaBalancer(StepPlanner(setup, Topology(2, 0, 1, 2, 0, 0), overlap=False), Topology(2, 0, 1, 2, 0, 0))
    lens = [30, 25, 2000, 40, 35, 28, 33, 27]
    split = balancer.split(lens)
    assert sorted(i for part in split for i in part) == list(range(len(lens)))
    heavy = next(r for r, part in enumerate(split) if 2 in part)
    assert len(split[heavy]) < len(split[1 - heavy]), split
    count = balance_replicas(lens, 2, cost, setup.layout, 0, method="count", solver="greedy",
                             max_tokens_per_chunk=256)
    assert balancer.last_split.step_time_s < count.step_time_s
