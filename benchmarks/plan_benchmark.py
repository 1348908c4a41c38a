"""Planner benchmark: predicted step time of every strategy, and planning time.

    python benchmarks/plan_benchmark.py                 # default: under a minute (about 30 s on 2 cores)
    python benchmarks/plan_benchmark.py --batches 5 --repeats 5 --time-limit 2

Settings (each one global batch per seed, planned by every strategy, scored by the same
simulator and cost model, so ratios are like for like):

(a) the paper's setting (arXiv 2509.21275): LLaMA-13B shapes, 4 pipeline stages of 8 A800s
    (:func:`stage_of_a800s`, 8 x 80 GiB per stage), 512 sequences from the ``github``
    distribution truncated at 64K and at 128K tokens. The shipped distribution is CONSTRUCTED
    from the paper's published statements, not measured (benchmarks/README.md). Also the same
    model on 16 GPUs (4 stages of 4 A800s, 320 GiB per stage), where memory binds.
(b) a real corpus here: the standard library's Python sources (734 files on Python 3.11)
    tokenized with the bundled tokenizer, the whole corpus as one batch truncated at 64K
    tokens, the ``tiny-llama`` config on 2 and 4 stages with ``DeviceSpec.cpu()`` rates and a
    budget that binds: 30% of the way from the full-recompute plan's peak to the no-recompute
    plan's peak (both planned without a budget).

Reported per setting: each strategy's step time, ratio to the best, bubble and recompute
fractions, peak memory; adaptive / packed, adaptive / split (both baselines tuned over their
knob), adaptive / ideal (``ideal_step_time``: every stage busy, nothing recomputed, no
overhead); planning time of adaptive (median over ``--repeats``) with the ILP and with the
greedy recompute solver. Writes benchmarks/results/plan_benchmark.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _results import Run, write_results  # noqa: E402
from concertina_hf.tools import data  # noqa: E402
from concertina_hf.planning.presets import MODEL_PRESETS  # noqa: E402
from concertina_hf.planning import (  # noqa: E402
    PIPELINE_STRATEGIES, CostModel, DeviceSpec, InfeasiblePlanError, PlanError, ideal_step_time, partition_layers,
    plan_step,
    simulate,
)

GIB = 2**30
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def stage_of_a800s(gpus: int) -> DeviceSpec:
    """``gpus`` A800s as one device, rates and memory added up and no communication inside the
    stage: the paper setting as this benchmark has always modelled it (a stage running Ulysses
    over its GPUs is ``CostModel.with_parallel(sp=gpus)``, with its all-to-alls)."""
    a = DeviceSpec.a800()
    return dataclasses.replace(a, flops=a.flops * gpus, mem_bandwidth=a.mem_bandwidth * gpus,
                               p2p_bandwidth=a.p2p_bandwidth * gpus, memory_bytes=a.memory_bytes * gpus)


def _time_plan(lens, cost, layout, budget, strategy, solver, time_limit, repeats):
    """(plan, median planning seconds) or (reason, median seconds) when nothing fits."""
    times, plan, reason = [], None, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            plan = plan_step(lens, cost, layout, budget, strategy, solver=solver, time_limit_s=time_limit)
        except (InfeasiblePlanError, PlanError) as e:
            reason = str(e)
        times.append(time.perf_counter() - t0)
    return (plan if plan is not None else reason), statistics.median(times)


def run_setting(name: str, lens: list[int], cost: CostModel, num_stages: int, budget: int,
                time_limit: float, repeats: int) -> dict[str, Any]:
    layout = partition_layers(cost, num_stages)
    ideal = ideal_step_time(lens, cost, layout)
    rows = []
    # the pipeline strategies; sp-only (another layout of per-GPU devices, not these aggregate
    # stages) is compared in benchmarks/paper_layout.py
    for strategy in PIPELINE_STRATEGIES:
        solvers = ("ilp", "greedy") if strategy == "adaptive" else ("ilp",)
        for solver in solvers:
            # only adaptive's timing is repeated; the baselines do not use the solver
            res, t_plan = _time_plan(lens, cost, layout, budget, strategy, solver, time_limit,
                                     repeats if strategy == "adaptive" else 1)
            label = strategy if solver == "ilp" else f"{strategy} (greedy)"
            if isinstance(res, str):
                rows.append({"strategy": label, "fits": False, "reason": res, "plan_time_s": t_plan})
                continue
            sim = simulate(res, cost)
            rows.append({
                "strategy": label, "fits": True, "step_time_s": sim.step_time_s,
                "bubble_fraction": sim.bubble_fraction, "recompute_fraction": sim.recompute_fraction,
                "peak_memory_bytes": list(sim.peak_memory_bytes), "num_chunks": res.chunk_counts(),
                "plan_time_s": t_plan, "knobs": [[k, v] for k, v in res.knobs],
            })
    fit = {r["strategy"]: r for r in rows if r["fits"]}
    best = min(r["step_time_s"] for r in fit.values()) if fit else float("nan")
    for r in fit.values():
        r["ratio_to_best"] = r["step_time_s"] / best

    def ratio(a, b):
        return fit[a]["step_time_s"] / fit[b]["step_time_s"] if a in fit and b in fit else None

    ad = fit.get("adaptive")
    return {
        "setting": name, "num_seqs": len(lens), "num_tokens": sum(lens), "longest": max(lens),
        "median_len": sorted(lens)[len(lens) // 2], "num_stages": num_stages,
        "layer_ranges": [list(r) for r in layout.layer_ranges], "budget_bytes": budget,
        "ideal_step_time_s": ideal, "rows": rows,
        "adaptive_over_packed": ratio("adaptive", "packed"),
        "adaptive_over_split": ratio("adaptive", "split"),
        "adaptive_over_ideal": ad["step_time_s"] / ideal if ad else None,
        "adaptive_greedy_over_ilp": ratio("adaptive (greedy)", "adaptive"),
        "plan_time_ilp_s": next((r["plan_time_s"] for r in rows if r["strategy"] == "adaptive"), None),
        "plan_time_greedy_s": next((r["plan_time_s"] for r in rows if r["strategy"] == "adaptive (greedy)"), None),
    }


def binding_budget(lens, cost, num_stages, frac=0.3) -> int:
    """A budget between the unconstrained full-recompute and no-recompute plans' peaks."""
    layout = partition_layers(cost, num_stages)
    lo = max(simulate(plan_step(lens, cost, layout, 0, "full-recompute"), cost).peak_memory_bytes)
    hi = max(simulate(plan_step(lens, cost, layout, 0, "no-recompute"), cost).peak_memory_bytes)
    return int(lo + frac * (hi - lo))


