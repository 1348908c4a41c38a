"""The GPU check (benchmarks/gpu_check.py) cannot rot: its ``--cpu-smoke`` run (the same code,
tiny shapes, float32) on every test run, and the full check where CUDA is present.

The smoke run takes ~15-25 s on a loaded 2-core machine (a subprocess: imports, two Trainer runs of
a tiny Llama, a profile, a few executor steps). That its attention check can fail:
``tests/runtime/test_gpu_check_attention.py``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from _helpers import Command

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(out: pathlib.Path, *extra: str, timeout: int) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, str(SCRIPT), *extra, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (out / "gpu_check.md").stat().st_size > 0
    return json.loads((out / "gpu_check.json").read_text())


#: the job (a command, started by the session in the background, read through ``launched``)
LAUNCHES = {"cpu-smoke": Command(sys.executable, str(SCRIPT), "--cpu-smoke", "--out", "{out}", cwd=ROOT, timeout=300,
                                 env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})}


def test_cpu_smoke_runs_every_section(launched):
    run = launched("cpu-smoke")
    tmp_path = run.out
    assert run.codes == [0], run.stderr[0][-8000:]
    assert (tmp_path / "gpu_check.md").stat().st_size > 0
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["mode"] == "cpu-smoke" and rep["dtype"] == "float32"
    assert rep["environment"]["torch"] == torch.__version__ and rep["environment"]["transformers"]
    assert set(rep["sections"]) == set("abcdef")
    for key, sec in rep["sections"].items():
        assert sec["status"] in ("passed", "failed"), (key, sec.get("error"), sec.get("note"), sec.get("traceback"))
        assert sec["checks"], key
        for c in sec["checks"]:
            assert isinstance(c["measured"], float) and math.isfinite(c["measured"]), (key, c)
            assert isinstance(c["passed"], bool) and c["target"], (key, c)
        assert sec["wall_s"] > 0
    # (a) every case, forward and backward, within tolerance of HF's SDPA per sequence
    a = rep["sections"]["a"]
    assert a["status"] == "passed" and all(c["passed"] for c in a["checks"]), a["checks"]
    cases, skipped = a["results"]["cases"], a["results"]["skipped_cases"]
    # soft-capping and sinks run where the backend takes them (skipped, saying so, where it would ignore them)
    assert len(cases) + len(skipped) == 6 and all("ignore" in s["reason"] for s in skipped), skipped
    assert any(c["window"] for c in cases) and any(c["kv_heads"] < c["heads"] for c in cases)
    assert any(len(c["chunks"]) > 1 for c in cases)  # K/V carried across chunks
    for c in cases:
        assert {"out", "dq", "dk", "dv"} <= set(c["errors"]) and c["kernel"] != "unknown", c
    assert rep["kernels"]
    # (b) float32: the pipeline's losses are Trainer's, with split and hybrid chunks
    b = rep["sections"]["b"]
    assert b["status"] == "passed", b["checks"]
    assert len(b["results"]["runs"]["Trainer"]["losses"]) == 3
    # (c)-(e) numbers present (their targets are the GPU's)
    c = rep["sections"]["c"]["results"]
    assert len(c["sweep"]) == 4 and len(c["held_out"]) == 9
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in c["sweep"] + c["held_out"])
    d = rep["sections"]["d"]["results"]["rows"]
    assert [r["tokens"] for r in d] == [32, 64, 128] and all(r["mfu"] > 0 for r in d)
    e = rep["sections"]["e"]["results"]["rows"]
    assert len(e) == 3 and all(r["measured_act_bytes"] > 0 and r["predicted_act_bytes"] > 0 for r in e)
    assert e[1]["budget_act_bytes"] > 0 and e[2]["recompute_layers"] > 0
    # (f) float32: each recurrent mixer family's loss 1e-5 and gradients 1e-4 of HF's on the padded batch
    f = rep["sections"]["f"]
    assert f["status"] == "passed" and len(f["results"]["rows"]) == 3 and len(f["checks"]) == 6, f["checks"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## Checks" in md and "## (a) Attention" in md and "## (e) Memory" in md


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_check_full(tmp_path):
    """The full check on the GPU (~5 min on an H200): every section runs; the correctness checks
    (attention within bf16 tolerance, Trainer's loss, memory within the plan's budget) pass. Time,
    MFU and memory-prediction targets are reported in the files, not asserted here."""
    rep = _run(tmp_path, "--budget-s", "600", timeout=900)
    assert rep["mode"] == "cuda" and rep["dtype"] == "bfloat16"
    for key, sec in rep["sections"].items():
        assert sec["status"] in ("passed", "failed"), (key, sec.get("error"), sec.get("note"))
        bad = [c for c in sec["checks"] if c["kind"] == "correctness" and not c["passed"]]
        assert not bad, (key, bad)
