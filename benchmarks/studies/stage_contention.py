"""Stage contention: how fast one rank's layers, head and embedding run while the other rank
sleeps, waits in a gloo receive the way the executor waits, or computes (CPU, one thread each).

    flock /tmp/concertina_bench.lock python benchmarks/studies/stage_contention.py           # 10M Llama, ~2-3 min
    python benchmarks/studies/stage_contention.py --quick                                     # tiny model, seconds
    python benchmarks/studies/stage_contention.py --check                                     # --quick, asserting its invariants

Two processes, one thread each, a gloo group between them (as ``_pipeline_worker``). Rank 0
times a fixed loop of forward + backward of (a) the pipeline's stage-0 decoder layers on a
chunk, (b) the head (final norm, LM head, float32 summed cross-entropy), (c) the embedding, on
the profiler's own probe (:mod:`concertina_hf.runtime.probe`: the runtime's ``run_layers``,
``head_loss_sum``, ``embed``), wall time and CPU time per pass (median over the loop), while
rank 1:

- ``sleep``: sleeps (the machine's other core idle: what a stage gets when its peer is done);
- ``recv``: waits in :meth:`StageComm.exchange` for a message rank 0 sends once it is done
  (``batch_isend_irecv`` then ``Work.wait``: the executor's way of waiting for a neighbour);
- ``layers`` / ``head``: runs the same layers (or the head) on the same chunk in a loop (the
  other stage computing: what the two stages of a pp=2 step do most of the time).

Reported: each measurement's time over its ``sleep`` time (1.00: the peer costs nothing), the
load average and the cores probe (``_pipeline_worker._capacity_probe``). Writes
``benchmarks/results/studies/stage_contention.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH = pathlib.Path(__file__).resolve().parents[1]
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
RESULTS = BENCH / "results" / "studies"
PEER_MODES = ("sleep", "recv", "layers", "head")
WORKS = ("layers", "head", "embed")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, short loops (smoke)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens of the chunk (default 512; --quick 64)")
    ap.add_argument("--context", type=int, default=None,
                    help="context before the chunk's slice (default 1536: a late slice of a 4K sequence; --quick 0)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers timed (default 5, stage 0's; --quick 2)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds of each timed loop (default 4; --quick 0.3)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds over the peer modes (default 2; --quick 1)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    q = args.quick
    args.tokens = args.tokens or (64 if q else 512)
    args.context = args.context if args.context is not None else (0 if q else 1536)
    args.layers = args.layers or (2 if q else 5)
    args.seconds = args.seconds or (0.3 if q else 4.0)
    args.rounds = args.rounds or (1 if q else 2)
    args.out = args.out or RESULTS / ("stage_contention_quick" if q else "stage_contention")
    return args


def _config(quick: bool) -> dict[str, Any]:
    import measured

    pre = measured.PRESETS["tiny" if quick else "full"]
    return measured.model_config(pre["model"], 4096)


def _work(pr, what: str, tokens: int, context: int):
    """A closure running one forward + backward of ``what`` on the probe."""
    import torch

    from concertina_hf.runtime.attention import ChunkAttentionContext
    from concertina_hf.runtime.probe import _specs

    if what == "layers":
        specs = _specs(((context, tokens),), False)
        store = pr._store(specs)  # the context's K/V, kept across passes (their grads accumulate)

        def run():
            x = torch.randn(1, tokens, pr.hidden_size).requires_grad_()
            y = pr.stage.run_layers(x, ChunkAttentionContext(specs, store, pr.device, requires_grad=True), 0)
            torch.autograd.backward(y, torch.randn_like(y))
        return run
    if what == "head":
        targets = torch.randint(0, pr.vocab_size, (tokens,))

        def run():
            x = torch.randn(1, tokens, pr.hidden_size).requires_grad_()
            pr.stage.head_loss_sum(x, targets).backward()
        return run
    ids = torch.randint(0, pr.vocab_size, (tokens,))

    def run():
        y = pr.stage.embed(ids)
        y.backward(torch.ones_like(y))
    return run


def _worker(rank: int, port: int, spec: dict, out_dir: str, flag) -> None:
    import torch
    import torch.distributed as dist

    from _pipeline_worker import _capacity_probe, build_model
    from concertina_hf.runtime.distributed import p2p_channels
    from concertina_hf.runtime.p2p import StageComm
    from concertina_hf.runtime.probe import build_probe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = StageComm(None, rank, 2, p2p_channels([[0, 1]]))
    cores = [_capacity_probe(rank, 2)]
    pr = build_probe(build_model(spec["config"], 0), spec["layers"])
    works = {w: _work(pr, w, spec["tokens"], spec["context"]) for w in WORKS}
    rows = []
    with pr.measuring():
        for w in works.values():  # warm-up
            w()
        for rnd in range(spec["rounds"]):
            for peer in PEER_MODES:
                for what in WORKS:
                    dist.barrier()
                    if rank == 0:
                        flag.value = 0
                        dist.barrier()
                        time.sleep(0.05)  # the peer is in its mode
                        wall, cpu = [], []
                        t_end = time.perf_counter() + spec["seconds"]
                        while time.perf_counter() < t_end or len(wall) < 3:
                            w0, c0 = time.perf_counter(), time.process_time()
                            works[what]()
                            wall.append(time.perf_counter() - w0)
                            cpu.append(time.process_time() - c0)
                        flag.value = 1
                        if peer == "recv":
                            comm.exchange([comm.send_op(torch.ones(4), 1, 7)], [])
                            comm.drain()
                        rows.append({"round": rnd, "peer": peer, "work": what, "passes": len(wall),
                                     "wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
                                     "wall_min_s": min(wall), "cpu_min_s": min(cpu)})
                    else:
                        dist.barrier()
                        c0, w0 = time.process_time(), time.perf_counter()
                        if peer == "sleep":
                            while not flag.value:
                                time.sleep(0.01)
                        elif peer == "recv":
                            comm.exchange([], [comm.recv_op(torch.empty(4), 0, 7)])
                        else:
                            while not flag.value:
                                works[peer]()
                        rows.append({"round": rnd, "peer_mode": peer, "work": what, "peer_cpu_s": time.process_time() - c0,
                                     "peer_wall_s": time.perf_counter() - w0})
    cores.append(_capacity_probe(rank, 2))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"rows": rows, "cores": cores}, fh)
    dist.barrier()
    dist.destroy_process_group()


def summarize(rows: list[dict], peer_rows: list[dict]) -> dict[str, Any]:
    """Per work and peer mode: median over rounds of the median pass (wall, CPU), and its ratio
    to the same work with the peer sleeping; the peer's CPU share while it waited in ``recv``."""
    out: dict[str, Any] = {}
    for what in WORKS:
        base = statistics.median(r["wall_s"] for r in rows if r["work"] == what and r["peer"] == "sleep")
        base_cpu = statistics.median(r["cpu_s"] for r in rows if r["work"] == what and r["peer"] == "sleep")
        out[what] = {}
        for peer in PEER_MODES:
            rs = [r for r in rows if r["work"] == what and r["peer"] == peer]
            wall = statistics.median(r["wall_s"] for r in rs)
            cpu = statistics.median(r["cpu_s"] for r in rs)
            out[what][peer] = {"wall_s": wall, "cpu_s": cpu, "wall_over_sleep": wall / base,
                               "cpu_over_sleep": cpu / base_cpu, "passes": sum(r["passes"] for r in rs)}
    recv = [r for r in peer_rows if r["peer_mode"] == "recv"]
    out["recv_peer_cpu_share"] = sum(r["peer_cpu_s"] for r in recv) / max(1e-9, sum(r["peer_wall_s"] for r in recv))
    return out


