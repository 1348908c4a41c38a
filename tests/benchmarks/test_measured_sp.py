"""The 4-process sequence-parallel benchmark (benchmarks/measured_sp.py) ``--quick`` end to end (4
gloo processes, three meshes, ~30 s on 2 busy cores): files and fields, the warm-up loss of every
layout equal to the single-process HF model's, measured activation peaks under the budget. Its
budget rule on one process: ``tests/runtime/test_measured_sp_budget.py``.
"""

from __future__ import annotations

import json
import pathlib
import sys

from _helpers import Command

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


#: the job (a command, started by the session in the background, read through ``launched``)
LAUNCHES = {"quick": Command(sys.executable, "benchmarks/measured_sp.py", "--quick", "--out", "{out}/measured_sp_quick",
                             cwd=ROOT, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=600)}


def test_measured_sp_quick(launched):
    run = launched("quick")
    tmp_path = run.out
    assert run.codes == [0], run.stderr[0][-6000:]
    for name in ("measured_sp_quick.md", "measured_sp_quick.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    res = json.loads((tmp_path / "measured_sp_quick.json").read_text())
    (ctx,) = res["contexts"]
    runs = ctx["runs"]
    assert set(runs) == {"pp2xsp2", "pp1xsp4", "pp4xsp1"}
    assert len(ctx["cores_probe"]) == 2 and all(x > 0 for x in ctx["cores_probe"])
    assert ctx["a2a_fit"]["pp4xsp1"] is None
    for name, r in runs.items():
        assert r["tokens_per_s"]["min"] > 0, name
        # same initial weights, same batch: every layout's loss is the single-process HF model's
        assert r["loss_rel_diff"] < 1e-4, (name, r["warmup_loss"], ctx["reference_loss"])
        assert len(r["memory_batch_alloc_peak_bytes"]) == 4
        for k, (got, pred) in enumerate(zip(r["memory_batch_alloc_peak_bytes"],
                                            r["memory_batch_predicted_act_peak_bytes"])):
            assert 0 < got <= ctx["activation_budget_bytes"], (name, k, got, ctx["activation_budget_bytes"])
            assert pred > 0, (name, k)
    assert runs["pp1xsp4"]["stage_of_rank"] == [0, 0, 0, 0] and runs["pp4xsp1"]["stage_of_rank"] == [0, 1, 2, 3]
    assert runs["pp2xsp2"]["pp2xsp2_over_this"] == 1.0
    assert ctx["loss_ok"]
    md = (tmp_path / "measured_sp_quick.md").read_text()
    assert "share" in md and "Cores probe" in md and "| pp1xsp4 |" in md and "## Summary" in md
    # the markdown is rewritten from the JSON alone, unchanged
    (tmp_path / "measured_sp_quick.md").unlink()
    from measured_sp import main

    main(["--from-json", str(tmp_path / "measured_sp_quick.json")])
    assert (tmp_path / "measured_sp_quick.md").read_text() == md
