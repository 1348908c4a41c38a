"""Planner fuzz: random steps through ``plan_step``, counting what breaks the planner's contract.

    python benchmarks/planner_fuzz.py                   # 120 s of random calls
    python benchmarks/planner_fuzz.py --seconds 600 --seed 3

Each call draws a model (tiny-llama on CPU rates, LLaMA-7B on A800 rates), a pipeline depth
(1-8), a batch (many sequences of length 1, many equal lengths, or long-tailed lengths up to 1M,
sometimes an empty one), a token cap (none, 1, 2, 16, 512, 4096, 65536), a strategy and a
budget (unlimited, below static memory, just above it, 2x, 10x, huge). The contract:
every call returns a plan that passes ``validate()`` and fits its budget in simulation, or
raises ``PlanError``, within 2 s. Reported: calls (plans, refusals), contract violations (other
exceptions, plans over budget), calls over 2 s of CPU (this process and the CBC solver it waits
for) and over 2 s of wall clock (which counts the machine's other load too), calls stopped at
the ``--call-limit`` (counted as over both), the largest and the 99th-percentile CPU and wall
seconds, and the slowest cases. The default suite checks the same contract on derandomized
calls (tests/planning/test_planner_fuzz.py); this runs for a set time on fresh ones. Writes
benchmarks/results/planner_fuzz.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _results import Run, write_results  # noqa: E402
from concertina_hf.planning.presets import MODEL_PRESETS  # noqa: E402
from concertina_hf.planning import STRATEGIES, CostModel, DeviceSpec, PlanError, fits, partition_layers  # noqa: E402
from concertina_hf.planning import plan_step  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BOUND_S = 2.0


class _CallLimit(Exception):
    pass


def _draw(rng: random.Random, costs: dict) -> dict:
    name = rng.choice(sorted(costs))
    cost = costs[name]
    p = rng.randint(1, min(8, cost.num_layers))
    layout = partition_layers(cost, p)
    k = rng.choice([1, 2, 5, 30, 200])
    mode = rng.random()
    if mode < 0.2:
        lens = [1] * k
    elif mode < 0.4:
        lens = [rng.choice([1, 7, 4096])] * k
    else:
        lens = [int(min(10**6, rng.paretovariate(1.1) * rng.choice([10, 300, 3000]))) for _ in range(k)]
    if rng.random() < 0.1:
        lens[0] = 0
    static = max(cost.static_memory(layout, s) for s in range(p))
    factor = rng.choice([0, 0.5, 1.01, 2, 10, 10**6])
    return dict(model=name, cost=cost, layout=layout, lens=lens, cap=rng.choice([None, 1, 2, 16, 512, 4096, 65536]),
                strategy=rng.choice(STRATEGIES), budget=int(static * factor), budget_x_static=factor)


def run(seconds: float, seed: int, call_limit: int) -> dict:
    rng = random.Random(seed)
    costs = {"tiny-llama": CostModel.from_hf_config(MODEL_PRESETS["tiny-llama"], DeviceSpec.cpu()),
             "llama-7b": CostModel.from_hf_config(MODEL_PRESETS["llama-7b"], DeviceSpec.a800())}

    def stop(*_):
        raise _CallLimit()

    signal.signal(signal.SIGALRM, stop)
    calls, violations, slow, plans, cpu_all, wall_all = 0, [], [], 0, [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        c = _draw(rng, costs)
        case = {k: c[k] for k in ("model", "strategy", "cap", "budget_x_static")}
        case.update(stages=c["layout"].num_stages, sequences=len(c["lens"]), longest=max(c["lens"]),
                    tokens=sum(c["lens"]))
        t0, c0 = time.perf_counter(), _cpu_s()
        signal.alarm(call_limit)
        try:
            plan = plan_step(c["lens"], c["cost"], c["layout"], c["budget"], c["strategy"],
                             max_tokens_per_chunk=c["cap"])
            plans += 1
            plan.validate()
            if not fits(plan, c["cost"], c["budget"]):  # one size: sp-only plans have one stage
                violations.append(dict(case, what="plan over its budget"))
        except _CallLimit:
            case["stopped"] = True
        except PlanError:
            pass
        except Exception as e:  # the contract allows PlanError only
            violations.append(dict(case, what=f"{type(e).__name__}: {str(e)[:200]}"))
        finally:
            signal.alarm(0)
        dt, cpu = time.perf_counter() - t0, _cpu_s() - c0
        cpu_all.append(cpu)
        wall_all.append(dt)
        if dt > BOUND_S or cpu > BOUND_S:
            slow.append(dict(case, seconds=round(dt, 2), cpu_seconds=round(cpu, 2)))
        calls += 1
    slow.sort(key=lambda s: -s["seconds"])

    def q99(xs):
        return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0

    return dict(calls=calls, plans=plans, violations=violations, slow=slow, seconds=seconds, seed=seed,
                call_limit_s=call_limit, over_cpu=sum(1 for x in cpu_all if x > BOUND_S),
                over_wall=sum(1 for x in wall_all if x > BOUND_S), max_cpu_s=max(cpu_all, default=0.0),
                max_wall_s=max(wall_all, default=0.0), p99_cpu_s=q99(cpu_all), p99_wall_s=q99(wall_all))


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it waited for (the CBC solver)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv: list[str] | None = None) -> int:
    run_ = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--call-limit", type=int, default=10, help="stop a call after this many seconds")
    ap.add_argument("--out", default=str(RESULTS / "planner_fuzz"), help="output path without extension")
    args = ap.parse_args(argv)
    res = run(args.seconds, args.seed, args.call_limit)
    stopped = sum(1 for s in res["slow"] if s.get("stopped"))
    lines = [
        "# Planner fuzz",
        "",
        f"{res['calls']} random calls in {res['seconds']:.0f} s (seed {res['seed']}; {res['plans']} plans, "
        f"{res['calls'] - res['plans']} refusals). "
        f"Contract: a valid plan within budget or PlanError, within {BOUND_S:.0f} s.",
        "",
        f"- contract violations (other exceptions, plans over budget): **{len(res['violations'])}**",
        f"- calls over {BOUND_S:.0f} s of CPU: **{res['over_cpu']}**; over {BOUND_S:.0f} s of wall clock: "
        f"**{res['over_wall']}** ({stopped} stopped at the {res['call_limit_s']} s call limit)",
        f"- slowest call: {res['max_cpu_s']:.2f} s CPU, {res['max_wall_s']:.2f} s wall; 99th percentile: "
        f"{res['p99_cpu_s']:.2f} s CPU, {res['p99_wall_s']:.2f} s wall",
        "",
    ]
    if res["slow"]:
        lines += ["| wall s | CPU s | model | stages | strategy | cap | budget / static | sequences | longest "
                  "| tokens |", "|---:|---:|---|---:|---|---:|---:|---:|---:|---:|"]
        for s in res["slow"][:15]:
            secs = f">{res['call_limit_s']}" if s.get("stopped") else f"{s['seconds']}"
            lines.append(f"| {secs} | {s['cpu_seconds']} | {s['model']} | {s['stages']} | {s['strategy']} | "
                         f"{s['cap']} | {s['budget_x_static']} | {s['sequences']} | {s['longest']} | {s['tokens']} |")
    for v in res["violations"][:15]:
        lines.append(f"- violation: {v}")
    write_results(args.out, "\n".join(lines) + "\n", res, run_)
    return 0


if __name__ == "__main__":
    sys.exit(main())
