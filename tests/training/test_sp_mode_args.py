"""concertina_sequence_parallel_mode: choices, refusals, and the mode the trainer plans
with: 'auto' chooses whole-doc / per-doc only under a cost model whose collective times are
measured (concertina_cost_model 'profiled' or 'online')."""

from __future__ import annotations

import pytest

from concertina_hf.training.args import ConcertinaTrainingArguments


def _args(tmp_path, **kw):
    return ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_auto_plans_placements_only_under_a_measured_cost_model(tmp_path):
    a = _args(tmp_path)
    assert (a.concertina_sequence_parallel_mode, a.concertina_cost_model) == ("auto", "analytic")
    assert a.sequence_parallel_mode == "ulysses"
    for source in ("profiled", "online"):
        assert _args(tmp_path, concertina_cost_model=source).sequence_parallel_mode == "auto"
    for source in ("analytic", "profiled", "online"):
        for mode in ("ulysses", "context"):
            a = _args(tmp_path, concertina_cost_model=source, concertina_sequence_parallel_mode=mode)
            assert a.sequence_parallel_mode == mode


def test_unknown_mode_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="concertina_sequence_parallel_mode='fast': choose one of auto, ulysses, "
                                         "context"):
        _args(tmp_path, concertina_sequence_parallel_mode="fast")
