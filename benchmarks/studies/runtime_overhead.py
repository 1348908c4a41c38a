"""Per-step overhead of the runtime at small chunks: one process, one stage (pp=1).

    python benchmarks/studies/runtime_overhead.py            # 10M Llama (measured.py's), chunks of 64 / 256 / 1024 tokens
    python benchmarks/studies/runtime_overhead.py --quick    # tiny model, one setting, one round
    python benchmarks/studies/runtime_overhead.py --check    # --quick, asserting its invariants

Each setting is one step of ``5 x chunk`` tokens: a sequence of ``4 x chunk`` tokens cut into 4
slices (each later slice attends to the K/V of the earlier ones) plus a packed chunk of four
sequences of ``chunk / 4`` tokens, no recompute. Three ways to run the same step, interleaved
round by round (round ``r`` runs them rotated by ``r``, so a change of machine load hits all
alike; the first round is a warm-up, not counted):

- ``metered``: :meth:`PipelineExecutor.run_step` measuring the activation peak (the executor's
  default: :class:`~concertina_hf.runtime.memory.SavedTensorMeter`'s Python hook on every tensor
  autograd saves);
- ``unmetered``: ``run_step(..., measure_memory=False)``: what ``ConcertinaTrainer`` runs on the
  steps whose statistics are not logged (the benchmarks' timed steps too);
- ``hf``: the plain HF model (SDPA) on each sequence alone, forward and backward with the same
  ``num_items_in_batch``: the floor without any runtime (its attention never crosses sequences;
  the split sequence runs whole).

Reported: the median step time of each, ``metered / unmetered`` (the meter's cost) and
``unmetered / hf`` (what the runtime still adds), the saved tensors per step, the load average,
and a cores probe (a fixed matmul loop timed at the start and at the end: a slower end means
the machine got busier). Writes ``benchmarks/results/studies/runtime_overhead{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import torch  # noqa: E402

from _results import Run, write_results  # noqa: E402

MODELS = {
    "full": dict(model_type="llama", vocab_size=8192, tie_word_embeddings=False, attention_dropout=0.0,
                 hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
                 intermediate_size=688),
    "quick": dict(model_type="llama", vocab_size=512, tie_word_embeddings=False, attention_dropout=0.0,
                  hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                  intermediate_size=176),
}
VARIANTS = ("metered", "unmetered", "hf")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, one 32-token chunk size, one timed round")
    ap.add_argument("--chunks", type=int, nargs="+", default=None, help="chunk sizes in tokens (default 64 256 1024)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; --quick 1)")
    ap.add_argument("--out", default=None, help="output path without suffix")
    return ap.parse_args(argv)


def probe_ms(iters: int = 200) -> float:
    a = torch.randn(256, 256)
    torch.mm(a, a)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, a)
    return (time.perf_counter() - t0) * 1e3


def build(config: dict, chunk: int):
    """Executor, HF copy, plan and token ids of one setting."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from concertina_hf.planning import Chunk, ChunkKind, Plan, Slice, StageLayout, build_schedule
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa").float()
    hf = copy.deepcopy(model)
    layout = StageLayout.even(config["num_hidden_layers"], 1)
    ex = PipelineExecutor(PipelineWrapper(model, layout, 0))
    q = max(1, chunk // 4)
    seq_lens = (4 * chunk, q, q, q, q)
    specs = [(Slice(0, i * chunk, chunk),) for i in range(4)] + [tuple(Slice(s, 0, q) for s in range(1, 5))]
    chunks = tuple(Chunk(i, ChunkKind.of(sl, seq_lens), sl) for i, sl in enumerate(specs))
    groups = (tuple(range(len(chunks))),)
    plan = Plan(strategy="runtime_overhead", seq_lens=seq_lens, layout=layout, chunks=chunks, groups=groups,
                schedule=build_schedule(chunks, groups, 1), recompute=((0,) * len(chunks),))
    plan.validate()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, config["vocab_size"], (t,), generator=g) for t in seq_lens]
    return ex, hf, plan, ids


def count_saved(ex, plan, ids) -> int:
    """Tensors autograd saves in one step (what the meter's hook is called on)."""
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ex.run_step(plan, ids, measure_memory=False)
    ex.wrapper.zero_grad(set_to_none=True)
    return n[0]


