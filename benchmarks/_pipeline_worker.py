"""Worker of ``measured.py``: one process per pipeline stage, running planned steps for real.

Every rank builds the same HF model from the config with the same seed (so both stages start
from the weights the single-process Trainer starts from), keeps its stage
(:class:`~concertina_hf.runtime.PipelineWrapper`) and runs *jobs* (a strategy with fixed knobs,
optionally its own activation ``budgets``; a ``pp: 1`` job runs the whole model in one process,
rank 0, on a copy of its own, while rank 1 idles: the pp=1 reference)
through :class:`~concertina_hf.runtime.PipelineExecutor`, with an optimizer step after each
pipeline step (the optimizer class and settings ``transformers.Trainer`` builds by default).

Steps of the different jobs are interleaved round by round (round 0 is the untimed warm-up and
memory round, rounds 1.. the timed steps; round ``r`` runs the jobs rotated by ``r``), so a
change of machine load hits every strategy alike. All jobs train the same weights: every
strategy computes the same gradients for a batch (the runtime's equivalence with the HF model),
so the interleaved run is one valid training run.

Planning is overlapped as in ``StepStatsCallback``: pipeline rank 0 plans a job's next step in a
background thread (which hands it to a planning process, as ``StepPlanner`` does; spec
``planner: "thread"``: in the thread itself) while the job's current step runs (so the planning of one strategy never
competes with another strategy's step), and broadcasts the plan (JSON) at the start of the
step. One timed step on every rank::

    barrier | t0 | wait for the plan (rank 0: the planning thread; others: the broadcast) |
    run_step | optimizer.step + zero_grad | t1

The step time is the slowest rank's ``t1 - t0``; the planning time on the critical path is the
wait for the plan (rank 0) plus its broadcast. The memory round runs ``run_step`` under an
:class:`~concertina_hf.runtime.memory.AllocationTracker` (untimed) besides the runtime's own
:class:`~concertina_hf.runtime.memory.SavedTensorMeter`; the timed rounds run without the
meter (``measure_memory=False``, ``meter_peak_bytes`` ``None``), as ``ConcertinaTrainer`` runs
the steps it does not log.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

__all__ = ["build_model", "run_profile", "run_worker", "trainer_optimizer_spec"]


def build_model(config: dict, seed: int):
    """The benchmark's HF causal LM, fp32, initialized from ``seed`` (identical on every process)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def trainer_optimizer_spec() -> tuple[type, dict]:
    """The optimizer class and settings ``transformers.Trainer`` uses with default
    ``TrainingArguments`` on CPU (called before any process group exists)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=os.devnull, use_cpu=True, report_to="none")
    return Trainer.get_optimizer_cls_and_kwargs(args)


def run_worker(rank: int, world: int, port: int, spec_path: str, out_path: str) -> None:
    serve(rank, world, port, spec_path, out_path, lambda spec: _run(rank, world, spec))


def serve(rank: int, world: int, port: int, spec_path: str, out_path: str, run) -> None:
    """One process of a 2-rank benchmark: join the gloo group, ``run(spec)`` on the pickled spec,
    rank 0 writes the result as JSON; a failure is written to ``<out_path>.rank<r>.error``."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    try:
        with open(spec_path, "rb") as fh:
            spec = pickle.load(fh)
        result = run(spec)
        if rank == 0:
            with open(out_path, "w") as fh:
                json.dump(result, fh)
    except Exception:
        with open(f"{out_path}.rank{rank}.error", "w") as fh:
            fh.write(traceback.format_exc())
        dist.destroy_process_group()
        raise
    finish()


