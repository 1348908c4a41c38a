"""Document-aware sharding inside a stage (FlashCP) at paper scale, simulated.

    python benchmarks/flashcp.py                    # about 1-3 min on 2 loaded cores
    python benchmarks/flashcp.py --batches 1 --quick

Setting (paper_layout.py's): 32 A800-80GB GPUs (``DeviceSpec.a800()`` rates, 8 GPUs a node, NVLink
150 GB/s a GPU in collectives, 25 GB/s between nodes: assumptions, not measurements), ``--memory-gb``
(80) per GPU, optimizer state sharded over each stage's GPUs, 512 sequences from the shipped
``github`` distribution (CONSTRUCTED, benchmarks/data/make_distributions.py) capped at 8K (an
all-short batch), 64K and 128K, the analytic cost model. Layouts: LLaMA-13B pp=4 x sp=8, the 52-head LLaMA-30B pp=4 x sp=8
(sp=8 does not divide 52 heads: Ulysses cannot run it; its Ulysses-only reference is today's
pp=8 x sp=4), LLaMA-7B pp=2 x sp=16 (a stage spans two nodes: the all-to-alls and all-gathers
cross the inter-node link). The 30B at pp=4 x sp=8 runs whole-doc / per-doc only; a per-doc split
sequence keeps only each GPU's shard of its K/V for the later slices, which gather it again
(runtime/context_parallel.py), so a 64K or 128K sequence fits 80 GiB.

Per layout and batch, ``adaptive`` planned three ways (``plan_step(sp_mode=...)``): **modes**
(``auto``: per chunk the cheapest of Ulysses, whole-doc and per-doc by the cost model,
planning/placement.py), **Ulysses-only** (``ulysses``: every chunk Ulysses), **context** (``context``: whole-doc / per-doc only, never an all-to-all); and ``sp-only``
(no pipeline: the 32 GPUs in Ulysses groups with ZeRO-3, planning/strategies/sp_only.py). Each is
scored by the same simulator: predicted step time, and the bytes the GPUs of each stage send one
another per step (``SimResult.stage_comm_bytes``: Ulysses' all-to-alls, per-doc K/V all-gathers
and dK/dV reduce-scatters, recompute's replays included; sp-only: its all-to-alls, not its ZeRO-3
weight gathers), and the chunks of each mode.

Targets: modes never slower than Ulysses-only; intra-stage bytes per step at least 30%
lower than Ulysses-only at the 64K cap; the 52-head 30B planned as pp=4 x sp=8. Writes
benchmarks/results/flashcp.{md,json}. The measured CPU comparison (4 processes) is the runtime's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _results import Run, write_results  # noqa: E402
from concertina_hf.tools import data  # noqa: E402
from concertina_hf.planning import CostModel, DeviceSpec, PlanError, partition_layers, plan_step, simulate  # noqa: E402
from concertina_hf.planning.lpt import lpt_ranks  # noqa: E402
from concertina_hf.planning.presets import MODEL_PRESETS  # noqa: E402
from concertina_hf.planning.types import ChunkKind  # noqa: E402
from concertina_hf.planning.sharding import MODES, PER_DOC, chunk_mode  # noqa: E402

GIB = 2**30
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# (model, pp, sp, Ulysses-only reference layout when Ulysses cannot run pp x sp)
LAYOUTS = (("llama-13b", 4, 8, None), ("llama-30b", 4, 8, (8, 4)), ("llama-7b", 2, 16, None))
#: 8K: an all-short batch (the same distribution capped at 8K tokens); 64K and 128K: the long tail
CAPS = (8192, 65536, 131072)
BYTES_TARGET = 0.30  # at least 30% fewer intra-stage bytes than Ulysses-only at 64K


def _plan(lens, model: str, pp: int, sp: int, mode: str, budget: int, solver: str, strategy: str = "adaptive"):
    cost = CostModel.from_hf_config(MODEL_PRESETS[model], DeviceSpec.a800()).with_parallel(
        sp=sp, state_shards=sp, ulysses=mode == "ulysses")
    t0 = time.perf_counter()
    try:
        layout = partition_layers(cost, pp)
        plan = plan_step(lens, cost, layout, budget, strategy, solver=solver, sp_mode=mode)
    except PlanError as e:
        return {"fits": False, "reason": str(e)[:300], "plan_s": round(time.perf_counter() - t0, 2)}
    plan_s = round(time.perf_counter() - t0, 2)
    sim = simulate(plan, cost)
    modes = {m: 0 for m in MODES}
    whole = 0  # tokens of whole-doc slices (no attention traffic)
    for c in plan.chunks:
        modes[chunk_mode(c)] += 1
        whole += sum(sl.length for sl, w in zip(c.slices, c.placement) if w != PER_DOC)
    return {"fits": True, "layout": f"pp{pp} x sp{sp}" if strategy != "sp-only" else "sp-only",
            "step_s": sim.step_time_s, "stage_gib": sim.stage_comm_bytes / GIB, "comm_s": sim.comm_time_s,
            "peak_gib": max(sim.peak_memory_bytes) / GIB, "chunks": plan.num_chunks, "modes": modes,
            "whole_doc_share": whole / sum(lens), "whole_doc_tokens": plan.knob("whole_doc_tokens", 0),
            "plan_s": plan_s}


def run(batches: int, caps, solver: str, memory_gb: float, sp_only: bool) -> dict:
    rows = []
    for model, pp, sp, ref in LAYOUTS:
        budget = int(memory_gb * GIB)
        for cap in caps:
            for seed in range(batches):
                lens = data.sample_lengths("github", 512, cap, seed)
                row = {"model": model, "pp": pp, "sp": sp, "cap": cap, "seed": seed, "tokens": sum(lens),
                       "memory_gb": memory_gb}
                row["modes"] = _plan(lens, model, pp, sp, "auto", budget, solver)
                row["context"] = _plan(lens, model, pp, sp, "context", budget, solver)
                upp, usp = ref or (pp, sp)
                row["ulysses"] = _plan(lens, model, upp, usp, "ulysses", budget, solver)
                if sp_only:
                    row["sp_only"] = _plan(lens, model, pp, sp if ref is None else usp, "ulysses", budget, solver,
                                           strategy="sp-only")
                rows.append(row)
                print(_line(row), flush=True)
    diag = {}
    if 65536 in caps:
        diag = {"packing": _diagnose_packing("llama-13b", 4, 8, 65536, 0, int(memory_gb * GIB), solver),
                "memory_30b": _memory_terms("llama-30b", 4, 8, 65536),
                "whole_doc_tradeoff": _whole_doc_tradeoff("llama-13b", 4, 8, 65536, batches, int(memory_gb * GIB),
                                                          solver)}
    return {"rows": rows, "memory_gb": memory_gb, "solver": solver, "batches": batches, "caps": list(caps),
            "targets": _targets(rows), "diagnosis": diag}


def _diagnose_packing(model: str, pp: int, sp: int, cap: int, seed: int, budget: int, solver: str) -> dict:
    """Why whole-doc rarely won before whole-doc packing: the packed chunks of the chunking made for
    Ulysses (``whole_doc_tokens=0``), each placed whole-doc by LPT over the ``sp`` GPUs (one GPU's
    layer time), against Ulysses' compute plus all-to-alls; and the tokens the sequences short
    enough for whole-doc hold."""
    lens = data.sample_lengths("github", 512, cap, seed)
    cost = CostModel.from_hf_config(MODEL_PRESETS[model], DeviceSpec.a800()).with_parallel(sp=sp, state_shards=sp)
    layout = partition_layers(cost, pp)
    plan = plan_step(lens, cost, layout, budget, "adaptive", solver=solver, sp_mode="auto", whole_doc_tokens=0)
    base = cost.rank_model()
    rows = []
    for c in plan.chunks:
        if c.kind is not ChunkKind.PACKED:
            continue
        work = [base.layer_compute_time((sl,)) - base.beta for sl in c.slices]
        ranks = lpt_ranks(work, sp)
        load = [sum(w for w, r in zip(work, ranks) if r == k) for k in range(sp)]
        uly = dataclasses.replace(c, placement=())
        t_u = cost.placed_layer_time(uly)
        a2a = 2 * cost.a2a_time(c.num_tokens)
        t_w = cost.placed_layer_time(dataclasses.replace(c, placement=tuple(ranks)))
        rows.append({"sequences": len(c.slices), "imbalance": max(load) / (sum(load) / sp), "a2a_share": a2a / t_u,
                     "whole_over_ulysses": t_w / t_u})
    total = sum(lens)
    return {"model": model, "layout": f"pp{pp} x sp{sp}", "cap": cap, "seed": seed, "chunks": plan.num_chunks,
            "packed": len(rows), "fewer_than_sp": sum(r["sequences"] < sp for r in rows),
            "median_sequences": statistics.median(r["sequences"] for r in rows) if rows else 0,
            "median_imbalance": statistics.median(r["imbalance"] for r in rows) if rows else 0,
            "a2a_share": statistics.median(r["a2a_share"] for r in rows) if rows else 0,
            "whole_faster": sum(r["whole_over_ulysses"] < 1 for r in rows),
            "token_share_up_to": {n: sum(x for x in lens if x <= n) / total for n in (2048, 4096, 8192, 16384)}}


def _whole_doc_tradeoff(model: str, pp: int, sp: int, cap: int, batches: int, budget: int, solver: str) -> list:
    """What the bytes target costs: ``modes`` with the knob ``whole_doc_tokens`` forced up (more
    sequences whole-doc, in per-GPU bins) against Ulysses-only, step time and bytes, per batch."""
    cost = CostModel.from_hf_config(MODEL_PRESETS[model], DeviceSpec.a800()).with_parallel(sp=sp, state_shards=sp)
    layout = partition_layers(cost, pp)
    out = []
    for seed in range(batches):
        lens = data.sample_lengths("github", 512, cap, seed)
        uly = simulate(plan_step(lens, cost, layout, budget, "adaptive", solver=solver, sp_mode="ulysses"), cost)
        for tokens in (8192, 16384):
            sim = simulate(plan_step(lens, cost, layout, budget, "adaptive", solver=solver, sp_mode="auto",
                                     whole_doc_tokens=tokens), cost)
            out.append({"model": model, "layout": f"pp{pp} x sp{sp}", "cap": cap, "seed": seed,
                        "whole_doc_tokens": tokens, "time_ratio": sim.step_time_s / uly.step_time_s,
                        "bytes_cut": 1 - sim.stage_comm_bytes / uly.stage_comm_bytes})
    return out


def _memory_terms(model: str, pp: int, sp: int, seq: int) -> dict:
    """What one GPU of stage 0 keeps of one ``seq``-token sequence run per-doc (split into slices,
    all in flight, planning/cost.py's model) for its later slices, beside the stage's static
    memory, in GiB: its shard of the K/V and of their gradient buffers, and what it kept before the
    carried K/V were sharded (the gathered whole, every GPU; whole gradient buffers)."""
    cost = CostModel.from_hf_config(MODEL_PRESETS[model], DeviceSpec.a800()).with_parallel(
        sp=sp, state_shards=sp, ulysses=False)
    layout = partition_layers(cost, pp)
    n, kv = layout.num_stage_layers(0), cost.rank_model().kv_bytes_per_token
    return {"model": model, "layout": f"pp{pp} x sp{sp}", "tokens": seq, "stage0_layers": n,
            "static_gib": cost.static_memory(layout, 0) / GIB,
            "shard_kv_gib": n * kv * seq / sp / GIB,  # kept for the later slices, and as much of gradients
            "whole_kv_gib": n * kv * seq / GIB}  # before: the gathered whole, and as much of gradients


def _cell(r: dict) -> str:
    if not r["fits"]:
        return "does not fit"
    return f"{r['step_s']:.2f} s, {r['stage_gib']:.0f} GiB"


def _line(row: dict) -> str:
    return (f"{row['model']} pp{row['pp']} x sp{row['sp']} {row['memory_gb']:g} GiB cap {row['cap'] // 1024}K "
            f"seed {row['seed']}: "
            + "; ".join(f"{k} {_cell(row[k])}" for k in ("modes", "ulysses", "context", "sp_only") if k in row))


def _targets(rows: list[dict]) -> dict:
    slower, bytes_ok, bytes_cut, planned_30b = [], [], [], []
    for r in rows:
        m, u = r["modes"], r["ulysses"]
        if m["fits"] and u["fits"] and r["model"] != "llama-30b":  # the 30B's Ulysses runs another layout
            if m["step_s"] > u["step_s"] * (1 + 1e-9):
                slower.append(f"{r['model']} {r['cap']} seed {r['seed']}")
            if r["cap"] == 65536:
                cut = 1 - m["stage_gib"] / u["stage_gib"] if u["stage_gib"] else 0.0
                bytes_cut.append(round(cut, 4))
                bytes_ok.append(cut >= BYTES_TARGET)
        if r["model"] == "llama-30b" and r["cap"] > 8192:
            planned_30b.append(f"{r['memory_gb']:g} GiB {r['cap'] // 1024}K seed {r['seed']}: "
                               + ("planned" if m["fits"] else "does not fit"))
    return {"never_slower_than_ulysses": not slower, "slower": slower,
            "bytes_cut_64k": bytes_cut, "bytes_target_met": bool(bytes_ok) and all(bytes_ok),
            "llama30b_pp4_sp8_planned": planned_30b,
            "llama30b_target_met": bool(planned_30b) and all(x.endswith(": planned") for x in planned_30b)}


def _md(res: dict) -> str:
    out = ["# FlashCP-style sharding inside a stage (simulated, 32 GPUs)", "",
           f"Analytic cost model, A800 rates (assumed), {res['memory_gb']:g} GiB per GPU, 512 sequences per batch "
           f"from the CONSTRUCTED `github` distribution, {res['batches']} batch(es) per cap, adaptive with the "
           f"{res['solver']} recompute solver. Per cell: predicted step time, bytes the GPUs of each stage send one "
           "another per step. modes = `sp_mode='auto'`; Ulysses-only = `'ulysses'` (the 30B: pp8 x sp4, Ulysses "
           "cannot split 52 heads over 8); context = `'context'`; chunk modes as u/w/d/m (Ulysses, whole-doc, "
           "per-doc, mixed); whole-doc: the share of the step's tokens in whole-doc slices (no attention traffic) "
           "and, after the slash, `whole_doc_tokens` (the longest sequence packed into per-GPU bins, 0: none; "
           "planning/chunking.py).", "",
           "| model | layout | GiB/GPU | cap | seed | modes | u/w/d/m | whole-doc | Ulysses-only | context | u/w/d/m | "
           "sp-only | modes / Ulysses time | bytes cut |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        m, u, c = r["modes"], r["ulysses"], r["context"]

        def mix(x):
            return "/".join(str(x["modes"][k]) for k in MODES) if x["fits"] else "-"

        ratio = f"{m['step_s'] / u['step_s']:.4f}" if m["fits"] and u["fits"] else "-"
        cut = f"{1 - m['stage_gib'] / u['stage_gib']:.1%}" if m["fits"] and u["fits"] and u["stage_gib"] else "-"
        sp_only = _cell(r["sp_only"]) if "sp_only" in r else "-"
        uly = _cell(u) + (f" ({u['layout']})" if u["fits"] and u["layout"] != f"pp{r['pp']} x sp{r['sp']}" else "")
        wd = f"{m['whole_doc_share']:.0%} / {m['whole_doc_tokens']}" if m["fits"] else "-"
        out.append(f"| {r['model']} | pp{r['pp']} x sp{r['sp']} | {r['memory_gb']:g} | {r['cap'] // 1024}K | {r['seed']} | "
                   f"{_cell(m)} | {mix(m)} | {wd} | {uly} | {_cell(c)} | {mix(c)} | {sp_only} | {ratio} | {cut} |")
    t = res["targets"]
    out += ["", "## Targets", "",
            f"- modes never slower than Ulysses-only (same layout): {'met' if t['never_slower_than_ulysses'] else 'MISSED'}"
            + (f" ({', '.join(t['slower'])})" if t["slower"] else ""),
            f"- intra-stage bytes at least {BYTES_TARGET:.0%} lower than Ulysses-only at 64K: "
            f"{'met' if t['bytes_target_met'] else 'MISSED'} (cuts {t['bytes_cut_64k']})",
            f"- the 52-head 30B planned as pp=4 x sp=8: {'met' if t['llama30b_target_met'] else 'MISSED'} "
            f"({t['llama30b_pp4_sp8_planned']})", ""]
    out += _md_diagnosis(res.get("diagnosis") or {})
    for r in res["rows"]:
        for k in ("modes", "context", "ulysses", "sp_only"):
            if k in r and not r[k]["fits"]:
                out.append(f"- {r['model']} {r['memory_gb']:g} GiB {r['cap'] // 1024}K seed {r['seed']} {k}: "
                           f"{r[k]['reason']}")
    return "\n".join(out) + "\n"


def _md_diagnosis(d: dict) -> list[str]:
    if not d:
        return []
    p, m, w = d["packing"], d["memory_30b"], d.get("whole_doc_tradeoff", [])
    share = ", ".join(f"{n // 1024}K {v:.0%}" for n, v in p["token_share_up_to"].items())
    return [
        "## Where each mode wins", "",
        f"- Before whole-doc packing ({p['model']} {p['layout']}, {p['cap'] // 1024}K cap, seed {p['seed']}, "
        f"`whole_doc_tokens=0`): {p['packed']} of {p['chunks']} chunks packed, {p['fewer_than_sp']} of them holding "
        f"fewer sequences than GPUs (median {p['median_sequences']:g}); placed whole-doc by LPT their busiest GPU "
        f"carries a median {p['median_imbalance']:.2f}x the mean, while Ulysses' all-to-alls are only "
        f"{p['a2a_share']:.1%} of a packed chunk's layer time (NVLink): whole-doc was faster for "
        f"{p['whole_faster']} of them. Token packing formed the chunks for Ulysses (by total work); packing the short "
        "sequences into per-GPU bins balances them (busiest GPU within 1-2% of the mean, tests/planning/"
        "test_whole_doc_packing.py).",
        f"- Whole-doc can carry only the tokens of sequences short enough to sit on one GPU without making "
        f"their chunk much longer than the others (a sequence alone on a GPU takes sp times its Ulysses time; "
        f"larger chunks stall 1F1B): sequences of at most {share} of the tokens. The rest are long sequences "
        "that stay Ulysses: per-doc moves sp/2 times Ulysses' bytes per token for MHA (the K/V of every token to "
        "every GPU against q, k, v and output over sp), and is rarely chosen where Ulysses can run.",
        *([f"- The bytes target bought with whole-doc ({w[0]['model']} {w[0]['layout']}, {w[0]['cap'] // 1024}K cap, "
           "knob `whole_doc_tokens` forced): " + "; ".join(
               f"seed {x['seed']} up to {x['whole_doc_tokens'] // 1024}K cuts {x['bytes_cut']:.0%} of Ulysses-only's "
               f"bytes at {x['time_ratio']:.2f}x its step time" for x in w)
           + ". The planner, choosing by time, stops where whole-doc stops being faster."] if w else []),
        f"- {m['model']} {m['layout']}: a {m['tokens'] // 1024}K sequence split per-doc leaves on each GPU of "
        f"stage 0 ({m['stage0_layers']} layers; {m['static_gib']:.1f} GiB static) its shard of the K/V for the later "
        f"slices, {m['shard_kv_gib']:.1f} GiB, and as much of gradient buffers; kept whole on every GPU (the gathered "
        f"K/V), it was {m['whole_kv_gib']:.1f} GiB and as much again, which no recompute removes and which put the "
        "sequence over 80 GiB. The price of the shard: every later slice gathers its earlier slices' K/V again, "
        "so a sequence cut into k equal per-doc slices moves (k + 1) / 2 times its K/V bytes per layer.", ""]


def main(argv: list[str] | None = None) -> int:
    run_ = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=2, help="batches (seeds) per layout and cap")
    ap.add_argument("--quick", action="store_true", help="the 8K and 64K caps only, no sp-only")
    ap.add_argument("--solver", choices=("ilp", "greedy"), default="greedy")
    ap.add_argument("--memory-gb", type=float, default=80.0, help="memory budget per GPU, GiB")
    ap.add_argument("--out", default=str(RESULTS / "flashcp"), help="output path without extension")
    args = ap.parse_args(argv)
    caps = CAPS[:2] if args.quick else CAPS
    res = run(args.batches, caps, args.solver, args.memory_gb, sp_only=not args.quick)
    write_results(args.out, _md(res), res, run_)
    return 0


if __name__ == "__main__":
    sys.exit(main())
