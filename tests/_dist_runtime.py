"""Worker of ``test_runtime_dist.py``: one process per pipeline stage on a gloo group.

Each rank builds the same tiny models, computes the single-process HF reference itself, runs
every plan of :func:`_runtime_cases.plans_for` on its stage and compares the loss and its own
stage's gradients; with 4 ranks it also runs two independent 2-stage pipelines on subgroups
(group rank != global rank). Results (failures, measured vs predicted memory) go to
``<outdir>/rank<r>.json``; the test asserts on them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import traceback
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _runtime_cases import (  # noqa: E402
    CHUNKINGS, SEQ_LENS, batch, compare_grads, make_plan, plans_for, reference, tiny_model,
)

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=180))
    report: dict = {"rank": rank, "failures": [], "cases": 0, "memory": []}
    try:
        _run(rank, world, report)
    except Exception:
        report["failures"].append("crash:\n" + traceback.format_exc())
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, report: dict) -> None:
    from concertina_hf.planning import CostModel, PlanError, StageLayout
    from concertina_hf.planning.simulate import simulate
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    fail = report["failures"]
    ids, labels = batch()
    layout = StageLayout.even(8, world)
    for kind in ("llama", "qwen2"):
        model = tiny_model(kind)
        ref_loss, ref_grads = reference(model, ids, labels)
        w = PipelineWrapper(copy.deepcopy(model), layout, rank)
        ex = PipelineExecutor(w)
        cost = CostModel.from_hf_config(model.config, dtype_bytes=4)
        for name, plan in plans_for(layout):
            w.zero_grad(set_to_none=True)
            res = ex.run_step(plan, ids, labels)
            report["cases"] += 1
            if not _rel(res.loss, ref_loss) < LOSS_TOL:
                fail.append(f"{kind} {name}: loss {res.loss} vs {ref_loss}")
            fail.extend(f"{kind} {name} stage {rank}: {b}" for b in compare_grads(w, ref_grads, GRAD_TOL))
            if [a for a, _, _ in res.action_times] != list(plan.schedule[rank]):
                fail.append(f"{kind} {name}: action_times do not follow the schedule")
            if kind == "llama":
                predicted = simulate(plan, cost).peak_memory_bytes[rank] - cost.static_memory(layout, rank)
                report["memory"].append((name, res.peak_activation_bytes, predicted))
        # evaluation: forward only, same loss on every rank, no gradients
        w.zero_grad(set_to_none=True)
        res = ex.run_step(make_plan(SEQ_LENS, CHUNKINGS["hybrid"], layout, "full"), ids, labels, train=False)
        if not _rel(res.loss, ref_loss) < LOSS_TOL:
            fail.append(f"{kind} eval: loss {res.loss} vs {ref_loss}")
        if any(p.grad is not None for p in w.parameters()):
            fail.append(f"{kind} eval: gradients were produced")
        # a full HF state dict gathered on pipeline rank 0
        sd = w.full_state_dict()
        if rank == 0:
            want = model.state_dict()
            if set(sd) != set(want) or not all(torch.equal(sd[k], want[k]) for k in want):
                fail.append(f"{kind}: full_state_dict differs from the model's state dict")
        elif sd is not None:
            fail.append(f"{kind}: full_state_dict returned a dict on rank {rank}")
    # neighbours forwarding chunks in different orders: refused before any message is sent
    plan = make_plan(SEQ_LENS, CHUNKINGS["packed"], layout)
    sched = list(plan.schedule)
    sched[-1] = tuple(sorted(sched[-1], key=lambda a: (a.kind.value != "F", -a.chunk)))  # F2 F1 F0 B2 B1 B0
    try:
        ex.run_step(dataclasses.replace(plan, schedule=tuple(sched)), ids, labels)
        fail.append("a plan whose neighbouring stages disagree on the chunk order was executed")
    except PlanError as e:
        if "different orders" not in str(e):
            fail.append(f"wrong error for mismatched orders: {e}")
    if world == 4:
        _subgroups(rank, report, ids, labels)


def _subgroups(rank: int, report: dict, ids, labels) -> None:
    """Two 2-stage pipelines on ranks (0, 1) and (2, 3): the group rank, not the global rank, is
    the stage."""
    from concertina_hf.planning import StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    members = [[0, 1], [2, 3]]
    groups = [dist.new_group(m) for m in members]  # every rank creates every group
    mine = 0 if rank in members[0] else 1
    stage = dist.get_rank(groups[mine])
    layout = StageLayout(8, ((0, 3), (3, 8)))  # uneven on purpose
    model = tiny_model("qwen2", seed=mine + 5)  # the two pipelines train different models
    ref_loss, ref_grads = reference(model, ids, labels)
    w = PipelineWrapper(copy.deepcopy(model), layout, stage)
    ex = PipelineExecutor(w, pp_group=groups[mine])
    plan = make_plan(SEQ_LENS, CHUNKINGS["hybrid"], layout, "partial")
    res = ex.run_step(plan, ids, labels)
    report["cases"] += 1
    if not _rel(res.loss, ref_loss) < LOSS_TOL:
        report["failures"].append(f"subgroup {mine}: loss {res.loss} vs {ref_loss}")
    report["failures"].extend(f"subgroup {mine} stage {stage}: {b}" for b in compare_grads(w, ref_grads, GRAD_TOL))
    sd = w.full_state_dict(groups[mine])
    if (sd is not None) != (stage == 0):
        report["failures"].append(f"subgroup {mine}: full_state_dict on the wrong rank")
    elif sd is not None and not all(torch.equal(sd[k], v) for k, v in model.state_dict().items()):
        report["failures"].append(f"subgroup {mine}: full_state_dict differs")
