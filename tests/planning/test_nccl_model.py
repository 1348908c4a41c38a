"""Every program the planner lowers runs under NCCL's message semantics on the runtime's channels
(``dry_run(program, rendezvous=True)``: a send completes only once its receive is posted, each
direction between two neighbours is one channel run in issue order; :mod:`concertina_hf.runtime.p2p`).

Random plans, derandomized: every pipeline strategy, 2 to 8 stages, long-tailed batches with
sequences of up to 128K tokens (split chains), budgets that make recompute and several pipeline
groups bind, token caps, the extra warm-up forwards and the taper fixed or searched, stages of
several GPUs (sp), and each plan's training and evaluation programs. The default suite plans
2,000 of them; ``CONCERTINA_NCCL_PLANS=20000`` runs more. Planning takes nearly all of the time: the
cases are drawn in this process in order and planned on two processes (the suite's machine has two
cores), the results taken in the order drawn, so the plans counted are those of one process.
"""

from __future__ import annotations

import os
import random

import pytest

from concertina_hf.planning import PIPELINE_STRATEGIES, CostModel, DeviceSpec, PlanError, dry_run, lower, partition_layers, plan_step
from concertina_hf.planning.presets import MODEL_PRESETS

NUM_PLANS = int(os.environ.get("CONCERTINA_NCCL_PLANS", "2000"))


def _costs():
    llama = CostModel.from_hf_config(MODEL_PRESETS["llama-7b"], DeviceSpec.a800())
    tiny = CostModel.from_hf_config(MODEL_PRESETS["tiny-llama"], DeviceSpec.cpu())
    return {"llama-7b": llama, "llama-7b-sp4": llama.with_parallel(sp=4, state_shards=4), "tiny-llama": tiny}


def _case(rng: random.Random, costs):
    name = rng.choice(sorted(costs))
    cost = costs[name]
    p = min(rng.choice([2, 2, 3, 4, 4, 8]), cost.num_layers)
    longest = rng.choice([2048, 16384, 65536, 131072]) if name != "tiny-llama" else rng.choice([512, 2048, 8192])
    n = rng.randint(1, 24)
    lens = [max(1, min(longest, int(rng.paretovariate(1.1) * longest / 50))) for _ in range(n)]
    if rng.random() < 0.5:
        lens[0] = longest  # a split chain
    layout = partition_layers(cost, p)
    knobs = {}
    strategy = rng.choice(PIPELINE_STRATEGIES)
    if strategy == "adaptive":
        if rng.random() < 0.3:
            knobs["extra_warmup"] = rng.randint(0, 3)
        if rng.random() < 0.3:
            knobs["taper"] = rng.choice([0, 0.5])
        if rng.random() < 0.3:
            knobs["max_groups"] = rng.randint(1, 4)
    static = max(cost.static_memory(layout, s) for s in range(p))
    budget = rng.choice([0, int(static * rng.uniform(1.05, 3)), int(80e9)])
    cap = rng.choice([None, None, 512, 4096])
    return name, lens, layout, budget, strategy, cap, knobs


#: the cost models, built once per process
_COSTS: dict = {}


def _plan_and_run(case) -> list[str] | None:
    """One case: ``None`` when the planner refuses it, else the failures of its training and
    evaluation programs under NCCL's semantics."""
    name, lens, layout, budget, strategy, cap, knobs = case
    if not _COSTS:  # once per process of the pool
        _COSTS.update(_costs())
    try:
        plan = plan_step(lens, _COSTS[name], layout, budget, strategy, max_tokens_per_chunk=cap, solver="greedy",
                         **knobs)
    except PlanError:
        return None
    failures = []
    for train in (True, False):
        try:
            dry_run(lower(plan, train=train), rendezvous=True)
        except PlanError as e:
            failures.append(f"{strategy} {name} pp={layout.num_stages} train={train} {lens}: {e}")
    return failures