def finish() -> None:
    """End a worker rank whose results are written: a barrier, then exit without tearing the gloo
    group down. On this machine a rank intermittently aborted in that teardown ("terminate called
    without an active exception", SIGABRT: about one run in three of ``studies/sharded_state.py --quick``
    and one CI run of ``measured.py --tiny``), after every result was already on disk; the group
    dies with the process either way."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_profile(rank: int, world: int, port: int, spec_path: str, out_path: str) -> None:
    """Both processes profile the model at the same time (so each sees the CPU contention of a
    pp=2 run); each writes its fitted cost model to ``out_path.rank<r>.json``. Then rank 0 and 1
    time P2P messages both ways through the runtime's :class:`~concertina_hf.runtime.p2p.StageComm`
    (the stage-to-stage link the cost model's ``p2p_latency_s`` / ``p2p_bandwidth`` describe)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    try:
        with open(spec_path, "rb") as fh:
            spec = pickle.load(fh)
        from concertina_hf.runtime.profiler import profile_cost_model

        model = build_model(spec["config"], spec["seed"])
        t0 = time.perf_counter()
        cost = profile_cost_model(model, shapes=spec["shapes"], repeats=spec["repeats"], warmup=1,
                                  num_layers=spec["num_layers"], max_tokens=spec["max_tokens"])
        took = time.perf_counter() - t0
        p2p = _p2p_probe(rank, int(spec["config"]["hidden_size"]), spec["p2p_tokens"])
        with open(f"{out_path}.rank{rank}.json", "w") as fh:
            json.dump({"cost": cost.to_dict(), "seconds": took, "p2p": p2p}, fh)
    except Exception:
        with open(f"{out_path}.rank{rank}.error", "w") as fh:
            fh.write(traceback.format_exc())
        dist.destroy_process_group()
        raise
    finish()


def _p2p_probe(rank: int, hidden: int, tokens: list[int], repeats: int = 20) -> list[tuple[int, float]]:
    """``(bytes, one-way seconds)`` of a ``[1, T, hidden]`` fp32 message between rank 0 and 1:
    half the median round trip (a send and a receive of the same size each way)."""
    from concertina_hf.runtime.distributed import p2p_channels
    from concertina_hf.runtime.p2p import StageComm

    comm = StageComm(None, rank, 2, p2p_channels([[0, 1]], timeout=timedelta(minutes=5)))
    out = []
    for t in tokens:
        buf = torch.zeros(1, t, hidden)
        trips = []
        for _ in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                comm.exchange([comm.send_op(buf, 1, 0)], [comm.recv_op(buf, 1, 1)])
            else:
                comm.exchange([], [comm.recv_op(buf, 0, 0)])
                comm.exchange([comm.send_op(buf, 0, 1)], [])
            comm.drain()
            trips.append(time.perf_counter() - t0)
        out.append((buf.numel() * 4, statistics.median(trips[2:]) / 2))
    return out


def _capacity_probe(rank: int, world: int, iters: int = 150) -> float:
    """How many cores the ranks really get: a fixed matmul workload timed on each rank alone
    (the others wait in a barrier, which sleeps), then on all ranks at once. Returns
    ``sum(alone) / max(together)`` (the same on every rank): ``world`` on an idle machine, about
    1 when the ranks share one core's worth of CPU (then pipeline bubbles cost nothing and finer
    pipelines only add overhead)."""
    a = torch.randn(256, 256)

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, a)
        return time.perf_counter() - t0

    work()
    alone = 0.0
    for r in range(world):
        dist.barrier()
        t = work() if rank == r else 0.0
        alone += t
        dist.barrier()
    dist.barrier()
    together = torch.tensor([work()])
    total = torch.tensor([alone])
    dist.all_reduce(together, op=dist.ReduceOp.MAX)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total) / float(together)


def _plan_for(spec: dict, cost, layout, job: dict, lens: list[int], process=None):
    """``(plan, wall seconds, CPU seconds of the planning)``; a job's ``budgets`` (0: unbounded)
    override the spec's. ``process``: a :class:`~concertina_hf.planning.process.PlanningProcess`
    to plan in (as ``StepPlanner`` does), else in this thread."""
    from concertina_hf.planning.process import plan_checked

    t0, c0 = time.perf_counter(), time.thread_time()
    budgets = job.get("budgets", spec["budgets"])
    args = (lens, cost, layout, tuple(budgets) if budgets else 0, job["strategy"])
    kwargs = dict(solver=spec["solver"], time_limit_s=spec["time_limit_s"], **job["knobs"])
    if process is not None:
        plan = process.plan(*args, **kwargs)
        cpu = process.last_cpu_s
    else:
        plan = plan_checked(*args, **kwargs)
        cpu = time.thread_time() - c0
    return plan, time.perf_counter() - t0, cpu


class _Replica:
    """What a job runs on: the shared pp=2 stage of this rank, or (``pp: 1`` jobs) a whole model of
    its own on rank 0, with its own optimizer (rank 1 idles through those steps)."""

    def __init__(self, spec: dict, layout, rank: int) -> None:
        from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

        self.layout = layout
        self.active = rank < layout.num_stages
        if not self.active:
            return
        self.wrapper = PipelineWrapper(build_model(spec["config"], spec["seed"]), layout, rank)
        self.wrapper.train()
        self.params = [p for p in self.wrapper.parameters() if p.requires_grad]
        self.executor = PipelineExecutor(self.wrapper)
        opt_cls, opt_kwargs = spec["optimizer"]
        self.opt = opt_cls(self.params, **opt_kwargs)