def to_markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    L = ["# Stage contention: one rank's compute while the other sleeps, waits in gloo, or computes (CPU)", "",
         f"Chunk: {res['tokens']} tokens after "
         f"{res['context']} of context; {res['layers']} decoder layers of the {res['num_params'] / 1e6:.1f}M Llama "
         f"(hidden {res['config']['hidden_size']}, vocab {res['config']['vocab_size']}), fp32, one thread per "
         f"process. Cores probe "
         f"{'/'.join(f'{c:.2f}' for c in res['cores'])} (2.0 idle).", "",
         "Median pass, forward + backward, ms (wall / CPU), and over the same work with the peer sleeping:", "",
         "| work | " + " | ".join(f"peer {p}" for p in PEER_MODES) + " |", "|---|" + "---|" * len(PEER_MODES)]
    for what in WORKS:
        L.append(f"| {what} | " + " | ".join(
            f"{1e3 * s[what][p]['wall_s']:.1f} / {1e3 * s[what][p]['cpu_s']:.1f} ({s[what][p]['wall_over_sleep']:.3f}x)"
            for p in PEER_MODES) + " |")
    L += ["", f"The peer's CPU share while it waited in `recv` (CPU over wall seconds): {s['recv_peer_cpu_share']:.4f}.",
          "", f"Head over one layer (wall, per pass): peer sleeping {s['head_per_layer']['sleep']:.3f}, peer computing "
          f"layers {s['head_per_layer']['layers_peer']:.3f} (the head against stage 0's layers in a pp=2 step)."
          f" Embedding over one layer: {s['embed_per_layer']:.3f}.", ""]
    return "\n".join(L)


