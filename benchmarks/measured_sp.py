"""Measured benchmark of sequence parallelism: pp=2 x sp=2 vs pp=1 x sp=4 vs pp=4 x sp=1, 4 processes.

    python benchmarks/measured_sp.py            # about 5-8 min on 2 busy cores
    python benchmarks/measured_sp.py --quick    # under a minute: tiny model, one 256-token context, 1 step

Measured on this machine with 4 processes (they share 2 cores: the ratios mean something, the
absolute tokens/s do not): pp=2 x sp=2 adaptive vs pp=1 x sp=4 vs pp=4 x sp=1 on the same
batches, tokens/s and per-rank peak memory. What runs (CPU, gloo, one thread per process, fp32):

1. **Model.** ``measured.py``'s Llama (hidden 256, 8 layers, 4 heads, 2 K/V heads, MLP 688,
   vocab 8192); its 4 heads divide by 4, so ``sp=4`` gives each rank one head (its 2 K/V heads
   are replicated to 4, as Ulysses does for ``K < sp``). ``--quick``: hidden 64, 4 layers, same
   head counts.
2. **Batches.** ``measured.make_batches``: the stdlib sources tokenized with the bundled
   tokenizer, shuffled, truncated at the context length, cut into batches of at most
   ``--tokens-per-step`` tokens; the warm-up (memory) batch holds a full-length sequence.
3. **Cost model.** ``measured.profile`` (two processes at once, one thread each), then per
   layout over ``sp`` GPUs (:meth:`CostModel.with_parallel`, optimizer state not sharded) with
   the all-to-all's latency and bandwidth timed on that layout's real sp group in the run
   (:func:`~concertina_hf.runtime.ulysses.profile_all_to_all`, what ``run_setup`` does at
   ``sp > 1``); layers split over stages by :func:`~concertina_hf.planning.partition_layers`.
4. **Budget, one rule for all.** Every GPU of every layout gets the same activation budget on
   top of its own static memory (GPUs of one kind have the same memory): ``measured.py``'s rule
   on the layout under test, pp=2 x sp=2: ``--budget-frac`` of the way from every layer
   recomputed to none for one whole context-length sequence run alone, on its GPU where that is
   most; raised by 10% steps until every layout plans every batch (reported). The other
   layouts' own figures are reported; the largest (pp=4 x sp=1, whose last GPU holds a whole
   sequence's logits) would leave the sp layouts unconstrained.
5. **Runs.** The adaptive strategy on each layout (its own mesh over the same 4 processes, its
   own copy of the model from the same seed, Trainer's AdamW), steps interleaved round by round
   (round 0: the untimed warm-up, where memory is measured; round ``r`` runs the layouts rotated
   by ``r``); see :mod:`_sp_worker`.

Figures: tokens/s (median over the timed steps, min, max; the ratio of pp=2 x sp=2 to each other
layout, also paired step by step), per-rank activation peak (the runtime's saved-tensor meter
over all steps, and the allocation peak of the warm-up step) next to the plan's prediction, and
the loss of the warm-up step against the single-process HF model's on the same batch. The four
processes share the machine's cores (2 here): absolute tokens/s are not GPU figures, only the
ratios between layouts (same processes, same cores, interleaved) mean something, and on 2 cores
a layout gains nothing from keeping 4 ranks busy. The load average and a cores probe (a fixed
matmul load on each rank alone vs all at once: 4.0 on 4 idle cores, about 2.0 on 2) are
reported. Writes ``benchmarks/results/measured_sp.{json,md}`` (``--out`` changes the prefix).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

RESULTS = HERE / "results"
MIB = 2**20
WORLD = 4
LAYOUTS = ({"name": "pp2xsp2", "pp": 2, "sp": 2}, {"name": "pp1xsp4", "pp": 1, "sp": 4},
           {"name": "pp4xsp1", "pp": 4, "sp": 1})
LOSS_TOL = 1e-4  # relative: the warm-up loss of every layout vs the single-process HF model

__all__ = ["LAYOUTS", "PRESETS", "main", "run"]

PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(
        model=dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
                   intermediate_size=688),
        contexts=(4096, 8192), tokens_per_step=8192, steps=3,
        profile_max_tokens=1024, profile_repeats=2, profile_layers=3, profile_procs=2, max_files=None,
    ),
    "quick": dict(
        model=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                   intermediate_size=176),
        contexts=(256,), tokens_per_step=1024, steps=1,
        profile_max_tokens=128, profile_repeats=2, profile_layers=2, profile_procs=1, max_files=80,
    ),
}


def _stats(xs) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(records: list[dict], reference: float) -> dict[str, Any]:
    """Per layout: tokens/s, step parts, per-rank memory (measured and predicted), loss check."""
    out = {}
    for lay in LAYOUTS:
        recs = [r for r in records if r["layout"] == lay["name"]]
        timed = sorted((r for r in recs if not r["memory_round"]), key=lambda r: r["round"])
        mem = next(r for r in recs if r["memory_round"])
        tps = [r["tokens"] / r["step_s"] for r in timed]
        out[lay["name"]] = {
            **lay,
            "tokens_per_s": _stats(tps),
            "tokens_per_s_by_step": tps,
            "tokens_per_s_total": sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed),
            "step_s": _stats([r["step_s"] for r in timed]),
            "run_s": _stats([r["run_s"] for r in timed]),
            "reduce_s": _stats([r["reduce_s"] for r in timed]),
            "opt_s": _stats([r["opt_s"] for r in timed]),
            "predicted_step_s": _stats([r["predicted_step_s"] for r in timed]),
            "plan_wait_s": _stats([r["plan_wait_s"] for r in timed]),
            "stage_of_rank": mem["stage_of_rank"],
            "meter_peak_bytes": [max(r["meter_peak_bytes"][k] for r in recs) for k in range(WORLD)],
            "predicted_act_peak_bytes": [max(r["predicted_act_peak_bytes"][k] for r in recs) for k in range(WORLD)],
            "memory_batch_alloc_peak_bytes": mem["alloc_peak_bytes"],
            "memory_batch_predicted_act_peak_bytes": mem["predicted_act_peak_bytes"],
            "memory_batch_meter_peak_bytes": mem["meter_peak_bytes"],
            "recompute_fraction": _stats([r["predicted_recompute_fraction"] for r in recs]),
            "num_chunks": [r["num_chunks"] for r in timed],
            "warmup_loss": mem["loss"],
            "warmup_losses_by_rank": mem["losses"],
            "loss_rel_diff": abs(mem["loss"] - reference) / abs(reference),
            "losses": [r["loss"] for r in sorted(recs, key=lambda r: r["round"])],
        }
    base = out["pp2xsp2"]
    for name, r in out.items():
        r["pp2xsp2_over_this"] = base["tokens_per_s"]["median"] / r["tokens_per_s"]["median"]
        r["pp2xsp2_over_this_paired"] = statistics.median(
            a / b for a, b in zip(base["tokens_per_s_by_step"], r["tokens_per_s_by_step"]))
    return out


def run_context(max_len: int, corpus, config: dict, cost, pre: dict, args, log) -> dict[str, Any]:
    from _pipeline_worker import trainer_optimizer_spec
    from _sp_worker import run_worker
    from measured import make_batches, run_pipeline

    batches, memory_batch, timed = make_batches(corpus, max_len, args.tokens_per_step, args.steps, args.seed)
    spec = {"config": config, "seed": args.seed, "cost": cost.to_dict(), "optimizer": trainer_optimizer_spec(),
            "layouts": list(LAYOUTS), "batches": batches, "memory_batch": memory_batch, "timed_batches": timed,
            "max_len": max_len, "budget_frac": args.budget_frac, "solver": args.solver,
            "time_limit_s": args.time_limit}
    log(f"L={max_len}: {len(batches)} batches, memory batch {memory_batch} "
        f"(longest {max(map(len, batches[memory_batch]))}), timed {timed}")
    load0 = os.getloadavg()
    out = run_pipeline(spec, log, worker=run_worker, what="4-process pp x sp", world=WORLD)
    runs = summarize(out["records"], out["reference_loss"])
    setup = out["setup"]
    return {
        "max_len": max_len,
        "tokens_per_step": args.tokens_per_step,
        "batches": [{"num_seqs": len(b), "tokens": sum(map(len, b)), "longest": max(map(len, b))} for b in batches],
        "memory_batch": memory_batch, "timed_batches": timed,
        "layer_ranges": dict(zip((lay["name"] for lay in LAYOUTS), setup["layer_ranges"])),
        "static_bytes": dict(zip((lay["name"] for lay in LAYOUTS), setup["static"])),
        "activation_budget_bytes": setup["budget"]["budget"],
        "budget_raised": setup["budget"]["raised"],
        "budget_rule": {lay["name"]: p for lay, p in zip(LAYOUTS, setup["budget"]["per_layout"])},
        "a2a_fit": dict(zip((lay["name"] for lay in LAYOUTS), out["a2a"])),
        "reference_loss": out["reference_loss"],
        "runs": runs,
        "loss_ok": all(r["loss_rel_diff"] < LOSS_TOL for r in runs.values()),
        "cores_probe": out["capacity"],
        "loadavg": {"before": load0, "after": out["loadavg_end"]},
        "wall_s": out["wall_s"], "setup_s": out["setup_s"],
        "records": [{k: v for k, v in r.items()} for r in out["records"]],
    }


def _peak_over(measured, reference) -> float:
    """The largest ratio of a measured peak to its reference over the ranks."""
    return max(m / r for m, r in zip(measured, reference))


def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def to_markdown(res: dict[str, Any]) -> str:
    from _results import header_markdown, header_of

    cfg = res["config"]
    L = ["# Measured: pp=2 x sp=2 vs pp=1 x sp=4 vs pp=4 x sp=1 (4 processes, CPU)", "",
         header_markdown(header_of(res)), "",
         f"**The 4 processes share {os.cpu_count()} cores**: absolute tokens/s are CPU figures of 4 ranks on "
         f"{os.cpu_count()} cores, not GPU figures; only the ratios between layouts (same processes, same cores, steps "
         "interleaved round by round) mean something, and on 2 cores no layout gains from keeping 4 ranks busy at "
         "once (a pipeline bubble or an all-to-all wait frees a core for another rank). Cores probe: a fixed matmul "
         "load on each rank alone vs all 4 at once (4.0 on 4 idle cores, about 2.0 on 2).", "",
         f"Model: Llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
         f"{cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} K/V: replicated to 4 at sp=4), "
         f"MLP {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, {res['num_params'] / 1e6:.1f}M parameters, fp32, "
         "one thread per process, gloo. Strategy: adaptive on every layout, same batches (stdlib sources, "
         "bundled tokenizer). Cost model profiled in two processes, then per layout over sp GPUs with the "
         "all-to-all timed on the layout's own sp group.", "",
         f"Budget rule (one for all): every GPU of every layout gets the same activation budget on top of its static "
         f"memory: {res['settings']['budget_frac']} of the way from full recompute to none for one whole "
         "context-length sequence alone on pp=2 x sp=2's worst GPU (`measured.py`'s rule on the layout under test), "
         "raised by 10% steps until every layout plans every batch; "
         "each layout's own figure is given in parentheses (pp=4 x sp=1's last GPU holds a whole sequence's logits: "
         "its figure would leave the sp layouts unconstrained).", ""]
    L += ["## Summary", "",
          "Ratios of tokens/s (median over the timed steps; paired: median of step-by-step ratios on the same batch), "
          "and each layout's largest allocated activation peak of the warm-up step over the budget and over the plan's "
          "prediction (any rank).", "",
          "| context | cores probe before / after | pp2xsp2 / pp1xsp4 (paired) | pp2xsp2 / pp4xsp1 (paired) | "
          "peak / budget: pp2xsp2, pp1xsp4, pp4xsp1 | peak / predicted: pp2xsp2, pp1xsp4, pp4xsp1 | losses = HF |",
          "|---:|---|---|---|---|---|---|"]
    for c in res["contexts"]:
        r = c["runs"]
        L.append(f"| {c['max_len']} | {' / '.join(f'{x:.2f}' for x in c['cores_probe'])} | "
                 f"{r['pp1xsp4']['pp2xsp2_over_this']:.3f}x ({r['pp1xsp4']['pp2xsp2_over_this_paired']:.3f}x) | "
                 f"{r['pp4xsp1']['pp2xsp2_over_this']:.3f}x ({r['pp4xsp1']['pp2xsp2_over_this_paired']:.3f}x) | "
                 + ", ".join(f"{_peak_over(x['memory_batch_alloc_peak_bytes'], [c['activation_budget_bytes']] * 4):.3f}"
                             for x in r.values()) + " | "
                 + ", ".join(f"{_peak_over(x['memory_batch_alloc_peak_bytes'], x['memory_batch_predicted_act_peak_bytes']):.3f}"
                             for x in r.values())
                 + f" | {'yes' if c['loss_ok'] else '**no**'} |")
    L += ["", "Predicted step times come from a cost model profiled with two processes on the machine's cores; the "
          "four ranks here get about half of that (and other jobs shared the machine): the predictions are the plans' "
          "relative expectations, not forecasts of these CPU step times. With fewer cores than ranks, every "
          "collective waits until all its ranks are scheduled: an sp=4 all-to-all needs all four ranks running at once "
          "(at most two are on 2 cores), a P2P send only two, so the oversubscription penalizes the sp-heavy layouts "
          "more than a GPU run would.", ""]
    for c in res["contexts"]:
        L += [f"## Context {c['max_len']} tokens", "",
              f"Batches of at most {c['tokens_per_step']} tokens: "
              + ", ".join(f"#{i} {b['num_seqs']} seqs / {b['tokens']} tok (longest {b['longest']})"
                          for i, b in enumerate(c["batches"]))
              + f". Warm-up (memory) batch #{c['memory_batch']}, timed {c['timed_batches']}. Activation budget per "
              f"GPU: {_mib(c['activation_budget_bytes'])} MiB ("
              + ", ".join(f"{n}: {_mib(p['at_frac'])}" for n, p in c["budget_rule"].items())
              + f"; raised {c['budget_raised']} time(s) by 10% so that every layout plans every batch). Cores probe before / after: {' / '.join(f'{x:.2f}' for x in c['cores_probe'])}; load "
              f"{c['loadavg']['before'][0]:.2f} / {c['loadavg']['after'][0]:.2f}. Layers per stage: "
              + "; ".join(f"{n}: {r}" for n, r in c["layer_ranges"].items())
              + ". Static memory per rank (weights, gradients, AdamW state; not in the activation figures), MiB: "
              + "; ".join(f"{n}: " + " / ".join(_mib(st[k]) for k in c["runs"][n]["stage_of_rank"])
                          for n, st in c["static_bytes"].items())
              + ". All-to-all fit (latency us, GB/s): "
              + "; ".join(f"{n}: {a[0] * 1e6:.0f}, {a[1] / 1e9:.2f}" for n, a in c["a2a_fit"].items() if a) + ".", "",
              "| layout | tokens/s median [min..max] | pp2xsp2 / this (paired) | step s | run s | grad reduce s | "
              "predicted s | act. peak MiB per rank: meter (all steps) | allocated (warm-up) | predicted (warm-up) | "
              "recompute | warm-up loss (rel. diff vs HF) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in c["runs"].items():
            t = r["tokens_per_s"]
            L.append(f"| {name} | {t['median']:.0f} [{t['min']:.0f}..{t['max']:.0f}] | "
                     f"{r['pp2xsp2_over_this']:.3f}x ({r['pp2xsp2_over_this_paired']:.3f}x) | "
                     f"{r['step_s']['median']:.2f} | {r['run_s']['median']:.2f} | {r['reduce_s']['median']:.3f} | "
                     f"{r['predicted_step_s']['median']:.2f} | {' / '.join(_mib(x) for x in r['meter_peak_bytes'])} | "
                     f"{' / '.join(_mib(x) for x in r['memory_batch_alloc_peak_bytes'])} | "
                     f"{' / '.join(_mib(x) for x in r['memory_batch_predicted_act_peak_bytes'])} | "
                     f"{r['recompute_fraction']['median']:.0%} | {r['warmup_loss']:.6f} ({r['loss_rel_diff']:.1e}) |")
        L += ["", f"Single-process HF loss on the warm-up batch (initial weights): {c['reference_loss']:.6f}; every "
              f"layout within {LOSS_TOL:g} relative: {'yes' if c['loss_ok'] else '**no**'}. Ranks in order 0..3; "
              "stage of each rank: " + "; ".join(f"{n}: {r['stage_of_rank']}" for n, r in c["runs"].items()) + ".", ""]
    return "\n".join(L)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, one 256-token context, one timed step")
    ap.add_argument("--contexts", type=str, default=None, help="context lengths, comma separated")
    ap.add_argument("--tokens-per-step", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per layout (after the warm-up step)")
    ap.add_argument("--budget-frac", type=float, default=0.5,
                    help="activation budget per GPU, every layout: this fraction of the way from full recompute (0) to "
                         "none (1) for one whole longest sequence on pp=2 x sp=2's worst GPU")
    ap.add_argument("--solver", choices=("ilp", "greedy"), default="ilp")
    ap.add_argument("--time-limit", type=float, default=1.0, help="ILP time limit, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="output prefix (default benchmarks/results/measured_sp, measured_sp_quick)")
    ap.add_argument("--from-json", type=pathlib.Path, default=None,
                    help="only rewrite the markdown of an earlier run's JSON (its command and figures kept)")
    args = ap.parse_args(argv)
    args.preset = "quick" if args.quick else "full"
    pre = PRESETS[args.preset]
    args.contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else list(pre["contexts"])
    for k in ("tokens_per_step", "steps"):
        if getattr(args, k) is None:
            setattr(args, k, pre[k])
    if args.out is None:
        args.out = RESULTS / ("measured_sp" if args.preset == "full" else "measured_sp_quick")
    return args


def run(args: argparse.Namespace, header, log=print) -> dict[str, Any]:
    """The benchmark; ``header``: its :class:`_results.Run`, started before anything else."""
    import torch

    from _pipeline_worker import build_model
    from measured import load_corpus, model_config, profile

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    pre = PRESETS[args.preset]
    loads = [os.getloadavg()[0]]
    corpus = load_corpus(pre["max_files"])
    config = model_config(pre["model"], max(args.contexts))
    cost, profile_s = profile(config, args.seed, pre, max(args.contexts), log)
    contexts = []
    for L in args.contexts:
        contexts.append(run_context(L, corpus, config, cost, pre, args, log))
        loads.append(os.getloadavg()[0])
    res = {
        "command": header.command,
        "date": datetime.date.today().isoformat(),
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "config": config,
        "num_params": sum(p.numel() for p in build_model(config, args.seed).parameters()),
        "cost_model": cost.to_dict(),
        "profile_s": profile_s,
        "contexts": contexts,
    }
    loads.append(os.getloadavg()[0])
    res["load_range"] = [min(loads), max(loads)]
    res["elapsed_s"] = time.perf_counter() - t_start
    res["header"] = header.header()
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(to_markdown(res) + "\n")
    log(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} in {res['elapsed_s'] / 60:.1f} min")
    return res


def main(argv=None) -> dict[str, Any]:
    from _results import Run

    argv = sys.argv[1:] if argv is None else list(argv)
    header = Run(__file__, argv)
    args = parse_args(argv)
    if args.from_json:
        res = json.loads(args.from_json.read_text())
        args.from_json.with_suffix(".md").write_text(to_markdown(res) + "\n")
        print(f"rewrote {args.from_json.with_suffix('.md')}")
        return res
    res = run(args, header, log=lambda m: print(f"[measured_sp] {m}", flush=True))
    for c in res["contexts"]:
        print(f"context {c['max_len']} (cores probe {' / '.join(f'{x:.2f}' for x in c['cores_probe'])}; "
              "4 processes on shared cores: compare ratios)")
        for name, r in c["runs"].items():
            print(f"  {name:<8} {r['tokens_per_s']['median']:8.0f} tok/s  pp2xsp2/this {r['pp2xsp2_over_this']:.3f}x  "
                  f"act peak MiB per rank {' / '.join(_mib(x) for x in r['memory_batch_alloc_peak_bytes'])} "
                  f"(pred {' / '.join(_mib(x) for x in r['memory_batch_predicted_act_peak_bytes'])})  "
                  f"loss diff {r['loss_rel_diff']:.1e}")
    return res


if __name__ == "__main__":
    main()
