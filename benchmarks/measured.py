"""Measured benchmark: real CPU runs of the adaptive planner against tuned baselines and Trainer.

    python benchmarks/measured.py            # default: about 15-25 min on 2 busy cores
    python benchmarks/measured.py --quick    # about 2-3 min: smaller model, 1K and 2K contexts
    python benchmarks/measured.py --tiny     # under a minute: the smoke test's setting

What runs (everything on CPU, one thread per process, fp32):

1. **Batches.** The Python standard library sources tokenized with the bundled tokenizer (a real
   long tail: median ~2K tokens, a few files above 100K), shuffled with ``--seed``, truncated at
   the context length ``L`` and cut into consecutive batches of at most ``--tokens-per-step``
   tokens. The *memory batch* is the first batch holding an ``L``-token sequence; it is the
   warm-up step of every run, and the batch every peak memory below is measured on. Then
   ``--steps`` timed batches. Every run sees exactly these sequences.
2. **Cost model.** :func:`concertina_hf.runtime.profiler.profile_cost_model` on this machine,
   in two processes at once with one thread each (the CPU contention of the pp=2 runs; time
   coefficients averaged), on about a stage's worth of decoder layers, the profiler's default
   shapes up to 1K tokens plus small chunks (16 to 64 tokens: they pin the per-call constant,
   which decides how finely a plan may cut), a whole ``L/2`` sequence and an ``L/4`` slice with
   ``L/2`` context (``L``: the longest context length). The P2P latency and bandwidth are timed
   between the two processes through the runtime's ``StageComm``. Planner, baselines and
   predictions all use this model; the layer split over the two stages is
   :func:`~concertina_hf.planning.partition_layers` of it.
3. **Budget.** One activation budget for every stage: the peak activation memory the cost model
   predicts for one whole ``L``-token sequence run alone (backward transients included),
   ``--budget-frac`` of the way from every layer recomputed (0) to nothing recomputed (1), on
   the stage where that is most. So the longest sequences cannot run without recompute, and
   short ones are unconstrained. Static memory (weights, gradients, AdamW state: 16 bytes per
   parameter) is added per stage and stated separately.
4. **pp=2 runs** (two processes, gloo, :mod:`_pipeline_worker`): ``adaptive``; ``packed`` and
   ``split`` with their knob (token budget / slices of the longest) tuned: every knob value is
   planned on every batch (recompute: the fewest uniform layers that fit) and scored by the
   simulator with the same cost model; the ``--tune-candidates`` best that fit every batch are
   *run for real* (``--tune measured``; ``simulated`` runs only the best) and the fastest
   measured one that fits the budget (allocated peak within 10%) is "best tuned". The adaptive
   planner gets no information the baselines do not (same cost model, same budget; the
   baselines additionally get measured tuning). Steps of all runs are interleaved round by round,
   planning is overlapped with the previous step (as ``StepStatsCallback`` does).
5. **Trainer** (:mod:`_trainer_baseline`): plain ``transformers.Trainer``, one process, one
   thread, ``DataCollatorWithFlattening``, with and without gradient checkpointing, same batches.
6. **Paper scale** (simulated): the planner benchmark's paper setting (LLaMA-13B, 4 stages of
   A800s, 512 ``github`` sequences) with the analytic cost model and with the coefficients that
   transfer from the profile (the backward/forward ratio and the measured/analytic ratio of
   every activation-memory coefficient), side by side.

Figures: tokens per second (median over the timed steps, min and max), per-stage peak
activation memory (the runtime's saved-tensor meter, and the allocation peak of the memory
batch), predicted vs measured step time, planning time and the part of it on the critical path.
Writes ``benchmarks/results/measured.{md,json,png}`` and ``gantt_measured.png`` (``--out``
changes the prefix). Cost: the default run does 20 pipeline steps (5 runs x 4 rounds) and 8
Trainer steps per context length, each a few seconds (Trainer steps 10-20 s: its flattened
8K-token row is one dense masked attention on CPU). On a shared machine the pp=2 runs of each
context first wait (up to ``--max-wait``) until a probe shows the two ranks get
``--min-capacity`` cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import pickle
import random
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

RESULTS = HERE / "results"
MIB = 2**20
GIB = 2**30

__all__ = ["PRESETS", "main", "make_batches", "run"]

# Model shapes and run sizes of each preset. `full` is sized so that a pipeline step takes a few
# seconds on one busy CPU core per stage; `tiny` only checks that everything runs.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(
        model=dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
                   intermediate_size=688),
        contexts=(2048, 4096, 8192), tokens_per_step=8192, steps=3, tune="measured", tune_candidates=2,
        profile_max_tokens=1024, profile_repeats=2, profile_layers=3, profile_procs=2, max_files=None,
        paper_settings=3,
    ),
    "quick": dict(
        model=dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=8,
                   intermediate_size=352),
        contexts=(1024, 2048), tokens_per_step=4096, steps=2, tune="simulated", tune_candidates=1,
        profile_max_tokens=512, profile_repeats=2, profile_layers=2, profile_procs=2, max_files=None,
        paper_settings=1,
    ),
    "tiny": dict(
        model=dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4,
                   intermediate_size=176),
        contexts=(256,), tokens_per_step=1024, steps=1, tune="simulated", tune_candidates=1,
        profile_max_tokens=128, profile_repeats=2, profile_layers=2, profile_procs=1, max_files=80,
        paper_settings=0,
    ),
}
TARGETS = dict(vs_baseline=1.15, vs_trainer=1.6, memory_fraction=0.60, prediction_error=0.15, planning_fraction=0.02)
# split baseline: slices of the longest sequence tried
SPLIT_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16)
FIT_TOLERANCE = 1.10  # an allocated peak up to 10% over the budget still counts as fitting


# ---------------------------------------------------------------------------------- data
def load_corpus(max_files: int | None) -> list[list[int]]:
    """Token ids of every stdlib source file (in path order), EOS appended, not truncated."""
    import datasets
    from transformers import AutoTokenizer

    from concertina_hf.tools import data

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(data.bundled_tokenizer_path())
    ds = data.tokenize_dataset(data.load_text_dataset("stdlib", max_files=max_files), tok)
    return [list(x) for x in ds["input_ids"]]


def make_batches(corpus: Sequence[Sequence[int]], max_len: int, tokens_per_step: int, num_steps: int,
                 seed: int) -> tuple[list[list[list[int]]], int, list[int]]:
    """``(batches, memory_batch, timed_batches)``: files in a seeded random order, truncated at
    ``max_len``, packed in order into batches of at most ``tokens_per_step`` tokens (a file that
    does not fit closes the batch). ``timed_batches`` are the first ``num_steps``; the memory
    batch is the first one holding a ``max_len``-token sequence (drawn further if none of those
    does; the longest batch if the corpus has none)."""
    if tokens_per_step < max_len:
        raise ValueError(f"--tokens-per-step ({tokens_per_step}) must hold at least one sequence of the context "
                         f"length ({max_len})")
    order = list(range(len(corpus)))
    random.Random(seed).shuffle(order)
    batches: list[list[list[int]]] = []
    cur: list[list[int]] = []
    n = 0
    for i in order:
        seq = list(corpus[i][:max_len])
        if len(seq) < 2:
            continue
        if cur and n + len(seq) > tokens_per_step:
            batches.append(cur)
            cur, n = [], 0
            if len(batches) >= num_steps and any(max(map(len, b)) == max_len for b in batches):
                break
        cur.append(seq)
        n += len(seq)
    else:
        if cur:
            batches.append(cur)
    if len(batches) < num_steps:
        raise ValueError(f"the corpus gives only {len(batches)} batches of {tokens_per_step} tokens; lower --steps")
    full = [i for i, b in enumerate(batches) if max(map(len, b)) == max_len]
    memory = full[0] if full else max(range(len(batches)), key=lambda i: max(map(len, batches[i])))
    timed = list(range(num_steps))
    keep = sorted(set(timed) | {memory})
    remap = {old: new for new, old in enumerate(keep)}
    return [batches[i] for i in keep], remap[memory], [remap[i] for i in timed]


# ---------------------------------------------------------------------------------- model, cost
def model_config(shape: dict[str, int], max_len: int) -> dict[str, Any]:
    # the bundled tokenizer's vocabulary; untied, since the embedding and the head sit on different stages
    return dict(model_type="llama", vocab_size=8192, tie_word_embeddings=False, attention_dropout=0.0,
                max_position_embeddings=max(4096, max_len), **shape)


# time coefficients averaged over the two concurrent profiles (memory ones are identical)
_TIME_FIELDS = ("alpha_attn", "alpha_tok", "beta", "bwd_factor", "embed_time_per_token", "head_time_per_token")


def profile(config: dict, seed: int, preset: dict, max_len: int, log) -> tuple[Any, float]:
    """The profiled cost model (see the module docstring) and the seconds it took.

    Two processes profile at once, one thread each, as the two stages will run: on a machine
    with two cores the layers then run at the speed they will have in the pp=2 runs. Their time
    coefficients are averaged."""
    import torch.multiprocessing as mp

    from _pipeline_worker import run_profile
    from concertina_hf.planning import CostModel
    from concertina_hf.runtime.profiler import default_shapes

    m = preset["profile_max_tokens"]
    shapes = list(default_shapes(m))
    # small chunks pin the per-call constant (beta), which decides how fine a plan may cut; a whole
    # sequence and a slice with context at the longest lengths pin the attention terms. The
    # whole longest sequence itself is left out: least squares on seconds would fit it alone.
    for extra in (((0, 16),), ((0, 32),), ((0, 64),), ((0, 32),) * 4, ((m, 32),),
                  ((0, max_len // 2),), ((max_len // 2, max_len // 4),)):
        if extra not in shapes:
            shapes.append(extra)
    spec = {"config": config, "seed": seed, "shapes": shapes, "repeats": preset["profile_repeats"],
            "num_layers": preset["profile_layers"], "max_tokens": m, "p2p_tokens": [16, 1024, max_len]}
    t0 = time.perf_counter()
    if preset["profile_procs"] == 1:  # in this process (the smoke test's setting: no spawn)
        from _pipeline_worker import build_model
        from concertina_hf.runtime.profiler import profile_cost_model

        cost = profile_cost_model(build_model(config, seed), shapes=shapes, repeats=spec["repeats"], warmup=1,
                                  num_layers=spec["num_layers"], max_tokens=m)
        took = time.perf_counter() - t0
        log(f"profiled the cost model in {took:.0f} s (one process)")
        return cost, took
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.pkl"), os.path.join(tmp, "cost")
        with open(spec_path, "wb") as fh:
            pickle.dump(spec, fh)
        try:
            mp.spawn(run_profile, args=(2, _free_port(), spec_path, out_path), nprocs=2, join=True)
        except Exception as e:
            errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".error")]
            raise RuntimeError(f"profiling failed: {e}\n" + "\n".join(errors)) from e
        fits = [json.load(open(f"{out_path}.rank{r}.json")) for r in range(2)]
    took = time.perf_counter() - t0
    costs = [CostModel.from_dict(f["cost"]) for f in fits]
    avg = {k: statistics.mean(getattr(c, k) for c in costs) for k in _TIME_FIELDS}
    # the P2P link: latency and bandwidth through the smallest and the largest message
    (b0, t0_), *_, (b1, t1_) = fits[0]["p2p"]
    bandwidth = (b1 - b0) / max(t1_ - t0_, 1e-9)
    avg.update(p2p_latency_s=max(0.0, t0_ - b0 / bandwidth), p2p_bandwidth=bandwidth)
    cost = dataclasses.replace(costs[0], **avg)
    log(f"profiled the cost model in {took:.0f} s (two processes at once): alpha_tok {cost.alpha_tok:.3g}, "
        f"alpha_attn {cost.alpha_attn:.3g}, beta {cost.beta:.3g}, "
        f"bwd {cost.bwd_factor:.2f}, act {cost.act_bytes_per_token:.0f} B/tok/layer, P2P "
        f"{cost.p2p_latency_s * 1e3:.2f} ms + {cost.p2p_bandwidth / 1e9:.2f} GB/s "
        f"(the two fits' alpha_tok: {costs[0].alpha_tok:.3g} / {costs[1].alpha_tok:.3g})")
    return cost, took


def whole_sequence_activation(cost, layout, length: int) -> tuple[list[float], list[float]]:
    """Predicted peak activation bytes per stage (static memory left out, backward transients
    in) of one whole ``length``-token sequence run alone as one chunk: ``(nothing recomputed,
    every layer recomputed)``."""
    from concertina_hf.planning import plan_step

    static = [cost.static_memory(layout, s) for s in range(layout.num_stages)]
    out = []
    for r in (0, max(layout.num_stage_layers(s) for s in range(layout.num_stages))):
        plan = plan_step([length], cost, layout, 0, "packed", token_budget=length, recompute_layers=r)
        out.append([pk - st for pk, st in zip(plan.predicted.peak_memory_bytes, static)])
    return out[0], out[1]


def activation_budget(cost, layout, length: int, frac: float) -> tuple[float, list[float], list[float]]:
    """``frac`` of the way from full recompute to none for one whole ``length``-token sequence,
    on the stage where that is most: ``(budget, no-recompute peaks, full-recompute peaks)``."""
    hi, lo = whole_sequence_activation(cost, layout, length)
    return max(l + frac * (h - l) for h, l in zip(hi, lo)), hi, lo


# ---------------------------------------------------------------------------------- tuning
def packed_candidates(longest: int) -> list[int]:
    """Token budgets: twice the longest, then powers of two and 1.5x between from the smallest
    covering the longest down to 1/32 of it (at least 32)."""
    x = 1
    while x < longest:
        x *= 2
    vals = {2 * x}
    floor = max(32, longest // 32)
    while x >= floor:
        vals.add(x)
        if 3 * x // 4 >= floor:
            vals.add(3 * x // 4)
        x //= 2
    return sorted(vals, reverse=True)


def tune_baseline(strategy: str, batches, cost, layout, budgets) -> list[dict[str, Any]]:
    """Every knob value of a baseline, planned on every batch and scored by the simulator:
    ``[{knob, value, predicted_s (sum over batches), fits}]``, fastest fitting first."""
    from concertina_hf.planning import PlanError, plan_step

    longest = max(len(s) for b in batches for s in b)
    if strategy == "packed":
        name, values = "token_budget", packed_candidates(longest)
    else:
        name, values = "num_slices", [n for n in SPLIT_CANDIDATES if n <= min(max(map(len, b)) for b in batches)]
    out = []
    for v in values:
        total, fits, why = 0.0, True, ""
        for b in batches:
            try:
                plan = plan_step([len(s) for s in b], cost, layout, budgets, strategy, **{name: v})
                total += plan.predicted.step_time_s
            except PlanError as e:
                fits, why = False, str(e).split(". ")[0]
                break
        out.append({"knob": name, "value": v, "predicted_s": total if fits else None, "fits": fits, "reason": why})
    out.sort(key=lambda r: (not r["fits"], r["predicted_s"] if r["fits"] else 0.0))
    return out


def check_adaptive(batches, cost, layout, budgets, args) -> None:
    """Fail early, naming the knob, when the adaptive planner finds no plan for a batch."""
    from concertina_hf.planning import PlanError, plan_step

    for i, b in enumerate(batches):
        try:
            plan_step([len(s) for s in b], cost, layout, budgets, "adaptive", solver="greedy")
        except PlanError as e:
            raise SystemExit(f"batch {i} does not fit the activation budget ({e}); raise --budget-frac "
                             f"(now {args.budget_frac})") from e


# ---------------------------------------------------------------------------------- running
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipeline(spec: dict, log, worker=None, what: str = "pp=2", world: int = 2) -> dict:
    """Spawn the ``world`` processes (default two stages) of ``worker`` (default:
    ``_pipeline_worker.run_worker``) on ``spec`` and return rank 0's records."""
    import torch.multiprocessing as mp

    from _pipeline_worker import run_worker

    worker = worker or run_worker

    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.pkl"), os.path.join(tmp, "out.json")
        with open(spec_path, "wb") as fh:
            pickle.dump(spec, fh)
        t0 = time.perf_counter()
        try:
            mp.spawn(worker, args=(world, _free_port(), spec_path, out_path), nprocs=world, join=True)
        except Exception as e:
            errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".error")]
            raise RuntimeError(f"the {what} run failed: {e}\n" + "\n".join(errors)) from e
        with open(out_path) as fh:
            out = json.load(fh)
    out["wall_s"] = time.perf_counter() - t0
    log(f"{what} runs took {out['wall_s']:.0f} s")
    return out


