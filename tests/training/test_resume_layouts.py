"""Resume at another ``dp x pp x sp`` layout (:meth:`StageCheckpointer.check_layout`, which every
rank runs before the first step): over every pair of layouts with dp, pp, sp in {1, 2}, a resume is
accepted exactly when the pipeline size and the number of processes are the checkpoint's (data- and
sequence-parallel sizes exchanged: the optimizer state is resharded; the resumed trajectory's equality
with the uninterrupted one is tests/launch/test_sharded_optimizer_launch.py's sp=2 -> dp=2 case and
tests/launch/test_resume_layouts_launch.py's dp=2 -> sp=2, both at pp=1), and
refused otherwise naming both layouts (the per-process RNG files would not match the processes)."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from concertina_hf.runtime.distributed import Topology
from concertina_hf.training.checkpoint import StageCheckpointer
from concertina_hf.training.manifest import PLAN_META_NAME

LAYOUTS = list(itertools.product((1, 2), repeat=3))  # (dp, pp, sp)


def _ranges(pp: int) -> list[list[int]]:
    return [[0, 2]] if pp == 1 else [[0, 1], [1, 2]]


def _name(dp: int, pp: int, sp: int) -> str:
    return f"dp={dp} x pp={pp} x sp={sp}"


@pytest.mark.parametrize("written", LAYOUTS, ids=lambda lay: _name(*lay).replace(" ", ""))
def test_resume_at_another_layout_is_accepted_or_refused_naming_both(tmp_path, written):
    dp, pp, sp = written
    (tmp_path / PLAN_META_NAME).write_text(json.dumps({
        "pipeline_size": pp, "data_parallel_size": dp, "sequence_parallel_size": sp, "layer_ranges": _ranges(pp),
        "shard_optimizer": False}))
    for now in LAYOUTS:
        topo = Topology(now[0] * now[1] * now[2], 0, now[1], now[0], 0, 0, sequence_parallel_size=now[2])
        checkpointer = StageCheckpointer(None, topo)
        layout = SimpleNamespace(layer_ranges=_ranges(now[1]))
        if now[1] == pp and now[0] * now[1] * now[2] == dp * pp * sp:
            assert checkpointer.check_layout(str(tmp_path), layout) is None, (written, now)
            continue
        with pytest.raises(ValueError) as refused:
            checkpointer.check_layout(str(tmp_path), layout)
        message = str(refused.value)
        assert f"checkpoint: {_name(*written)}, this run: {_name(*now)}" in message, message
