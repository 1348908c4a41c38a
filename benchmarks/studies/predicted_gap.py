"""Predicted adaptive vs tuned baselines on the measured benchmark's own batches (no timing).

    python benchmarks/studies/predicted_gap.py                 # benchmarks/results/measured.json, about 10 s
    python benchmarks/studies/predicted_gap.py --quick         # benchmarks/results/measured_quick.json
    python benchmarks/studies/predicted_gap.py --taper 0       # adaptive with the first-backward taper off
    python benchmarks/studies/predicted_gap.py --check         # --quick, asserting its invariants

Loads a ``benchmarks/measured.py`` result (the profiled cost model that run used, each context's
batches, budgets and measured ratios) and plans each context's tuned batches (the timed ones and
the memory batch, what measured.py tunes the baselines on) again with ``adaptive`` and with every
``split`` and ``packed`` setting of measured.py's tuning grid (:func:`measured.tune_baseline`),
under the same budgets. Reported per context: the predicted adaptive / best-baseline ratio of
median tokens/s over the timed batches (as measured.py computes the measured one; the best
setting: the fastest in simulation over the tuned batches) next to the measured ratio, and where
adaptive's plans still lose time: the bubble and the recompute of each plan's slowest stage, and
the *bound*: that stage's busy time without recompute, i.e. the plan's chunks with no wait and
nothing recomputed (best split over bound is the most any plan of that many chunks could reach).

Planning is order-invariant in the lengths (chunking sorts them), so the lengths the result
stores are enough: no corpus, no model. Writes ``benchmarks/results/studies/predicted_gap{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = pathlib.Path(__file__).resolve().parents[1]
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from _results import Run, write_results  # noqa: E402

MEASURED = BENCH / "results"  # measured.py's results, read
RESULTS = BENCH / "results" / "studies"


def stage_losses(plan, cost) -> dict[str, float]:
    """The slowest stage's busy time without recompute (the bound), bubble and recompute seconds."""
    from concertina_hf.planning import simulate

    sim = simulate(plan, cost)
    s = max(range(plan.num_stages), key=lambda q: sim.stage_busy_s[q])
    rc = sum(cost.recompute_time(c, plan.recompute[s][c.index]) for c in plan.chunks if plan.recompute[s][c.index])
    return {"stage": s, "step_s": sim.step_time_s, "bubble_s": sim.stage_bubble_s[s], "recompute_s": rc,
            "bound_s": sim.stage_busy_s[s] - rc}


def run(res: dict[str, Any], knobs: dict[str, Any], log=print) -> dict[str, Any]:
    from measured import tune_baseline

    from concertina_hf.planning import CostModel, StageLayout, plan_step

    cost = CostModel.from_dict(res["cost_model"])
    ranges = tuple(tuple(r) for r in res["layer_ranges"])
    layout = StageLayout(ranges[-1][1], ranges)
    solver = res["settings"].get("solver", "ilp")
    time_limit = float(res["settings"].get("time_limit", 1.0))
    out = []
    for ctx in res["contexts"]:
        budgets = ctx["budgets_bytes"]
        picks = sorted(set(ctx["timed_batches"]) | {ctx["memory_batch"]})
        batches = [ctx["batches"][i]["lengths"] for i in picks]
        t0 = time.perf_counter()
        plans = [plan_step(b, cost, layout, budgets, "adaptive", solver=solver, time_limit_s=time_limit, **knobs)
                 for b in batches]
        plan_s = (time.perf_counter() - t0) / len(batches)
        losses = [stage_losses(p, cost) for p in plans]
        ad = [p.predicted.step_time_s for p in plans]
        row: dict[str, Any] = {
            "max_len": ctx["max_len"], "batches": picks, "lengths": batches, "adaptive_s": ad,
            "adaptive_knobs": [dict(p.knobs) for p in plans], "adaptive_chunks": [p.num_chunks for p in plans],
            "adaptive_losses": losses, "adaptive_plan_s": plan_s,
        }
        timed = [picks.index(i) for i in ctx["timed_batches"]]
        tokens = [sum(b) for b in batches]

        def median_rate(times: list[float]) -> float:
            return statistics.median(tokens[i] / times[i] for i in timed)

        for strategy in ("split", "packed"):
            # measured.tune_baseline builds its lengths from the batches' sequences
            ranked = tune_baseline(strategy, [[[0] * n for n in b] for b in batches], cost, layout, budgets)
            best = next(r for r in ranked if r["fits"])
            per = [plan_step(b, cost, layout, budgets, strategy, **{best["knob"]: best["value"]}).predicted.step_time_s
                   for b in batches]
            row[strategy] = {"tuning": [{k: r[k] for k in ("value", "predicted_s", "fits")} for r in ranked],
                             "best": best["value"], "knob": best["knob"], "per_batch_s": per,
                             "predicted_ratio": median_rate(ad) / median_rate(per),
                             "bound_ratio": median_rate([x["bound_s"] for x in losses]) / median_rate(per),
                             "measured_ratio": ctx.get("ratios", {}).get(f"adaptive_over_{strategy}"),
                             "measured_paired_ratio": ctx.get("ratios", {}).get(f"adaptive_over_{strategy}_paired")}
        log(f"L={ctx['max_len']}: adaptive / best split predicted {row['split']['predicted_ratio']:.3f} "
            f"(measured {row['split']['measured_ratio'] or float('nan'):.3f}), bound {row['split']['bound_ratio']:.3f}")
        out.append(row)
    return {"source": res.get("command"), "source_date": res.get("date"), "knobs": knobs, "contexts": out}


