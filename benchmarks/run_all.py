"""Regenerate every benchmark result under ``benchmarks/results/`` with one command.

    python benchmarks/run_all.py            # full: planner benchmark (~30 s) + measured runs (~15-25 min)
    python benchmarks/run_all.py --quick    # short: ~2-3 min, results named *_quick

Runs, in order, each as its own process (so one's threads and imports do not touch the other):

1. ``plan_benchmark.py``: predicted step times of every strategy (paper setting and stdlib
   corpus), writes ``results/plan_benchmark.{md,json}`` (``--quick``: one batch, one repeat,
   written to ``results/measured_quick_plan_benchmark.{md,json}`` so the committed full results
   stay as they are);
2. ``measured.py``: real CPU runs (pp=2 adaptive vs tuned packed / split, single-process
   Trainer with and without checkpointing, three context lengths) and the simulated paper scale
   with profiled coefficients, writes ``results/measured.{md,json,png}`` and
   ``results/gantt_measured.png`` (``--quick``: ``measured_quick*``);
3. ``measured_sp.py``: four processes, pp=2 x sp=2 vs pp=1 x sp=4 vs pp=4 x sp=1 (adaptive,
   same batches), writes ``results/measured_sp.{md,json}`` (~5-8 min; ``--quick``:
   ``measured_sp_quick*``; ``--skip-sp`` leaves it out).

Extra arguments after ``--`` go to ``measured.py`` (e.g. ``-- --steps 5``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

__all__ = ["main"]


def _run(cmd: list[str]) -> None:
    print(f"[run_all] {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, cwd=HERE.parent, env=env)
    print(f"[run_all] done in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (about 3 minutes)")
    ap.add_argument("--skip-planner", action="store_true", help="do not rerun plan_benchmark.py")
    ap.add_argument("--skip-sp", action="store_true", help="do not run measured_sp.py (4 processes)")
    ap.add_argument("rest", nargs="*", help="extra arguments for measured.py (after --)")
    args = ap.parse_args(argv)
    py = sys.executable
    if not args.skip_planner:
        plan = [py, "benchmarks/plan_benchmark.py"]
        if args.quick:
            plan += ["--batches", "1", "--repeats", "1", "--out", "benchmarks/results/measured_quick_plan_benchmark"]
        _run(plan)
    _run([py, "benchmarks/measured.py", *(["--quick"] if args.quick else []), *args.rest])
    if not args.skip_sp:
        _run([py, "benchmarks/measured_sp.py", *(["--quick"] if args.quick else [])])


if __name__ == "__main__":
    main()
