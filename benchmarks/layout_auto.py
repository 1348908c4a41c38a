"""``concertina plan --layout auto`` at the paper's scale: the layout the planner picks for 32 GPUs.

    python benchmarks/layout_auto.py                 # six CLI runs, under 30 s each on 2 cores

Runs, as a user would (a fresh process each, timed end to end, imports included)::

    concertina plan --gpus 32 --layout auto --model-config {llama-7b,llama-13b,llama-30b} --memory-gb 80 \\
        --distribution github --max-len {65536,131072} --num-seqs 512 --json ...

LLaMA-7B/13B/30B shapes (the paper's three models), 32 GPUs of 80 GiB (``DeviceSpec.a800()``
rates, 8 GPUs a node: assumptions, not measurements), 512 sequences of the shipped long-tail
``github`` distribution (CONSTRUCTED from the paper's published statements,
benchmarks/data/make_distributions.py) capped at 64K and 128K.
Every pp x sp x dp layout the runtime can run is planned with ``adaptive`` (greedy recompute
solver; dp > 1: the batch split over the replicas by LPT on estimated cost, the slowest replica
sets the step) unless a lower bound of its step time is above the best found (pruned);
``sp-only`` (no pipeline) is planned as the runtime would hold its state (ZeRO-1) but is not
runnable by the trainer: a reference, never chosen. Reports per cap: the wall time, the chosen
layout, its ratio to the paper's pp4 x sp8 and to sp-only, and the full table. Writes
benchmarks/results/layout_auto.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import Run, write_results  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_cli(max_len: int, num_seqs: int, gpus: int, model: str, memory_gb: float, device: str) -> dict:
    """One ``concertina plan --layout auto`` in a fresh process: its output, JSON and wall time."""
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "auto.json"
        argv = ["plan", "--gpus", str(gpus), "--layout", "auto", "--model-config", model, "--memory-gb", f"{memory_gb:g}",
                "--device", device, "--distribution", "github", "--max-len", str(max_len), "--num-seqs", str(num_seqs),
                "--json", str(out)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "concertina_hf.tools.cli", *argv], capture_output=True,
                              text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"concertina plan failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        data = json.loads(out.read_text())
    shown = " ".join("'" + a + "'" if " " in a else a for a in argv if not a.endswith("auto.json"))
    return {"command": "concertina " + shown.replace("--json", "--json OUT.json"), "wall_s": round(wall, 2),
            "stdout": proc.stdout.replace(str(out), "OUT.json"), "table": data}


def summary(res: dict) -> dict:
    rows = res["table"]["rows"]
    best = next(r for r in rows if r["status"] == "ok")
    paper = next((r for r in rows if (r["pp"], r["sp"], r["dp"]) == (4, 8, 1)), None)
    ref = next((r for r in rows if r["status"] == "reference"), None)

    def ratio(r):
        if r is None or r.get("step_time_s") is None:
            return None
        return round(r["step_time_s"] / best["step_time_s"], 4)

    return {"chosen": best["layout"], "chosen_step_s": round(best["step_time_s"], 3),
            "pp4_sp8_status": paper["status"] if paper else "not a layout",
            "pp4_sp8_step_s": paper and paper.get("step_time_s") and round(paper["step_time_s"], 3),
            "pp4_sp8_over_chosen": ratio(paper),
            "sp_only_step_s": ref and ref.get("step_time_s") and round(ref["step_time_s"], 3),
            "sp_only_layout": ref and ref["layout"], "sp_only_over_chosen": ratio(ref),
            "sp_only_peak_gib": ref and ref.get("peak_memory_bytes") and round(ref["peak_memory_bytes"] / 2**30, 1),
            "planned": sum(r["status"] == "ok" for r in rows), "pruned": sum(r["status"] == "pruned" for r in rows),
            "infeasible": sum(r["status"] == "infeasible" for r in rows),
            "refused": sum(r["status"] == "refused" for r in rows), "wall_s": res["wall_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-lens", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--num-seqs", type=int, default=512)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--model-configs", nargs="+", default=["llama-7b", "llama-13b", "llama-30b"])
    ap.add_argument("--memory-gb", type=float, default=80)
    ap.add_argument("--device", default="a800")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "layout_auto"))
    args = ap.parse_args(argv)
    run_ = Run(__file__, argv)
    record = {"runs": []}
    lines = ["# `concertina plan --layout auto` at paper scale", "",
             f"{', '.join(args.model_configs)} shapes, {args.gpus} GPUs of {args.memory_gb:g} GiB "
             f"(`--device {args.device}` rates, "
             "assumed), 8 per node; the shipped `github` long-tail distribution (constructed, not measured). "
             "Each command in a fresh process, timed end to end (imports included) on this machine's 2 cores. "
             "`vs chosen`: step time over the chosen layout's. sp-only: planned as the runtime would hold its "
             "state (ZeRO-1), not runnable by the trainer (a reference, never chosen).", "",
             "| model | cap | wall (s) | chosen | step (s) | pp4 x sp8 | pp4 x sp8 vs chosen | sp-only "
             "| sp-only vs chosen "
             "| sp-only peak GiB | planned / pruned / infeasible / refused |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, max_len in [(m, n) for m in args.model_configs for n in args.max_lens]:
        res = run_cli(max_len, args.num_seqs, args.gpus, model, args.memory_gb, args.device)
        s = summary(res)
        res["model"] = model
        record["runs"].append({"model": model, "max_len": max_len, "summary": s, "command": res["command"],
                               "table": res["table"]})
        lines.append(f"| {model} | {max_len // 1024}K | {s['wall_s']} | {s['chosen']} | {s['chosen_step_s']} | "
                     f"{s['pp4_sp8_step_s'] if s['pp4_sp8_step_s'] else s['pp4_sp8_status']} | "
                     f"{s['pp4_sp8_over_chosen'] or '-'} | {s['sp_only_step_s'] or '-'} ({s['sp_only_layout']}) | "
                     f"{s['sp_only_over_chosen'] or '-'} | {s['sp_only_peak_gib'] or '-'} | "
                     f"{s['planned']} / {s['pruned']} / {s['infeasible']} / {s['refused']} |")
        res["summary"] = s
        record.setdefault("_outputs", []).append(res)
    for res in record.pop("_outputs"):
        lines += ["", f"## {res['model']}, {res['table']['longest'] // 1024}K cap", "", "```",
                  f"$ time {res['command']}", res["stdout"].rstrip(), f"(wall {res['wall_s']} s)", "```"]
    write_results(args.out, "\n".join(lines) + "\n", record, run_)
    return 0


if __name__ == "__main__":
    sys.exit(main())