def _run(rank: int, world: int, spec: dict) -> dict:
    from concertina_hf.planning import CostModel, Plan, StageLayout

    cost = CostModel.from_dict(spec["cost"])
    layout = StageLayout(cost.num_layers, tuple(tuple(r) for r in spec["layer_ranges"]))
    replicas = {layout.num_stages: _Replica(spec, layout, rank)}
    if any(job.get("pp", world) == 1 for job in spec["jobs"]):
        replicas[1] = _Replica(spec, StageLayout(cost.num_layers, ((0, cost.num_layers),)), rank)

    batches = [[torch.tensor(s, dtype=torch.long) for s in b] for b in spec["batches"]]
    rounds = [spec["memory_batch"]] + list(spec["timed_batches"])
    jobs = spec["jobs"]
    # round r runs the jobs rotated by r, so no job always follows the same one
    steps = [(r, (j + r) % len(jobs)) for r in range(len(rounds)) for j in range(len(jobs))]
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan") if rank == 0 else None
    # the background thread plans in a process of its own (StepPlanner's default) unless the spec
    # asks for the thread itself (planner "thread": what StepPlanner(isolate=False) does)
    # (a job's own "planner" overrides the spec's)
    process = None
    if rank == 0 and any(j.get("planner", spec.get("planner", "process")) == "process" for j in spec["jobs"]):
        from concertina_hf.planning.process import PlanningProcess

        process = PlanningProcess()
    futures: dict[tuple[int, int], object] = {}

    def replica(j: int) -> _Replica:
        return replicas[jobs[j].get("pp", layout.num_stages)]

    def submit(r: int, j: int) -> None:
        futures[(r, j)] = pool.submit(_plan_for, spec, cost, replica(j).layout, jobs[j],
                                      [len(s) for s in batches[rounds[r]]],
                                      process if jobs[j].get("planner", spec.get("planner", "process")) == "process"
                                      else None)

    if rank == 0:
        # the warm-up round's plans are made before it, off the clock
        for j in range(len(jobs)):
            submit(0, j)
        for f in list(futures.values()):
            f.result()
    # on a shared machine, wait (up to max_wait_s) until the ranks get min_capacity cores
    capacity = [_capacity_probe(rank, world)]
    waited = 0.0
    while capacity[0] < spec.get("min_capacity", 0.0) and waited < spec.get("max_wait_s", 0.0):
        if rank == 0:
            print(f"[pp2] the two ranks get {capacity[0]:.2f} cores; waiting for a quieter machine "
                  f"({waited:.0f}/{spec['max_wait_s']:.0f} s)", flush=True)
        time.sleep(20.0)
        waited += 20.0
        capacity[0] = _capacity_probe(rank, world)
    records: list[dict] = []
    for i, (r, j) in enumerate(steps):
        job, b, rep = jobs[j], rounds[r], replica(j)
        ids = batches[b]
        memory_round = r == 0
        dist.barrier()
        t0 = time.perf_counter()
        payload = [None]
        if rank == 0:
            plan, plan_time, plan_cpu = futures.pop((r, j)).result()
            payload = [plan.to_json()]
            if r + 1 < len(rounds):
                # the job's next step is planned while this one runs, as in a single-strategy run
                submit(r + 1, j)
        t_ready0 = time.perf_counter()
        dist.broadcast_object_list(payload, src=0)
        if rank != 0:
            plan, plan_time, plan_cpu = Plan.from_json(payload[0]), 0.0, 0.0
        t_ready = time.perf_counter()
        if rep.active:
            mine = _step(rank, rep, plan, ids, memory_round, t0, t_ready0, t_ready)
        else:  # a pp=1 job: this rank idles
            mine = {"rank": rank, "idle": True}
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            per = sorted((m for m in gathered if not m.get("idle")), key=lambda m: m["rank"])
            base = min(m["t_call"] for m in per)
            rec = {
                "job": job["name"], "strategy": job["strategy"], "round": r, "batch": b,
                "memory_round": memory_round,
                "tokens": sum(len(s) for s in ids), "num_seqs": len(ids), "longest": max(len(s) for s in ids),
                "step_s": max(m["step_s"] for m in per),
                "run_s": max(m["run_s"] for m in per),
                "opt_s": max(m["opt_s"] for m in per),
                "plan_wait_s": max(m["wait_s"] for m in per),
                "plan_wait_rank0_s": per[0]["wait_plan_s"],
                "plan_time_s": plan_time,
                "plan_cpu_s": plan_cpu,  # CPU time of the planning thread on rank 0 for this step's plan
                "pp": rep.layout.num_stages,
                "predicted_step_s": plan.predicted.step_time_s,
                "predicted_peak_bytes": list(plan.predicted.peak_memory_bytes),
                "predicted_recompute_fraction": plan.predicted.recompute_fraction,
                "predicted_bubble_fraction": plan.predicted.bubble_fraction,
                "meter_peak_bytes": [m["meter_peak"] for m in per],
                "alloc_peak_bytes": [m["alloc_peak"] for m in per] if memory_round else None,
                # the same, counting the parameter storages the layers viewed too
                "alloc_peak_with_params_bytes": [m["alloc_peak_params"] for m in per] if memory_round else None,
                "loss": per[-1]["loss"],
                "knobs": [[k, v] for k, v in plan.knobs],
                "chunks": plan.chunk_counts(),
                "num_chunks": plan.num_chunks,
                "recompute_layers": [sum(row) for row in plan.recompute],
                # measured actions on one clock: each rank's times from its run_step call
                "actions": {m["rank"]: [(a, s + m["t_call"] - base, e + m["t_call"] - base) for a, s, e in m["actions"]]
                            for m in per},
                "stage_breakdown": [m["breakdown"] for m in per],  # seconds per stage (rank), see mine
                "stage_step_s": [m["step_s"] for m in per],
                "stage_cpu_s": [m["cpu_s"] for m in per],
                "plan": plan.to_json(),  # for the online refit and the Gantt chart; not written out
            }
            records.append(rec)
            print(f"[pp2] round {r} {job['name']:<22} {rec['tokens']:>6} tok  step {rec['step_s']:.2f}s "
                  f"(pred {rec['predicted_step_s']:.2f}s)  plan wait {rec['plan_wait_s'] * 1e3:.1f}ms", flush=True)
    if pool is not None:
        pool.shutdown(wait=True)
    if process is not None:
        process.close()
    capacity.append(_capacity_probe(rank, world))
    return {"records": records, "loadavg_end": os.getloadavg(), "capacity": capacity, "waited_s": waited}


