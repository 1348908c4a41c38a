"""concertina_sequence_parallel_mode (issue 23): choices, refusals, and the mode the trainer plans
with while the runtime cannot run whole-doc / per-doc placements (args.PLACEMENTS_RUN)."""

from __future__ import annotations

import pytest

from concertina_hf.training import args as args_module
from concertina_hf.training.args import ConcertinaTrainingArguments


def _args(tmp_path, **kw):
    return ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_default_is_auto_and_plans_ulysses_until_the_runtime_runs_placements(tmp_path):
    a = _args(tmp_path)
    assert a.concertina_sequence_parallel_mode == "auto"
    assert a.sequence_parallel_mode == ("auto" if args_module.PLACEMENTS_RUN else "ulysses")
    assert _args(tmp_path, concertina_sequence_parallel_mode="ulysses").sequence_parallel_mode == "ulysses"


def test_unknown_mode_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="concertina_sequence_parallel_mode='fast': choose one of auto, ulysses, "
                                         "context"):
        _args(tmp_path, concertina_sequence_parallel_mode="fast")


def test_context_refused_until_the_runtime_runs_placements(tmp_path, monkeypatch):
    if not args_module.PLACEMENTS_RUN:
        with pytest.raises(ValueError, match="concertina_sequence_parallel_mode='context' needs whole-doc / per-doc "
                                             "execution in the runtime"):
            _args(tmp_path, concertina_sequence_parallel_mode="context")
    monkeypatch.setattr(args_module, "PLACEMENTS_RUN", True)
    a = _args(tmp_path, concertina_sequence_parallel_mode="context")
    assert a.sequence_parallel_mode == "context"
    assert _args(tmp_path).sequence_parallel_mode == "auto"
