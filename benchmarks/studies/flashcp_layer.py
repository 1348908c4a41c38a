"""Why per-doc is slower than Ulysses on this machine: one decoder layer's forward + backward per
step under Ulysses, per-doc and whole-doc, measured in parts and beside the cost model's parts.

    flock /tmp/heavy.lock python benchmarks/studies/flashcp_layer.py      # ~3-4 min on 2 busy cores

pp=1 x sp=4 on 4 CPU processes (gloo, one thread each), ``flashcp_measured.py``'s model (hidden
256, 8 heads, 4 K/V heads, float32) and batches (*long-tail*, *all-short*) at chunk cap 512. Per
batch, three plans on the same chunks (the Ulysses-only plan's): **Ulysses**, **per-doc** (every
slice per-doc), **context** (each chunk as ``sp_mode="context"`` places it: whole-doc where it
balances, per-doc for the sequences that unbalance it). Each plan's step runs on the model with 4
decoder layers and with 1 (fastest of 3 after a warm-up, the slowest rank's); **per layer** is
their difference over 3 (embedding and head cancel), split into the time the slowest rank spends
inside the attention's collectives (waiting for the others included: ``all_to_all_single``, or
``all_gather`` and ``reduce_scatter``) and the rest (compute). Beside them the cost model's
per-layer sums over the chunks (``placed_layer_time``; collectives ``2 a2a_time`` or the K/V
all-gather plus reduce-scatter, ``gather_kv_time``): the analytic model (``DeviceSpec.cpu()``)
and the model fitted here as ``flashcp_measured.py`` fits it (profiled compute of one process
alone, collectives timed on the 4 processes). Writes
``benchmarks/results/studies/flashcp_layer.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from _results import Run, write_results  # noqa: E402
from flashcp_measured import SP, _batches, _Bytes, _config, _fitted_cost  # noqa: E402

CAP = 512


def _layer_plans(lens, cost, layout) -> dict:
    from concertina_hf.planning import plan_step
    from concertina_hf.planning.placement import choose_placement
    from concertina_hf.planning.sharding import PER_DOC

    uly = plan_step(lens, cost, layout, 0, "adaptive", sp_mode="ulysses", max_tokens_per_chunk=CAP)

    def placed(choose):
        return dataclasses.replace(uly, chunks=tuple(dataclasses.replace(c, placement=choose(c))
                                                     for c in uly.chunks)).validate()
    return {"Ulysses": uly, "per-doc": placed(lambda c: (PER_DOC,) * len(c.slices)),
            "context": placed(lambda c: choose_placement(c, cost, "context") or (PER_DOC,) * len(c.slices))}


def _predicted(cost, plan) -> tuple[float, float]:
    """Per layer (forward + backward, summed over the plan's chunks): total and collectives."""
    from concertina_hf.planning import StageLayout

    one = StageLayout.even(1, 1)
    total = sum(cost.placed_layer_time(c) for c in plan.chunks)
    comm = sum(cost.comm_time(one, 0, c, False) + cost.comm_time(one, 0, c, True) for c in plan.chunks)
    return total, comm


def _worker(rank: int, port: int, outdir: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from concertina_hf.planning import CostModel, DeviceSpec, StageLayout
    from concertina_hf.planning.sharding import chunk_mode
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SP)
    counter = _Bytes(SP)
    rows, fits = [], {}
    for layers in (4, 1):
        cfg = _config(False)
        cfg.num_hidden_layers = layers
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
        layout = StageLayout.even(layers, 1)
        base = CostModel.from_hf_config(cfg, DeviceSpec.cpu(), dtype_bytes=4)
        if layers == 4:  # the fit of the 4-layer model (per layer: the same for 1)
            fits["fitted"] = _fitted_cost(model, base, dist.group.WORLD, rank, CAP).with_parallel(sp=SP, state_shards=1)
            fits["analytic"] = base.with_parallel(sp=SP, state_shards=1)
        ex = PipelineExecutor(PipelineWrapper(model, layout, 0), sp_group=dist.group.WORLD, measure_memory=False)
        for batch, lens in _batches(False).items():
            g = torch.Generator().manual_seed(1)
            ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
            for name, plan in _layer_plans(lens, fits["fitted"], StageLayout.even(4, 1)).items():
                plan = dataclasses.replace(plan, layout=layout).validate()  # the same chunks on 1 layer
                best = None
                for i in range(4):
                    model.zero_grad(set_to_none=True)
                    dist.barrier()
                    comm0, t0 = counter.seconds, time.perf_counter()
                    ex.run_step(plan, ids)
                    took = torch.tensor([time.perf_counter() - t0, counter.seconds - comm0])
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    if i and (best is None or took[0] < best[0]):
                        best = took
                modes: dict[str, int] = {}
                for c in plan.chunks:
                    modes[chunk_mode(c)] = modes.get(chunk_mode(c), 0) + 1
                row = dict(layers=layers, batch=batch, plan=name, modes=modes, step_s=float(best[0]),
                           comm_s=float(best[1]))
                for key, cost in fits.items():
                    row[f"{key}_layer_s"], row[f"{key}_comm_s"] = _predicted(cost, plan)
                rows.append(row)
    if rank == 0:
        keep = ("alpha_attn", "alpha_tok", "beta", "bwd_factor", "intra_node_latency_s", "intra_node_bandwidth",
                "all_gather_latency_s", "all_gather_bandwidth", "reduce_scatter_latency_s", "reduce_scatter_bandwidth")
        pathlib.Path(outdir, "rows.json").write_text(json.dumps(
            {"rows": rows, "fitted": {k: getattr(fits["fitted"], k) for k in keep}}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/studies/flashcp_layer")
    args = ap.parse_args(argv)
    run_ = Run(__file__, argv)
    import torch.multiprocessing as mp

    sys.path.insert(0, str(BENCH.parent / "tests"))
    from _helpers import free_port

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(free_port(), tmp), nprocs=SP, join=True)
        got = json.loads(pathlib.Path(tmp, "rows.json").read_text())
    rows = got["rows"]
    at = {(r["layers"], r["batch"], r["plan"]): r for r in rows}
    lines = ["# One decoder layer under Ulysses / per-doc / whole-doc (pp=1 x sp=4, 4 CPU processes)", "",
             "Per layer (forward + backward, all the step's chunks): (4-layer step - 1-layer step) / 3, the "
             "slowest rank's; *in collectives* the time inside the attention's collectives (waiting "
             "included), *compute* the rest. Predicted: the cost model's per-layer sums (fitted here: profiled "
             "compute of one process alone, collectives on the 4 processes; analytic: `DeviceSpec.cpu()`). "
             "4 processes share 2 cores: compare ratios.", "",
             "| batch | plan | chunks (modes) | per layer s | in collectives s | compute s | x Ulysses | "
             "fitted: per layer s | collectives s | x Ulysses | analytic: per layer ms | collectives ms | x Ulysses |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out = []
    for (layers, batch, plan), r4 in at.items():
        if layers != 4:
            continue
        r1, u4, u1 = at[(1, batch, plan)], at[(4, batch, "Ulysses")], at[(1, batch, "Ulysses")]
        layer = (r4["step_s"] - r1["step_s"]) / 3
        comm = (r4["comm_s"] - r1["comm_s"]) / 3
        u_layer = (u4["step_s"] - u1["step_s"]) / 3
        modes = ", ".join(f"{k} {v}" for k, v in sorted(r4["modes"].items()))
        lines.append(f"| {batch} | {plan} | {sum(r4['modes'].values())} ({modes}) | {layer:.3f} | {comm:.3f} "
                     f"| {layer - comm:.3f} | {layer / u_layer:.2f} | {r4['fitted_layer_s']:.3f} "
                     f"| {r4['fitted_comm_s']:.3f} | {r4['fitted_layer_s'] / u4['fitted_layer_s']:.2f} "
                     f"| {r4['analytic_layer_s'] * 1e3:.2f} | {r4['analytic_comm_s'] * 1e3:.2f} "
                     f"| {r4['analytic_layer_s'] / u4['analytic_layer_s']:.2f} |")
        out.append(dict(batch=batch, plan=plan, layer_s=layer, comm_s=comm, **{k: r4[k] for k in r4 if k.startswith(("fitted_", "analytic_"))}))
    write_results(args.out, "\n".join(lines), {"rows": out, "steps": rows, "fitted": got["fitted"]}, run_)


if __name__ == "__main__":
    main()