def to_markdown(rec: dict[str, Any]) -> str:
    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}"

    L = ["# Predicted adaptive vs tuned baselines on the measured batches", "",
         f"Source: `{rec['source']}` ({rec['source_date']}): its profiled cost model, batches and budgets, "
         f"planned again (adaptive knobs: {rec['knobs'] or 'defaults'}). Ratios: adaptive / baseline median "
         "tokens/s over the timed batches, predicted (step times of the plans) and measured (the source's). "
         "*bound*: the same with each adaptive plan's step time replaced by its slowest stage's busy time "
         "without recompute (its chunks, no wait, nothing recomputed). Bubble and recompute: that stage's, "
         "summed over the tuned batches (the timed ones and the memory batch).", "",
         "| context | vs best split: predicted | measured (paired) | bound | vs best packed: predicted | "
         "measured (paired) | slowest-stage bubble s | recompute s | adaptive plan ms |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c in rec["contexts"]:
        sp, pk = c["split"], c["packed"]
        bub = sum(x["bubble_s"] for x in c["adaptive_losses"])
        rc = sum(x["recompute_s"] for x in c["adaptive_losses"])
        L.append(f"| {c['max_len']} | {f(sp['predicted_ratio'])} (split[{sp['knob']}={sp['best']}]) | "
                 f"{f(sp['measured_ratio'])} ({f(sp['measured_paired_ratio'])}) | {f(sp['bound_ratio'])} | "
                 f"{f(pk['predicted_ratio'])} | {f(pk['measured_ratio'])} ({f(pk['measured_paired_ratio'])}) | "
                 f"{bub:.3f} of {sum(c['adaptive_s']):.3f} | {rc:.3f} | {1e3 * c['adaptive_plan_s']:.0f} |")
    L += ["", "Per batch (predicted step s; adaptive's knobs):", "",
          "| context | batch | lengths | adaptive | best split | best packed | chunks | slices of longest | extra_warmup "
          "| taper | slowest-stage bubble | recompute |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in rec["contexts"]:
        for i, b in enumerate(c["batches"]):
            kn, lo = c["adaptive_knobs"][i], c["adaptive_losses"][i]
            L.append(f"| {c['max_len']} | {b} | {c['lengths'][i]} | {c['adaptive_s'][i]:.3f} | "
                     f"{c['split']['per_batch_s'][i]:.3f} | {c['packed']['per_batch_s'][i]:.3f} | "
                     f"{c['adaptive_chunks'][i]} | {kn.get('num_slices_longest')} | {kn.get('extra_warmup')} | "
                     f"{kn.get('taper', '-')} | {lo['bubble_s']:.3f} | {lo['recompute_s']:.3f} |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv == ["--check"] or (argv is None and sys.argv[1:] == ["--check"]):
        from _results import self_check

        return self_check(main, check)
    run_ = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="read measured_quick.json (the quick preset's result)")
    ap.add_argument("--source", type=pathlib.Path, default=None, help="a measured.py result JSON")
    ap.add_argument("--taper", type=float, default=None, help="fix adaptive's taper knob (0: off)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="output prefix")
    args = ap.parse_args(argv)
    src = args.source or MEASURED / ("measured_quick.json" if args.quick else "measured.json")
    out = args.out or RESULTS / ("predicted_gap_quick" if args.quick else "predicted_gap")
    knobs = {} if args.taper is None else {"taper": args.taper}
    rec = run(json.loads(src.read_text()), knobs, log=lambda m: print(f"[predicted_gap] {m}", flush=True))
    write_results(out, to_markdown(rec), rec, run_)
    return rec


def check(rec: dict[str, Any], md: str) -> None:
    """``--check``: every context of measured_quick.json
    planned, the measured ratios carried over, the bound never below the plan's own ratio (a
    plan's step is at least its slowest stage's busy time less recompute)."""
    import math

    src = json.loads((MEASURED / "measured_quick.json").read_text())
    assert rec["command"].startswith("python benchmarks/studies/predicted_gap.py --quick"), rec["command"]
    assert [c["max_len"] for c in rec["contexts"]] == [c["max_len"] for c in src["contexts"]]
    for c, s in zip(rec["contexts"], src["contexts"]):
        assert c["split"]["measured_ratio"] == s["ratios"]["adaptive_over_split"]
        for strategy in ("split", "packed"):
            assert 0 < c[strategy]["predicted_ratio"] <= c[strategy]["bound_ratio"] * (1 + 1e-9)
        for lo, step in zip(c["adaptive_losses"], c["adaptive_s"]):
            assert math.isclose(lo["bound_s"] + lo["bubble_s"] + lo["recompute_s"], step, rel_tol=1e-9)
    assert md.startswith("# Predicted adaptive vs tuned baselines") and "Command: `python benchmarks/studies/" in md


if __name__ == "__main__":
    main()
