"""Worker of ``measured_sp.py``: four processes running three ``pp x sp`` layouts of one model.

Every rank builds the package's own mesh (:meth:`concertina_hf.runtime.distributed.Topology.build`) once
per layout (``pp=2 x sp=2``, ``pp=1 x sp=4``, ``pp=4 x sp=1``: three meshes over the same four
processes), a copy of the HF model from the same seed per layout (so every layout starts from
the weights of the single-process model), keeps its stage
(:class:`~concertina_hf.runtime.PipelineWrapper`) and runs the adaptive planner's steps through
:class:`~concertina_hf.runtime.PipelineExecutor` with Ulysses inside each stage (``sp_group``),
then sums the gradients over the stage's sp ranks (:func:`~concertina_hf.runtime.distributed.reduce_gradients`)
and takes an optimizer step (Trainer's default AdamW). Each layout trains its own copy on the same
batches in the same order.

Setup (collective, untimed): for each layout with ``sp > 1`` the all-to-alls of one decoder
layer are timed on its real sp group and fitted into its cost model
(:func:`~concertina_hf.runtime.ulysses.profile_all_to_all`, as ``run_setup`` does); rank 0 then
partitions the layers (:func:`~concertina_hf.planning.partition_layers`), sets the one activation
budget per GPU (see ``measured_sp.py``) and broadcasts layouts and budgets.

Steps are interleaved round by round as in ``_pipeline_worker`` (round 0: the untimed warm-up /
memory round under an :class:`~concertina_hf.runtime.memory.AllocationTracker`; round ``r`` runs
the layouts rotated by ``r``); rank 0 plans a layout's next step in a background thread while
its current step runs and broadcasts the plan. One timed step on every rank::

    barrier | t0 | wait for the plan | run_step | reduce gradients over sp | optimizer step | t1
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _pipeline_worker import _capacity_probe, build_model, serve  # noqa: E402

__all__ = ["activation_budget", "layout_costs", "reference_loss", "run_worker"]


def run_worker(rank: int, world: int, port: int, spec_path: str, out_path: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))  # Topology.build checks the launch
    serve(rank, world, port, spec_path, out_path, lambda spec: _run(rank, world, spec))


def layout_costs(cost, layouts: list[dict]) -> list:
    """Each layout's per-GPU cost model: ``cost`` (one process) over ``sp`` GPUs, the optimizer
    state not sharded (every rank of a stage holds its stage's whole state, as in the runs)."""
    return [cost.with_parallel(sp=lay["sp"], state_shards=1) if lay["sp"] > 1 else cost for lay in layouts]


def activation_budget(costs: list, stage_layouts: list, length: int, frac: float,
                      batches: list[list[int]] = (), raise_by: float = 1.1) -> dict:
    """The one activation budget per GPU for every layout (GPUs of one kind have the same
    memory): ``measured.py``'s rule on the first layout (the one under test, pp=2 x sp=2):
    ``frac`` of the way from every layer recomputed (0) to none (1) for one whole
    ``length``-token sequence run alone, on its GPU where that is most; raised by factors of
    ``raise_by`` until the adaptive planner (greedy) plans every one of ``batches`` (sequence
    lengths) on every layout (``raised``: how many times). The same figure of every layout is
    reported (``per_layout``). Not the largest of them: pp=4 x sp=1 holds the whole sequence's
    logits on its last GPU, and its figure would leave the sp layouts unconstrained."""
    from concertina_hf.planning import PlanError, plan_step
    from measured import whole_sequence_activation

    per = []
    for cost, layout in zip(costs, stage_layouts):
        hi, lo = whole_sequence_activation(cost, layout, length)
        per.append({"no_recompute": hi, "full_recompute": lo,
                    "at_frac": max(l + frac * (h - l) for h, l in zip(hi, lo))})
    budget, raised = per[0]["at_frac"], 0

    def fits(b: float) -> bool:
        for cost, layout in zip(costs, stage_layouts):
            static = [cost.static_memory(layout, s) for s in range(layout.num_stages)]
            for lens in batches:
                try:
                    plan_step(list(lens), cost, layout, [int(st + b) for st in static], "adaptive", solver="greedy")
                except PlanError:
                    return False
        return True

    while not fits(budget):
        budget, raised = budget * raise_by, raised + 1
    return {"budget": budget, "raised": raised, "per_layout": per}


def reference_loss(config: dict, seed: int, ids: list[torch.Tensor]) -> float:
    """The single-process HF model's loss on a batch (initial weights): each sequence alone,
    labels = inputs, token-averaged over the batch (``num_items_in_batch``)."""
    model = build_model(config, seed)
    n = sum(len(t) - 1 for t in ids)
    total = 0.0
    with torch.no_grad():
        for t in ids:
            total += float(model(input_ids=t[None], labels=t[None], num_items_in_batch=n).loss)
    return total


def _run(rank: int, world: int, spec: dict) -> dict:
    from concertina_hf.runtime.distributed import Topology, reduce_gradients
    from concertina_hf.planning import CostModel, Plan, StageLayout, partition_layers, plan_step, simulate
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
    from concertina_hf.runtime.memory import AllocationTracker
    from concertina_hf.runtime.ulysses import default_a2a_token_counts, profile_all_to_all

    layouts = spec["layouts"]
    t_setup = time.perf_counter()
    topos = [Topology.build(pp=lay["pp"], dp=1, sp=lay["sp"], timeout=timedelta(seconds=1800)) for lay in layouts]
    costs = layout_costs(CostModel.from_dict(spec["cost"]), layouts)
    a2a = []
    for i, (lay, topo) in enumerate(zip(layouts, topos)):
        a2a.append(None)
        if lay["sp"] > 1:  # the all-to-all on this layout's real sp group (collective)
            tokens = default_a2a_token_counts(max(spec["max_len"], 8192), lay["sp"])
            try:
                costs[i] = profile_all_to_all(costs[i], topo.sp_group, tokens, repeats=3)
                a2a[i] = [costs[i].intra_node_latency_s, costs[i].intra_node_bandwidth]
            except ValueError as e:  # times that do not grow with the size (same on every rank)
                if rank == 0:
                    print(f"[sp4] {lay['name']}: all-to-all not fitted, analytic fields kept ({e})", flush=True)
    setup = [None]
    if rank == 0:
        stage_layouts = [partition_layers(c, lay["pp"]) for c, lay in zip(costs, layouts)]
        budget = activation_budget(costs, stage_layouts, spec["max_len"], spec["budget_frac"],
                                   [[len(x) for x in b] for b in spec["batches"]])
        static = [[c.static_memory(sl, s) for s in range(sl.num_stages)] for c, sl in zip(costs, stage_layouts)]
        setup = [{"layer_ranges": [[list(r) for r in sl.layer_ranges] for sl in stage_layouts],
                  "budget": budget, "static": static,
                  "budgets": [[int(st + budget["budget"]) for st in row] for row in static]}]
    dist.broadcast_object_list(setup, src=0)
    setup = setup[0]
    stage_layouts = [StageLayout(costs[0].num_layers, tuple(tuple(r) for r in rr)) for rr in setup["layer_ranges"]]

    batches = [[torch.tensor(s, dtype=torch.long) for s in b] for b in spec["batches"]]
    rounds = [spec["memory_batch"]] + list(spec["timed_batches"])
    ref = reference_loss(spec["config"], spec["seed"], batches[spec["memory_batch"]]) if rank == 0 else None
    opt_cls, opt_kwargs = spec["optimizer"]
    runs = []
    for lay, topo, sl in zip(layouts, topos, stage_layouts):
        wrapper = PipelineWrapper(build_model(spec["config"], spec["seed"]), sl, topo.stage)
        wrapper.train()
        params = [p for p in wrapper.parameters() if p.requires_grad]
        ex = PipelineExecutor(wrapper, pp_group=topo.pp_group, sp_group=topo.sp_group if lay["sp"] > 1 else None,
                                channels=topo.p2p_channels)
        runs.append({"wrapper": wrapper, "params": params, "ex": ex, "opt": opt_cls(params, **opt_kwargs)})
    setup_s = time.perf_counter() - t_setup

    def plan_for(j: int, lens: list[int]):
        t0 = time.perf_counter()
        plan = plan_step(lens, costs[j], stage_layouts[j], tuple(setup["budgets"][j]), "adaptive",
                         solver=spec["solver"], time_limit_s=spec["time_limit_s"])
        if plan.predicted is None:
            plan = plan.with_predicted(simulate(plan, costs[j]).stats())
        return plan.validate(), time.perf_counter() - t0

    steps = [(r, (j + r) % len(layouts)) for r in range(len(rounds)) for j in range(len(layouts))]
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan") if rank == 0 else None
    futures: dict = {}

    def submit(r: int, j: int) -> None:
        futures[(r, j)] = pool.submit(plan_for, j, [len(s) for s in batches[rounds[r]]])

    if rank == 0:
        for j in range(len(layouts)):
            submit(0, j)
        for f in list(futures.values()):
            f.result()
    capacity = [_capacity_probe(rank, world)]
    records = []
    for r, j in steps:
        lay, topo, run = layouts[j], topos[j], runs[j]
        ids = batches[rounds[r]]
        memory_round = r == 0
        dist.barrier()
        t0 = time.perf_counter()
        payload = [None]
        if rank == 0:
            plan, plan_time = futures.pop((r, j)).result()
            payload = [plan.to_json()]
            if r + 1 < len(rounds):
                submit(r + 1, j)
        dist.broadcast_object_list(payload, src=0)
        if rank != 0:
            plan, plan_time = Plan.from_json(payload[0]), 0.0
        t_call = time.perf_counter()
        tracker = AllocationTracker() if memory_round else None
        if tracker is not None:
            tracker.__enter__()
        try:
            res = run["ex"].run_step(plan, ids)
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
        alloc_peak = None
        if tracker is not None:  # activations only (see _pipeline_worker)
            alloc_peak = tracker.peak_bytes(exclude=[*run["wrapper"].parameters(), *run["wrapper"].buffers(),
                                                     *(p.grad for p in run["params"])])
        del tracker
        t_run = time.perf_counter()
        reduce_gradients(run["params"], topo, average=False)
        t_red = time.perf_counter()
        run["opt"].step()
        run["opt"].zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        mine = {"rank": rank, "stage": topo.stage, "sp_rank": topo.sp_rank, "step_s": t1 - t0,
                "plan_wait_s": t_call - t0, "run_s": t_run - t_call, "reduce_s": t_red - t_run, "opt_s": t1 - t_red,
                "loss": res.loss, "meter_peak": res.peak_activation_bytes, "alloc_peak": alloc_peak}
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            per = sorted(gathered, key=lambda m: m["rank"])
            static = setup["static"][j]
            rec = {"layout": lay["name"], "round": r, "batch": rounds[r], "memory_round": memory_round,
                   "tokens": sum(len(s) for s in ids), "num_seqs": len(ids), "longest": max(len(s) for s in ids),
                   "step_s": max(m["step_s"] for m in per), "run_s": max(m["run_s"] for m in per),
                   "reduce_s": max(m["reduce_s"] for m in per), "opt_s": max(m["opt_s"] for m in per),
                   "plan_wait_s": max(m["plan_wait_s"] for m in per), "plan_time_s": plan_time,
                   "predicted_step_s": plan.predicted.step_time_s,
                   # per rank (rank order): its stage's predicted activation peak (static memory left out)
                   "predicted_act_peak_bytes": [plan.predicted.peak_memory_bytes[m["stage"]] - static[m["stage"]]
                                                for m in per],
                   "meter_peak_bytes": [m["meter_peak"] for m in per],
                   "alloc_peak_bytes": [m["alloc_peak"] for m in per] if memory_round else None,
                   "stage_of_rank": [m["stage"] for m in per],
                   "losses": [m["loss"] for m in per], "loss": per[-1]["loss"],
                   "predicted_recompute_fraction": plan.predicted.recompute_fraction,
                   "predicted_bubble_fraction": plan.predicted.bubble_fraction,
                   "num_chunks": plan.num_chunks, "knobs": [[k, v] for k, v in plan.knobs]}
            records.append(rec)
            print(f"[sp4] round {r} {lay['name']:<10} {rec['tokens']:>6} tok  step {rec['step_s']:.2f}s "
                  f"(pred {rec['predicted_step_s']:.2f}s)  loss {rec['loss']:.4f}", flush=True)
    if pool is not None:
        pool.shutdown(wait=True)
    capacity.append(_capacity_probe(rank, world))
    return {"records": records, "setup": setup, "a2a": a2a, "reference_loss": ref, "capacity": capacity,
            "setup_s": setup_s, "costs": [c.to_dict() for c in costs], "loadavg_end": os.getloadavg()}
