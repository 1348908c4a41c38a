"""concertina_layout="auto" on one process: the choice from a sample of the data (no process
group: ``choose_layout`` is pure in its inputs), fixed sizes kept, a checkpoint's recorded layout
kept and one of another number of processes refused. The 4-process run against Trainer is
tests/launch/test_auto_layout_launch.py."""

from __future__ import annotations

import json
import random

import pytest

from _models import tiny_model


def _rows(n, long_every=0, seed=0):
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"input_ids": [rng.randrange(64) for _ in range(900 if long_every and i % long_every == 0
                                                         else rng.randrange(5, 20))]} for i in range(n)])


def _args(tmp_path, **kw):
    from concertina_hf import ConcertinaTrainingArguments

    return ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[],
                                       **dict(dict(concertina_layout="auto", per_device_train_batch_size=2), **kw))


def test_choice_is_deterministic_and_keeps_fixed_sizes(tmp_path):
    from concertina_hf.training.auto_layout import SAMPLE_STEPS, choose_layout, sample_steps
    from concertina_hf.training.collator import LengthAwareCollator

    data, collate = _rows(200, long_every=8), LengthAwareCollator()
    args = _args(tmp_path)
    steps = sample_steps(data, collate, 8, args)
    assert len(steps) == SAMPLE_STEPS and all(len(s) == 8 for s in steps)
    assert steps == sample_steps(data, collate, 8, args)  # seeded: the same rows on every rank
    a = choose_layout(args, tiny_model("llama"), 4, data, collate)
    b = choose_layout(args, tiny_model("llama"), 4, data, collate)
    assert a == b and a.source == "auto" and a.pp * a.sp * a.dp == 4 and a.steps_sampled == SAMPLE_STEPS
    ok = [r for r in a.table if r["step_time_s"] is not None]
    assert ok[0]["layout"] == f"pp{a.pp} x sp{a.sp} x dp{a.dp}" and ok[0]["ratio"] == 1.0
    assert all(r["ratio"] >= 1.0 for r in ok) and len(ok) >= 4, a.table
    assert "chose pp=" in a.table_text()
    fixed = choose_layout(_args(tmp_path, concertina_pipeline_size=2), tiny_model("llama"), 4, data, collate)
    assert fixed.pp == 2 and all(r["layout"].startswith("pp2 ") for r in fixed.table if r["step_time_s"])
    # sequential sampling reads the first rows in order
    seq = sample_steps(data, collate, 8, _args(tmp_path, train_sampling_strategy="sequential"), steps=2)
    assert seq == [[len(r["input_ids"]) for r in data.select(range(i, i + 8))] for i in (0, 8)]


def test_resume_keeps_the_recorded_layout_and_refuses_another_world_size(tmp_path):
    from concertina_hf.training.auto_layout import choose_layout

    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "concertina.json").write_text(json.dumps(
        {"pipeline_size": 2, "sequence_parallel_size": 1, "data_parallel_size": 2}))
    args = _args(tmp_path, resume_from_checkpoint=str(ckpt))
    kept = choose_layout(args, tiny_model("llama"), 4, _rows(40), None)
    assert (kept.pp, kept.sp, kept.dp, kept.source) == (2, 1, 2, "checkpoint")
    with pytest.raises(ValueError, match=r"written by 4 processes \(pp=2 x sp=1 x dp=2\), this run has 2: .*"
                                         r"resume with 4 processes"):
        choose_layout(args, tiny_model("llama"), 2, _rows(40), None)


def test_auto_needs_training_data_and_a_known_mode(tmp_path):
    from concertina_hf.training.auto_layout import choose_layout

    with pytest.raises(ValueError, match="concertina_layout='auto' chooses the layout from the training data"):
        choose_layout(_args(tmp_path), tiny_model("llama"), 2, None, None)
    with pytest.raises(ValueError, match="concertina_layout='sometimes': choose 'manual'"):
        _args(tmp_path, concertina_layout="sometimes")


def test_shard_parameters_chooses_among_pp1_layouts_and_says_why_not_pp2(tmp_path):
    """concertina_shard_parameters=True: the layouts ranked as the runtime holds them (ZeRO-3 at
    pp=1), pp > 1 refused with the setting named in the table and in concertina.json's record;
    with tied embeddings pp=1 x sp > 1 too (FSDP2 cannot shard them on one stage)."""
    from concertina_hf.training.auto_layout import choose_layout
    from concertina_hf.training.collator import LengthAwareCollator

    data, collate = _rows(200, long_every=8), LengthAwareCollator()
    plain = choose_layout(_args(tmp_path), tiny_model("llama"), 4, data, collate)
    assert any(r["layout"].startswith("pp2 ") and r["step_time_s"] is not None for r in plain.table)
    a = choose_layout(_args(tmp_path, concertina_shard_parameters=True), tiny_model("llama"), 4, data, collate)
    assert a.pp == 1 and a.pp * a.sp * a.dp == 4
    rows = {r["layout"]: r for r in a.to_dict()["table"]}
    assert {"pp1 x sp1 x dp4", "pp1 x sp2 x dp2", "pp1 x sp4 x dp1"} <= {n for n, r in rows.items() if r["step_time_s"]}
    piped = [r for n, r in rows.items() if not n.startswith("pp1 ")]
    assert {r["layout"] for r in piped} == {"pp2 x sp1 x dp2", "pp2 x sp2 x dp1", "pp4 x sp1 x dp1"}
    for r in piped:
        assert r["step_time_s"] is None
        assert "refused: pp=" in r["reason"] and "concertina_shard_parameters=True runs at concertina_pipeline_size=1" \
            " only; set concertina_shard_parameters=False" in r["reason"], r
    assert "concertina_pipeline_size=1 only" in a.table_text()
    with pytest.raises(ValueError, match=r"found no layout of 4 processes that fits \(pp2 x sp1 x dp2: refused: pp=2: "
                                         r"concertina_shard_parameters=True runs at concertina_pipeline_size=1 only"):
        choose_layout(_args(tmp_path, concertina_shard_parameters=True, concertina_pipeline_size=2), tiny_model("llama"),
                      4, data, collate)
    tied = choose_layout(_args(tmp_path, concertina_shard_parameters=True), tiny_model("llama-tied"), 4, data, collate)
    assert tied.sizes == (1, 1, 4), tied.table
    why = {r["layout"]: r.get("reason") for r in tied.table}
    assert "cannot shard tied input/output embeddings on one stage" in why["pp1 x sp2 x dp2"]
    assert "set model.config.tie_word_embeddings=False" in why["pp1 x sp4 x dp1"]