def _stats(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def online_refit_predictions(records: list[dict], cost, layout) -> None:
    """Add ``predicted_online_s`` to every timed record: the step's plan simulated under the cost
    model refitted from measured actions (``planning.fit.refit_cost_model``, what ``StepStatsCallback``
    does online) of the *other* timed rounds, all runs pooled (leave one round out, so no step
    predicts itself; the warm-up round is left out, its steps run under the allocation tracker)."""
    from concertina_hf.planning.fit import action_samples, refit_cost_model
    from concertina_hf.planning import Action, Plan, simulate

    plans = {id(r): Plan.from_json(r["plan"]) for r in records if r.get("plan")}
    samples: dict[int, list] = {}
    for r in records:
        if r["memory_round"] or id(r) not in plans:
            continue
        acts = [(Action.parse(a), t0, t1) for stage in r["actions"].values() for a, t0, t1 in stage]
        samples.setdefault(r["round"], []).extend(action_samples(plans[id(r)], acts))
    fitted = {}
    for rnd in samples:
        pool = [x for k, v in samples.items() if k != rnd for x in v]
        fitted[rnd] = refit_cost_model(cost, layout, pool) if pool else None
    for r in records:
        model = fitted.get(r["round"]) if not r["memory_round"] else None
        r["predicted_online_s"] = simulate(plans[id(r)], model).step_time_s if model and id(r) in plans else None


BREAKDOWN = ("plan_wait", "compute", "comm_wait", "other", "optimizer")


def memory_peak_pairs(run: dict) -> list[tuple[int, float, float]]:
    """``(stage, allocated, predicted)`` activation peaks of a run's memory batch: the
    allocation tracker's peak of the warm-up step against that step's own plan's prediction.
    (The maximum prediction over every step's plan belongs to other batches: at 4K and 8K it
    read up to 25% over the memory batch's allocation while that batch's own plan was within
    -2.8% to +0.7% of it.)"""
    got = run.get("memory_batch_alloc_peak_bytes") or ()
    return [(s, g, p) for s, (g, p) in enumerate(zip(got, run["memory_batch_predicted_activation_peak_bytes"]))]


def summarize_job(records: list[dict], act_budget: float, static: Sequence[float]) -> dict[str, Any]:
    """Figures of one pp=2 run from its step records (timed steps; the meter from the metered
    memory round, predictions from every step)."""
    timed = sorted((r for r in records if not r["memory_round"]), key=lambda r: r["round"])
    mem = next(r for r in records if r["memory_round"])
    tps = [r["tokens"] / r["step_s"] for r in timed]
    err = [(r["predicted_step_s"] - r["run_s"]) / r["run_s"] for r in timed]
    online = [(r["predicted_online_s"] - r["run_s"]) / r["run_s"] for r in timed if r.get("predicted_online_s")]
    # metered steps only (the memory round; timed rounds run unmetered, as the trainer's unlogged steps)
    meter = [max((r["meter_peak_bytes"][s] for r in records if r["meter_peak_bytes"][s] is not None), default=0)
             for s in range(len(static))]
    predicted_act = [max(r["predicted_peak_bytes"][s] for r in records) - static[s] for s in range(len(static))]
    # what the memory batch's own plan predicted: the allocation tracker runs on that step only
    mem_pred = [mem["predicted_peak_bytes"][s] - static[s] for s in range(len(static))]
    return {
        "tokens_per_s": _stats(tps),
        "tokens_per_s_by_step": tps,  # timed steps in batch order (the same batches for every run)
        "tokens_per_s_total": sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed),
        "step_s": _stats([r["step_s"] for r in timed]),
        "pipeline_s": _stats([r["run_s"] for r in timed]),
        "optimizer_s": _stats([r["opt_s"] for r in timed]),
        "predicted_step_s": _stats([r["predicted_step_s"] for r in timed]),
        "prediction_error": _stats(err),
        "prediction_abs_error_median": statistics.median(abs(e) for e in err),
        "online_prediction_error": _stats(online) if online else None,
        "online_prediction_abs_error_median": statistics.median(abs(e) for e in online) if online else None,
        "plan_time_s": _stats([r["plan_time_s"] for r in timed]),
        "plan_wait_s": _stats([r["plan_wait_s"] for r in timed]),
        "plan_wait_fraction": _stats([r["plan_wait_s"] / r["step_s"] for r in timed]),
        "meter_peak_bytes": meter,
        "memory_batch_meter_peak_bytes": mem["meter_peak_bytes"],
        "memory_batch_alloc_peak_bytes": mem["alloc_peak_bytes"],
        "memory_batch_alloc_peak_with_params_bytes": mem.get("alloc_peak_with_params_bytes"),
        "predicted_activation_peak_bytes": predicted_act,  # max over every step's plan
        "memory_batch_predicted_activation_peak_bytes": mem_pred,
        "fits_measured": all(m <= act_budget * FIT_TOLERANCE for m in mem["alloc_peak_bytes"]),
        "knobs": [r["knobs"] for r in timed],
        "chunks": [r["chunks"] for r in timed],
        "recompute_layers": [r["recompute_layers"] for r in timed],
        "predicted_recompute_fraction": _stats([r["predicted_recompute_fraction"] for r in timed]),
        "losses": [r["loss"] for r in records],
        # per stage, medians over the timed steps: where the step went (plan wait, compute, comm
        # waits, other Python in run_step, optimizer and the rest), and the stage's step time
        "stage_breakdown": [
            {**{k: statistics.median(r["stage_breakdown"][s][k] for r in timed) for k in BREAKDOWN},
             "step": statistics.median(r["stage_step_s"][s] for r in timed)}
            for s in range(len(static))] if timed and "stage_breakdown" in timed[0] else None,
    }


