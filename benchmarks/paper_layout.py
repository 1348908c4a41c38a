"""The paper's layout simulated: every strategy's predicted step time on 32 GPUs, ``sp-only`` included.

    python benchmarks/paper_layout.py                   # about 2-4 min on 2 loaded cores
    python benchmarks/paper_layout.py --batches 1 --solver greedy

Setting (arXiv 2509.21275's): 32 A800-80GB GPUs as 4 pipeline stages of 8 GPUs (one node each,
Ulysses sequence parallelism inside a stage, weights and gradients whole on each GPU during the
step, fp32 master weights and Adam moments sharded over the stage's 8 GPUs), ``--memory-gb``
(80) per GPU, 512 sequences from the shipped ``github`` distribution capped at 64K and at 128K
tokens (CONSTRUCTED from the paper's published statements, not measured:
benchmarks/data/make_distributions.py), LLaMA-13B and LLaMA-30B shapes. LLaMA-30B has 52
attention heads, which 8 does not divide (Ulysses gives each GPU whole heads): its 32 GPUs run
as 8 stages of 4 (the refusal of pp=4 x sp=8 is recorded in the results).

Every strategy of the registry plans each batch and is scored by the same simulator and
analytic cost model (``DeviceSpec.a800()`` rates: assumptions, not measurements). ``sp-only``
runs the same 32 GPUs without a pipeline: Ulysses groups of the largest degree that divides the
heads, data parallel between the groups, ZeRO-3 over all 32 (what DeepSpeed ALST / accelerate's
sequence-parallel config run), its token budget, recompute and Ulysses degree tuned
(planning/strategies/sp_only.py). ``ideal``: every GPU busy with forward and backward compute,
nothing recomputed, no overhead or communication (``ideal_step_time``).

Also per row: where each strategy's time goes over the ideal bound (:func:`time_breakdown`:
bubble, all-to-alls, recompute, ZeRO-3 gathers not hidden, per-call overhead, per-step sync),
and ``sp-only`` with every layer recomputed (DeepSpeed ALST's recipe: HF gradient checkpointing
on), next to the tuned one (the fewest recomputed layers that fit, a stronger baseline).

Targets: adaptive finds a plan for every batch; adaptive at least 1.3x faster than
sp-only at 128K (with, per 128K batch, the most any plan could gain: sp-only / ideal); adaptive
within 1.15x of the ideal bound. Writes benchmarks/results/paper_layout.{md,json}
(``--from-json`` rewrites the markdown of an earlier run).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _results import Run, header_of, write_results  # noqa: E402
from concertina_hf.tools import data  # noqa: E402
from concertina_hf.planning.presets import MODEL_PRESETS  # noqa: E402
from concertina_hf.planning import (  # noqa: E402
    STRATEGIES, CostModel, DeviceSpec, PlanError, ideal_step_time, partition_layers, plan_step, simulate,
)
from concertina_hf.planning.cost import attn_pairs  # noqa: E402

GIB = 2**30
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# (model preset, pp, sp): 32 GPUs each
LAYOUTS = (("llama-13b", 4, 8), ("llama-30b", 8, 4))
REFUSED = (("llama-30b", 4, 8),)
CAPS = (65536, 131072)
TARGET_VS_SP_ONLY = 1.3  # at 128K
TARGET_VS_IDEAL = 1.15
# where a step's time goes beyond the ideal bound (time_breakdown), in the tables' order
PARTS = ("bubble", "a2a", "recompute", "zero3", "overhead", "sync")


def time_breakdown(plan, sim, cost: CostModel, ideal: float) -> dict[str, float]:
    """A simulated step's time per GPU, as multiples of the ideal bound, in parts that sum to
    ``sim.step_time_s / ideal``: ``useful`` (forward and backward compute of every token, what
    the bound counts: 1 when the work is spread evenly), ``overhead`` (the per-layer-call
    constant ``beta``, forward and backward, of every chunk), ``a2a`` (Ulysses all-to-alls,
    recomputed layers' excluded), ``recompute`` (recomputed layers' forwards and their
    all-to-alls), ``zero3`` (sp-only: the per-layer weight gathers and gradient reduce-scatters
    compute did not hide), ``sync`` (the once-per-step gather / reduce-scatter of sharded state)
    and ``bubble`` (idle time: pipeline fill, drain and waits; for sp-only the Ulysses groups
    waiting for the slowest micro-batch of each round). Averaged over the stages (sp-only: over
    its data-parallel groups)."""
    c = cost.for_plan(plan)
    lay = plan.layout
    groups = int(plan.knob("data_parallel", 1) or 1)
    parts = dict.fromkeys(("useful", "overhead", "a2a", "recompute", "zero3"), 0.0)
    for s in range(lay.num_stages):
        n = lay.num_stage_layers(s)
        per_tok = ((c.embed_time_per_token if lay.has_embedding(s) else 0.0)
                   + (c.head_time_per_token if lay.has_head(s) else 0.0))
        for ch in plan.chunks:
            tok, r = ch.num_tokens, plan.recompute[s][ch.index]
            useful = (1 + c.bwd_factor) * (n * (c.alpha_attn * attn_pairs(ch.slices) + c.alpha_tok * tok) + per_tok * tok)
            overhead = (1 + c.bwd_factor) * n * c.beta
            a2a = 2 * n * c.a2a_time(tok)
            rec = c.recompute_time(ch, r)
            busy = c.fwd_time(lay, s, ch) + c.bwd_time(lay, s, ch, r)
            parts["useful"] += useful
            parts["overhead"] += overhead
            parts["a2a"] += a2a
            parts["recompute"] += rec
            parts["zero3"] += busy - useful - overhead - a2a - rec
    k = lay.num_stages * groups
    out = {name: v / k / ideal for name, v in parts.items()}
    out["sync"] = sim.sync_time_s / ideal
    out["bubble"] = sim.step_time_s / ideal - sum(out.values())
    return out


def run(batches: int, solver: str, time_limit: float, memory_gb: float) -> dict:
    rows, refusals = [], []
    for model, pp, sp in REFUSED:
        try:
            CostModel.from_hf_config(MODEL_PRESETS[model], DeviceSpec.a800()).with_parallel(sp=sp)
        except PlanError as e:
            refusals.append({"model": model, "pp": pp, "sp": sp, "reason": str(e)})
    for model, pp, sp in LAYOUTS:
        cost = CostModel.from_hf_config(MODEL_PRESETS[model], DeviceSpec.a800()).with_parallel(sp=sp)
        layout = partition_layers(cost, pp)
        for cap in CAPS:
            for seed in range(batches):
                lens = data.sample_lengths("github", 512, cap, seed)
                ideal = ideal_step_time(lens, cost, layout)
                rec = {"model": model, "pp": pp, "sp": sp, "cap": cap, "seed": seed, "tokens": sum(lens),
                       "longest": max(lens), "ideal_s": ideal, "strategies": {}}
                for strategy in STRATEGIES:
                    t0 = time.perf_counter()
                    try:
                        plan = plan_step(lens, cost, layout, int(memory_gb * GIB), strategy, solver=solver,
                                         time_limit_s=time_limit)
                    except PlanError as e:
                        rec["strategies"][strategy] = {"fits": False, "reason": str(e),
                                                       "plan_s": time.perf_counter() - t0}
                        continue
                    plan_s = time.perf_counter() - t0
                    sim = simulate(plan, cost)
                    assert max(sim.peak_memory_bytes) <= memory_gb * GIB, (strategy, sim.peak_memory_bytes)
                    rec["strategies"][strategy] = {
                        "fits": True, "step_s": sim.step_time_s, "vs_ideal": sim.step_time_s / ideal,
                        "bubble": sim.bubble_fraction, "recompute": sim.recompute_fraction,
                        "comm_s": sim.comm_time_s, "peak_gib": max(sim.peak_memory_bytes) / GIB,
                        "knobs": {k: v for k, v in plan.knobs}, "plan_s": plan_s,
                        "breakdown": time_breakdown(plan, sim, cost, ideal),
                    }
                    print(f"{model} pp{pp}xsp{sp} {cap // 1024}K seed {seed} {strategy}: {sim.step_time_s:.1f} s "
                          f"({sim.step_time_s / ideal:.3f}x ideal, planned in {plan_s:.1f} s)", flush=True)
                # sp-only as HF users run it with DeepSpeed ALST: gradient checkpointing on every layer
                # (the tuned sp-only above recomputes only the fewest layers that fit)
                try:
                    plan = plan_step(lens, cost, layout, int(memory_gb * GIB), "sp-only",
                                     recompute_layers=cost.num_layers)
                    sim = simulate(plan, cost)
                    rec["sp_only_full_recompute"] = {
                        "fits": True, "step_s": sim.step_time_s, "vs_ideal": sim.step_time_s / ideal,
                        "knobs": {k: v for k, v in plan.knobs}, "breakdown": time_breakdown(plan, sim, cost, ideal)}
                except PlanError as e:
                    rec["sp_only_full_recompute"] = {"fits": False, "reason": str(e)}
                rows.append(rec)
    # targets
    adaptive_all = all(r["strategies"]["adaptive"]["fits"] for r in rows)
    vs_sp, vs_ideal, bound, long_only = [], [], [], []
    for r in rows:
        a, s = r["strategies"]["adaptive"], r["strategies"]["sp-only"]
        if a["fits"]:
            vs_ideal.append(a["vs_ideal"])
            if r["cap"] == 131072 and s["fits"]:
                vs_sp.append(s["step_s"] / a["step_s"])
                # no plan beats the ideal bound: sp-only / ideal is the most any method can gain
                bound.append(s["vs_ideal"])
                if r["longest"] > 65536:
                    long_only.append(s["step_s"] / a["step_s"])
    return {
        "rows": rows, "refusals": refusals, "batches": batches, "solver": solver, "time_limit_s": time_limit,
        "memory_gb_per_gpu": memory_gb,
        "targets": {
            "adaptive_plans_every_batch": {"met": adaptive_all},
            "adaptive_vs_sp_only_at_128k": {"target": TARGET_VS_SP_ONLY, "values": vs_sp,
                                            "met": bool(vs_sp) and min(vs_sp) >= TARGET_VS_SP_ONLY,
                                            "sp_only_vs_ideal": bound, "batches_above_64k": long_only},
            "adaptive_vs_ideal": {"target": TARGET_VS_IDEAL, "values": vs_ideal,
                                  "met": bool(vs_ideal) and max(vs_ideal) <= TARGET_VS_IDEAL},
        },
    }


SP_ONLY_CHECK = (
    "How sp-only is modelled, against DeepSpeed ALST / Ulysses as HF users run it (checked for this table): "
    "(1) ZeRO-3 over all 32 GPUs gathers each layer's weights per micro-batch forward and backward and "
    "reduce-scatters its gradients per micro-batch (DeepSpeed refuses `no_sync` under ZeRO-3), over the "
    "inter-node link (a ring over 4 nodes), overlapped with compute as its prefetch does: a layer takes "
    "max(compute + all-to-alls, gather) forward and max(..., gather + reduce-scatter) backward; a recomputed "
    "layer uses the weights its backward gathers. (2) Memory: all state (2 + 2 + 12 bytes per parameter) over "
    "32 GPUs plus two gathered layers and the embedding or head (DeepSpeed's `stage3_max_live_parameters` "
    "default of 1e9 holds about three llama-13b layers; its gradient bucket is not counted: both favour "
    "sp-only by a GiB or two), the micro-batch's activations and logits per GPU (tokens / Ulysses degree). "
    "(3) Recompute: uniform over layers and micro-batches (HF gradient checkpointing is one switch), tuned "
    "to the fewest layers that fit; ALST's recipe checkpoints every layer (the `sp-only (all rc)` rows). "
    "(4) Micro-batches: sequences spread over the Ulysses groups by LPT on their cost (accelerate and "
    "DeepSpeed split by count: LPT favours sp-only), packed whole under a tuned token budget. Where it "
    "loses at 128K: the one >64K sequence needs its whole activations on one group of GPUs, which forces "
    "recompute on every micro-batch, and its group's rounds run long while the other groups wait (bubble). "
    "No modelling error found that changes the ratios; sp-only's settings are the most favourable a user "
    "could pick.")


def _target_reasons(res: dict) -> list[str]:
    """Why the 1.3x-over-sp-only target is met or missed on each 128K batch: no plan beats the
    ideal bound, so sp-only / ideal is the most any plan can gain; 1.3x needs adaptive within
    (sp-only / ideal) / 1.3 of the bound, against what its bubble and all-to-alls cost."""
    rows = [r for r in res["rows"] if r["cap"] == 131072 and r["strategies"]["adaptive"]["fits"]
            and r["strategies"]["sp-only"]["fits"]]
    if not rows:
        return []
    out = ["", f"Each 128K batch against the {TARGET_VS_SP_ONLY}x target. No plan beats the ideal bound, so sp-only / "
           "ideal is the most any plan can gain over sp-only on that batch; reaching the target needs adaptive within "
           f"(sp-only / ideal) / {TARGET_VS_SP_ONLY} of the bound. Last column: against sp-only with every layer "
           "recomputed, as ALST's recipe runs it (not the target's baseline: the tuned one is stronger).", "",
           "| model | seed | longest | sp-only / adaptive | sp-only / ideal (most any plan gains) | adaptive / ideal needed "
           "| adaptive / ideal | adaptive bubble + a2a | verdict | sp-only (all rc) / adaptive |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        a, s = r["strategies"]["adaptive"], r["strategies"]["sp-only"]
        need = s["vs_ideal"] / TARGET_VS_SP_ONLY
        b = a["breakdown"]
        if s["step_s"] / a["step_s"] >= TARGET_VS_SP_ONLY:
            verdict = "met"
        elif need < 1.0:
            verdict = "unreachable by any plan"
        else:
            verdict = (f"missed: needs <= {need - 1:+.3f} over the bound, adaptive's bubble + a2a alone are "
                       f"{b['bubble'] + b['a2a']:+.3f}")
        full = r.get("sp_only_full_recompute") or {}
        out.append(f"| {r['model']} | {r['seed']} | {r['longest']} | {s['step_s'] / a['step_s']:.3f}x | "
                   f"{s['vs_ideal']:.3f} | {need:.3f} | {a['vs_ideal']:.3f} | {b['bubble'] + b['a2a']:+.3f} | {verdict} | "
                   + (f"{full['step_s'] / a['step_s']:.3f}x" if full.get("fits") else "-") + " |")
    out += ["", "Where the target is missed, the reason is one of two, neither a fault of the comparison: on "
            "128K-cap batches without a sequence above 64K (the same batches as at 64K) sp-only has nothing long to "
            "lose on and may run so close to the bound that no plan can be 1.3x faster (`unreachable`); where sp-only "
            "does lose (a >64K sequence, or llama-30b's 52 heads limiting its Ulysses groups to 4 GPUs, which forces "
            "recompute), adaptive's own pipeline bubble and all-to-alls keep it above the (sp-only / ideal) / 1.3 it "
            "would need (`missed`; its breakdown is in the section above)."]
    return out


def _md(res: dict) -> str:
    lines = [
        "# The paper's layout, simulated (32 A800-80GB GPUs)",
        "",
        f"512 sequences per batch from the CONSTRUCTED `github` distribution, {res['batches']} batch(es) per cap; "
        f"{res['memory_gb_per_gpu']:g} GiB per GPU; analytic cost model at `DeviceSpec.a800()` rates (assumed, not "
        f"measured); recompute solver {res['solver']} ({res['time_limit_s']:g} s limit). Predicted step times in "
        f"seconds (ratio to the ideal bound).",
        "",
    ]
    for r in res["refusals"]:
        lines.append(f"- {r['model']} as pp={r['pp']} x sp={r['sp']}: refused: {r['reason']}")
    if res["refusals"]:
        lines.append("")
    names = list(STRATEGIES)
    lines += ["| model | layout | cap | seed | longest | ideal | " + " | ".join(names) + " | sp-only / adaptive |",
              "|---|---|---:|---:|---:|---:|" + "---:|" * len(names) + "---:|"]
    for r in res["rows"]:
        cells = []
        for n in names:
            s = r["strategies"][n]
            cells.append(f"{s['step_s']:.1f} ({s['vs_ideal']:.3f}x)" if s["fits"] else "does not fit")
        a, s = r["strategies"]["adaptive"], r["strategies"]["sp-only"]
        ratio = f"{s['step_s'] / a['step_s']:.3f}x" if a["fits"] and s["fits"] else "-"
        lines.append(f"| {r['model']} | pp={r['pp']} x sp={r['sp']} | {r['cap'] // 1024}K | {r['seed']} | "
                     f"{r['longest']} | {r['ideal_s']:.1f} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "sp-only's tuned settings (Ulysses degree `sp`, Ulysses groups `data_parallel`, token budget, "
              "recompute layers) and adaptive's planning time:", ""]
    for r in res["rows"]:
        s, a = r["strategies"]["sp-only"], r["strategies"]["adaptive"]
        kn = s.get("knobs", {})
        lines.append(f"- {r['model']} {r['cap'] // 1024}K seed {r['seed']}: sp-only "
                     + (f"sp={kn.get('sp')}, data_parallel={kn.get('data_parallel')}, token_budget="
                        f"{kn.get('token_budget')}, recompute_layers={kn.get('recompute_layers')}" if s["fits"]
                        else "does not fit")
                     + f"; adaptive planned in {a['plan_s']:.1f} s")
    lines += ["", "A batch capped at 128K whose longest sequence is under 64K is the same batch as at 64K (the "
              "distribution puts 0.55% of sequences above 64K: about half the 512-sequence batches hold one).",
              "", "**llama-30b runs as pp=8 x sp=4, not the paper's pp=4 x sp=8**: its 52 attention heads are not "
              "divisible by 8 and Ulysses gives each GPU whole heads (the refusal is quoted above). Same 32 GPUs; "
              "sp-only is limited the same way (Ulysses groups of at most 4 GPUs, 8 groups data parallel). "
              "llama-13b (40 heads) runs the paper's pp=4 x sp=8; its sp-only gets groups of 8 (32 does not divide "
              "40), 4 groups data parallel."]
    lines += ["", "## Where the time goes over the ideal bound", "",
              "Each strategy's simulated step per GPU as a multiple of the ideal bound (`time_breakdown`): 1 (the "
              "useful forward and backward compute the bound counts) plus **bubble** (idle: pipeline fill, drain and "
              "waits; for sp-only the Ulysses groups waiting for each round's slowest micro-batch, since ZeRO-3's "
              "per-layer collectives over all 32 GPUs keep the groups in step), **a2a** (Ulysses all-to-alls), "
              "**recompute** (recomputed layers' forwards, their all-to-alls included), **zero3** (sp-only's per-layer "
              "weight gathers and gradient reduce-scatters that compute did not hide), **overhead** (the per-layer-call "
              "constant of every chunk) and **sync** (the once-per-step gather / reduce-scatter of the stage's sharded "
              "state). `sp-only (all rc)`: sp-only with gradient checkpointing on every layer, as HF users run "
              "DeepSpeed ALST (the table's sp-only recomputes only the fewest layers that fit, a stronger baseline).",
              "", "| model | cap | seed | strategy | step / ideal | " + " | ".join(PARTS) + " |",
              "|---|---:|---:|---|---:|" + "---:|" * len(PARTS)]
    for r in res["rows"]:
        entries = [("adaptive", r["strategies"]["adaptive"]), ("sp-only", r["strategies"]["sp-only"]),
                   ("sp-only (all rc)", r.get("sp_only_full_recompute") or {"fits": False})]
        for name, e in entries:
            if not e.get("fits") or "breakdown" not in e:
                continue
            b = e["breakdown"]
            lines.append(f"| {r['model']} | {r['cap'] // 1024}K | {r['seed']} | {name} | {e['vs_ideal']:.3f} | "
                         + " | ".join(f"{b[k]:+.3f}" for k in PARTS) + " |")
    lines += ["", SP_ONLY_CHECK]
    t = res["targets"]
    fmt = lambda v: ", ".join(f"{x:.3f}" for x in v)  # noqa: E731
    vs = t["adaptive_vs_sp_only_at_128k"]
    lines += [
        "",
        "## Targets",
        "",
        f"- adaptive finds a plan for every batch: {'met' if t['adaptive_plans_every_batch']['met'] else 'MISSED'}",
        f"- adaptive >= {TARGET_VS_SP_ONLY}x faster than sp-only at 128K: "
        f"{'met' if vs['met'] else 'MISSED'} (sp-only / adaptive: {fmt(vs['values'])}; why: the table below)",
        f"- adaptive within {TARGET_VS_IDEAL}x of the ideal bound: "
        f"{'met' if t['adaptive_vs_ideal']['met'] else 'MISSED'} (adaptive / ideal: "
        f"{fmt(t['adaptive_vs_ideal']['values'])}; median {statistics.median(t['adaptive_vs_ideal']['values']):.3f})",
    ]
    lines += _target_reasons(res)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    run_ = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=2, help="batches (seeds) per model and cap")
    ap.add_argument("--solver", choices=("ilp", "greedy"), default="ilp")
    ap.add_argument("--time-limit", type=float, default=1.0, help="ILP time limit per call, seconds")
    ap.add_argument("--memory-gb", type=float, default=80.0, help="memory budget per GPU, GiB")
    ap.add_argument("--out", default=str(RESULTS / "paper_layout"), help="output path without extension")
    ap.add_argument("--from-json", metavar="JSON", default=None,
                    help="rewrite the tables from an earlier run's JSON (its command and load kept)")
    args = ap.parse_args(argv)
    if args.from_json:
        res = json.loads(pathlib.Path(args.from_json).read_text())
        header = header_of(res)
        for k in ("header", "command", "load_average"):
            res.pop(k, None)
        write_results(args.out, _md(res), res, header)
        return 0
    res = run(args.batches, args.solver, args.time_limit, args.memory_gb)
    write_results(args.out, _md(res), res, run_)
    return 0


if __name__ == "__main__":
    sys.exit(main())
