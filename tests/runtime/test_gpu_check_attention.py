"""The GPU check's attention section (``benchmarks/gpu_check.py``, section a) can fail: two runs of
it in this process (~3 s each, ``--cpu-smoke --only a``), with an off-by-one sliding window and
with K/V whose gradient never reaches the earlier slices, are both caught. The whole ``--cpu-smoke``
run: ``tests/benchmarks/test_gpu_check_smoke.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_attention_check_fails_on_a_wrong_window_or_lost_kv_gradients(tmp_path, monkeypatch):
    from concertina_hf.runtime import attention

    gc = _module()
    # the packed, split and sliding-window cases (the others cost time and add nothing here)
    by_name = {c.name: c for c in gc.CPU_SIZES.attn_cases}
    some = tuple(by_name[n] for n in ("packed", "split (K/V carry, hybrid tail)", "sliding window 16 (GQA, split)"))
    monkeypatch.setattr(gc, "CPU_SIZES", dataclasses.replace(gc.CPU_SIZES, attn_cases=some))
    forward = attention.concertina_attention_forward

    def window_off_by_one(*args, sliding_window=None, **kwargs):
        return forward(*args, sliding_window=None if sliding_window is None else sliding_window + 1, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(attention, "concertina_attention_forward", window_off_by_one)
        assert gc.main(["--cpu-smoke", "--only", "a", "--out", str(tmp_path / "window")]) == 0
    rep = json.loads((tmp_path / "window" / "gpu_check.json").read_text())
    passed = {c["name"]: c["passed"] for c in rep["sections"]["a"]["results"]["cases"]}
    assert [name for name, ok in passed.items() if not ok] == ["sliding window 16 (GQA, split)"], passed
    assert rep["sections"]["a"]["status"] == "failed" and not rep["passed"]

    put = attention.KVStore.put_if_absent

    def no_leaf_grad(self, seq, start, layer, k, v, requires_grad):
        return put(self, seq, start, layer, k, v, False)

    with monkeypatch.context() as m:
        m.setattr(attention.KVStore, "put_if_absent", no_leaf_grad)
        assert gc.main(["--cpu-smoke", "--only", "a", "--out", str(tmp_path / "kv")]) == 0
    rep = json.loads((tmp_path / "kv" / "gpu_check.json").read_text())
    cases = {c["name"]: c for c in rep["sections"]["a"]["results"]["cases"]}
    assert cases["packed"]["passed"]  # nothing carried there
    for name, c in cases.items():
        if len(c["chunks"]) > 1:  # earlier slices miss the key/value gradient of later ones
            assert not c["passed"] and c["errors"]["dk"]["ours_vs_ref"] > 1e-3, (name, c["errors"])