def run_context(max_len: int, corpus, config: dict, cost, layout, preset: dict, args, log) -> dict[str, Any]:
    """Everything measured at one context length."""
    from concertina_hf.planning import simulate

    batches, memory_batch, timed = make_batches(corpus, max_len, args.tokens_per_step, args.steps, args.seed)
    p = layout.num_stages
    static = [cost.static_memory(layout, s) for s in range(p)]
    act_budget, whole, whole_rc = activation_budget(cost, layout, max_len, args.budget_frac)
    budgets = [int(static[s] + act_budget) for s in range(p)]
    check_adaptive(batches, cost, layout, budgets, args)
    tune_on = [batches[i] for i in sorted(set(timed) | {memory_batch})]
    jobs: list[dict[str, Any]] = [{"name": "adaptive", "strategy": "adaptive", "knobs": {}}]
    tuning = {}
    for strategy in ("packed", "split"):
        ranked = tune_baseline(strategy, tune_on, cost, layout, budgets)
        tuning[strategy] = ranked
        k = args.tune_candidates if args.tune == "measured" else 1
        chosen = [r for r in ranked if r["fits"]][:k]
        if not chosen:
            log(f"L={max_len}: no {strategy} setting fits the budget; it is left out")
        for r in chosen:
            jobs.append({"name": f"{strategy}[{r['knob']}={r['value']}]", "strategy": strategy,
                         "knobs": {r["knob"]: r["value"]}})
    log(f"L={max_len}: {len(batches)} batches, memory batch {memory_batch} "
        f"(longest {max(map(len, batches[memory_batch]))}), activation budget {act_budget / MIB:.0f} MiB per stage, "
        f"jobs {[j['name'] for j in jobs]}")
    from _pipeline_worker import trainer_optimizer_spec

    spec = {"config": config, "seed": args.seed, "cost": cost.to_dict(), "optimizer": trainer_optimizer_spec(),
            "layer_ranges": [list(r) for r in layout.layer_ranges], "budgets": budgets, "batches": batches,
            "memory_batch": memory_batch, "timed_batches": timed, "jobs": jobs, "solver": args.solver,
            "time_limit_s": args.time_limit, "min_capacity": args.min_capacity, "max_wait_s": args.max_wait}
    load0 = os.getloadavg()
    out = run_pipeline(spec, log)
    online_refit_predictions(out["records"], cost, layout)
    runs = {}
    for job in jobs:
        recs = [r for r in out["records"] if r["job"] == job["name"]]
        runs[job["name"]] = {"strategy": job["strategy"], "knobs": job["knobs"],
                             **summarize_job(recs, act_budget, static)}
    best = {}
    for strategy in ("packed", "split"):
        names = [n for n, r in runs.items() if r["strategy"] == strategy]
        fitting = [n for n in names if runs[n]["fits_measured"]] or names
        if fitting:
            best[strategy] = max(fitting, key=lambda n: runs[n]["tokens_per_s"]["median"])
    # the Gantt chart: adaptive on the memory batch if it is timed, else its first timed step
    ad = [r for r in out["records"] if r["job"] == "adaptive" and not r["memory_round"]]
    pick = next((r for r in ad if r["batch"] == memory_batch), ad[0])
    gantt = {"plan": pick["plan"], "actions": pick["actions"], "round": pick["round"], "batch": pick["batch"],
             "measured_s": pick["run_s"], "predicted_s": pick["predicted_step_s"]}
    trainer = {}
    load1 = os.getloadavg()
    if not args.no_trainer:
        from _trainer_baseline import run_trainer

        for gc in (False, True):
            name = "trainer+ckpt" if gc else "trainer"
            t0 = time.perf_counter()
            res = run_trainer(config, args.seed, batches, memory_batch, timed, gc)
            res["tokens_per_s_stats"] = _stats(res["tokens_per_s"])
            res["step_s_stats"] = _stats(res["step_s"])
            trainer[name] = res
            log(f"L={max_len}: {name}: {res['tokens_per_s_stats']['median']:.0f} tok/s, "
                f"peak activations {res['meter_peak_bytes'] / MIB:.0f} MiB (meter) {res['alloc_peak_bytes'] / MIB:.0f} "
                f"MiB (allocated), {time.perf_counter() - t0:.0f} s")
    # losses of the first (warm-up) step are on the initial weights and the same batch everywhere
    loss_check = None
    if trainer:
        first_pp = out["records"][0]["loss"]
        loss_check = {"pipeline": first_pp, "trainer": trainer["trainer"]["losses"][0],
                      "rel_diff": abs(first_pp - trainer["trainer"]["losses"][0]) / abs(trainer["trainer"]["losses"][0])}
    sim = None
    if gantt["plan"]:
        from concertina_hf.planning import Plan

        sim = simulate(Plan.from_json(gantt["plan"]), cost)
    return {
        "max_len": max_len,
        "tokens_per_step": args.tokens_per_step,
        "batches": [{"num_seqs": len(b), "tokens": sum(map(len, b)), "longest": max(map(len, b)),
                     "lengths": sorted((len(s) for s in b), reverse=True)} for b in batches],
        "memory_batch": memory_batch,
        "timed_batches": timed,
        "static_bytes": static,
        "whole_sequence_activation_bytes": whole,
        "whole_sequence_recomputed_activation_bytes": whole_rc,
        "activation_budget_bytes": act_budget,
        "budget_frac": args.budget_frac,
        "budgets_bytes": budgets,
        "tuning": tuning,
        "runs": runs,
        "best": best,
        "trainer": trainer,
        "loss_check": loss_check,
        "gantt": gantt,
        "gantt_sim_step_s": sim.step_time_s if sim else None,
        "loadavg": {"before_pp": load0, "after_pp": out.get("loadavg_end"), "before_trainer": load1,
                    "after_trainer": os.getloadavg()},
        "pp_wall_s": out["wall_s"],
        "parallel_capacity": out.get("capacity"),
        "capacity_wait_s": out.get("waited_s"),
    }