def stdlib_lengths(max_len: int) -> list[int]:
    from transformers import AutoTokenizer
    import datasets

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(data.bundled_tokenizer_path())
    ds = data.tokenize_dataset(data.load_text_dataset("stdlib"), tok, max_length=max_len)
    return [int(x) for x in ds["length"]]


def _fmt(x, spec=".3f", none="n/a"):
    return none if x is None else format(x, spec)


def to_markdown(results: list[dict[str, Any]], args, elapsed: float) -> str:
    lines = [
        "# Planner benchmark",
        "",
        "Step times are the simulator's "
        "predictions from the analytic cost model, not measurements. The `github` lengths come from a "
        "distribution constructed from published statements (see benchmarks/README.md).",
        "",
        "## Summary (mean over batches; min..max in brackets)",
        "",
        "| setting | batches | adaptive / packed | adaptive / split | adaptive / ideal | greedy / ILP step | plan ms ILP | plan ms greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_setting: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_setting.setdefault(r["setting"], []).append(r)

    def agg(rs, key, scale=1.0, spec=".3f"):
        vals = [r[key] * scale for r in rs if r[key] is not None]
        if not vals:
            return "does not fit"
        if len(vals) == 1:
            return format(vals[0], spec)
        return f"{format(statistics.mean(vals), spec)} [{format(min(vals), spec)}..{format(max(vals), spec)}]"

    for name, rs in by_setting.items():
        lines.append(
            f"| {name} | {len(rs)} | {agg(rs, 'adaptive_over_packed')} | {agg(rs, 'adaptive_over_split')} | "
            f"{agg(rs, 'adaptive_over_ideal')} | {agg(rs, 'adaptive_greedy_over_ilp')} | "
            f"{agg(rs, 'plan_time_ilp_s', 1e3, '.0f')} | {agg(rs, 'plan_time_greedy_s', 1e3, '.0f')} |"
        )
    lines += ["", "Ratios below 1 mean adaptive is faster. `ideal` is a lower bound no schedule reaches.", ""]
    for name, rs in by_setting.items():
        r = rs[0]
        lines += [
            f"## {name} (first batch: seed {r['seed']})",
            "",
            f"{r['num_seqs']} sequences, {r['num_tokens']} tokens, longest {r['longest']}, median {r['median_len']}; "
            f"{r['num_stages']} stages {r['layer_ranges']}; budget {r['budget_bytes'] / GIB:.3g} GiB per stage; "
            f"ideal step {r['ideal_step_time_s']:.4g} s.",
            "",
            "| strategy | step (s) | vs best | bubble | recompute | peak GiB per stage | chunks p/s/h | plan ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            if not row["fits"]:
                reason = row["reason"].split(". ")[0].replace("|", "/")
                lines.append(f"| {row['strategy']} | does not fit: {reason} | | | | | | {row['plan_time_s'] * 1e3:.0f} |")
                continue
            c = row["num_chunks"]
            lines.append(
                f"| {row['strategy']} | {row['step_time_s']:.4g} | {row['ratio_to_best']:.3f} | "
                f"{row['bubble_fraction']:.1%} | {row['recompute_fraction']:.1%} | "
                f"{'/'.join(f'{b / GIB:.3g}' for b in row['peak_memory_bytes'])} | "
                f"{c['packed']}/{c['split']}/{c['hybrid']} | {row['plan_time_s'] * 1e3:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    run_ = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=3, help="global batches (seeds) per paper setting")
    ap.add_argument("--repeats", type=int, default=3, help="planning-time repeats of adaptive (median)")
    ap.add_argument("--time-limit", type=float, default=1.0, help="ILP time limit per call, seconds")
    ap.add_argument("--only", choices=("paper", "stdlib"), default=None, help="run one part only")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "plan_benchmark")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    results: list[dict[str, Any]] = []

    if args.only in (None, "paper"):
        cfg = MODEL_PRESETS["llama-13b"]
        for gpus, ctx in ((8, 65536), (8, 131072), (4, 131072)):
            dev = stage_of_a800s(gpus)
            cost = CostModel.from_hf_config(cfg, dev)
            name = f"LLaMA-13B, 4x{gpus} A800, github, 512 seqs, max {ctx // 1024}K"
            for seed in range(args.batches):
                lens = data.sample_lengths("github", 512, ctx, seed)
                r = run_setting(name, lens, cost, 4, int(dev.memory_bytes), args.time_limit, args.repeats)
                r["seed"] = seed
                results.append(r)
                print(f"{name} seed {seed}: adaptive/packed {_fmt(r['adaptive_over_packed'])}, "
                      f"adaptive/split {_fmt(r['adaptive_over_split'])}, adaptive/ideal {_fmt(r['adaptive_over_ideal'])}",
                      flush=True)

    if args.only in (None, "stdlib"):
        lens = stdlib_lengths(65536)
        cost = CostModel.from_hf_config(MODEL_PRESETS["tiny-llama"], DeviceSpec.cpu())
        for pp in (2, 4):
            budget = binding_budget(lens, cost, pp)
            name = f"tiny-llama, stdlib corpus ({len(lens)} files), pp {pp}, CPU rates, binding budget"
            r = run_setting(name, lens, cost, pp, budget, args.time_limit, args.repeats)
            r["seed"] = 0
            results.append(r)
            print(f"{name}: adaptive/packed {_fmt(r['adaptive_over_packed'])}, "
                  f"adaptive/split {_fmt(r['adaptive_over_split'])}, adaptive/ideal {_fmt(r['adaptive_over_ideal'])}",
                  flush=True)

    elapsed = time.perf_counter() - t_start
    md = to_markdown(results, args, elapsed)
    print()
    write_results(args.out, md + "\n", {"date": datetime.date.today().isoformat(), "elapsed_s": elapsed,
                                        "results": results}, run_)
    print(f"\nwrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
