"""Rerun every headline benchmark: each with the arguments that produced its committed result.

    python benchmarks/run_all.py --list              # what it would run, in order (runs nothing)
    python benchmarks/run_all.py                     # everything on CPU: about 1-1.5 h on 2 quiet cores
    python benchmarks/run_all.py --quick             # the short settings (about 15-20 min), results *_quick
    python benchmarks/run_all.py --only measured,measured_sp   # some of them
    python benchmarks/run_all.py --gpu               # also gpu_check.py (one CUDA GPU)

Each benchmark runs as its own process (one's threads and imports never touch another's), with
``HF_HUB_OFFLINE=1`` and ``OMP_NUM_THREADS=1``, in the order below (``measured`` first: the cost
model ``pipeline_efficiency`` and ``torch_pipelining_peer`` reuse is the one it profiles). Every
result file starts with the shared header (``_results.py``: command, date, commit, cores, load
average before and after, versions). The timings measured on CPU move with the machine's load:
run on quiet cores, and read the cores probe each result gives. The one-off studies
(``benchmarks/studies/``) are not run here.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

__all__ = ["BENCHMARKS", "main"]

#: name: (script, full arguments = those of the committed result, --quick arguments, what, full time on 2 cores)
BENCHMARKS: dict[str, tuple[str, list[str], list[str], str, str]] = {
    "plan_benchmark": ("plan_benchmark.py", [],
                       ["--batches", "1", "--repeats", "1", "--out", "benchmarks/results/measured_quick_plan_benchmark"],
                       "every strategy's predicted step time, paper setting and stdlib corpus", "~30 s"),
    "paper_layout": ("paper_layout.py", [],
                     ["--batches", "1", "--solver", "greedy", "--out", "benchmarks/results/paper_layout_quick"],
                     "the paper's 32-GPU layout simulated, sp-only included", "~2-4 min"),
    "layout_auto": ("layout_auto.py", [], [], "concertina plan --layout auto on 32 GPUs at 64K and 128K "
                    "(LLaMA-7B/13B/30B)", "~3 min"),
    "layout_measured": ("layout_measured.py", [], ["--quick", "--out", "benchmarks/results/layout_measured_quick"],
                        "concertina_layout='auto' vs every fixed layout of 4 processes, two length distributions (CPU)",
                        "~6-10 min"),
    "flashcp": ("flashcp.py", [], ["--batches", "1", "--quick", "--out", "benchmarks/results/flashcp_quick"],
                "whole-doc / per-doc / Ulysses per chunk vs Ulysses-only vs sp-only, 32 GPUs simulated", "~5 min"),
    "flashcp_measured": ("flashcp_measured.py", [], ["--quick", "--out", "benchmarks/results/flashcp_measured_quick"],
                         "planner modes vs Ulysses-only vs per-doc-only at pp=1 x sp=4, 4 processes on CPU",
                         "~1-5 min"),
    "planner_speed": ("planner_speed.py", [], ["--repeats", "1", "--out", "benchmarks/results/planner_speed_quick"],
                      "simulator and recompute solvers on a 512-sequence plan", "~30 s"),
    "planner_fuzz": ("planner_fuzz.py", ["--seconds", "120"],
                     ["--seconds", "10", "--out", "benchmarks/results/planner_fuzz_quick"],
                     "random plan_step calls against the planner's contract", "~2 min"),
    "cost_model_accuracy": ("cost_model_accuracy.py", [],
                            ["--repeats", "1", "--no-steps", "--out", "benchmarks/results/cost_model_accuracy_quick"],
                            "profiled cost model against measured chunks and steps (CPU)", "~1-3 min"),
    "measured": ("measured.py", [], ["--quick"],
                 "pp=2 adaptive vs tuned packed / split vs Trainer, measured on CPU", "~15-25 min"),
    "measured_sp": ("measured_sp.py", [], ["--quick"],
                    "pp=2 x sp=2 vs pp=1 x sp=4 vs pp=4 x sp=1, 4 processes on CPU", "~5-8 min"),
    "pipeline_efficiency": ("pipeline_efficiency.py", ["--before", "warmup", "--before", "planner", "--max-wait", "60"],
                            ["--quick"], "pp=2 against twice the project's pp=1 on CPU", "~10-30 min"),
    "torch_pipelining_peer": ("torch_pipelining_peer.py", [], ["--quick"],
                              "torch.distributed.pipelining (1F1B) against adaptive on CPU", "~15 min"),
    "stage_loading": ("stage_loading.py", [], ["--quick", "--no-self-check", "--out",
                                               "benchmarks/results/stage_loading_quick"],
                      "pp=4 peak RSS per rank loading and saving by stage vs a model object (1.2 GB)", "~1 min"),
    "segments": ("segments.py", [], ["--quick", "--out", "benchmarks/results/segments_quick"],
                 "one 32K-64K sequence per step: segment options vs full attention (CPU); 128K-1M simulated",
                 "~5-8 min"),
}
#: on a CUDA GPU only (``--gpu``): the committed result is written to benchmarks/results/gpu/
GPU = {"gpu_check": ("gpu_check.py", [], ["--only", "a,c", "--budget-s", "240", "--out", "benchmarks/results/gpu_quick"],
                     "the runtime's CUDA paths on one GPU (attention, Trainer, profiler, MFU, memory)", "~5-8 min")}


def commands(quick: bool, only: list[str] | None, gpu: bool, py: str = "python") -> list[tuple[str, list[str]]]:
    table = dict(BENCHMARKS, **GPU)
    names = only or [*BENCHMARKS, *(GPU if gpu else ())]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"run_all: unknown benchmark(s) {unknown}; choose from {', '.join(table)}")
    return [(n, [py, f"benchmarks/{table[n][0]}", *(table[n][2] if quick else table[n][1])]) for n in names]


def _run(cmd: list[str]) -> float:
    print(f"[run_all] {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, cwd=HERE.parent, env=env)
    dt = time.perf_counter() - t0
    print(f"[run_all] done in {dt:.0f} s", flush=True)
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print what would run, run nothing")
    ap.add_argument("--quick", action="store_true", help="the short settings (results named *_quick)")
    ap.add_argument("--only", default=None, help="comma-separated names (default: every headline benchmark)")
    ap.add_argument("--gpu", action="store_true", help="also gpu_check.py (needs one CUDA GPU)")
    args = ap.parse_args(argv)
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    table = dict(BENCHMARKS, **GPU)
    if args.list:
        for name, cmd in commands(args.quick, only, args.gpu):
            what, t = table[name][3], table[name][4]
            print(f"{name:<22} {' '.join(cmd)}\n{'':<22} {what} ({'short' if args.quick else t})")
        return 0
    for name, cmd in commands(args.quick, only, args.gpu, py=sys.executable):
        _run(cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