def _step(rank: int, rep: _Replica, plan, ids, memory_round: bool, t0: float, t_ready0: float, t_ready: float) -> dict:
    """``run_step`` and the optimizer step of one job on this rank, with its timings."""
    from concertina_hf.runtime.memory import AllocationTracker

    wrapper, params = rep.wrapper, rep.params
    tracker = None
    if memory_round:
        tracker = AllocationTracker()
        tracker.__enter__()
    t_call, c_call = time.perf_counter(), time.thread_time()
    try:
        # the activation peak is measured on the memory round only, as the trainer measures only
        # the steps it logs: the saved-tensor hooks cost 1-7% of a CPU step (chunks of 1024 to 64 tokens)
        # (studies/runtime_overhead.py); the Trainer baseline meters its first step only too
        res = rep.executor.run_step(plan, ids, measure_memory=memory_round)
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    # activations only: parameter gradients are created in the step but persist (static
    # memory), and a layer's view of its weight (``weight.t()``) makes the tracker count the
    # parameter's storage from then on: both left out (the budget is for activations)
    alloc_peak = alloc_peak_params = None
    if tracker is not None:
        alloc_peak = tracker.peak_bytes(exclude=[*wrapper.parameters(), *wrapper.buffers(),
                                                 *(p.grad for p in params)])
        alloc_peak_params = tracker.peak_bytes(exclude=[p.grad for p in params])
    del tracker
    t_run = time.perf_counter()
    rep.opt.step()
    rep.opt.zero_grad(set_to_none=True)
    t1, c1 = time.perf_counter(), time.thread_time()
    return {
        "rank": rank, "step_s": t1 - t0, "wait_s": t_ready - t0, "wait_plan_s": t_ready0 - t0,
        "run_s": t_run - t_call, "opt_s": t1 - t_run, "t_call": t_call, "loss": res.loss,
        "meter_peak": res.peak_activation_bytes, "alloc_peak": alloc_peak, "alloc_peak_params": alloc_peak_params,
        "actions": [(str(a), s, e) for a, s, e in res.action_times],
        # where this rank's step went: plan wait, run_step's compute / comm waits / other, the rest
        # (allocation tracker, optimizer); the parts sum to step_s
        "breakdown": {"plan_wait": t_call - t0, **res.breakdown, "optimizer": t1 - t_call - res.wall_time_s},
        # CPU seconds of this rank's main thread from run_step to the end of the optimizer step: over
        # that wall time, the share of a core the rank got while it had work (waits sleep)
        "cpu_s": c1 - c_call,
    }
