"""The PyTorch-native peer, side by side: ``torch.distributed.pipelining`` against ``adaptive``.

    python benchmarks/torch_pipelining_peer.py            # 2K, 4K and 8K contexts, ~10-15 min on 2 quiet cores
    python benchmarks/torch_pipelining_peer.py --quick    # 2K only, one timed step, a smaller grid (< 5 min)
    python benchmarks/torch_pipelining_peer.py --tiny     # the smoke test's setting (tiny model, 256 tokens)

What a PyTorch user would pick for pipeline-parallel training of an HF model (see
:mod:`_peer_worker`): ``PipelineStage`` + ``Schedule1F1B`` over two hand-split stage modules, the
step's sequences packed into fixed rows of the context length (position ids restarting per
document, the last row padded), with and without activation checkpointing of every layer. Its
micro-batch count and layer split are tuned by measurement (the grid ``--splits`` x
``--microbatches``, one timed step each on the first timed batch, with and without checkpointing).
Its attention comes two ways: the project's ``concertina`` kernel (per-document attention, one SDPA
call per document on CPU, no dense mask: the comparison measures the pipelining method, not the
kernel) and HF's default SDPA path (a block-diagonal ``T x T`` mask per row, as users run it).

Beside it, on the same model, batches and two gloo ranks as ``measured.py`` (its ``full`` preset's
10M Llama, stdlib-source batches of at most ``--tokens-per-step`` tokens): the project's runtime
at pp=2 with ``adaptive`` under the measured benchmark's binding activation budget
(``--budget-frac`` of the way from full recompute to none for one whole longest sequence) and
unbounded, and at pp=1 (one process, unbounded: twice its speed is the ideal for pp=2). The
project's plans are made in the parent process before the run (planning is off the clock here; the
measured benchmark times it: well under 2% of a step). The cost model is the one
``measured.py`` profiled on this machine for the same model (``benchmarks/results/measured.json``)
unless ``--profile`` asks for a fresh one.

Every job has its own copy of the model (same seed) and AdamW; steps of all jobs are interleaved
round by round (round 0: warm-up and memory, under the allocation tracker; then the timed rounds),
so machine load hits all alike. Before any timed step, the peer's loss on the memory batch (initial
weights) must equal the single-process HF model's on the same rows (``use_cache=False``: with a
cache HF drops its packed-sequence mask) within 1e-4, or the run stops.

Figures: tokens/s (real tokens over the step's wall time: slowest rank, forward, backward,
optimizer; median over timed steps), per-rank allocation peak of the memory step (parameter
gradients excluded; ``runtime.memory.AllocationTracker``), the load average seen. Writes
``benchmarks/results/torch_pipelining_peer.{md,json}`` (``--out``) with
:func:`_results.write_results`.
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

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

RESULTS = HERE / "results"
MIB = 2**20
TARGET_VS_PEER = 1.25

PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(model="full", contexts=(2048, 4096, 8192), tokens_per_step=8192, steps=2, splits=(4, 5),
                 microbatches=(2, 4)),
    "quick": dict(model="full", contexts=(2048,), tokens_per_step=8192, steps=1, splits=(4, 5),
                  microbatches=(2,)),
    "tiny": dict(model="tiny", contexts=(256,), tokens_per_step=1024, steps=1, splits=(2,), microbatches=(2,)),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="2K only, one timed step, a smaller grid (< 5 min)")
    size.add_argument("--tiny", action="store_true", help="smoke-test setting (tiny model, 256 tokens)")
    ap.add_argument("--contexts", type=str, default=None, help="context lengths, comma separated")
    ap.add_argument("--tokens-per-step", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per job (after the warm-up step)")
    ap.add_argument("--splits", type=str, default=None, help="peer: decoder layers on stage 0, comma separated")
    ap.add_argument("--microbatches", type=str, default=None, help="peer: micro-batch counts, comma separated")
    ap.add_argument("--budget-frac", type=float, default=0.5, help="as in measured.py")
    ap.add_argument("--tune-ckpt", action="store_true",
                    help="tune the checkpointed peer separately (default: it uses the setting tuned without)")
    ap.add_argument("--profile", action="store_true", help="profile a fresh cost model instead of measured.json's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    args.preset = "quick" if args.quick else "tiny" if args.tiny else "full"
    pre = PRESETS[args.preset]
    args.contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else list(pre["contexts"])
    args.splits = [int(x) for x in args.splits.split(",")] if args.splits else list(pre["splits"])
    args.microbatches = [int(x) for x in args.microbatches.split(",")] if args.microbatches else list(pre["microbatches"])
    for k in ("tokens_per_step", "steps"):
        if getattr(args, k) is None:
            setattr(args, k, pre[k])
    if args.out is None:
        args.out = RESULTS / ("torch_pipelining_peer" if args.preset == "full" else f"torch_pipelining_peer_{args.preset}")
    if min(args.microbatches) < 2:
        ap.error("Schedule1F1B needs at least as many micro-batches as stages (2)")
    return args


def cost_model(config: dict, args, log, sources: tuple[str, ...] = ("measured.json",)):
    """The cost model: the first of ``sources`` (result files) profiled for this model on the
    current attention backend (``--profile``: fresh). A model with ``alpha_mask > 0`` was profiled
    on the former dense-mask CPU backend: it prices every sliced or packed chunk as a dense
    ``T x S`` attention, which no backend does now, and is not reused; nor is one without
    ``max_chunk_tokens`` (profiled before the planner kept chunks within the profiled range)."""
    import measured
    from concertina_hf.planning import CostModel

    for name in sources if not args.profile and args.preset != "tiny" else ():
        src = RESULTS / name
        rec = json.loads(src.read_text()) if src.exists() else {}
        if rec.get("config") != config:
            continue
        if rec["cost_model"].get("alpha_mask"):
            log(f"{src.name} ({rec.get('date')}): its cost model was profiled on the former dense-mask backend "
                "(alpha_mask > 0); not reused")
            continue
        if not rec["cost_model"].get("max_chunk_tokens"):
            log(f"{src.name} ({rec.get('date')}): its cost model records no fitted chunk range (max_chunk_tokens: "
                "its plans put a step in chunks far larger than any profiled one); "
                "not reused")
            continue
        log(f"cost model from {src.name} ({rec.get('date')}, {rec.get('command')})")
        return CostModel.from_dict(rec["cost_model"]), f"{src.name} ({rec.get('date')})"
    pre = measured.PRESETS["tiny" if args.preset == "tiny" else "full"]
    cost, took = measured.profile(config, args.seed, pre, max(args.contexts), log)
    return cost, f"profiled here in {took:.0f} s"


def project_jobs(batches, cost, max_len: int, args, log) -> tuple[list[dict], dict]:
    """The project's runs with their plans (made here, before the run): adaptive pp=2 under the
    binding budget and unbounded, adaptive pp=1 unbounded."""
    import measured
    from concertina_hf.planning import StageLayout, partition_layers, plan_step, simulate

    layout = partition_layers(cost, 2)
    static = [cost.static_memory(layout, s) for s in range(2)]
    act_budget, _, _ = measured.activation_budget(cost, layout, max_len, args.budget_frac)
    budgets = [int(static[s] + act_budget) for s in range(2)]
    one = StageLayout(cost.num_layers, ((0, cost.num_layers),))

    def plans(lay, budget) -> tuple[list[str], float]:
        out, t = [], 0.0
        for b in batches:
            t0 = time.perf_counter()
            p = plan_step([len(s) for s in b], cost, lay, budget, "adaptive")
            if p.predicted is None:
                p = p.with_predicted(simulate(p, cost).stats())
            t += time.perf_counter() - t0
            out.append(p.validate().to_json())
        return out, t / len(batches)

    jobs = []
    for name, lay, budget, pp in (("adaptive", layout, budgets, 2), ("adaptive unbounded", layout, 0, 2),
                                  ("project pp=1", one, 0, 1)):
        ps, t = plans(lay, budget)
        jobs.append({"name": name, "pp": pp, "layer_ranges": [list(r) for r in lay.layer_ranges], "plans": ps,
                     "plan_s": t})
        log(f"L={max_len}: planned {name} ({t * 1e3:.0f} ms per batch)")
    info = {"activation_budget_bytes": act_budget, "static_bytes": static, "budgets_bytes": budgets,
            "layer_ranges": [list(r) for r in layout.layer_ranges]}
    return jobs, info


def run_pair(spec: dict, log) -> dict:
    """The two peer processes on ``spec`` (measured.py's launcher, the peer's worker)."""
    from _peer_worker import run_worker
    from measured import run_pipeline

    return run_pipeline(spec, log, worker=run_worker, what="peer")


def summarize(records: list[dict], name: str) -> dict[str, Any]:
    recs = [r for r in records if r["job"] == name]
    timed = sorted((r for r in recs if not r["memory_round"]), key=lambda r: r["round"])
    mem = next(r for r in recs if r["memory_round"])
    tps = [r["tokens"] / r["step_s"] for r in timed]
    out = {"tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
           "tokens_per_s_by_step": tps, "step_s": [r["step_s"] for r in timed],
           "alloc_peak_bytes": mem["alloc_peak_bytes"], "losses": [r["loss"] for r in recs]}
    if "rows" in mem:
        out["rows"] = [r["rows"] for r in recs]
        out["padded_fraction"] = statistics.mean(r["padded_tokens"] / (r["padded_tokens"] + r["tokens"]) for r in recs)
    return out


def run_context(max_len: int, corpus, config: dict, cost, args, log) -> dict[str, Any]:
    import measured
    from _pipeline_worker import trainer_optimizer_spec

    # at least two rows of the context per step: with one, Schedule1F1B has nothing to pipeline
    tokens_per_step = max(args.tokens_per_step, 2 * max_len)
    batches, memory_batch, timed = measured.make_batches(corpus, max_len, tokens_per_step, args.steps, args.seed)
    jobs, info = project_jobs(batches, cost, max_len, args, log)
    n = int(config["num_hidden_layers"])
    splits = [s for s in args.splits if 0 < s < n]
    # micro-batch counts above the tuning batch's row count only add rows of padding
    rows = -(-sum(map(len, batches[timed[0]])) // max_len)
    microbatches = [m for m in args.microbatches if m <= max(2, rows)] or [min(args.microbatches)]
    spec = {"config": config, "seed": args.seed, "optimizer": trainer_optimizer_spec(), "row_len": max_len,
            "batches": batches, "memory_batch": memory_batch, "timed_batches": timed, "tune_batch": timed[0],
            "splits": splits, "microbatches": microbatches, "tune_ckpt": [False, True] if args.tune_ckpt else [False],
            "project_jobs": jobs}
    load0 = os.getloadavg()
    out = run_pair(spec, log)
    names = [j["name"] for j in jobs] + list(out["peer_jobs"])
    runs = {nm: summarize(out["records"], nm) for nm in names}
    for nm, p in out["peer_jobs"].items():
        runs[nm].update(p)
    return {"max_len": max_len, "tokens_per_step": tokens_per_step,
            "batches": [{"num_seqs": len(b), "tokens": sum(map(len, b)), "longest": max(map(len, b))} for b in batches],
            "memory_batch": memory_batch, "timed_batches": timed, **info, "runs": runs, "tuning": out["tuning"],
            "peer_best": out["best"], "loss_check": out["loss_check"], "parallel_capacity": out["capacity"],
            "loadavg": {"before": load0, "after": out["loadavg_end"]}, "wall_s": out["wall_s"],
            "plan_s": {j["name"]: j["plan_s"] for j in jobs}}


def ratios_and_targets(c: dict) -> list[dict[str, Any]]:
    runs = c["runs"]
    med = lambda n: runs[n]["tokens_per_s"]["median"]  # noqa: E731
    peak = lambda n: max(runs[n]["alloc_peak_bytes"])  # noqa: E731
    same_kernel = [n for n in ("peer concertina", "peer concertina+ckpt") if n in runs]
    best_peer = max(same_kernel, key=med)
    rows = []
    for ad in ("adaptive", "adaptive unbounded"):
        for peer in same_kernel + [n for n in ("peer sdpa", "peer sdpa+ckpt") if n in runs]:
            ratio = med(ad) / med(peer)
            mem_ok = peak(ad) <= peak(peer)
            # the target: adaptive at equal or lower peak memory than the best same-kernel
            # peer; both adaptive runs are checked (the binding budget's is the stricter reading)
            is_target = peer == best_peer
            rows.append({"context": c["max_len"], "run": ad, "peer": peer, "ratio": ratio,
                         "paired": statistics.median(a / b for a, b in zip(runs[ad]["tokens_per_s_by_step"],
                                                                           runs[peer]["tokens_per_s_by_step"])),
                         "peak_mib": peak(ad) / MIB, "peer_peak_mib": peak(peer) / MIB, "memory_ok": mem_ok,
                         "target": is_target, "met": bool(ratio >= TARGET_VS_PEER and mem_ok) if is_target else None})
    return rows


def to_markdown(res: dict[str, Any]) -> str:
    L = ["# torch.distributed.pipelining (Schedule1F1B) vs adaptive, pp=2 on CPU", "",
         f"**Loaded machine**: load average (1 min) {res['load_range'][0]:.1f} to {res['load_range'][1]:.1f} on "
         f"{os.cpu_count()} cores shared with other work (`cores` below: what the two ranks really got, 2.0 idle). "
         "Steps of all runs are interleaved round by round so load changes hit all alike; absolute figures are "
         "low and noisy, ratios are the result.", "",
         f"Model: the measured benchmark's Llama ({res['num_params'] / 1e6:.1f}M parameters, "
         f"{res['config']['num_hidden_layers']} layers, hidden {res['config']['hidden_size']}), fp32, one thread per "
         f"process, gloo. Cost model: {res['cost_source']}. Project pp=2 stages: layers "
         f"{res['contexts'][0]['layer_ranges']}. The peer's split (layers on stage 0) and micro-batch count are "
         "tuned per context by one measured step per grid point (concertina attention; see the tuning lines); the "
         "chosen setting without checkpointing is used for both attention paths without checkpointing, the one "
         "with checkpointing (when tuned) for both with it.", "",
         "## Targets", "",
         f"adaptive >= {TARGET_VS_PEER}x the tokens/s of the best-tuned peer with the same attention kernel, at equal "
         "or lower peak memory per rank. Two rows per context: `adaptive` (the measured benchmark's binding "
         "activation budget, well below the peer's peak: the stricter reading) and `adaptive unbounded` (no "
         "budget; it counts only where its measured peak is at or below the peer's).", "",
         "| context | cores | run | / best same-kernel peer | paired | adaptive peak MiB (max rank) | peer peak MiB | met |",
         "|---|---|---|---|---|---|---|---|"]
    for c in res["contexts"]:
        cores = "/".join(f"{x:.2f}" for x in c["parallel_capacity"])
        for t in c["ratios"]:
            if t["target"]:
                L.append(f"| {c['max_len']} | {cores} | {t['run']} | {t['ratio']:.2f}x vs {t['peer']} | {t['paired']:.2f}x | "
                         f"{t['peak_mib']:.0f} | {t['peer_peak_mib']:.0f} | {'yes' if t['met'] else '**no**'} |")
    for c in res["contexts"]:
        runs = c["runs"]
        pp1 = runs["project pp=1"]["tokens_per_s"]["median"]
        L += ["", f"## Context {c['max_len']}", "",
              f"Batches (at most {c['tokens_per_step']} tokens): "
              + "; ".join(f"#{i}: {b['num_seqs']} seqs, {b['tokens']} tok, longest {b['longest']}"
                          for i, b in enumerate(c["batches"]))
              + f". Memory (warm-up) batch #{c['memory_batch']}, timed {c['timed_batches']}. Activation budget per "
              f"stage (adaptive): {c['activation_budget_bytes'] / MIB:.0f} MiB. Cores the two ranks got: "
              f"{' then '.join(f'{x:.2f}' for x in c['parallel_capacity'])}; load average "
              f"{c['loadavg']['before'][0]:.1f} then {c['loadavg']['after'][0]:.1f}.", "",
              "| run | tokens/s median [min..max] | / project pp=1 | allocated peak MiB per rank (memory step) | setting |",
              "|---|---|---|---|---|"]
        for name, r in runs.items():
            t = r["tokens_per_s"]
            setting = ""
            if "split" in r:
                setting = (f"split {r['split']}/{c_layers(res) - r['split']}, {r['microbatches']} micro-batches, rows "
                           f"{sorted(set(r['rows']))}, {r['padded_fraction']:.0%} padding")
            elif name == "project pp=1":
                setting = "one process (rank 1 idle); 2x this is the ideal pp=2"
            L.append(f"| {name} | {t['median']:.0f} [{t['min']:.0f}..{t['max']:.0f}] | {t['median'] / pp1:.2f} | "
                     f"{' / '.join(f'{b / MIB:.0f}' for b in r['alloc_peak_bytes'])} | {setting} |")
        L += ["", "Ratios (tokens/s medians; paired: median of per-batch ratios):", ""]
        for t in c["ratios"]:
            L.append(f"- {t['run']} / {t['peer']}: {t['ratio']:.2f}x (paired {t['paired']:.2f}x); peak "
                     f"{t['peak_mib']:.0f} vs {t['peer_peak_mib']:.0f} MiB")
        lc = c["loss_check"]
        L += ["", "Loss check (memory batch, initial weights; the peer's summed micro-batch losses vs one HF process "
              "on the same rows, `use_cache=False`): "
              + "; ".join(f"{k} {v['peer']:.6f} vs {v['reference']:.6f} (rel. {v['rel_diff']:.1e})" for k, v in lc.items())
              + ".", "",
              "Peer tuning (one measured step on batch "
              f"#{c['timed_batches'][0]}, concertina attention): "
              + ", ".join(f"{'ckpt ' if t['checkpoint'] else ''}split {t['split']} x {t['microbatches']} mb: "
                          f"{t['step_s']:.2f}s" for t in c["tuning"]) + "."]
    L += ["", "## How to read this", "",
          "- tokens/s: real tokens of the step's batch (padding not counted) over the step's wall time, slowest "
          "rank (forward, backward, optimizer; the project's plans were made before the run). pp=1 runs on rank 0 "
          "while rank 1 waits in a barrier.",
          "- allocated peak: every tensor created during the memory step's forward and backward (parameter "
          "gradients excluded), per rank (`runtime.memory.AllocationTracker`); the peer's includes the pipelining "
          "stage's receive buffers and the logits of its micro-batches.",
          "- the peer packs documents into rows of the context length: a document cut at a row end continues as a "
          "new document (position 0) in the next row, as packing collators do, so its loss differs slightly from "
          "the project's (which keeps documents whole); the same tokens are trained."]
    return "\n".join(L) + "\n"


def c_layers(res) -> int:
    return int(res["config"]["num_hidden_layers"])


def run(args, header, log=print) -> dict[str, Any]:
    """The benchmark; ``header``: its :class:`_results.Run`, started before anything else."""
    import datetime

    import torch

    import measured
    from _pipeline_worker import build_model

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    loads = [os.getloadavg()[0]]
    pre = PRESETS[args.preset]
    mpre = measured.PRESETS[pre["model"]]
    corpus = measured.load_corpus(mpre["max_files"])
    config = measured.model_config(mpre["model"], max(max(args.contexts), 8192 if pre["model"] == "full" else 0))
    cost, cost_source = cost_model(config, args, log)
    contexts = []
    for L in args.contexts:
        c = run_context(L, corpus, config, cost, args, log)
        c["ratios"] = ratios_and_targets(c)
        contexts.append(c)
        loads += [c["loadavg"]["before"][0], c["loadavg"]["after"][0]]
    loads.append(os.getloadavg()[0])
    res = {"date": datetime.date.today().isoformat(),
           "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
           "config": config, "num_params": sum(p.numel() for p in build_model(config, args.seed).parameters()),
           "cost_source": cost_source, "contexts": contexts, "load_range": [min(loads), max(loads)],
           "elapsed_s": time.perf_counter() - t0}
    from _results import write_results

    write_results(args.out, to_markdown(res), res, header)
    return res


def main(argv=None) -> dict[str, Any]:
    from _results import Run

    argv = sys.argv[1:] if argv is None else list(argv)
    header = Run(__file__, argv)
    args = parse_args(argv)
    return run(args, header, log=lambda m: print(f"[peer] {m}", flush=True))


if __name__ == "__main__":
    main()