def run_setting(config: dict, chunk: int, rounds: int, log) -> dict[str, Any]:
    ex, hf, plan, ids = build(config, chunk)
    items = sum(len(t) - 1 for t in ids)

    def step(kind: str) -> float:
        t0 = time.perf_counter()
        if kind == "hf":
            for t in ids:
                hf(input_ids=t[None], labels=t[None], num_items_in_batch=items).loss.backward()
        else:
            ex.run_step(plan, ids, measure_memory=kind == "metered")
        dt = time.perf_counter() - t0
        (hf if kind == "hf" else ex.wrapper).zero_grad(set_to_none=True)
        return dt

    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(rounds + 1):
        for k in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            dt = step(k)
            if r > 0:  # round 0: warm-up
                times[k].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    saved = count_saved(ex, plan, ids)
    res = {
        "chunk_tokens": chunk, "tokens": sum(plan.seq_lens), "chunks": plan.num_chunks,
        "layer_calls": 2 * plan.num_chunks * config["num_hidden_layers"],
        "saved_tensors_per_step": saved,
        "step_s": {k: times[k] for k in VARIANTS}, "median_s": med,
        "metered_over_unmetered": med["metered"] / med["unmetered"],
        "unmetered_over_hf": med["unmetered"] / med["hf"],
        "meter_us_per_saved_tensor": (med["metered"] - med["unmetered"]) * 1e6 / max(1, saved),
    }
    log(f"chunk {chunk:>5}: metered {med['metered'] * 1e3:.1f} ms, unmetered {med['unmetered'] * 1e3:.1f} ms, "
        f"hf {med['hf'] * 1e3:.1f} ms (metered/unmetered {res['metered_over_unmetered']:.3f}, "
        f"unmetered/hf {res['unmetered_over_hf']:.3f})")
    return res


def to_markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Runtime overhead per step at small chunks", "",
        f"Model: Llama, hidden {res['config']['hidden_size']}, "
        f"{res['config']['num_hidden_layers']} layers, fp32, one thread, one process (pp=1). "
        f"Cores probe (a fixed matmul loop) {res['probe_ms_start']:.0f} ms at the "
        f"start, {res['probe_ms_end']:.0f} ms at the end. Median of {res['rounds']} interleaved rounds "
        "after a warm-up round.", "",
        "Each step: a sequence of 4 x chunk tokens in 4 slices plus a packed chunk of 4 sequences of chunk / 4 "
        "tokens, no recompute. `metered`: `run_step` measuring the activation peak; "
        "`unmetered`: `measure_memory=False` (the trainer's steps that log no statistics); `hf`: the HF model on "
        "each sequence alone.", "",
        "| chunk tokens | step tokens | saved tensors | metered ms | unmetered ms | HF ms | metered / unmetered | "
        "unmetered / HF | meter us per saved tensor |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["settings"]:
        m = s["median_s"]
        lines.append(f"| {s['chunk_tokens']} | {s['tokens']} | {s['saved_tensors_per_step']} | "
                     f"{m['metered'] * 1e3:.1f} | {m['unmetered'] * 1e3:.1f} | {m['hf'] * 1e3:.1f} | "
                     f"{s['metered_over_unmetered']:.3f} | {s['unmetered_over_hf']:.3f} | "
                     f"{s['meter_us_per_saved_tensor']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict[str, Any]:
    if argv == ["--check"] or (argv is None and sys.argv[1:] == ["--check"]):
        from _results import self_check

        return self_check(main, check)
    run = Run(__file__, argv)
    args = parse_args(argv)
    torch.set_num_threads(1)
    config = MODELS["quick" if args.quick else "full"]
    chunks = args.chunks or ([32] if args.quick else [64, 256, 1024])
    rounds = args.rounds or (1 if args.quick else 5)
    out = args.out or os.path.join(BENCH, "results", "studies",
                                   "runtime_overhead_quick" if args.quick else "runtime_overhead")
    res: dict[str, Any] = {"config": config, "rounds": rounds, "probe_ms_start": probe_ms()}
    res["settings"] = [run_setting(config, c, rounds, lambda m: print(m, flush=True)) for c in chunks]
    res["probe_ms_end"] = probe_ms()
    write_results(out, to_markdown(res), res, run)
    return res


def check(rec: dict[str, Any], md: str) -> None:
    """``--check``: every variant timed, the files written with
    their command, and the unmetered step saves the same tensors (counted by an outer hook) as the
    metered one would hook."""
    (s,) = rec["settings"]
    assert all(s["median_s"][k] > 0 for k in VARIANTS)
    assert s["saved_tensors_per_step"] > 0 and s["chunks"] == 5 and s["tokens"] == 5 * 32
    assert md.startswith("# Runtime overhead")
    assert rec["command"].startswith("python benchmarks/studies/runtime_overhead.py --quick") and "load_average" in rec


if __name__ == "__main__":
    main()