@pytest.mark.parametrize("mode,cost_model,runs", [("auto", "analytic", "ulysses"), ("context", "analytic", "context"),
                                                  ("ulysses", "analytic", "ulysses")])
def test_chosen_line_names_the_sequence_parallel_mode(tmp_path, mode, cost_model, runs):
    """sp > 1: the chosen line and the record name the mode the stages run (concertina_sequence_
    parallel_mode as args.sequence_parallel_mode resolves it: auto is Ulysses under analytic)."""
    from concertina_hf.training.auto_layout import choose_layout

    data = _rows(64, long_every=8)
    args = _args(tmp_path, concertina_sequence_parallel_size=2, concertina_sequence_parallel_mode=mode,
                 concertina_cost_model=cost_model)
    a = choose_layout(args, tiny_model("llama"), 4, data, None)
    assert a.sp == 2 and a.sp_mode == runs and a.to_dict()["sequence_parallel_mode"] == runs
    assert a.table_text().splitlines()[0].startswith(
        f"concertina_layout='auto' chose pp={a.pp} x sp=2 x dp={a.dp}, sequence-parallel mode {runs} (auto; ")
    one = choose_layout(_args(tmp_path, concertina_sequence_parallel_mode=mode, concertina_pipeline_size=4),
                        tiny_model("llama"), 4, data, None)
    assert one.sp == 1 and one.sp_mode is None and "sequence-parallel mode" not in one.table_text()


@pytest.mark.parametrize("kw,want", [
    (dict(), dict(shard_optimizer=False, shard_parameters=False, sp_mode="ulysses", tied_embeddings=False)),
    (dict(concertina_shard_optimizer=True), dict(shard_optimizer=True, shard_parameters=False)),
    (dict(concertina_shard_parameters=True),  # pp=1 x sp=1 then holds the optimizer whole, as run_setup does
     dict(shard_optimizer=False, shard_parameters=True)),
    (dict(concertina_sequence_parallel_mode="context"), dict(sp_mode="context")),
    (dict(concertina_cost_model="online"), dict(sp_mode="auto")),
    (dict(model="llama-tied"), dict(tied_embeddings=True)),  # the last of several stages holds a copy
])
def test_the_runtime_settings_reach_rank_layouts(tmp_path, monkeypatch, kw, want):
    """The settings that change a layout's cost or whether it runs go to rank_layouts as the
    runtime (run_setup.resolve_run) applies them."""
    from concertina_hf.training import auto_layout

    seen = []
    real = auto_layout.rank_layouts
    monkeypatch.setattr(auto_layout, "rank_layouts", lambda *a, **k: seen.append(k) or real(*a, **k))
    kw = dict(kw)
    model = tiny_model(kw.pop("model", "llama"))
    auto_layout.choose_layout(_args(tmp_path, **kw), model, 2, _rows(16), None)
    assert seen and all({k: s[k] for k in want} == want for s in seen), seen[0]


def test_a_layout_out_on_one_step_keeps_its_reason():
    """The sum over the sampled steps: a layout infeasible on one step is out with that step's
    reason, whatever later steps say; a refusal the planner cannot see comes first."""
    from concertina_hf.planning.layouts import Layout, LayoutResult
    from concertina_hf.training.auto_layout import _sum

    a, b, c = Layout(1, 2, 1), Layout(2, 1, 1), Layout(1, 1, 2)
    steps = [[LayoutResult(a, "adaptive", "ok", step_time_s=1.0),
              LayoutResult(b, "adaptive", "infeasible", reason="no plan fits 1 MB"),
              LayoutResult(c, "adaptive", "ok", step_time_s=1.5)],
             [LayoutResult(a, "adaptive", "pruned", lower_bound_s=2.0),
              LayoutResult(b, "adaptive", "ok", step_time_s=0.5),
              LayoutResult(c, "adaptive", "ok", step_time_s=1.5)]]
    totals, reasons = {}, {}
    _sum(steps, {}, totals, reasons, {c: "refused: tied"})
    assert totals == {a: 3.0}
    assert reasons == {b: "infeasible: no plan fits 1 MB", c: "refused: tied"}
    _sum(steps, {"pp": 2}, totals, reasons, {c: "refused: tied"})  # fixed sizes: the others are not listed
    assert totals == {} and reasons == {b: "infeasible: no plan fits 1 MB"}
