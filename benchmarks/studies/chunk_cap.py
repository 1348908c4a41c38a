"""Chunk cap: the project's pp=1 step against its prediction, chunks capped at the profiled range or not.

    flock /tmp/concertina_bench.lock python benchmarks/studies/chunk_cap.py   # 2K/4K/8K, ~5 min on one core
    python benchmarks/studies/chunk_cap.py --quick                            # tiny model, < 1 min
    python benchmarks/studies/chunk_cap.py --check                            # --quick, asserting its invariants

Same model, batches and cost model as ``pipeline_efficiency.py`` (``measured.py``'s ``full`` preset,
stdlib batches of up to ``--tokens-per-step`` tokens, the cost model of ``results/measured.json``
when it records its fitted chunk range, else profiled here). One process runs the executor on the
whole model (pp=1, ``adaptive`` unbounded) for each timed batch with two plans, alternated
``--reps`` times after a warm-up step: **capped** (the planner's default: no chunk larger than the
cost model's ``max_chunk_tokens``, the largest profiled chunk) and **uncapped** (the same model
with ``max_chunk_tokens=0``: pp=1 then puts a step in one or two chunks). Reported per step: the
chunks, the largest, the simulator's step time, and the measured wall and CPU time (the process's;
on a shared machine CPU time is the honest figure) with their error. Writes
``benchmarks/results/studies/chunk_cap.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = pathlib.Path(__file__).resolve().parents[1]
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

RESULTS = BENCH / "results" / "studies"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, one 256-token context (smoke)")
    ap.add_argument("--contexts", type=str, default=None, help="context lengths, comma separated (default 2048,4096,8192)")
    ap.add_argument("--tokens-per-step", type=int, default=None, help="most tokens in one step's batch (default 16384)")
    ap.add_argument("--steps", type=int, default=2, help="timed batches per context")
    ap.add_argument("--reps", type=int, default=1, help="alternations of the two plans per batch")
    ap.add_argument("--profile", action="store_true", help="profile a fresh cost model instead of measured.json's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    args.preset = "tiny" if args.quick else "full"
    args.contexts = ([int(x) for x in args.contexts.split(",")] if args.contexts
                     else [256] if args.quick else [2048, 4096, 8192])
    args.tokens_per_step = args.tokens_per_step or (1024 if args.quick else 16384)
    if args.out is None:
        args.out = RESULTS / ("chunk_cap_quick" if args.quick else "chunk_cap")
    return args


def run(args, log) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import measured
    from _pipeline_worker import build_model
    from concertina_hf.planning import StageLayout, plan_step, simulate
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
    from torch_pipelining_peer import cost_model

    torch.set_num_threads(1)
    pre = measured.PRESETS[args.preset]
    config = measured.model_config(pre["model"], max(args.contexts))
    corpus = measured.load_corpus(pre["max_files"])
    cost, source = cost_model(config, args, log, ("measured.json",))
    if not cost.max_chunk_tokens:
        raise RuntimeError("the cost model records no fitted chunk range (max_chunk_tokens); profile it afresh")
    variants = {"capped": cost, "uncapped": dataclasses.replace(cost, max_chunk_tokens=0)}
    layout = StageLayout(cost.num_layers, ((0, cost.num_layers),))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{measured._free_port()}", rank=0, world_size=1)
    try:
        wrapper = PipelineWrapper(build_model(config, args.seed), layout, 0)
        wrapper.train()
        executor = PipelineExecutor(wrapper)
        rows = []
        for ctx in args.contexts:
            batches, _, timed = measured.make_batches(corpus, ctx, args.tokens_per_step, args.steps, args.seed)
            for b in timed:
                ids = [torch.tensor(s, dtype=torch.long) for s in batches[b]]
                lens = [len(s) for s in ids]
                plans = {name: plan_step(lens, c, layout, 0, "adaptive") for name, c in variants.items()}
                executor.run_step(plans["capped"], ids)  # warm-up
                wrapper.zero_grad(set_to_none=True)
                for rep in range(args.reps):
                    for name, plan in plans.items():
                        pred = simulate(plan, cost).step_time_s
                        t0, c0 = time.perf_counter(), time.process_time()
                        executor.run_step(plan, ids)
                        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                        wrapper.zero_grad(set_to_none=True)
                        row = {"context": ctx, "batch": b, "tokens": sum(lens), "rep": rep, "plan": name,
                               "chunks": plan.num_chunks, "largest_chunk": max(c.num_tokens for c in plan.chunks),
                               "predicted_s": pred, "wall_s": wall, "cpu_s": cpu, "load": os.getloadavg()[0]}
                        rows.append(row)
                        log(f"ctx {ctx} batch {b} {name:<9} {row['chunks']} chunks (largest {row['largest_chunk']}): "
                            f"predicted {pred:.2f}s, wall {wall:.2f}s, CPU {cpu:.2f}s")
    finally:
        dist.destroy_process_group()
    summary = {name: {"mean_abs_cpu_error": statistics.mean(abs(r["cpu_s"] / r["predicted_s"] - 1) for r in rows
                                                           if r["plan"] == name),
                      "max_cpu_error": max(r["cpu_s"] / r["predicted_s"] - 1 for r in rows if r["plan"] == name)}
               for name in variants}
    return {"config": config, "cost_source": source, "max_chunk_tokens": cost.max_chunk_tokens, "rows": rows,
            "summary": summary}


def to_markdown(res: dict[str, Any]) -> str:
    L = ["# Chunk cap: pp=1 steps against their prediction, chunks within the profiled range or not", "",
         f"Cost model: {res['cost_source']}, "
         f"largest profiled chunk {res['max_chunk_tokens']} tokens. One process, the executor on the whole "
         "model (pp=1, `adaptive` unbounded), the two plans of each batch alternated after a warm-up step; "
         "errors are measured over predicted (CPU: the process's CPU time, unaffected by other processes).", "",
         "| plan | mean abs CPU error | largest CPU error |", "|---|---|---|"]
    for name, s in res["summary"].items():
        L.append(f"| {name} | {s['mean_abs_cpu_error']:.1%} | {s['max_cpu_error']:+.1%} |")
    L += ["", "| context | batch (tokens) | plan | chunks | largest chunk | predicted s | wall s | CPU s | load |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        L.append(f"| {r['context']} | {r['batch']} ({r['tokens']}) | {r['plan']} | {r['chunks']} | {r['largest_chunk']} | "
                 f"{r['predicted_s']:.2f} | {r['wall_s']:.2f} ({r['wall_s'] / r['predicted_s'] - 1:+.0%}) | "
                 f"{r['cpu_s']:.2f} ({r['cpu_s'] / r['predicted_s'] - 1:+.0%}) | {r['load']:.1f} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> dict[str, Any]:
    from _results import Run, write_results

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--check"]:
        from _results import self_check

        return self_check(main, check)
    run_ = Run(__file__, argv)
    args = parse_args(argv)
    log = lambda m: print(f"[chunk_cap] {m}", flush=True)  # noqa: E731
    res = run(args, log)
    res.update(settings={k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()})
    write_results(args.out, to_markdown(res), res, run_)
    return res


def check(res: dict[str, Any], md: str) -> None:
    """``--check``: both plans of each batch run, the capped
    one within the profiled range, the uncapped one beyond it (one chunk per step at pp=1)."""
    assert res["command"].startswith("python benchmarks/studies/chunk_cap.py --quick"), res["command"]
    assert "load_average" in res and "header" in res
    cap = res["max_chunk_tokens"]
    rows = {(r["batch"], r["plan"]): r for r in res["rows"]}
    assert {p for _, p in rows} == {"capped", "uncapped"}
    assert all(r["largest_chunk"] <= cap for (_, p), r in rows.items() if p == "capped")
    assert any(r["largest_chunk"] > cap for (_, p), r in rows.items() if p == "uncapped")
    assert "| capped |" in md


if __name__ == "__main__":
    main()