# ---------------------------------------------------------------------------------- ratios and targets
def ratios(ctx: dict) -> dict[str, Any]:
    runs, best, tr = ctx["runs"], ctx["best"], ctx["trainer"]
    ad = runs["adaptive"]
    out: dict[str, Any] = {}
    med = lambda r: r["tokens_per_s"]["median"]  # noqa: E731
    def paired(a: Sequence[float], b: Sequence[float]) -> float:
        # step by step on the same batch, steps of both runs close in time: less exposed to load drift
        return statistics.median(x / y for x, y in zip(a, b))

    for strategy in ("packed", "split"):
        if strategy in best:
            other = runs[best[strategy]]
            out[f"adaptive_over_{strategy}"] = med(ad) / med(other)
            out[f"adaptive_over_{strategy}_paired"] = paired(ad["tokens_per_s_by_step"], other["tokens_per_s_by_step"])
    if "trainer" in tr:
        out["adaptive_over_trainer"] = med(ad) / tr["trainer"]["tokens_per_s_stats"]["median"]
        out["adaptive_over_trainer_paired"] = paired(ad["tokens_per_s_by_step"], tr["trainer"]["tokens_per_s"])
        base_meter, base_alloc = tr["trainer"]["meter_peak_bytes"], tr["trainer"]["alloc_peak_bytes"]
        out["stage_memory_over_trainer_meter"] = [m / base_meter for m in ad["memory_batch_meter_peak_bytes"]]
        out["stage_memory_over_trainer_alloc"] = [m / base_alloc for m in ad["memory_batch_alloc_peak_bytes"]]
    if "trainer+ckpt" in tr:
        out["adaptive_over_trainer_ckpt"] = med(ad) / tr["trainer+ckpt"]["tokens_per_s_stats"]["median"]
    out["adaptive_prediction_abs_error"] = ad["prediction_abs_error_median"]
    out["adaptive_online_prediction_abs_error"] = ad["online_prediction_abs_error_median"]
    out["adaptive_plan_wait_fraction"] = ad["plan_wait_fraction"]["median"]
    out["adaptive_plan_wait_fraction_max"] = ad["plan_wait_fraction"]["max"]
    return out


