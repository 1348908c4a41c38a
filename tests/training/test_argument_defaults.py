"""The arguments' defaults are their base classes', on the installed transformers and TRL.

``ConcertinaTrainingArguments`` against ``TrainingArguments`` and ``ConcertinaSFTConfig`` against
TRL's ``SFTConfig``: every field the two classes of a pair share has the same default and, on a
default-constructed instance, the same value after ``__post_init__`` (TRL resolves ``bf16=None`` to
``not fp16`` there), except the fields of ``DEFAULTS_NOT_TAKEN``, each with its reason. The
fields are enumerated with ``dataclasses.fields``, so a release that adds or changes a default
fails here instead of changing what a swapped-in script trains.
"""

from __future__ import annotations

import dataclasses

import pytest

from concertina_hf.training.args import DEFAULTS_NOT_TAKEN

#: what both classes of a pair are built with: use_cpu because TRL's bf16 default refuses a CPU-only
#: machine without it (SFTConfig's own behaviour), in both classes alike
BUILD = dict(output_dir="defaults", use_cpu=True)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _same(a, b) -> bool:
    try:
        return bool(a == b) or repr(a) == repr(b)
    except Exception:
        return repr(a) == repr(b)


def _differences(base: type, ours: type) -> dict[str, tuple]:
    """``{field: (what differs, base's, ours)}`` over the shared fields, exceptions left out."""
    theirs = {f.name: f for f in dataclasses.fields(base)}
    mine = {f.name: f for f in dataclasses.fields(ours)}
    shared = sorted(set(theirs) & set(mine))
    assert len(shared) > 100, shared  # TrainingArguments' fields at least
    built_base, built_ours = base(**BUILD), ours(**BUILD)
    out = {}
    for name in shared:
        if name in DEFAULTS_NOT_TAKEN:
            continue
        a, b = _default(theirs[name]), _default(mine[name])
        if not _same(a, b):
            out[name] = ("default", a, b)
            continue
        a, b = getattr(built_base, name), getattr(built_ours, name)
        if not _same(a, b):
            out[name] = ("resolved", a, b)
    return out


def test_concertina_training_arguments_keep_every_training_arguments_default():
    from transformers import TrainingArguments

    from concertina_hf import ConcertinaTrainingArguments

    assert _differences(TrainingArguments, ConcertinaTrainingArguments) == {}


def test_concertina_sft_config_keeps_every_sft_config_default():
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments

    from concertina_hf.integrations.trl import ConcertinaSFTConfig

    assert _differences(trl.SFTConfig, ConcertinaSFTConfig) == {}
    ours, theirs = ConcertinaSFTConfig(**BUILD), trl.SFTConfig(**BUILD)
    # the defaults the swap keeps, spelled out (the comparison above is the guard)
    assert ours.bf16 is True and theirs.bf16 is True
    assert (ours.learning_rate, ours.logging_steps) == (theirs.learning_rate, theirs.logging_steps)
    # the exceptions: TrainingArguments' value (the planner recomputes), not SFTConfig's
    plain = TrainingArguments(**BUILD)
    assert "gradient_checkpointing" in DEFAULTS_NOT_TAKEN
    for name in DEFAULTS_NOT_TAKEN:
        if hasattr(plain, name):
            assert getattr(ours, name) == getattr(plain, name) == False, name  # noqa: E712
    # and a user's True is still taken as the planner's (resolved off, with the warning)
    assert ConcertinaSFTConfig(gradient_checkpointing=True, **BUILD).gradient_checkpointing is False
    # bf16 unset follows fp16 as in TRL: fp16 is refused by the pipeline, naming bf16
    with pytest.raises(ValueError, match="fp16 mixed precision"):
        ConcertinaSFTConfig(fp16=True, **BUILD)
