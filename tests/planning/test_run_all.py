"""benchmarks/run_all.py reruns exactly the headline benchmarks (every script at the top of
benchmarks/, private workers and run_all itself aside; the one-off studies live in
benchmarks/studies/), each with the command of its committed result; and the shared header
(benchmarks/_results.py) every benchmark writes."""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))


def test_run_all_lists_every_headline_benchmark_with_its_committed_command(capsys):
    import run_all

    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_") and p.name != "run_all.py"}
    table = dict(run_all.BENCHMARKS, **run_all.GPU)
    assert {v[0] for v in table.values()} == scripts
    assert run_all.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name, (script, full, _quick, _what, _t) in run_all.BENCHMARKS.items():
        cmd = " ".join(["python", f"benchmarks/{script}", *full])
        assert cmd in listed, name
        committed = BENCH / "results" / f"{pathlib.Path(script).stem}.json"
        if committed.is_file():  # the arguments that produced the committed result
            assert json.loads(committed.read_text())["command"] == cmd, name
    assert "gpu_check" not in listed  # only with --gpu


def test_write_results_puts_the_shared_header_in_both_files(tmp_path):
    from _results import Run, write_results

    run = Run(BENCH / "planner_speed.py", ["--repeats", "1"])
    write_results(tmp_path / "r", "# Title\n\nbody\n", {"x": 1}, run)
    rec = json.loads((tmp_path / "r.json").read_text())
    h = rec["header"]
    assert rec["command"] == h["command"] == "python benchmarks/planner_speed.py --repeats 1"
    assert h["machine"]["cores"] >= 1 and len(h["load_before"]) == len(h["load_after"]) == 3
    assert h["date"] and h["commit"] and "torch" in h["versions"] and rec["x"] == 1
    md = (tmp_path / "r.md").read_text().split("\n")
    assert md[0] == "# Title" and md[2].startswith("Command: `python benchmarks/planner_speed.py --repeats 1`")
    assert "load average (1/5/15 min) before" in md[3] and md[-2] == "body"