def targets(contexts: list[dict]) -> list[dict[str, Any]]:
    rows = []

    def add(name, ctx, value, goal, ok, fmt):
        rows.append({"target": name, "context": ctx["max_len"], "value": value, "goal": goal, "met": bool(ok),
                     "text": fmt, "cores": ctx.get("parallel_capacity")})

    for c in contexts:
        r = c["ratios"]
        for s in ("packed", "split"):
            v = r.get(f"adaptive_over_{s}")
            if v is not None:
                add(f"adaptive / best {s} tokens/s", c, v, f">= {TARGETS['vs_baseline']}", v >= TARGETS["vs_baseline"],
                    f"{v:.3f}x (paired {r[f'adaptive_over_{s}_paired']:.3f}x)")
        v = r.get("adaptive_over_trainer")
        if v is not None:
            add("adaptive pp=2 / Trainer tokens/s", c, v, f">= {TARGETS['vs_trainer']}", v >= TARGETS["vs_trainer"],
                f"{v:.3f}x (paired {r['adaptive_over_trainer_paired']:.3f}x)")
            for kind in ("meter", "alloc"):
                m = max(r[f"stage_memory_over_trainer_{kind}"])
                add(f"max stage peak activation / Trainer ({'saved tensors' if kind == 'meter' else 'allocated'})",
                    c, m, f"<= {TARGETS['memory_fraction']:.0%}", m <= TARGETS["memory_fraction"], f"{m:.1%}")
        v = r["adaptive_prediction_abs_error"]
        add("adaptive abs(predicted - measured) / measured step (median)", c, v, f"<= {TARGETS['prediction_error']:.0%}",
            v <= TARGETS["prediction_error"], f"{v:.1%}")
        v = r.get("adaptive_online_prediction_abs_error")
        if v is not None:
            add("same, cost model refitted online from the other timed steps", c, v,
                f"<= {TARGETS['prediction_error']:.0%}", v <= TARGETS["prediction_error"], f"{v:.1%}")
        # every run's allocated activation peak (memory batch) within the budget and
        # within 5% of its plan's prediction, on every stage
        mem = [(name, s, got, pred) for name, run in c["runs"].items() for s, got, pred in memory_peak_pairs(run)]
        if mem:
            worst = max(got / c["activation_budget_bytes"] for _, _, got, _ in mem)
            add("max allocated activation peak / budget (every run and stage)", c, worst, "<= 100%", worst <= 1.0,
                f"{worst:.1%}")
            errs = [got / pred - 1 for *_, got, pred in mem if pred > 0]
            lo, hi = min(errs), max(errs)
            v = max(abs(lo), abs(hi))
            add("allocated activation peak vs predicted (every run and stage)", c, v, "within 5%", v <= 0.05,
                f"{lo:+.1%} to {hi:+.1%}")
        v, vmax = r["adaptive_plan_wait_fraction"], r["adaptive_plan_wait_fraction_max"]
        add("planning on the critical path / step time (median over steps)", c, v,
            f"< {TARGETS['planning_fraction']:.0%}", v < TARGETS["planning_fraction"], f"{v:.2%} (max {vmax:.2%})")
    return rows


# ---------------------------------------------------------------------------------- paper scale
def transferred_cost(analytic_big, profiled, analytic_small):
    """The paper-scale cost model with what transfers from the profile: the backward/forward
    ratio and the measured/analytic ratio of each activation-memory coefficient. Times stay
    analytic (A800 rates cannot be measured here); CPU-SDPA terms (dense mask) do not apply to
    flash-attn and stay 0."""
    def ratio(field):
        a = getattr(analytic_small, field)
        return getattr(profiled, field) / a if a else 1.0

    return dataclasses.replace(
        analytic_big,
        bwd_factor=profiled.bwd_factor,
        act_bytes_per_token=analytic_big.act_bytes_per_token * ratio("act_bytes_per_token"),
        ckpt_bytes_per_token=analytic_big.ckpt_bytes_per_token * ratio("ckpt_bytes_per_token"),
        kv_bytes_per_token=analytic_big.kv_bytes_per_token * ratio("kv_bytes_per_token"),
        logits_bytes_per_token=analytic_big.logits_bytes_per_token * ratio("logits_bytes_per_token"),
        output_bytes_per_token=analytic_big.hidden_bytes_per_token,
        source="analytic times, profiled ratios",
    )


def paper_scale(cost, config: dict, num_settings: int, seed: int, log) -> list[dict[str, Any]]:
    import plan_benchmark as pb

    from concertina_hf.tools import data
    from concertina_hf.planning.presets import MODEL_PRESETS
    from concertina_hf.planning import CostModel, DeviceSpec

    small = CostModel.from_hf_config(config, DeviceSpec.cpu(), dtype_bytes=4)
    out = []
    for gpus, ctx in ((8, 65536), (8, 131072), (4, 131072))[:num_settings]:
        dev = pb.stage_of_a800s(gpus)
        analytic = CostModel.from_hf_config(MODEL_PRESETS["llama-13b"], dev)
        lens = data.sample_lengths("github", 512, ctx, seed)
        name = f"LLaMA-13B, 4x{gpus} A800, github, 512 seqs, max {ctx // 1024}K"
        for label, c in (("analytic", analytic), ("profiled ratios", transferred_cost(analytic, cost, small))):
            r = pb.run_setting(name, lens, c, 4, int(dev.memory_bytes), 1.0, 1)
            r["cost_model"] = label
            r["seed"] = seed
            out.append(r)
            log(f"paper scale, {name}, {label}: adaptive/packed {r['adaptive_over_packed']}, "
                f"adaptive/split {r['adaptive_over_split']}")
    return out


# ---------------------------------------------------------------------------------- output
def _mib(b) -> str:
    return "n/a" if b is None else f"{b / MIB:.0f}"


