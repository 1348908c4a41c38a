"""Sharded state inside a stage: torch's ``ZeroRedundancyOptimizer`` (what ``concertina_shard_optimizer``
uses) against FSDP2 ``fully_shard(reshard_after_forward=False)`` on the stage's layers.

    python benchmarks/studies/sharded_state.py            # ~2-3 min on 2 busy cores
    python benchmarks/studies/sharded_state.py --quick    # ~40 s, writes results/studies/sharded_state_quick.*
    python benchmarks/studies/sharded_state.py --check    # --quick into a temporary folder, asserting its invariants

Two gloo processes on this machine (the ``dp x sp`` ranks of one stage), one tiny Llama (the
stage's layers), each optimizer step composed as the executor runs it: the chunks of a step
(different tokens on each rank) in 1F1B order with two in flight (``F0 F1 B0 F2 B1 ... B(K-1)``,
as the first of two stages runs them), each forward calling the embedding, every decoder layer
and the norm and head on their own (as ``PipelineExecutor`` does, never the model's own forward),
each backward a separate ``backward()``; then the gradients reduced over the two ranks, the global norm clipped (exact, ``max_grad_norm=1``) and
AdamW stepped:

- ``zero``: the project's path: a whole replica of the layers on each rank,
  ``distributed.reduce_gradients`` (one all-reduce per bucket), ``distributed.global_grad_norm``,
  ``sharded_optimizer.shard_optimizer`` (``ZeroRedundancyOptimizer``: each rank steps its share of the
  parameters, then broadcasts them);
- ``fsdp2``: ``fully_shard`` on the embedding, on every decoder layer, on the norm and on the
  head (each its own unit and its own FSDP root: the executor never runs the model's forward, and
  FSDP2 refuses a unit of several modules without a parent: "FSDP requires a single root module"), ``reshard_after_forward=False``
  (the parameters all-gathered once per step, not once per chunk, as torchtitan composes FSDP with
  pipelining), and, as ``torch.distributed.pipelining`` does for every backward but the last,
  ``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``,
  ``set_is_last_backward(False)`` (the gradients accumulate unsharded and are reduce-scattered
  once, the parameters stay gathered until then), ``clip_grad_norm_`` over the DTensor
  gradients, AdamW over the sharded parameters.

Both start from the same weights and see the same tokens, so their losses must agree (reported:
the largest difference; a check that the FSDP2 composition computes the same step). Each variant
runs in its own fresh pair of processes, alternating ``zero, fsdp2, zero, fsdp2, ...``
(``--rounds`` pairs each), so the memory of one never counts for the other. Reported per variant:
the median step time over the rounds (each round's median after ``--warmup`` steps), and per rank
the resident state between steps (bytes of the parameters, gradients and optimizer state the rank
holds, from the tensors themselves: local shards of DTensors) and the peak RSS growth of the
process over the steps (``ru_maxrss`` at the end minus the RSS before the model was built).
Writes benchmarks/results/studies/sharded_state{_quick}.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import socket
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from _results import Run, self_check, write_results  # noqa: E402

RESULTS = BENCH / "results" / "studies"
FULL = dict(hidden=256, layers=4, vocab=4096, chunks=4, tokens=512, steps=8, warmup=2, rounds=3)
QUICK = dict(hidden=64, layers=2, vocab=512, chunks=3, tokens=64, steps=4, warmup=1, rounds=1)
MAX_GRAD_NORM = 1.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model(cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
                                        intermediate_size=3 * cfg["hidden"], num_hidden_layers=cfg["layers"],
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                        max_position_embeddings=4 * cfg["tokens"]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _one_f_one_b(chunks: int) -> list[int]:
    """Forward ``c`` as ``c``, backward ``c`` as ``-(c + 1)``: F0 F1 B0 F2 B1 ... B(K-1)."""
    order, nxt = [0], 1
    for c in range(chunks):
        if nxt < chunks:
            order.append(nxt)
            nxt += 1
        order.append(-(c + 1))
    return order


def _forward_loss(model, x: torch.Tensor) -> torch.Tensor:
    """The chunk through the model the way the executor runs a stage: the embedding, each decoder
    layer called on its own, the norm and the head; mean next-token loss."""
    inner = model.model
    positions = torch.arange(x.shape[1]).unsqueeze(0)
    h = inner.embed_tokens(x)
    rotary = inner.rotary_emb(h, positions)
    for layer in inner.layers:
        h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        h = h[0] if isinstance(h, tuple) else h
    logits = model.lm_head(inner.norm(h))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def _state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes this rank holds between steps: parameters, gradients, optimizer state (local shards)."""
    from concertina_hf.training.sharded_optimizer import optimizer_share

    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(_local(t).numel() * t.element_size() for s in optimizer_share(optimizer).state.values()
                for t in s.values() if isinstance(t, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def _worker(rank: int, variant: str, cfg: dict, port: int, out: str) -> None:
    from concertina_hf.runtime.distributed import Topology, global_grad_norm, reduce_gradients
    from concertina_hf.training.sharded_optimizer import shard_optimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    cores = None
    if cfg.get("probe_cores"):
        from _pipeline_worker import _capacity_probe

        cores = _capacity_probe(rank, 2)
    rss0 = _rss_bytes()
    model = _model(cfg)
    params = list(model.parameters())
    if variant == "zero":
        topo = Topology(2, rank, 1, 2, 0, rank, dp_group=dist.group.WORLD, dp_ranks=(0, 1),
                        grad_group=dist.group.WORLD)
        optimizer = shard_optimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1), topo)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        # as the executor calls them: the embedding, each decoder layer, the norm, the head, each its
        # own FSDP unit (no root forward runs; a unit of several modules, e.g. [norm, lm_head], is
        # refused: "FSDP requires a single root module")
        units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
        fsdp = [fully_shard(u, mesh=mesh, reshard_after_forward=False) for u in units]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens, the same in both variants
    n_steps = cfg["warmup"] + cfg["steps"]
    data = torch.randint(cfg["vocab"], (n_steps, cfg["chunks"], 1, cfg["tokens"]), generator=g)
    losses, times = [], []
    for step in range(n_steps):
        dist.barrier()
        t0 = time.perf_counter()
        total = 0.0
        # 1F1B with two chunks in flight, as the first stage of two runs them: F0 F1 B0 F2 B1 ... B(K-1)
        pending = []
        for action in _one_f_one_b(cfg["chunks"]):
            if action >= 0:
                pending.append(_forward_loss(model, data[step, action]) / cfg["chunks"])
                continue
            last = action == -cfg["chunks"]
            if variant == "fsdp2":  # gradients reduce-scattered (and parameters resharded) once, after the last
                for unit in fsdp:
                    unit.set_requires_gradient_sync(last)
                    unit.set_reshard_after_backward(last)
                    unit.set_is_last_backward(last)
            loss = pending.pop(0)
            loss.backward()
            total += loss.item()
        if variant == "zero":
            reduce_gradients(params, topo, average=True)
            norm = global_grad_norm([p.grad for p in params], topo, torch.device("cpu"))
            torch.nn.utils.clip_grads_with_norm_(params, MAX_GRAD_NORM, norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            norm = _local(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        optimizer.step()
        if step < n_steps - 1:
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        losses.append(mean.item() / 2)
        if step == n_steps - 1:
            resident = _state_bytes(model, optimizer)
            norm_last = float(norm)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    with open(os.path.join(out, f"{variant}-rank{rank}.json"), "w") as fh:
        json.dump({"times": times[cfg["warmup"]:], "losses": losses, "resident": resident,
                   "peak_rss_growth": peak, "grad_norm": norm_last, "cores": cores}, fh)
    from _pipeline_worker import finish

    finish()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cfg: dict) -> dict:
    runs: dict[str, list] = {"zero": [], "fsdp2": []}
    cores = None
    for r in range(cfg["rounds"]):
        for variant in ("zero", "fsdp2"):
            with tempfile.TemporaryDirectory(prefix="sharded-bench-") as out:
                mp.spawn(_worker, args=(variant, dict(cfg, probe_cores=r == 0 and variant == "zero"), _free_port(),
                                        out), nprocs=2, join=True)
                ranks = [json.loads(pathlib.Path(out, f"{variant}-rank{i}.json").read_text()) for i in range(2)]
            cores = cores if cores is not None else ranks[0]["cores"]
            runs[variant].append(ranks)
    res: dict = {"config": cfg, "cores_probe": cores, "variants": {}}
    for variant, rounds in runs.items():
        res["variants"][variant] = {
            "step_s_median": statistics.median(statistics.median(max(a, b) for a, b in zip(rk[0]["times"], rk[1]["times"]))
                                               for rk in rounds),
            "step_s_rounds": [statistics.median(max(a, b) for a, b in zip(rk[0]["times"], rk[1]["times"]))
                              for rk in rounds],
            "resident_bytes_per_rank": [rk["resident"] for rk in rounds[0]],
            "peak_rss_growth_bytes_per_rank": [max(rk[i]["peak_rss_growth"] for rk in rounds) for i in range(2)],
            "losses": rounds[0][0]["losses"], "grad_norm_last": rounds[0][0]["grad_norm"]}
    z, f = res["variants"]["zero"], res["variants"]["fsdp2"]
    res["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(z["losses"], f["losses"]))
    res["fsdp2_over_zero_step_time"] = f["step_s_median"] / z["step_s_median"]
    return res


def _table(res: dict) -> str:
    cfg, mib = res["config"], 2**20
    lines = ["# Sharded state inside a stage: ZeroRedundancyOptimizer vs FSDP2", "",
             f"2 gloo processes, tiny Llama (hidden {cfg['hidden']}, {cfg['layers']} layers, vocab {cfg['vocab']}), "
             f"{cfg['chunks']} chunks x {cfg['tokens']} tokens per rank and step, {cfg['steps']} timed steps after "
             f"{cfg['warmup']} warm-up, {cfg['rounds']} round(s) per variant, alternating; cores probe "
             f"{res['cores_probe']:.2f} of 2.", "",
             "| variant | step time (median) | per round | resident state per rank (params + grads + optimizer) "
             "| peak RSS growth per rank |", "|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        resident = " / ".join(f"{r['total'] / mib:.2f} MiB ({r['params'] / mib:.2f} + {r['grads'] / mib:.2f} + "
                              f"{r['optimizer'] / mib:.2f})" for r in v["resident_bytes_per_rank"])
        lines.append(f"| {name} | {v['step_s_median'] * 1e3:.1f} ms | "
                     f"{', '.join(f'{t * 1e3:.1f}' for t in v['step_s_rounds'])} ms | {resident} | "
                     f"{' / '.join(f'{b / mib:.1f} MiB' for b in v['peak_rss_growth_bytes_per_rank'])} |")
    lines += ["", f"FSDP2 / ZeRO step time: {res['fsdp2_over_zero_step_time']:.2f}x; largest loss difference between "
              f"the two: {res['loss_max_abs_diff']:.2e} (same weights, same tokens)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    if argv == ["--check"] or (argv is None and sys.argv[1:] == ["--check"]):
        return self_check(main, check)
    run_ = Run(__file__, argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one round: a smoke run (~40 s)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=None, help="results path without suffix")
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for k in ("rounds", "steps"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    out = args.out or str(RESULTS / ("sharded_state_quick" if args.quick else "sharded_state"))
    res = run(cfg)
    write_results(out, _table(res), res, run_)
    return res


def check(res: dict, md: str) -> None:
    """``--check``: the fields promised, and what must
    hold on any machine: both variants compute the same steps (same losses), and each shards the
    optimizer state (each rank holds about half of it)."""
    assert res["command"].startswith("python benchmarks/studies/sharded_state.py --quick"), res["command"]
    assert "Command:" in md
    z, f = res["variants"]["zero"], res["variants"]["fsdp2"]
    assert len(z["losses"]) == len(f["losses"]) == res["config"]["steps"] + res["config"]["warmup"]
    assert res["loss_max_abs_diff"] < 1e-4, (z["losses"], f["losses"])
    assert z["step_s_median"] > 0 and f["step_s_median"] > 0
    # both shard the Adam moments over the two ranks: each holds about half
    for v in (z, f):
        states = [r["optimizer"] for r in v["resident_bytes_per_rank"]]
        assert all(0.3 < s / sum(states) < 0.7 for s in states), states
    # FSDP2 also shards the parameters between steps; ZeRO keeps them whole
    assert all(rf["params"] < 0.7 * rz["params"] for rf, rz in zip(f["resident_bytes_per_rank"],
                                                                   z["resident_bytes_per_rank"]))


if __name__ == "__main__":
    main()
