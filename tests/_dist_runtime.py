"""Worker of ``tests/launch/test_runtime_dist.py``: one process per pipeline stage on a gloo group.

Each rank builds the same tiny models, computes the single-process HF reference itself, runs
every plan of :func:`_runtime_cases.plans_for` on its stage and compares the loss and its own
stage's gradients, a few of them also under bf16 autocast; a tied-embedding Llama checks the
gradient sum of the two copies of its shared weight (first and last stage); with 4 ranks it also
runs two independent 2-stage pipelines on subgroups (group rank != global rank). Results
(failures, measured vs predicted memory, autocast errors) go to ``<outdir>/rank<r>.json``; the
test asserts on them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _helpers import gloo_rank  # noqa: E402
from _runtime_cases import (  # noqa: E402
    CHUNKINGS, SEQ_LENS, batch, compare_grads, grad_error, make_plan, plans_for, reference, tied_model, tiny_model,
)

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
# bf16 autocast (tests/runtime/test_runtime.py explains AMP_LOSS_TOL and AMP_GRAD_TOL): the
# pipeline under autocast must equal HF under autocast within bf16 tolerances, and must really have
# run in bf16. The second is shown against bf16's unit roundoff u = 2**-8 (3.9e-3): a stage that
# ignored autocast computes float32 gradients, within GRAD_TOL (1e-4) of HF in float32, while bf16
# compute puts its gradients at least ~u away (measured at pp = 2 and 4: 2.8e-2 to 7.1e-2, i.e.
# 7x to 18x u). AMP_ROUNDED = u sits 7x under the smallest measured and 39x over GRAD_TOL.
# (It replaces "closer to HF-autocast than 0.7x the distance to float32", which bf16 does not
# promise: two bf16 roundings of the same function are each about as far from float32 as from
# each other; measured 0.37 to 0.61 here, 0.72 with transformers 5.25 elsewhere.)
AMP_LOSS_TOL = 1e-3
AMP_GRAD_TOL = 5e-2
AMP_ROUNDED = 2.0**-8
AMP_PLANS = ("hybrid/partial", "split/full", "adaptive-tight")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _breakdown_problems(res) -> list[str]:
    """``StepResult.breakdown``: compute equals the action spans, every part >= 0, the parts sum to
    the step's wall time within 5%, and a pipeline stage spent some time in communication."""
    parts = res.breakdown
    out = []
    if set(parts) != {"compute", "comm_wait", "other"} or min(parts.values()) < 0:
        out.append(f"breakdown {parts}")
    elif abs(sum(parts.values()) - res.wall_time_s) > 0.05 * res.wall_time_s:
        out.append(f"breakdown {parts} sums to {sum(parts.values())}, wall time {res.wall_time_s}")
    elif abs(parts["compute"] - sum(e - s for _, s, e in res.action_times)) > 1e-9 or not parts["comm_wait"] > 0:
        out.append(f"breakdown {parts}: compute is not the action spans' sum, or no communication")
    return out


def worker(outdir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gloo_rank(outdir, lambda report: _run(rank, world, report), memory=[], amp=[])


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
            fail.extend(f"{kind} {name} stage {rank}: {b}" for b in _breakdown_problems(res))
            if kind == "llama":
                predicted = simulate(plan, cost).peak_memory_bytes[rank] - cost.static_memory(layout, rank)
                report["memory"].append((name, res.peak_activation_bytes, predicted))
        # bf16 autocast (float32 weights): the same as HF under autocast, within bf16 tolerances
        amp_loss, amp_grads = reference(model, ids, labels, autocast=torch.bfloat16)
        for name, plan in plans_for(layout):
            if name not in AMP_PLANS:
                continue
            w.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                res = ex.run_step(plan, ids, labels)
            report["cases"] += 1
            err, err_fp32 = grad_error(w, amp_grads), grad_error(w, ref_grads)
            report["amp"].append((kind, name, rank, _rel(res.loss, amp_loss), err, err_fp32))
            if not (_rel(res.loss, amp_loss) < AMP_LOSS_TOL and err < AMP_GRAD_TOL and err_fp32 > AMP_ROUNDED):
                fail.append(f"{kind} {name} autocast stage {rank}: loss {res.loss} vs {amp_loss}, "
                            f"grad err {err:.2e} (vs fp32 reference {err_fp32:.2e})")
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
    _tied(rank, world, report, ids, labels)
    if world == 4:
        _subgroups(rank, report, ids, labels)


def _tied(rank: int, world: int, report: dict, ids, labels) -> None:
    """Tied input/output embeddings: the first stage's embedding and the last stage's head are
    copies; each gets its share of the gradient, ``sync_tied_gradients`` sums them (the
    single-process gradient of the shared weight), bit-identical on both stages."""
    from concertina_hf.planning import StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    fail = report["failures"]
    layout = StageLayout.even(8, world)
    model = tied_model()
    ref_loss, ref_grads = reference(model, ids, labels)
    w = PipelineWrapper(copy.deepcopy(model), layout, rank)
    ex = PipelineExecutor(w)
    tied = w.tied_weight
    if (tied is not None) != (rank in (0, world - 1)):
        fail.append(f"tied: stage {rank} has tied_weight={tied is not None}")
    for name in ("hybrid/partial", "split/full", "hybrid-2groups/partial"):
        plan = dict(plans_for(layout))[name]
        w.zero_grad(set_to_none=True)
        res = ex.run_step(plan, ids, labels)
        report["cases"] += 1
        if not _rel(res.loss, ref_loss) < LOSS_TOL:
            fail.append(f"tied {name}: loss {res.loss} vs {ref_loss}")
        if tied is not None:  # one share only before the sum
            share = float((tied.grad - ref_grads["lm_head.weight"]).norm() / ref_grads["lm_head.weight"].norm())
            if not share > 1e-2:
                fail.append(f"tied {name} stage {rank}: the copy's gradient is already the total before the sum")
        ex.sync_tied_gradients()
        fail.extend(f"tied {name} stage {rank}: {b}" for b in compare_grads(w, ref_grads, GRAD_TOL))
        # both copies hold the same bits
        first = tied.grad.clone() if rank == 0 else torch.empty_like(model.lm_head.weight)
        dist.broadcast(first, src=0)
        if rank == world - 1 and not torch.equal(first, tied.grad):
            fail.append(f"tied {name}: the two copies' gradients differ after the sum")
    sd = w.full_state_dict()
    if rank == 0:
        want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # HF tied checkpoint
        if set(sd) != set(want) or not all(torch.equal(sd[k], want[k]) for k in want):
            fail.append(f"tied: full_state_dict keys {sorted(set(sd) ^ set(want))} or values differ")


def _subgroups(rank: int, report: dict, ids, labels) -> None:
    """Two 2-stage pipelines on ranks (0, 1) and (2, 3): the group rank, not the global rank, is
    the stage."""
    from concertina_hf.planning import StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
    from concertina_hf.runtime.distributed import p2p_channels

    members = [[0, 1], [2, 3]]
    groups = [dist.new_group(m) for m in members]  # every rank creates every group
    mine = 0 if rank in members[0] else 1
    stage = dist.get_rank(groups[mine])
    layout = StageLayout(8, ((0, 3), (3, 8)))  # uneven on purpose
    model = tiny_model("qwen2", seed=mine + 5)  # the two pipelines train different models
    ref_loss, ref_grads = reference(model, ids, labels)
    w = PipelineWrapper(copy.deepcopy(model), layout, stage)
    ex = PipelineExecutor(w, pp_group=groups[mine], channels=p2p_channels(members))
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