def test_every_lowered_program_runs_under_nccl_semantics():
    from _helpers import fork_pool

    rng = random.Random(21)
    costs = _costs()
    planned, refused, failures = 0, 0, []
    with fork_pool(2) as pool:
        while planned < NUM_PLANS:
            cases = [_case(rng, costs) for _ in range(min(256, max(16, (NUM_PLANS - planned) * 13 // 10)))]
            for result in pool.imap(_plan_and_run, cases, chunksize=8):
                if planned == NUM_PLANS:  # the cases drawn after the last one counted are not
                    break
                if result is None:
                    refused += 1
                    continue
                planned += 1
                failures += result
    assert not failures, f"{len(failures)} of {planned} plans:\n" + "\n".join(failures[:5])
    assert refused < planned  # the cases plan, mostly


def test_the_rendezvous_dry_run_waits_for_every_send_at_the_step_end():
    """A send whose receive is never reached (the peer stops before it) holds the step's end."""
    from concertina_hf.planning.plan import Program

    cost = _costs()["tiny-llama"]
    plan = plan_step([300, 200], cost, partition_layers(cost, 2), 0, "packed", token_budget=200)
    program = lower(plan)
    dry_run(program, rendezvous=True)
    # stage 1 without its last receive and everything after it: stage 0's last send is unmatched
    steps = list(program.steps[1])
    last_recv = max(i for i, st in enumerate(steps) if any(a.kind.is_recv for a in st))
    cut = Program(plan, (program.steps[0], tuple(steps[:last_recv])), True)
    with pytest.raises(PlanError, match="no matching"):
        dry_run(cut, rendezvous=True)


def test_placed_plans_run_under_nccl_semantics_on_every_sp_rank():
    """Stages of sp GPUs with whole-doc / per-doc chunks: rank ``r`` of each stage exchanges with
    rank ``r`` of its neighbours and drops the messages of the chunks it holds no token of
    (:func:`~concertina_hf.planning.lower.rank_program`); every rank's program runs under NCCL's
    semantics, training and evaluation. Batches of a few short sequences leave ranks empty."""
    from concertina_hf.planning.lower import rank_program
    from concertina_hf.planning.sharding import rank_tokens

    rng = random.Random(23)
    base = CostModel.from_hf_config(MODEL_PRESETS["tiny-llama"], DeviceSpec.cpu())
    failures, dropped, planned = [], 0, 0
    for _ in range(40):
        sp = rng.choice([2, 4])
        cost = base.with_parallel(sp=sp, state_shards=sp)
        p = rng.choice([2, 3, 4])
        lens = [rng.choice([1, 3, 5, 9, 30, 120]) for _ in range(rng.randint(1, 6))]
        mode = rng.choice(["context", "auto"])
        cap = rng.choice([None, 24, 64])
        plan = plan_step(lens, cost, partition_layers(cost, p), 0, rng.choice(PIPELINE_STRATEGIES), sp_mode=mode,
                         max_tokens_per_chunk=cap, solver="greedy")
        planned += 1
        for train in (True, False):
            program = lower(plan, train=train)
            for r in range(sp):
                mine = rank_program(program, sp, r)
                empty = {c.index for c in plan.chunks if c.placement and rank_tokens(c, sp, r) == 0}
                assert mine.silent == empty
                dropped += len(empty)
                try:
                    dry_run(mine, rendezvous=True)
                except PlanError as e:
                    failures.append(f"sp={sp} rank {r} pp={p} {mode} cap={cap} train={train} {lens}: {e}")
    assert not failures, f"{len(failures)} of {planned} plans:\n" + "\n".join(failures[:5])
    assert dropped > 20  # ranks were left empty, their messages dropped


def test_a_rank_program_that_keeps_one_end_of_a_dropped_message_fails():
    """The dry run bites: rank 1's program of a chunk it holds nothing of, with stage 0 still
    sending it, has a send without its receive."""
    from concertina_hf.planning.lower import rank_program
    from concertina_hf.planning.plan import Program

    cost = CostModel.from_hf_config(MODEL_PRESETS["tiny-llama"], DeviceSpec.cpu()).with_parallel(sp=2, state_shards=2)
    plan = plan_step([5], cost, partition_layers(cost, 2), 0, "adaptive", sp_mode="context")
    holder = plan.chunks[0].placement[0]
    program = lower(plan)
    mine = rank_program(program, 2, 1 - holder)
    assert mine.silent == {0} and all(a.kind.is_compute for st in mine.steps for step in st for a in step)
    dry_run(mine, rendezvous=True)
    half = Program(plan, (program.steps[0], mine.steps[1]), True, mine.silent)
    with pytest.raises(PlanError, match="no matching"):
        dry_run(half, rendezvous=True)
