"""Cost-model accuracy: the profiled cost model's predictions against measurement.

    python benchmarks/cost_model_accuracy.py                  # default: about 1-3 min, one CPU thread
    python benchmarks/cost_model_accuracy.py --max-tokens 2048 --repeats 7   # longer, larger chunks
    python benchmarks/cost_model_accuracy.py --repeats 1 --no-steps --out benchmarks/results/cost_model_accuracy_quick

Model: a tiny-but-not-trivial Llama (hidden 256, 8 heads, 4 KV heads, intermediate 688, vocab
8192, 4 layers, float32) built from its config, run on one CPU thread through the concertina
runtime (SDPA attention on CPU).

1. **Fit**: :func:`profile_cost_model` on ``default_shapes(max_tokens)`` (16 shapes), profiling
   2 of the 4 layers.
2. **Held-out chunks**: 12 shapes the fit never saw (packed, single slices with context as in a
   split sequence, hybrids). Each runs forward and backward through all 4 layers (one stage,
   :func:`measure_chunk`, the minimum of ``--repeats`` CPU times) and is compared with the fitted model's
   ``4 * (1 + bwd_factor) * layer_fwd_time``; also with the analytic model
   (``CostModel.from_hf_config`` at ``DeviceSpec.cpu()`` rates), the planner's default before any
   profiling. Activation bytes are compared too (exact counts of saved tensors), the profiled
   model's and the analytic one's (what it counts from the config for the kernel the runtime
   takes on CPU: ``planning/activations.py``).
3. **Head and embedding** on chunk sizes between the profile's ladder points, against the model
   and against per-token rates through the origin at ``m/4`` and ``m`` (``former``).
4. **Whole steps**: one-stage plans (embedding, 4 layers, head and loss; a split sequence;
   recompute none / partial / full) run by :class:`PipelineExecutor`: measured step wall time
   against ``simulate(plan, cost).step_time_s``, and the activation-memory peak (every live
   tensor, :class:`LiveTensorMeter`) against the simulated peak minus static memory, of the
   profiled model and of the analytic one.

Times are the process's CPU time on one thread (the profiler's clock on CPU, and the same around
each step here): on a machine shared with other jobs (the committed results: 2 cores, several
jobs; the load average is recorded) wall time would mostly measure the others. Errors are
``(predicted - measured) / measured``. Writes benchmarks/results/cost_model_accuracy.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from concertina_hf.planning import (  # noqa: E402
    Chunk,
    ChunkKind,
    CostModel,
    DeviceSpec,
    Plan,
    Slice,
    StageLayout,
    build_schedule,
    simulate,
)
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper  # noqa: E402
from concertina_hf.runtime.attention import attention_kernel  # noqa: E402
from concertina_hf.runtime.memory import LiveTensorMeter  # noqa: E402
from concertina_hf.runtime.profiler import default_shapes, measure_chunk, profile_cost_model  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
NUM_LAYERS = 4
CONFIG = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=NUM_LAYERS,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
              tie_word_embeddings=False)


def held_out_shapes(m: int) -> list[tuple[str, tuple[tuple[int, int], ...], bool]]:
    """(kind, shape, split) for chunks not in ``default_shapes(m)``, scaled to ``m`` tokens."""
    def s(x: float) -> int:
        return max(8, int(x * m))

    return [
        ("packed", ((0, s(3 / 8)),), False),
        ("packed", ((0, s(3 / 4)),), False),
        ("packed", ((0, s(3 / 16)),) * 3, False),
        ("packed", ((0, s(0.39)), (0, s(0.24)), (0, s(0.1))), False),
        ("packed", ((0, s(3 / 32)),) * 8, False),
        ("split", ((s(3 / 8), s(3 / 8)),), True),
        ("split", ((s(3 / 4), s(5 / 16)),), True),
        ("split", ((s(1.5), s(3 / 16)),), True),
        ("split", ((s(3 / 16), s(5 / 8)),), True),
        ("hybrid", ((s(5 / 8), s(3 / 16)), (0, s(1 / 4)), (0, s(1 / 8))), False),
        ("hybrid", ((s(1.17), s(5 / 32)), (0, s(3 / 32)), (0, s(3 / 32)), (0, s(3 / 32))), False),
        ("hybrid", ((s(0.29), s(0.49)), (0, s(0.2))), False),
    ]


def _chunk(shape, split: bool) -> Chunk:
    kind = ChunkKind.SPLIT if split else (ChunkKind.HYBRID if shape[0][0] > 0 else ChunkKind.PACKED)
    return Chunk(0, kind, tuple(Slice(i, c, n) for i, (c, n) in enumerate(shape)))


def _stage_time(cost: CostModel, shape) -> float:
    """Forward + backward seconds of the 4 layers (a stage without embedding or head)."""
    layer = cost.layer_fwd_time([Slice(i, c, n) for i, (c, n) in enumerate(shape)])
    return NUM_LAYERS * (1.0 + cost.bwd_factor) * layer


def _plans(m: int, layout: StageLayout) -> list[tuple[str, Plan]]:
    """One-stage plans over a batch with one long sequence in 3 slices (its tail in a hybrid)."""
    lens = (int(1.5 * m), m // 2, m // 4, m // 4, m // 8, m // 8)
    a, b = int(0.6 * m), int(0.5 * m)
    specs = [[(0, 0, a)], [(0, a, b)], [(0, a + b, lens[0] - a - b), (1, 0, lens[1])],
             [(2, 0, lens[2]), (3, 0, lens[3]), (4, 0, lens[4]), (5, 0, lens[5])]]
    chunks = []
    for i, spec in enumerate(specs):
        slices = tuple(Slice(*x) for x in spec)
        kind = ChunkKind.SPLIT if i < 2 else (ChunkKind.HYBRID if i == 2 else ChunkKind.PACKED)
        chunks.append(Chunk(i, kind, slices))
    groups = (tuple(range(len(chunks))),)
    schedule = build_schedule(chunks, groups, 1, prefetch=True)
    out = []
    for name, rec in (("none", (0, 0, 0, 0)), ("partial", (2, 1, 3, 0)), ("full", (4, 4, 4, 4))):
        out.append((name, Plan(f"recompute-{name}", lens, layout, tuple(chunks), groups, schedule,
                               (rec,)).validate()))
    return out


def head_and_embedding(model, cost: CostModel, m: int, repeats: int, warmup: int) -> list[dict]:
    """The head (with the loss) and the embedding, forward + backward, on chunk sizes between
    the profile's ladder points, against ``cost`` and against per-token rates
    through the origin at ``m // 4`` and ``m`` tokens (``former``), from the same profile's measurements."""
    from concertina_hf.planning.fit import through_origin
    from concertina_hf.runtime.probe import build_probe

    bf = 1.0 + cost.bwd_factor
    pts = dict(cost.head_time_points)
    if m // 4 not in pts or m not in pts:
        return []
    head_former = through_origin([m // 4, m], [pts[m // 4], pts[m]])
    line = lambda t: cost.embed_time_per_call + cost.embed_time_per_token * t  # noqa: E731
    embed_former = through_origin([m // 4, m], [line(m // 4), line(m)])
    pr = build_probe(model, 1, None, None)
    out = []
    with pr.measuring():
        for tok in sorted({max(16, m * k // 32) for k in (3, 5, 7, 10, 14, 20, 28)}):
            f, b, _ = pr.time_head(tok, repeats, warmup)
            e = pr.time_embed(tok, repeats, warmup)
            r = {"tokens": tok, "head_measured_ms": 1e3 * (f + b), "head_predicted_ms": 1e3 * bf * cost.head_time(tok),
                 "head_former_ms": 1e3 * bf * head_former * tok, "embed_measured_ms": 1e3 * e,
                 "embed_predicted_ms": 1e3 * bf * line(tok), "embed_former_ms": 1e3 * bf * embed_former * tok}
            for k in ("head", "embed"):
                for v in ("predicted", "former"):
                    r[f"{k}_{'error' if v == 'predicted' else 'former_error'}"] = (
                        r[f"{k}_{v}_ms"] / r[f"{k}_measured_ms"] - 1)
            out.append(r)
            print(f"head/embedding {tok} tokens: head {r['head_measured_ms']:.2f} ms ({r['head_error']:+.1%}, former "
                  f"{r['head_former_error']:+.1%}), embedding {r['embed_measured_ms']:.2f} ms ({r['embed_error']:+.1%})",
                  file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from _results import Run, write_results

    run_ = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=1024, help="largest chunk of the fit (and scale of held-out)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (minimum)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-steps", action="store_true", help="skip the whole-step part")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "cost_model_accuracy",
                    help="output path without extension")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, LlamaConfig

    t_start = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation="sdpa")
    m = args.max_tokens

    t0 = time.perf_counter()
    fit_samples: list = []
    cost = profile_cost_model(model, shapes=default_shapes(m), repeats=args.repeats, warmup=args.warmup,
                              num_layers=2, samples_out=fit_samples)
    fit_s = time.perf_counter() - t0
    fit_rows = []
    for smp in fit_samples:
        shape = smp.slices
        meas = NUM_LAYERS * (smp.fwd_time_s + smp.bwd_time_s)
        fit_rows.append({"shape": [list(x) for x in shape], "measured_ms": 1e3 * meas,
                         "predicted_ms": 1e3 * _stage_time(cost, shape),
                         "error": (_stage_time(cost, shape) - meas) / meas})
    analytic = CostModel.from_hf_config(model.config, device=DeviceSpec.cpu(), dtype_bytes=4,
                                        attention_kernel=attention_kernel("cpu"))
    print(f"fit: {fit_s:.1f} s", file=sys.stderr, flush=True)

    layout = StageLayout(NUM_LAYERS, ((0, NUM_LAYERS),))
    rows = []
    for kind, shape, split in held_out_shapes(m):
        sample = measure_chunk(model, shape, split=split, repeats=args.repeats, warmup=args.warmup,
                               num_layers=NUM_LAYERS)
        measured = NUM_LAYERS * (sample.fwd_time_s + sample.bwd_time_s)
        chunk = _chunk(shape, split)
        pred_bytes = cost.act_memory(layout, 0, chunk, 0) - cost.logits_bytes_per_token * chunk.num_tokens
        analytic_bytes = analytic.act_memory(layout, 0, chunk, 0) - analytic.logits_bytes_per_token * chunk.num_tokens
        rows.append({
            "kind": kind, "shape": [list(x) for x in shape], "tokens": chunk.num_tokens,
            "measured_ms": 1e3 * measured, "predicted_ms": 1e3 * _stage_time(cost, shape),
            "analytic_ms": 1e3 * _stage_time(analytic, shape),
            "measured_fwd_ms": 1e3 * NUM_LAYERS * sample.fwd_time_s,
            "measured_bwd_ms": 1e3 * NUM_LAYERS * sample.bwd_time_s,
            "measured_act_bytes": sample.act_bytes * NUM_LAYERS, "predicted_act_bytes": pred_bytes,
            "analytic_act_bytes": analytic_bytes,
        })
        r = rows[-1]
        print(f"{kind:7s} {shape}: measured {r['measured_ms']:.1f} ms, predicted {r['predicted_ms']:.1f} ms",
              file=sys.stderr, flush=True)
    for r in rows:
        r["error"] = (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        r["analytic_error"] = (r["analytic_ms"] - r["measured_ms"]) / r["measured_ms"]
        r["bytes_error"] = (r["predicted_act_bytes"] - r["measured_act_bytes"]) / r["measured_act_bytes"]
        r["analytic_bytes_error"] = (r["analytic_act_bytes"] - r["measured_act_bytes"]) / r["measured_act_bytes"]

    ends = head_and_embedding(model, cost, m, args.repeats, args.warmup)

    steps = []
    if not args.no_steps:
        wrapper = PipelineWrapper(copy.deepcopy(model), StageLayout.even(NUM_LAYERS, 1), 0)
        ex = PipelineExecutor(wrapper)
        for p in wrapper.parameters():
            p.grad = torch.zeros_like(p)
        exclude = [*wrapper.parameters(), *wrapper.buffers(), *(p.grad for p in wrapper.parameters())]
        static = cost.static_memory(layout, 0)
        for name, plan in _plans(m, layout):
            g = torch.Generator().manual_seed(0)
            ids = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g) for n in plan.seq_lens]
            walls = []
            for _ in range(args.warmup + args.repeats):
                t0 = time.process_time()  # CPU time of one thread: what other jobs do not inflate
                ex.run_step(plan, ids)
                walls.append(time.process_time() - t0)
            walls = walls[args.warmup:]
            with LiveTensorMeter(exclude) as live:
                res = ex.run_step(plan, ids)
            sim = simulate(plan, cost)
            analytic_peak = simulate(plan, analytic).peak_memory_bytes[0] - analytic.static_memory(layout, 0)
            steps.append({
                "plan": name, "tokens": sum(plan.seq_lens), "chunks": plan.num_chunks,
                "measured_s": min(walls), "predicted_s": sim.step_time_s,
                "analytic_s": simulate(plan, analytic).step_time_s,
                "live_peak_bytes": live.peak_bytes, "meter_peak_bytes": res.peak_activation_bytes,
                "predicted_peak_bytes": sim.peak_memory_bytes[0] - static,
                "analytic_peak_bytes": analytic_peak,
            })
            s = steps[-1]
            s["error"] = (s["predicted_s"] - s["measured_s"]) / s["measured_s"]
            s["analytic_error"] = (s["analytic_s"] - s["measured_s"]) / s["measured_s"]
            s["memory_error"] = (s["predicted_peak_bytes"] - s["live_peak_bytes"]) / s["live_peak_bytes"]
            s["analytic_memory_error"] = (s["analytic_peak_bytes"] - s["live_peak_bytes"]) / s["live_peak_bytes"]
            print(f"step {name}: measured {s['measured_s']:.3f} s, predicted {s['predicted_s']:.3f} s",
                  file=sys.stderr, flush=True)

    elapsed = time.perf_counter() - t_start
    errs = [abs(r["error"]) for r in rows]
    aerrs = [abs(r["analytic_error"]) for r in rows]
    summary = {"mean_abs_error": statistics.mean(errs), "max_abs_error": max(errs),
               "analytic_mean_abs_error": statistics.mean(aerrs), "analytic_max_abs_error": max(aerrs),
               "max_abs_bytes_error": max(abs(r["bytes_error"]) for r in rows),
               "analytic_min_bytes_error": min(r["analytic_bytes_error"] for r in rows),
               "analytic_max_bytes_error": max(r["analytic_bytes_error"] for r in rows)}
    if steps:
        summary["analytic_memory_errors"] = [s["analytic_memory_error"] for s in steps]
    fitted = {k: v for k, v in cost.to_dict().items()
              if k in ("alpha_attn", "alpha_tok", "beta", "bwd_factor", "embed_time_per_token",
                       "head_time_per_token", "embed_time_per_call", "head_time_per_call", "max_chunk_tokens",
                       "act_bytes_per_token", "ckpt_bytes_per_token", "ckpt_chunk_bytes_per_token",
                       "kv_bytes_per_token",
                       "context_bytes_per_token", "logits_bytes_per_token",
                       "bwd_transient_bytes_per_token", "head_bwd_transient_bytes_per_token",
                       "bwd_transient_bytes", "head_bwd_transient_bytes", "embed_bwd_transient_bytes",
                       "recompute_factor")}

    lines = [
        "# Cost-model accuracy",
        "",
        f"One thread; {elapsed:.0f} s (profile {fit_s:.1f} s).",
        "",
        f"Model: Llama, hidden {CONFIG['hidden_size']}, {CONFIG['num_attention_heads']} heads, "
        f"{CONFIG['num_key_value_heads']} KV heads, intermediate {CONFIG['intermediate_size']}, vocab "
        f"{CONFIG['vocab_size']}, {NUM_LAYERS} layers, float32, CPU (SDPA). Fitted on `default_shapes({m})` "
        f"(16 shapes, 2 profiled layers); measured on held-out shapes through all {NUM_LAYERS} layers, "
        f"forward + backward, minimum of {args.repeats} after {args.warmup} warm-up, CPU time of the "
        "process (one thread). Error = "
        "(predicted - measured) / measured. `analytic` is `CostModel.from_hf_config` at `DeviceSpec.cpu()` "
        "rates (the planner's default before profiling).",
        "",
        "## Fit (in sample): the profiled shapes, scaled to one stage (4 layers)",
        "",
        "| shape (context, length) per slice | measured ms | predicted ms | error |",
        "|---|---|---|---|",
        *[f"| {' '.join(f'({c},{n})' for c, n in r['shape'])} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
          f"{r['error']:+.1%} |" for r in fit_rows],
        "",
        "## Held-out chunks: one stage (4 layers), forward + backward",
        "",
        "| kind | shape (context, length) per slice | tokens | measured ms | predicted ms | error | analytic ms | "
        "analytic error | act bytes error | analytic act bytes error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = " ".join(f"({c},{n})" for c, n in r["shape"])
        lines.append(f"| {r['kind']} | {shape} | {r['tokens']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{r['error']:+.1%} | {r['analytic_ms']:.1f} | {r['analytic_error']:+.1%} | "
                     f"{r['bytes_error']:+.2%} | {r['analytic_bytes_error']:+.2%} |")
    lines += [
        "",
        f"**Time: mean absolute error {summary['mean_abs_error']:.1%}, max {summary['max_abs_error']:.1%}** "
        f"(analytic model: mean {summary['analytic_mean_abs_error']:.1%}, "
        f"max {summary['analytic_max_abs_error']:.1%}). "
        f"Activation bytes: max absolute error {summary['max_abs_bytes_error']:.2%} (analytic model: "
        f"{summary['analytic_min_bytes_error']:+.2%} to {summary['analytic_max_bytes_error']:+.2%}).",
        "",
    ]
    if ends:
        lines += [
            "## Head and embedding on held-out chunk sizes, forward + backward",
            "",
            "Chunk sizes between the profile's ladder points. `former`: per-token rates "
            f"through the origin at {m // 4} and {m} tokens, no per-call constant, from the same profile's "
            "measurements at those sizes.",
            "",
            "| tokens | head measured ms | predicted | error | former | former error | embedding measured ms | "
            "predicted | error | former | former error |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *[f"| {r['tokens']} | {r['head_measured_ms']:.2f} | {r['head_predicted_ms']:.2f} | {r['head_error']:+.1%} | "
              f"{r['head_former_ms']:.2f} | {r['head_former_error']:+.1%} | {r['embed_measured_ms']:.2f} | "
              f"{r['embed_predicted_ms']:.2f} | {r['embed_error']:+.1%} | {r['embed_former_ms']:.2f} | "
              f"{r['embed_former_error']:+.1%} |" for r in ends],
            "",
            f"Mean absolute error: head {statistics.mean(abs(r['head_error']) for r in ends):.1%} (former "
            f"{statistics.mean(abs(r['head_former_error']) for r in ends):.1%}), embedding "
            f"{statistics.mean(abs(r['embed_error']) for r in ends):.1%} (former "
            f"{statistics.mean(abs(r['embed_former_error']) for r in ends):.1%}).",
            "",
        ]
    if steps:
        lines += [
            "## Whole steps: one stage (embedding, 4 layers, head), executed by PipelineExecutor",
            "",
            f"Batch of {len(_plans(m, layout)[0][1].seq_lens)} sequences ({steps[0]['tokens']} tokens), the longest "
            f"in 3 slices (tail in a hybrid chunk), {steps[0]['chunks']} chunks; recompute per chunk as named. "
            "Memory: activation peak, every live tensor (`LiveTensorMeter`), against the simulated peak minus "
            "static memory; `meter` is the executor's own `StepResult.peak_activation_bytes` (saved tensors only); "
            "`analytic peak` the analytic model's simulated peak minus its static memory.",
            "",
            "Step time: CPU time of `run_step`, minimum of the repeats.",
            "",
            "| recompute | measured s | predicted s | error | analytic s | analytic error | live peak MiB | "
            "meter peak MiB | predicted peak MiB | memory error | analytic peak MiB | analytic memory error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in steps:
            lines.append(
                f"| {s['plan']} | {s['measured_s']:.3f} | {s['predicted_s']:.3f} | {s['error']:+.1%} | "
                f"{s['analytic_s']:.3f} | {s['analytic_error']:+.1%} | {s['live_peak_bytes'] / 2**20:.2f} | "
                f"{s['meter_peak_bytes'] / 2**20:.2f} | {s['predicted_peak_bytes'] / 2**20:.2f} | "
                f"{s['memory_error']:+.1%} | {s['analytic_peak_bytes'] / 2**20:.2f} | "
                f"{s['analytic_memory_error']:+.1%} |")
        lines.append("")
    lines += ["## Fitted coefficients", "", "```json", json.dumps(fitted, indent=1), "```", ""]

    write_results(args.out, "\n".join(lines), {
        "date": datetime.date.today().isoformat(), "elapsed_s": elapsed, "profile_s": fit_s,
        "config": CONFIG, "max_tokens": m, "repeats": args.repeats,
        "fitted": fitted, "fit": fit_rows, "held_out": rows, "head_and_embedding": ends, "steps": steps,
        "summary": summary,
    }, run_)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
