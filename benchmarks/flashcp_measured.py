"""Document-aware sharding inside a stage, measured: pp=1 x sp=4 on 4 CPU processes.

    python benchmarks/flashcp_measured.py            # a few minutes on 2 busy cores
    python benchmarks/flashcp_measured.py --quick    # tiny model, 2 timed steps

The 4 processes share this machine's cores (gloo, one thread each): tokens/s are reported as
ratios to Ulysses-only and the absolute figures say little about GPUs. What runs:

- **Model**: a Llama (hidden 256, 4 layers, 8 heads, 4 K/V heads, MLP 512, vocab 4096, float32;
  ``--quick``: hidden 64, 2 layers); 8 heads divide by 4, so Ulysses runs too.
- **Batches** (seeded): *long-tail*, one 1536-token sequence and 40 sequences of 16-128 tokens;
  *all-short*, 64 sequences of 16-96 tokens (``--quick``: a quarter of the tokens).
- **Cost model fitted here**, as ``concertina_cost_model="profiled"`` fits it (run_setup): rank 0
  profiles the model's decoder layers, head and embedding on one process
  (:func:`~concertina_hf.runtime.profiler.profile_cost_model`, chunks up to ``--cap`` tokens),
  then the 4 processes time one layer's all-to-alls (:func:`~concertina_hf.runtime.ulysses.profile_all_to_all`)
  and the per-doc K/V all-gather and reduce-scatter (:func:`~concertina_hf.runtime.ulysses.profile_all_gather`)
  on their group; the analytic model (``DeviceSpec.cpu()``) beside it. The profile runs while the
  other 3 processes wait, so its compute rates are one process's alone; the collectives are timed
  with all 4 running.
- **Plans** (the adaptive strategy at sp=4, chunk cap ``--cap``): **modes** (``sp_mode="auto"``:
  Ulysses / whole-doc / per-doc per chunk, chosen by the planner with the fitted model),
  **modes (analytic)** (the same with the analytic model), **Ulysses-only** (``sp_mode="ulysses"``),
  **per-doc-only** (the Ulysses-only plan's chunks with every slice per-doc).
- **Runs**: each plan's step (forward and backward, :class:`PipelineExecutor` at sp=4 over the
  4 processes) ``--steps`` times after one warm-up, plans interleaved round by round; the step
  time is the slowest rank's; tokens/s from the median. **Bytes moved inside the stage**: what
  the 4 ranks send one another per step in the attention's collectives (counted by wrapping
  ``all_to_all_single``, ``all_gather``, ``reduce_scatter``: an all-to-all sends ``(sp - 1) / sp``
  of its input, an all-gather its (padded) input to each of the ``sp - 1`` others, a
  reduce-scatter ``sp - 1`` output-sized blocks), beside the planner's prediction
  (``SimResult.stage_comm_bytes``); each plan's predicted step time relative to Ulysses-only's
  under both models (``simulate``).

Writes benchmarks/results/flashcp_measured.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import Run, write_results  # noqa: E402

SP = 4


def _batches(quick: bool) -> dict[str, list[int]]:
    rng = random.Random(0)
    k = 4 if quick else 1
    return {"long-tail": [1536 // k] + [rng.randint(16, 128) for _ in range(40 // k)],
            "all-short": [rng.randint(16, 96) for _ in range(64 // k)]}


def _config(quick: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=4096, hidden_size=64 if quick else 256, intermediate_size=128 if quick else 512,
                       num_hidden_layers=2 if quick else 4, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=4096, tie_word_embeddings=False)


def _plans(lens: list[int], cost, analytic, layout, cap: int) -> dict:
    from concertina_hf.planning import plan_step
    from concertina_hf.planning.sharding import PER_DOC

    modes = plan_step(lens, cost, layout, 0, "adaptive", sp_mode="auto", max_tokens_per_chunk=cap)
    modes_a = plan_step(lens, analytic, layout, 0, "adaptive", sp_mode="auto", max_tokens_per_chunk=cap)
    ulysses = plan_step(lens, cost, layout, 0, "adaptive", sp_mode="ulysses", max_tokens_per_chunk=cap)
    per_doc = dataclasses.replace(ulysses, chunks=tuple(dataclasses.replace(c, placement=(PER_DOC,) * len(c.slices))
                                                        for c in ulysses.chunks), strategy="per-doc-only")
    return {"modes": modes, "modes (analytic)": modes_a, "Ulysses-only": ulysses, "per-doc-only": per_doc.validate()}


def _fitted_cost(model, base, group, rank: int, cap: int):
    """``base`` fitted on this machine as run_setup's profiled path fits it (module docstring):
    rank 0 profiles the layers (chunks up to ``cap``), every rank the collectives. Collective."""
    import torch.distributed as dist

    from concertina_hf.planning import CostModel
    from concertina_hf.runtime.profiler import profile_cost_model
    from concertina_hf.runtime.ulysses import default_a2a_token_counts, profile_all_gather, profile_all_to_all

    payload = [None]
    if rank == 0:
        payload = [profile_cost_model(model, base=base, num_layers=base.num_layers, max_tokens=max(32, cap)).to_dict()]
    dist.broadcast_object_list(payload, src=0)
    tokens = default_a2a_token_counts(cap, SP)
    cost = profile_all_to_all(CostModel.from_dict(payload[0]), group, tokens)
    return profile_all_gather(cost, group, tokens)


class _Bytes:
    """Counts what this rank sends in the attention's collectives (see the module docstring) and
    the seconds it spends in them (waiting for the other ranks included)."""

    def __init__(self, sp: int) -> None:
        import torch.distributed as dist

        self.sent, self.sp, self.seconds = 0, sp, 0.0
        a2a, ag, rs = dist.all_to_all_single, dist.all_gather, dist.reduce_scatter

        def timed(fn, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        def all_to_all_single(out, x, *a, **kw):
            self.sent += x.numel() * x.element_size() * (self.sp - 1) // self.sp
            return timed(a2a, out, x, *a, **kw)

        def all_gather(parts, x, *a, **kw):
            self.sent += x.numel() * x.element_size() * (self.sp - 1)
            return timed(ag, parts, x, *a, **kw)

        def reduce_scatter(out, parts, *a, **kw):
            self.sent += out.numel() * out.element_size() * (self.sp - 1)
            return timed(rs, out, parts, *a, **kw)

        dist.all_to_all_single, dist.all_gather, dist.reduce_scatter = all_to_all_single, all_gather, reduce_scatter


def _worker(rank: int, port: int, quick: bool, steps: int, cap: int, outdir: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SP,
                            timeout=timedelta(seconds=600))
    from transformers import AutoModelForCausalLM

    from concertina_hf.planning import CostModel, DeviceSpec, StageLayout
    from concertina_hf.planning.simulate import simulate
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    counter = _Bytes(SP)
    cfg = _config(quick)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    layout = StageLayout.even(cfg.num_hidden_layers, 1)
    base = CostModel.from_hf_config(cfg, DeviceSpec.cpu(), dtype_bytes=4)
    analytic = base.with_parallel(sp=SP, state_shards=1)
    fitted = _fitted_cost(model, base, dist.group.WORLD, rank, cap)
    cost = fitted.with_parallel(sp=SP, state_shards=1)
    ex = PipelineExecutor(PipelineWrapper(model, layout, 0), sp_group=dist.group.WORLD, measure_memory=False)
    rows = []
    for batch, lens in _batches(quick).items():
        g = torch.Generator().manual_seed(1)
        ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
        plans = _plans(lens, cost, analytic, layout, cap)
        times: dict[str, list[float]] = {name: [] for name in plans}
        in_comm: dict[str, list[float]] = {name: [] for name in plans}
        sent: dict[str, int] = {}
        for step in range(steps + 1):
            for name, plan in plans.items():
                model.zero_grad(set_to_none=True)
                dist.barrier()
                before, comm0, t0 = counter.sent, counter.seconds, time.perf_counter()
                ex.run_step(plan, ids)
                took = torch.tensor([time.perf_counter() - t0, counter.seconds - comm0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if step:
                    times[name].append(float(took[0]))
                    in_comm[name].append(float(took[1]))
                total = torch.tensor([counter.sent - before], dtype=torch.float64)
                dist.all_reduce(total)
                sent[name] = int(total)
        for name, plan in plans.items():
            modes: dict[str, int] = {}
            from concertina_hf.planning.sharding import chunk_mode

            for c in plan.chunks:
                modes[chunk_mode(c)] = modes.get(chunk_mode(c), 0) + 1
            rows.append(dict(batch=batch, plan=name, tokens=sum(lens), sequences=len(lens), chunks=len(plan.chunks),
                             modes=modes, step_s=statistics.median(times[name]), times=times[name],
                             comm_s=statistics.median(in_comm[name]),
                             predicted_comm_s=simulate(plan, cost).comm_time_s,
                             bytes_measured=sent[name], bytes_predicted=simulate(plan, cost).stage_comm_bytes,
                             predicted_step_s=simulate(plan, cost).step_time_s,
                             analytic_step_s=simulate(plan, analytic).step_time_s))
    if rank == 0:
        keep = ("alpha_attn", "alpha_tok", "beta", "bwd_factor", "intra_node_latency_s", "intra_node_bandwidth",
                "all_gather_latency_s", "all_gather_bandwidth", "reduce_scatter_latency_s", "reduce_scatter_bandwidth")
        pathlib.Path(outdir, "rows.json").write_text(json.dumps(
            {"rows": rows, "fitted": {k: getattr(fitted, k) for k in keep},
             "analytic": {k: getattr(base, k) for k in keep}}))
    dist.barrier()
    dist.destroy_process_group()


def _link(fit: dict, name: str) -> str:
    """A fitted collective as ``latency + bytes / bandwidth`` in words."""
    from concertina_hf.runtime.ulysses import LATENCY_BOUND_BANDWIDTH

    lat, bw = fit[f"{name}_latency_s"], fit[f"{name}_bandwidth"]
    size = "(latency-bound: no size term)" if bw >= LATENCY_BOUND_BANDWIDTH else f"+ bytes at {bw / 1e6:.0f} MB/s"
    return f"{lat * 1e3:.2f} ms {size}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per plan (default 5; --quick 2)")
    ap.add_argument("--cap", type=int, default=None, help="tokens per chunk cap (default 512; --quick 128)")
    ap.add_argument("--out", default="benchmarks/results/flashcp_measured")
    args = ap.parse_args(argv)
    run_ = Run(__file__, argv)
    steps = args.steps or (2 if args.quick else 5)
    cap = args.cap or (128 if args.quick else 512)
    import torch.multiprocessing as mp

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    from _helpers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(free_port(), args.quick, steps, cap, tmp), nprocs=SP, join=True)
        got = json.loads(pathlib.Path(tmp, "rows.json").read_text())
    rows, fit = got["rows"], got["fitted"]
    base = {r["batch"]: r for r in rows if r["plan"] == "Ulysses-only"}
    lines = ["# Whole-doc / per-doc / Ulysses inside a stage, measured (pp=1 x sp=4, 4 CPU processes)", "",
             f"{SP} processes share this machine's cores: tokens/s as ratios to Ulysses-only. Chunk cap {cap}, "
             f"{steps} timed steps per plan (median). Plans use the cost model fitted here (profiled compute; "
             f"collectives on the {SP} processes, a call: all-to-all {_link(fit, 'intra_node')}, all-gather "
             f"{_link(fit, 'all_gather')}, reduce-scatter {_link(fit, 'reduce_scatter')}), except *modes (analytic)*; "
             "predicted steps under both.", "",
             "*in collectives*: seconds a step the slowest rank spends inside the attention's collectives "
             "(waiting for the others included), beside the fitted model's (`SimResult.comm_time_s`); the "
             "rest of the step is compute (the fitted model's compute is one process's alone).", "",
             "| batch | plan | chunks (modes) | tokens/s | x Ulysses-only | step s | in collectives s (predicted) "
             "| bytes in stage / step (measured) | x Ulysses-only | predicted bytes "
             "| predicted step x Ulysses-only (fitted) | (analytic) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = base[r["batch"]]
        tps = r["tokens"] / r["step_s"]
        modes = ", ".join(f"{k} {v}" for k, v in sorted(r["modes"].items()))
        lines.append(f"| {r['batch']} ({r['sequences']} seq, {r['tokens']} tok) | {r['plan']} | {r['chunks']} ({modes}) "
                     f"| {tps:.0f} | {b['step_s'] / r['step_s']:.2f} | {r['step_s']:.2f} "
                     f"| {r['comm_s']:.2f} ({r['predicted_comm_s']:.2f}) | {r['bytes_measured'] / 2**20:.1f} MiB "
                     f"| {r['bytes_measured'] / max(b['bytes_measured'], 1):.2f} | {r['bytes_predicted'] / 2**20:.1f} MiB "
                     f"| {b['predicted_step_s'] / r['predicted_step_s']:.2f} "
                     f"| {b['analytic_step_s'] / r['analytic_step_s']:.2f} |")
    write_results(args.out, "\n".join(lines), {"rows": rows, "cap": cap, "steps": steps, "quick": args.quick,
                                                "fitted": fit, "analytic": got["analytic"]}, run_)


if __name__ == "__main__":
    main()