def main(argv=None) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from _pipeline_worker import build_model
    from _results import Run, self_check, write_results
    from measured import _free_port

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--check"]:
        return self_check(main, check)
    run = Run(__file__, argv)
    args = parse_args(argv)
    config = _config(args.quick)
    spec = {"config": config, "tokens": args.tokens, "context": args.context, "layers": args.layers,
            "seconds": args.seconds, "rounds": args.rounds}
    ctx = mp.get_context("spawn")
    flag = ctx.Value("i", 0)
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, spec, tmp, flag)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"stage_contention workers failed: exit codes {[p.exitcode for p in procs]}")
        got = json.load(open(os.path.join(tmp, "rank0.json")))
        rows, cores = got["rows"], got["cores"]
        peer_rows = json.load(open(os.path.join(tmp, "rank1.json")))["rows"]
    summ = summarize(rows, peer_rows)
    n = args.layers
    summ["head_per_layer"] = {"sleep": summ["head"]["sleep"]["wall_s"] / (summ["layers"]["sleep"]["wall_s"] / n),
                              "layers_peer": summ["head"]["layers"]["wall_s"] / (summ["layers"]["layers"]["wall_s"] / n)}
    summ["embed_per_layer"] = summ["embed"]["layers"]["wall_s"] / (summ["layers"]["layers"]["wall_s"] / n)
    res = {"config": config, "num_params": sum(p.numel() for p in build_model(config, 0).parameters()),
           "tokens": args.tokens, "context": args.context, "layers": n, "seconds": args.seconds,
           "cores": cores, "rows": rows, "peer_rows": peer_rows,
           "summary": summ}
    write_results(args.out, to_markdown(res), res, run)
    return res


def check(res: dict[str, Any], md: str) -> None:
    """``--check``: the fields promised, and what holds on any
    machine: a rank waiting for its neighbour the executor's way (``StageComm.exchange``:
    ``batch_isend_irecv`` then ``Work.wait``) sleeps in the wait, it does not poll (its CPU seconds
    are a small share of the wait's wall seconds), so a waiting stage never takes a core from the
    computing one."""
    assert res["command"].startswith("python benchmarks/studies/stage_contention.py --quick"), res["command"]
    assert len(res["cores"]) == 2 and len(res["header"]["load_before"]) == 3 and "| layers |" in md
    s = res["summary"]
    for what in WORKS:
        for peer in PEER_MODES:
            row = s[what][peer]
            assert row["wall_s"] > 0 and row["cpu_s"] > 0 and row["passes"] >= 3, (what, peer, row)
        assert s[what]["sleep"]["wall_over_sleep"] == 1.0
    # a polling wait would burn about a core (share ~1); a blocking one a few thousandths
    assert 0 <= s["recv_peer_cpu_share"] < 0.05, s["recv_peer_cpu_share"]


if __name__ == "__main__":
    main()
