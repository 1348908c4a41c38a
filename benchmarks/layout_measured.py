"""Measured: ``concertina_layout="auto"``'s pick against every fixed layout of 4 processes (CPU).

    python benchmarks/layout_measured.py            # about 6-10 min on 2 busy cores
    python benchmarks/layout_measured.py --quick    # a smoke run: short distribution, one round

On this machine with 4 processes, two length distributions, auto's pick against
every runnable fixed layout of 4 processes, tokens/s as ratios from one run with interleaved
candidates. What runs (CPU, gloo, one thread per process, fp32, ``ConcertinaTrainer`` itself):

1. **Model.** A tiny Llama: hidden 32, 4 layers, 4 heads (head size 8), 2 K/V heads (so sp=4
   replicates them, as Ulysses does), MLP 88, the bundled tokenizer's 8192-token vocabulary. pp4
   needs 4 layers; the width keeps a 16K-token step around ten seconds on 2 cores.
2. **Data** (``measured.load_corpus``: the stdlib sources tokenized with the bundled tokenizer,
   shuffled with a fixed seed). ``short``: every sequence a file truncated at 512 tokens, 16 per
   step. ``longtail``: 8 sequences per step, 7 short ones (files truncated at 512 tokens) and one of
   16384 tokens (consecutive files concatenated: a constructed long document, one per step).
3. **Cost model.** Profiled once before the runs (``measured.profile``, in one process, one thread)
   and given to every trainer as ``concertina_cost_model_path``; auto decides on it.
4. **Candidates.** Every ``pp x sp x dp`` layout of 4 processes the runtime runs for 4 heads / 2 K/V
   heads (pp4, pp2 x sp2, pp2 x dp2, pp1 x sp4, pp1 x sp2 x dp2, pp1 x dp4), each as
   ``concertina_layout="auto"`` with all three sizes fixed (so every candidate takes the same global
   batch, ``per_device x world`` sequences, and the same data), plus ``auto`` itself (nothing
   fixed): the same layout as one of them, so their ratio is a measure of run-to-run noise. Same
   arguments otherwise (adaptive, ``concertina_max_tokens_per_chunk=1024``, memory budget ``auto``,
   the optimizer state not sharded, sequential sampling, no self-check).
5. **Runs.** One ``torchrun`` of 4 processes builds every candidate's trainer (its own mesh over
   the same 4 processes), then runs rounds: in round ``r`` each candidate, in an order rotated by
   ``r``, runs ``train()`` for a few optimizer steps on the same first batches (:data:`SCHEDULE`),
   timed from one step's end to the next (data read, plan wait, pipeline, gradient reduction,
   optimizer step); ``short``: 3 rounds of 3 steps, the first of each call a warm-up (its plan is
   not overlapped); ``longtail``: 2 rounds of one step timed from ``train()``'s start.

Figures per distribution: each candidate's tokens/s (median over rounds of the round's timed
tokens over its timed seconds; min and max), its ratio to the fastest, and auto's pick with the
ratio of ``auto`` to its identical fixed layout. **The 4 processes share the machine's 2 cores**:
tokens/s are not GPU figures and collectives wait for ranks to be scheduled (sp=4's all-to-all
needs all 4 at once); only ratios between candidates measured in the same run mean something.
Writes ``benchmarks/results/layout_measured.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

WORLD = 4
SHORT, LONG = 512, 16384
#: every pp x sp x dp layout of 4 processes for 4 heads / 2 K/V heads (layouts.runnable_layouts)
FIXED = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)]
SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, intermediate_size=88)
#: per distribution: rounds, optimizer steps per candidate and round, the first timed step (1: the
#: first step of each train() call is a warm-up; 0: timed from train()'s start, for the 16K steps
#: that take seconds each, so the per-call setup and unoverlapped first plan are included)
SCHEDULE = {"short": dict(rounds=3, steps=3, timed_from=1), "longtail": dict(rounds=2, steps=1, timed_from=0)}
# one process (measured.profile's two-process path fails in _pipeline_worker's P2P probe today)
PROFILE = dict(profile_max_tokens=1024, profile_repeats=2, profile_layers=2, profile_procs=1)

__all__ = ["main"]


def _name(pp: int, sp: int, dp: int) -> str:
    return f"pp{pp} x sp{sp} x dp{dp}"


# ---------------------------------------------------------------------------------- data
def distributions(corpus: list[list[int]], steps: int, seed: int, quick: bool) -> dict[str, dict]:
    """Per distribution: rows (token id lists, in step order) and rows per step."""
    order = list(range(len(corpus)))
    random.Random(seed).shuffle(order)
    files = [corpus[i] for i in order if len(corpus[i]) >= 2]
    short = [f[:SHORT] for f in files]
    out = {"short": {"rows_per_step": 16, "rows": short[:16 * steps]}}
    if quick:
        return out
    rows, k, j = [], 0, len(files) - 1
    for _ in range(steps):
        long: list[int] = []
        while len(long) < LONG:  # consecutive files from the other end of the order: one long document
            long += files[j]
            j -= 1
        rows.append(long[:LONG])
        rows += short[k:k + 7]
        k += 7
    out["longtail"] = {"rows_per_step": 8, "rows": rows}
    return out


# ---------------------------------------------------------------------------------- worker
def worker(spec_path: str, out_path: str) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainerCallback

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    torch.set_num_threads(1)
    spec = json.loads(pathlib.Path(spec_path).read_text())
    config = LlamaConfig(**spec["config"])

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    report: dict[str, Any] = {"distributions": {}}
    for dist_name, d in spec["distributions"].items():
        data = datasets.Dataset.from_list([{"input_ids": r} for r in d["rows"]])
        per_device = d["rows_per_step"] // WORLD
        sched = d["schedule"]
        cands = [("auto", {})] + [(_name(*s), dict(concertina_pipeline_size=s[0], concertina_data_parallel_size=s[2],
                                                   concertina_sequence_parallel_size=s[1])) for s in FIXED]
        trainers, clocks, built = {}, {}, {}
        for name, sizes in cands:
            clock = StepClock()
            torch.manual_seed(spec["seed"])
            model = AutoModelForCausalLM.from_config(config)
            args = ConcertinaTrainingArguments(
                output_dir=os.path.join(spec["tmp"], dist_name, name.replace(" ", "")), report_to=[],
                disable_tqdm=True, save_strategy="no", logging_steps=1000, max_steps=sched["steps"],
                per_device_train_batch_size=per_device, gradient_accumulation_steps=1, learning_rate=1e-4,
                train_sampling_strategy="sequential", seed=spec["seed"], concertina_layout="auto",
                concertina_cost_model_path=spec["cost_path"], concertina_max_tokens_per_chunk=1024,
                concertina_self_check=False, concertina_gantt_steps=-1, **sizes)
            t0 = time.perf_counter()
            trainers[name] = ConcertinaTrainer(model=model, args=args, train_dataset=data, callbacks=[clock])
            built[name] = time.perf_counter() - t0
            clocks[name] = clock
        auto = trainers["auto"].layout_choice
        lens = [len(r) for r in d["rows"]]
        step_tokens = [sum(lens[i * d["rows_per_step"]:(i + 1) * d["rows_per_step"]]) for i in range(sched["steps"])]
        rounds = []
        first = sched["timed_from"]
        for r in range(sched["rounds"]):
            order = cands[r % len(cands):] + cands[:r % len(cands)]
            for name, _ in order:
                clock = clocks[name]
                clock.ends = []
                trainers[name].topology.barrier()
                start = time.perf_counter()
                trainers[name].train()
                ends = [start] + clock.ends
                dts = [b - a for a, b in zip(ends, ends[1:])]
                rounds.append({"round": r, "candidate": name, "step_s": dts,
                               "timed_tokens": sum(step_tokens[first:len(dts)]), "timed_s": sum(dts[first:])})
        report["distributions"][dist_name] = {
            "auto_pick": _name(*auto.sizes), "auto_table": list(auto.table), "construct_s": built,
            "rounds": rounds, "step_tokens": step_tokens, "per_device": per_device,
            "layouts": {name: [t.topology.pipeline_size, t.topology.sequence_parallel_size,
                               t.topology.data_parallel_size] for name, t in trainers.items()}}
        for t in trainers.values():
            t.planner.close()
    last = trainers["auto"]
    if last.topology.rank == 0:
        pathlib.Path(out_path).write_text(json.dumps(report))
    last.end()


# ---------------------------------------------------------------------------------- main
def summarize(d: dict) -> dict:
    by: dict[str, list[float]] = {}
    for r in d["rounds"]:
        if r["timed_s"] > 0:
            by.setdefault(r["candidate"], []).append(r["timed_tokens"] / r["timed_s"])
    rows = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v} for name, v in by.items()}
    best = max(v["median"] for n, v in rows.items())
    for v in rows.values():
        v["best_over_this"] = best / v["median"]
        v["spread"] = (v["max"] - v["min"]) / v["median"]
    pick = d["auto_pick"]
    fastest = min((n for n in rows if n != "auto"), key=lambda n: rows[n]["best_over_this"])
    same = rows["auto"]["median"] / rows[pick]["median"] if pick in rows else None
    # run-to-run noise: a candidate's spread over rounds, or auto against its identical fixed layout
    noise = max([v["spread"] for v in rows.values()] + ([abs(same - 1)] if same else []))
    return {"rows": rows, "pick": pick, "fastest_fixed": fastest,
            "pick_over_fastest": rows[pick]["median"] / rows[fastest]["median"],
            "auto_over_its_layout": same, "noise": noise,
            "verdict": ("fastest" if pick == fastest else
                        "within noise" if rows[fastest]["median"] / rows[pick]["median"] - 1 <= noise else "slower")}


def to_markdown(res: dict) -> str:
    cfg = res["config"]
    cores = os.cpu_count()
    L = ["# Measured: concertina_layout='auto' against every fixed layout of 4 processes (CPU)", "",
         f"**The 4 processes share this machine's {cores} cores**: tokens/s are CPU figures of 4 ranks on {cores} "
         "cores, not GPU figures, and a collective waits until all its ranks are scheduled (sp=4's all-to-all needs "
         "all four at once, at most two run); only the ratios between candidates of one run mean something. "
         "Candidates interleaved round by round (order rotated each round), the same batches for every candidate.", "",
         f"Model: Llama, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} "
         f"heads ({cfg['num_key_value_heads']} K/V), MLP {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, fp32, "
         "`ConcertinaTrainer` on gloo, one thread per process. Cost model profiled once (one process) and given to "
         "every trainer (`concertina_cost_model_path`): auto decides on it. Every fixed candidate runs as "
         "`concertina_layout='auto'` with its three sizes set, so all take the same global batch. `auto`: nothing "
         "fixed (the same layout as its pick: their ratio shows the run-to-run noise). Rounds x steps per "
         "candidate: " + "; ".join(f"{n}: {s['rounds']} x {s['steps']}" + (" (the first step of each round untimed)"
                                   if s["timed_from"] else " (timed from train()'s start)")
                                   for n, s in res["schedule"].items()) + ".", "",
         "| distribution | auto's pick | fastest fixed | pick / fastest (tokens/s) | auto / its fixed layout | "
         "noise (largest max-min over median, or auto vs its layout) | verdict |", "|---|---|---|---|---|---|---|"]
    for name, d in res["distributions"].items():
        s = d["summary"]
        L.append(f"| {name} | {s['pick']} | {s['fastest_fixed']} | {s['pick_over_fastest']:.3f} | "
                 f"{s['auto_over_its_layout']:.3f} | {s['noise']:.3f} | {s['verdict']} |")
    L += ["", "Reading: `pick / fastest` below 1 means a fixed layout measured faster than auto's pick; the verdict "
          "compares the gap with the noise of the same run (a candidate's spread over rounds, or `auto` against its "
          "identical fixed layout). On 4 ranks over 2 cores the simulator (which prices every rank on a core of its "
          "own) and the measurement disagree most where ranks idle: a replica or stage that waits gives its core to "
          "a busy rank, which favours dp and pp layouts here over what a GPU per rank would show; the load average "
          "in the header shows how busy the machine was."]
    for name, d in res["distributions"].items():
        s = d["summary"]
        lens = d["describe"]
        L += ["", f"## {name}", "", lens, "",
              "| candidate | tokens/s median [min..max] over rounds | fastest / this | auto's simulated ratio |",
              "|---|---|---|---|"]
        sim = {r["layout"]: r.get("ratio") for r in d["auto_table"]}
        for cand, v in sorted(s["rows"].items(), key=lambda kv: kv[1]["best_over_this"]):
            simr = sim.get(cand)
            L.append(f"| {cand}{' (pick)' if cand == s['pick'] else ''} | {v['median']:.0f} [{v['min']:.0f}.."
                     f"{v['max']:.0f}] | {v['best_over_this']:.3f} | {f'{simr:.3f}' if simr else '-'} |")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short distribution only, one round of 2 steps")
    ap.add_argument("--max-files", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "layout_measured"))
    ap.add_argument("--from-json", type=pathlib.Path, default=None,
                    help="only recompute the summaries and the markdown of an earlier run's JSON (header kept)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    from _results import Run, header_of, write_results

    if args.from_json:
        res = json.loads(args.from_json.read_text())
        for d in res["distributions"].values():
            d["summary"] = summarize(d)
        write_results(args.from_json.with_suffix(""), to_markdown(res) + "\n", res, header_of(res))
        return 0
    from measured import load_corpus, model_config, profile

    run_ = Run(__file__, argv)
    schedule = {"short": dict(rounds=1, steps=2, timed_from=1)} if args.quick else dict(SCHEDULE)
    corpus = load_corpus(args.max_files)
    dists = distributions(corpus, max(s["steps"] for s in schedule.values()), args.seed, args.quick)
    for name, d in dists.items():
        d["schedule"] = schedule[name]
    config = model_config(SHAPE, LONG)
    # profiled up to 4K-token shapes (a slice with 2K of context): the attention term without a 16K probe
    cost, _ = profile(config, args.seed, PROFILE,
                      SHORT if args.quick else 8 * SHORT, lambda m: print(f"[layout_measured] {m}", flush=True))
    with tempfile.TemporaryDirectory() as tmp:
        cost_path = os.path.join(tmp, "cost.json")
        pathlib.Path(cost_path).write_text(json.dumps(cost.to_dict()))
        spec = {"config": config, "seed": args.seed, "cost_path": cost_path,
                "tmp": tmp, "distributions": dists}
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        pathlib.Path(spec_path).write_text(json.dumps(spec))
        sys.path.insert(0, str(ROOT / "tests"))
        from _helpers import free_port, worker_env

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), __file__, "--worker", spec_path, out_path]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"workers failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        report = json.loads(pathlib.Path(out_path).read_text())
        wall = time.perf_counter() - t0
    res = {"config": config, "schedule": schedule, "runs_wall_s": round(wall, 1),
           "cost_model": cost.to_dict(), "distributions": {}}
    for name, d in report["distributions"].items():
        lens = [len(r) for r in dists[name]["rows"]]
        d["describe"] = (f"{dists[name]['rows_per_step']} sequences per step ({d['per_device']} per device x 4), "
                         f"{statistics.mean(d['step_tokens']):.0f} tokens per step on average, longest {max(lens)}, "
                         f"median {statistics.median(lens):.0f}.")
        d["summary"] = summarize(d)
        res["distributions"][name] = d
    write_results(args.out, to_markdown(res) + "\n", res, run_)
    return 0


if __name__ == "__main__":
    sys.exit(main())