def to_markdown(res: dict[str, Any]) -> str:
    cm = res["cost_model"]
    L = [
        "# Measured benchmark: adaptive vs tuned baselines vs Trainer (CPU, pp=2)",
        "",
        f"Load average (1 min) during the runs: {res['load_range'][0]:.1f} to {res['load_range'][1]:.1f} on "
        f"{os.cpu_count()} cores (other jobs may share the machine: steps of all pp=2 runs are interleaved so that "
        "load changes hit every strategy alike, and each context section gives the cores the two ranks really "
        "had; Trainer runs follow the pp=2 runs of the same context).",
        "",
        f"Model: Llama, hidden {res['config']['hidden_size']}, {res['config']['num_hidden_layers']} layers, "
        f"{res['config']['num_attention_heads']} heads ({res['config']['num_key_value_heads']} K/V), MLP "
        f"{res['config']['intermediate_size']}, vocab 8192 (bundled tokenizer), {res['num_params'] / 1e6:.1f}M "
        "parameters, fp32, one thread per process. pp=2: two processes (gloo); Trainer: one process.",
        f"Cost model profiled on this machine in {res['profile_s']:.0f} s ("
        f"{'two processes at once, one thread each, like the pp=2 runs' if res['profile_procs'] == 2 else 'one process'}; "
        f"{cm['source']}): alpha_tok "
        f"{cm['alpha_tok']:.3g} s/token/layer, alpha_attn {cm['alpha_attn']:.3g}, beta {cm['beta']:.3g} s, backward/forward {cm['bwd_factor']:.2f}, head "
        f"{cm['head_time_per_token']:.3g} s/token; activations {cm['act_bytes_per_token']:.0f} B/token/layer, "
        f"logits {cm['logits_bytes_per_token']:.0f} B/token. Stages: "
        + ", ".join(f"{s}: layers {a}-{b - 1}" + (" + embedding" if s == 0 else "") +
                    (" + head" if s == len(res['layer_ranges']) - 1 else "")
                    for s, (a, b) in enumerate(res["layer_ranges"])) + ".",
        f"Static memory (weights, gradients, AdamW state; 16 B/parameter) per stage: "
        f"{' / '.join(_mib(b) for b in res['contexts'][0]['static_bytes'])} MiB; single process: "
        f"{_mib(res['num_params'] * 16)} MiB. Budgets below are on activation memory, on top of that.",
        f"Baseline tuning: {res['settings']['tune']} ("
        + (f"the best {res['settings']['tune_candidates']} settings by simulation run for real, the fastest measured "
           "one that fits kept" if res['settings']['tune'] == 'measured' else "the best setting by simulation") + ").",
        "",
        "## Targets",
        "",
        "`cores`: what the two pipeline ranks really got during that context's pp=2 runs (probe before / after; "
        "2.0 on an idle machine). Near 1, the ranks share one core: pipeline bubbles are then free and finer "
        "pipelines only add overhead, so the pp=2 comparisons of that context say little about the method.",
        "",
        "| target | context | cores | measured | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    for t in res["targets"]:
        cores = "/".join(f"{x:.2f}" for x in t.get("cores") or []) or "n/a"
        L.append(f"| {t['target']} | {t['context']} | {cores} | {t['text']} | {t['goal']} | "
                 f"{'yes' if t['met'] else '**no**'} |")
    L += ["", "## Scaling with context (tokens/s, median over timed steps)", ""]
    names = ["adaptive", "best packed", "best split", "trainer", "trainer+ckpt"]
    L.append("| context | " + " | ".join(names) + " | peak activation MiB (adaptive stages / Trainer) |")
    L.append("|---|" + "---|" * len(names) + "---|")
    for c in res["contexts"]:
        cells = []
        for n in names:
            r = _lookup(c, n)
            cells.append("n/a" if r is None else f"{r['median']:.0f}")
        ad = c["runs"]["adaptive"]
        tr = c["trainer"].get("trainer")
        mem = "/".join(_mib(b) for b in ad["memory_batch_meter_peak_bytes"]) + \
            (f" / {_mib(tr['meter_peak_bytes'])}" if tr else "")
        L.append(f"| {c['max_len']} | " + " | ".join(cells) + f" | {mem} |")
    for c in res["contexts"]:
        L += _context_markdown(c)
    if res.get("paper_scale"):
        L += ["", "## Paper scale (simulated, not measured)", "",
              "The planner benchmark's paper setting, planned and simulated with the analytic cost model and with "
              "the coefficients that transfer from this machine's profile (backward/forward ratio, measured/analytic "
              "ratio of each activation-memory coefficient; times stay analytic at A800 rates, no dense-mask terms). "
              "Speedups are step-time ratios baseline / adaptive (above 1: adaptive faster), comparable with the "
              "tokens/s ratios above.", "",
              "| setting | cost model | speedup over packed | speedup over split | ideal / adaptive | adaptive plan ms |",
              "|---|---|---|---|---|---|"]
        for r in res["paper_scale"]:
            f = lambda x: "does not fit" if not x else f"{1 / x:.3f}"  # noqa: E731
            pt = r.get("plan_time_ilp_s")
            L.append(f"| {r['setting']} | {r['cost_model']} | {f(r['adaptive_over_packed'])} | "
                     f"{f(r['adaptive_over_split'])} | {f(r['adaptive_over_ideal'])} | "
                     f"{'n/a' if pt is None else f'{pt * 1e3:.0f}'} |")
    L += ["", "## How to read this", "",
          "- tokens/s: tokens of the step's batch over the step's wall time (slowest rank: plan wait, pipeline, "
          "optimizer; Trainer: between consecutive `on_step_end`), median over the timed steps [min..max]. Target "
          "ratios are ratios of these medians; *paired*: the median over batches of the per-batch ratio (both runs' "
          "steps on the same batch, close in time), less exposed to load changes.",
          "- predicted: the simulator's step time for the plan under the profiled cost model, against the measured "
          "pipeline time (`run_step`, slowest rank; the optimizer step is not in the plan). *Refitted online*: the "
          "same plans simulated under the cost model `StepStatsCallback` would refit from measured actions "
          "(`planning.fit.refit_cost_model`), fitted on the other timed rounds of all runs (leave one round out).",
          "- peak activation, saved tensors: the runtime's `SavedTensorMeter` (what autograd saves plus what the "
          "runtime holds: stage inputs/outputs, K/V of earlier slices); the Trainer is measured by the same meter "
          "around its `training_step`. With HF gradient checkpointing the meter does not see what checkpointing "
          "keeps itself, so the allocated column is the fair one there.",
          "- allocated: every tensor created during the step's forward and backward (parameters, their views and "
          "gradients excluded), "
          "peak of the live bytes, on the memory batch (see `runtime.memory.AllocationTracker`).",
          "- plan wait: time the step waited for its plan (background planning on pipeline rank 0, plus the plan's "
          "broadcast); plan time: how long planning took in the background.", ""]
    return "\n".join(L)


def _lookup(c: dict, name: str):
    if name == "adaptive":
        return c["runs"]["adaptive"]["tokens_per_s"]
    if name.startswith("best "):
        s = name.split()[1]
        return c["runs"][c["best"][s]]["tokens_per_s"] if s in c["best"] else None
    tr = c["trainer"].get(name)
    return tr["tokens_per_s_stats"] if tr else None


def _context_markdown(c: dict) -> list[str]:
    b = c["batches"]
    L = ["", f"## Context {c['max_len']} tokens", "",
         f"Batches of at most {c['tokens_per_step']} tokens: "
         + "; ".join(f"#{i}: {x['num_seqs']} seqs, {x['tokens']} tok, longest {x['longest']}" for i, x in enumerate(b))
         + f". Memory (warm-up) batch: #{c['memory_batch']}; timed: {c['timed_batches']}. "
         f"Activation budget per stage: {_mib(c['activation_budget_bytes'])} MiB "
         f"(one whole {c['max_len']}-token sequence alone peaks at "
         f"{' / '.join(_mib(x) for x in c['whole_sequence_activation_bytes'])} MiB on stages 0 / 1 with nothing "
         f"recomputed, {' / '.join(_mib(x) for x in c['whole_sequence_recomputed_activation_bytes'])} MiB with every layer "
         f"recomputed; the budget is {c['budget_frac']:.2f} of the way between them). Cores the two ranks really "
         f"had (a fixed matmul load alone vs both at once; 2.0 on an idle machine): "
         f"{' then '.join(f'{x:.2f}' for x in c['parallel_capacity'] or [])} (before / after the pp=2 runs).", "",
         "| run | tokens/s median [min..max] | step s | pipeline s | predicted s (error; refitted online) | peak act. "
         "MiB per stage (memory batch), saved / allocated | predicted act. MiB (memory batch's plan; max over every step's plan) | recompute | plan ms (wait ms) | fits |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in c["runs"].items():
        t = r["tokens_per_s"]
        best = " (best)" if name in c["best"].values() else ""
        L.append(
            f"| {name}{best} | {t['median']:.0f} [{t['min']:.0f}..{t['max']:.0f}] | {r['step_s']['median']:.2f} | "
            f"{r['pipeline_s']['median']:.2f} | {r['predicted_step_s']['median']:.2f} "
            f"({r['prediction_error']['median']:+.0%}; "
            f"{'n/a' if not r.get('online_prediction_error') else format(r['online_prediction_error']['median'], '+.0%')}) | "
            f"{'/'.join(_mib(x) for x in r['memory_batch_meter_peak_bytes'])} / "
            f"{'/'.join(_mib(x) for x in r['memory_batch_alloc_peak_bytes'])} | "
            f"{'/'.join(_mib(x) for x in r['memory_batch_predicted_activation_peak_bytes'])} "
            f"({'/'.join(_mib(x) for x in r['predicted_activation_peak_bytes'])}) | "
            f"{r['predicted_recompute_fraction']['median']:.0%} | "
            f"{r['plan_time_s']['median'] * 1e3:.0f} ({r['plan_wait_s']['median'] * 1e3:.1f}) | "
            f"{'yes' if r['fits_measured'] else 'no'} |")
    for name, r in c["trainer"].items():
        t = r["tokens_per_s_stats"]
        L.append(f"| {name} (1 process) | {t['median']:.0f} [{t['min']:.0f}..{t['max']:.0f}] | "
                 f"{r['step_s_stats']['median']:.2f} | | | {_mib(r['meter_peak_bytes'])} / {_mib(r['alloc_peak_bytes'])} "
                 "| | | | |")
    rows = [(name, s, b) for name, r in c["runs"].items() for s, b in enumerate(r.get("stage_breakdown") or [])]
    if rows:
        L += ["", "Where each stage's step went (median seconds over the timed steps; compute: the actions' spans, "
              "comm wait: inside P2P exchanges and the loss broadcast, other: Python and allocation between actions "
              "in `run_step`, optimizer: AdamW step and the rest after `run_step`; the planner runs on a thread of "
              "stage 0's process, so its CPU time shows in that stage's parts):", "",
              "| run | stage | step s | plan wait | compute | comm wait | other | optimizer |", "|---|---|---|---|---|---|---|---|"]
        L += [f"| {name} | {s} | {b['step']:.3f} | " + " | ".join(f"{b[k]:.3f} ({b[k] / b['step']:.0%})" for k in BREAKDOWN)
              + " |" for name, s, b in rows]
    if c.get("loss_check"):
        lc = c["loss_check"]
        L += ["", f"Loss of the warm-up step (initial weights, memory batch): pipeline {lc['pipeline']:.6f}, Trainer "
              f"{lc['trainer']:.6f} (relative difference {lc['rel_diff']:.1e})."]
    for strategy, ranked in c["tuning"].items():
        cells = [f"{r['value']}: {r['predicted_s']:.2f}s" if r["fits"] else f"{r['value']}: does not fit"
                 for r in ranked]
        L += ["", f"{strategy} tuning ({ranked[0]['knob'] if ranked else ''}, simulated total over the batches): "
              + ", ".join(cells) + "."]
    return L


def plot(res: dict[str, Any], path: pathlib.Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ctxs = res["contexts"]
    names = ["adaptive", "best packed", "best split", "trainer", "trainer+ckpt"]
    colors = ["#55A868", "#4C72B0", "#DD8452", "#8172B2", "#937860"]
    fig = Figure(figsize=(14, 4.6), dpi=120)
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    width = 0.8 / len(names)
    for k, (n, col) in enumerate(zip(names, colors)):
        xs, ys, lo, hi = [], [], [], []
        for i, c in enumerate(ctxs):
            r = _lookup(c, n)
            if r is None:
                continue
            xs.append(i + (k - (len(names) - 1) / 2) * width)
            ys.append(r["median"])
            lo.append(r["median"] - r["min"])
            hi.append(r["max"] - r["median"])
        ax1.bar(xs, ys, width, color=col, label=n, yerr=[lo, hi], capsize=2)
    ax1.set_xticks(range(len(ctxs)))
    ax1.set_xticklabels([f"{c['max_len']}" for c in ctxs])
    ax1.set_xlabel("context length (tokens)")
    ax1.set_ylabel("tokens / s (median, min-max)")
    ax1.set_title("throughput", fontsize=10)
    ax1.set_ylim(0, ax1.get_ylim()[1] * 1.3)
    ax1.legend(fontsize=7, loc="upper left", ncol=2)
    # peak activation memory: max over stages for pp=2, whole model for the Trainer
    for k, (n, col) in enumerate(zip(names, colors)):
        xs, ys = [], []
        for i, c in enumerate(ctxs):
            if n.startswith("trainer"):
                tr = c["trainer"].get(n)
                v = tr["alloc_peak_bytes"] if tr else None
            else:
                key = "adaptive" if n == "adaptive" else c["best"].get(n.split()[1])
                v = max(c["runs"][key]["memory_batch_alloc_peak_bytes"]) if key else None
            if v is not None:
                xs.append(i + (k - (len(names) - 1) / 2) * width)
                ys.append(v / MIB)
        ax2.bar(xs, ys, width, color=col, label=n)
    for i, c in enumerate(ctxs):
        ax2.hlines(c["activation_budget_bytes"] / MIB, i - 0.45, i + 0.45, colors="black", linestyles="--",
                   linewidth=1, label="activation budget per stage" if i == 0 else None)
    ax2.set_xticks(range(len(ctxs)))
    ax2.set_xticklabels([f"{c['max_len']}" for c in ctxs])
    ax2.set_xlabel("context length (tokens)")
    ax2.set_ylabel("MiB (allocated, memory batch)")
    ax2.set_title("peak activation memory (pp=2: worst stage)", fontsize=10)
    ax2.set_ylim(0, ax2.get_ylim()[1] * 1.45)  # room for the legend above the bars
    ax2.legend(fontsize=7, loc="upper left", ncol=2)
    allv = []
    for c in ctxs:
        for n, r in c["runs"].items():
            col = colors[0] if r["strategy"] == "adaptive" else colors[1] if r["strategy"] == "packed" else colors[2]
            ax3.scatter([r["pipeline_s"]["median"]], [r["predicted_step_s"]["median"]], color=col, s=18)
            allv += [r["pipeline_s"]["median"], r["predicted_step_s"]["median"]]
    if allv:
        hi = max(allv) * 1.1
        ax3.plot([0, hi], [0, hi], color="grey", linewidth=0.8)
        ax3.plot([0, hi], [0, hi * 1.15], color="grey", linewidth=0.6, linestyle=":")
        ax3.plot([0, hi], [0, hi * 0.85], color="grey", linewidth=0.6, linestyle=":")
        ax3.set_xlim(0, hi)
        ax3.set_ylim(0, hi)
    for n, col in zip(("adaptive", "packed", "split"), colors[:3]):
        ax3.scatter([], [], color=col, s=18, label=n)
    ax3.legend(fontsize=7, loc="upper left")
    ax3.set_xlabel("measured pipeline step (s, median)")
    ax3.set_ylabel("predicted (s, median)")
    ax3.set_title("predicted vs measured (dotted: +-15%)", fontsize=10)
    fig.suptitle(f"Measured on CPU, pp=2 vs Trainer: {res['command']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def plot_gantt_measured(res: dict[str, Any], cost, path: pathlib.Path) -> None:
    from concertina_hf.planning import Plan, simulate
    from concertina_hf.planning.viz import plot_gantt

    c = res["contexts"][-1]
    g = c["gantt"]
    plan = Plan.from_json(g["plan"])
    sim = simulate(plan, cost)
    measured = {int(s): acts for s, acts in g["actions"].items()}
    plot_gantt(plan, sim, path, measured=measured, cost=cost,
               title=f"adaptive, context {c['max_len']}, batch #{g['batch']} ({sum(plan.seq_lens)} tokens, "
                     f"{len(plan.seq_lens)} sequences): planned (top) and measured (middle)")


# ---------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="short run (2-3 min): smaller model, 1K and 2K contexts")
    size.add_argument("--tiny", action="store_true", help="smoke-test run (under a minute)")
    ap.add_argument("--contexts", type=str, default=None, help="context lengths, comma separated (e.g. 2048,4096,8192)")
    ap.add_argument("--tokens-per-step", type=int, default=None, help="most tokens in one step's batch")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (after the warm-up step)")
    ap.add_argument("--budget-frac", type=float, default=0.5,
                    help="activation budget per stage: this fraction of the way from full recompute (0) to none (1) "
                         "for one whole longest sequence")
    ap.add_argument("--tune", choices=("measured", "simulated"), default=None, help="how the baselines' knob is tuned")
    ap.add_argument("--tune-candidates", type=int, default=None, help="baseline settings run for real (--tune measured)")
    ap.add_argument("--solver", choices=("ilp", "greedy"), default="ilp", help="adaptive recompute solver")
    ap.add_argument("--time-limit", type=float, default=1.0, help="ILP time limit, seconds")
    ap.add_argument("--min-capacity", type=float, default=None,
                    help="before each context's pp=2 runs, wait until the two ranks get this many cores (probe; 2.0 "
                         "idle); default 1.7 for the full run, 0 for --quick/--tiny")
    ap.add_argument("--max-wait", type=float, default=None, help="the longest wait for --min-capacity, seconds "
                    "(default 600 for the full run, 0 otherwise); then the runs go ahead, the probe is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-trainer", action="store_true", help="skip the single-process Trainer runs")
    ap.add_argument("--no-paper", action="store_true", help="skip the simulated paper-scale setting")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="output prefix (default benchmarks/results/measured, measured_quick, measured_tiny)")
    args = ap.parse_args(argv)
    args.preset = "quick" if args.quick else "tiny" if args.tiny else "full"
    pre = PRESETS[args.preset]
    args.contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else list(pre["contexts"])
    if args.min_capacity is None:
        args.min_capacity = 1.7 if args.preset == "full" else 0.0
    if args.max_wait is None:
        args.max_wait = 600.0 if args.preset == "full" else 0.0
    for k in ("tokens_per_step", "steps", "tune", "tune_candidates"):
        if getattr(args, k) is None:
            setattr(args, k, pre[k])
    if args.out is None:
        args.out = RESULTS / ("measured" if args.preset == "full" else f"measured_{args.preset}")
    if args.steps < 1 or args.tune_candidates < 1:
        ap.error("--steps and --tune-candidates must be at least 1")
    if not 0 < args.budget_frac:
        ap.error("--budget-frac must be positive")
    if args.budget_frac > 1:
        print(f"--budget-frac {args.budget_frac} > 1: the longest sequence fits without recompute", file=sys.stderr)
    return args


def run(args: argparse.Namespace, header, log=print) -> dict[str, Any]:
    """The whole benchmark; returns the JSON-able results (also written to ``args.out``).
    ``header``: its :class:`_results.Run`, started before anything else."""
    from _results import header_markdown
    import torch

    from concertina_hf.planning import partition_layers

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    pre = PRESETS[args.preset]
    loads = [os.getloadavg()[0]]
    corpus = load_corpus(pre["max_files"])
    log(f"corpus: {len(corpus)} files, {sum(map(len, corpus))} tokens")
    config = model_config(pre["model"], max(args.contexts))
    cost, profile_s = profile(config, args.seed, pre, max(args.contexts), log)
    layout = partition_layers(cost, 2)
    contexts = []
    for L in args.contexts:
        c = run_context(L, corpus, config, cost, layout, pre, args, log)
        c["ratios"] = ratios(c)
        contexts.append(c)
        loads += [x[0] for x in c["loadavg"].values() if x]
    paper = []
    if not args.no_paper and pre["paper_settings"]:
        paper = paper_scale(cost, config, pre["paper_settings"], args.seed, log)
    from _pipeline_worker import build_model

    num_params = sum(p.numel() for p in build_model(config, args.seed).parameters())
    res = {
        "command": header.command,
        "date": datetime.date.today().isoformat(),
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "config": config,
        "num_params": num_params,
        "cost_model": cost.to_dict(),
        "profile_s": profile_s,
        "profile_procs": pre["profile_procs"],
        "layer_ranges": [list(r) for r in layout.layer_ranges],
        "contexts": contexts,
        "paper_scale": paper,
    }
    res["targets"] = targets(contexts)
    res["elapsed_s"] = time.perf_counter() - t_start
    loads.append(os.getloadavg()[0])
    res["load_range"] = [min(loads), max(loads)]
    res["header"] = header.header()
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    md = to_markdown(res)
    title, rest = md.split("\n", 1)
    out.with_suffix(".md").write_text(f"{title}\n\n{header_markdown(res['header'])}\n{rest}\n")
    print(header_markdown(res["header"]), flush=True)
    try:
        plot(res, out.with_suffix(".png"))
        gantt = out.parent / f"gantt_{out.name}.png"
        plot_gantt_measured(res, cost, gantt)
        log(f"wrote {out.with_suffix('.png')} and {gantt}")
    except ImportError as e:  # matplotlib is optional
        log(f"no plots: {e}")
    log(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} in {res['elapsed_s'] / 60:.1f} min")
    return res


def main(argv=None) -> dict[str, Any]:
    from _results import Run

    argv = sys.argv[1:] if argv is None else list(argv)
    header = Run(__file__, argv)
    args = parse_args(argv)
    res = run(args, header, log=lambda m: print(f"[measured] {m}", flush=True))
    for t in res["targets"]:
        print(f"  {t['target']} @ {t['context']}: {t['text']} (goal {t['goal']}) {'met' if t['met'] else 'MISSED'}")
    return res


if __name__ == "__main__":
    main()
