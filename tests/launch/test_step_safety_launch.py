"""Safety of a step on two processes (pp = 2, gloo), one launch of
``tests/training/test_step_safety.py`` as plain processes: a wrong model refused on both ranks
with rank 0's verdict (caught, the ranks go on), each stage's own dropout stream, resume with dropout, a NaN on stage 1
skipped, then raised on both ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import test_step_safety
from _helpers import start_ranks
from test_step_safety import NAN_STEP


def test_pp2_dropout_streams_resume_and_nonfinite_steps(tmp_path):
    procs = start_ranks(2, test_step_safety.__file__, tmp_path, stderr_dir=tmp_path)
    deadline = time.time() + 600  # only ends a hung run
    for p, err in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
        err.close()
    stderr = [(tmp_path / f"stderr-rank{r}.txt").read_text() for r in range(2)]
    infos = []
    for r in range(2):
        path = tmp_path / f"info-rank{r}.json"
        assert path.exists(), f"rank {r} did not finish the first scenarios:\n{stderr[r][-6000:]}"
        infos.append(json.loads(path.read_text()))

    # the self-check's verdict reached both ranks
    assert infos[0]["refused"] and infos[0]["refused"] == infos[1]["refused"], infos
    assert "model type 'qwen2'" in infos[1]["refused"]
    # stage 0's layer 0 and stage 1's layer 1 (its layer 0 of the stage) draw different numbers
    assert infos[0]["draws"] and infos[1]["draws"]
    assert infos[0]["draws"][0] != infos[1]["draws"][0], infos
    # resume restores each stage's stream: bit-identical weights, which dropout did change
    for info in infos:
        assert info["resume_max_diff"] == 0.0 and info["resume_changed"] > 0, info
        assert info["skip_step2_equal_step1"] and info["skip_step3_trained"], info
        assert info["skip_losses_nan"] == [False, True, False, False], info
        assert info["skip_counter"] == [0, 1, 1, 1], info
    # "raise": both ranks exit non-zero naming the step, the plan, stage 1 and the sequences
    for (p, _), text in zip(procs, stderr):
        assert p.returncode not in (0, None), text[-3000:]
        assert "raise mode trained through the NaN" not in text
        assert f"optimizer step {NAN_STEP} (plan " in text and "on pipeline stage 1 (rank 1" in text, text[-4000:]
        assert "holds sequence(s)" in text, text[-4000:]
