"""Gated DeltaNet layers at pp = 2 on 2 CPU ranks, one launch. ``ConcertinaTrainer`` on Qwen3-Next
(its self-check at construction included) trains 3 steps, long sequences split into chunks of at
most 32 tokens, against ``Trainer`` on right-padded batches: loss 1e-5, every parameter 1e-3 relative
to its update. Then, on the trainer's process group, for every model of
:data:`_linear_attention_cases.MODELS` (one per Gated DeltaNet class), each rank computes HF's
reference on the right-padded batch itself and runs on its stage (layers 0-1: a linear layer and
an attention layer; 2-3: the same) the split, hybrid and packed chunks of :mod:`_linear_attention_cases`
under recompute none / partial / full, and the adaptive planner's plan; loss 1e-5 and its
stage's every gradient 1e-4 (``A_log``, ``dt_bias``, the convolution weights among them). Then a
stage of 2 sequence-parallel ranks over one key head is refused, naming the setting (Ulysses
itself: ``tests/launch/test_ulysses_launch.py``). Then the Mamba2 (SSD) models of
:data:`_ssm_cases.MODELS` (Granite-4.0 hybrid, Bamba, Falcon-H1, Nemotron-H) likewise, ``D`` among the compared parameters.
Then the short-convolution (LFM2, LFM2-MoE, LFM3), lightning-attention (MiniMax) and KDA (Kimi
Linear) models of :data:`_recurrent_cases.MODELS` likewise. The one-process tests (pp=1, the leak
test, the self-check): ``tests/runtime/test_linear_attention.py``, ``tests/runtime/test_ssm.py``,
``tests/runtime/test_short_conv.py``, ``tests/runtime/test_lightning_kda.py``. Also: the saved
Qwen3-Next checkpoint loaded by stage (``model=<directory>``) gives Trainer's next loss, and LoRA on
its Gated DeltaNet and attention projections gives Trainer's losses and adapter update.
"""

from __future__ import annotations

import copy
import os

from _helpers import reports as read_reports, run_ranks


def _worker(outdir: str) -> None:
    """``ConcertinaTrainer`` (pp=2, the self-check at construction), then the executor's cases on
    the trainer's process group; the report in ``<outdir>/rank<r>.json``."""
    import json
    import traceback

    import _linear_attention_cases as cases
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    report: dict = {"rank": int(os.environ["RANK"]), "failures": [], "cases": 0, "rows": []}
    trainer = None
    try:
        args = ConcertinaTrainingArguments(output_dir=os.path.join(outdir, "trainer"),
                                           concertina_max_tokens_per_chunk=32, **cases.COMMON)
        trainer = ConcertinaTrainer(model=cases.build_model(), args=args, train_dataset=cases.dataset())
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        trainer.save_model(os.path.join(outdir, "trainer", "final"))
        report["trainer"] = {"losses": [h["loss"] for h in logs],
                             "split": [h.get("concertina/chunks_split", 0.0) for h in logs],
                             "pp": trainer.topology.pipeline_size}
        _loaded_and_lora(outdir, report)
        _run(report)
        _run_ssm(report)
        _run_recurrent(report)
    except Exception:
        report["failures"].append("crash:\n" + traceback.format_exc())
    with open(os.path.join(outdir, f"rank{report['rank']}.json"), "w") as fh:
        json.dump(report, fh)
    if trainer is not None:
        trainer.end()


def _loaded_and_lora(outdir: str, report: dict) -> None:
    """The saved checkpoint loaded by stage (``model=<directory>``: each rank reads its stage's
    tensors) and trained one step; then LoRA on the Gated DeltaNet and attention projections
    (``in_proj_qkvz``, ``in_proj_ba``, ``out_proj``, ``q_proj``, ``v_proj``), 3 steps, its adapter saved."""
    import torch
    from safetensors.torch import load_file

    import _linear_attention_cases as cases
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    final = os.path.join(outdir, "trainer", "final")
    saved = {k: v for f in os.listdir(final) if f.endswith(".safetensors") for k, v in load_file(os.path.join(final, f)).items()}
    loaded = ConcertinaTrainer(model=final, train_dataset=cases.dataset(seed=1), args=ConcertinaTrainingArguments(
        output_dir=os.path.join(outdir, "loaded"), concertina_max_tokens_per_chunk=32, **dict(cases.COMMON, max_steps=1)))
    params = dict(loaded.model.named_parameters())
    report["loaded_params"] = sorted(params)
    report["loaded_equal"] = all(torch.equal(p.detach(), saved[k]) for k, p in params.items())
    loaded.train()
    report["loaded_losses"] = [h["loss"] for h in loaded.state.log_history if "loss" in h]
    lora = ConcertinaTrainer(model=cases.lora_model(), train_dataset=cases.dataset(), args=ConcertinaTrainingArguments(
        output_dir=os.path.join(outdir, "lora"), concertina_max_tokens_per_chunk=32, **cases.COMMON))
    lora.train()
    report["lora_losses"] = [h["loss"] for h in lora.state.log_history if "loss" in h]
    lora.save_model(os.path.join(outdir, "lora", "final"))


def _check_family(report: dict, kinds, build, mixer_params, expected, what: str, grad_tol=None) -> None:
    """Each model of ``kinds`` (``build(kind)``) at pp=2 on this rank's stage: HF's reference on the
    right-padded batch computed here, then the split, hybrid and packed chunks under recompute none /
    partial / full and the adaptive planner's plan; loss 1e-5, every gradient ``grad_tol(kind)``
    (1e-4), and ``expected(kind, (first, end))`` of the stage's ``mixer_params(kind)`` compared."""
    import _linear_attention_cases as cases
    from concertina_hf.planning import CostModel, StageLayout
    from concertina_hf.planning.strategies import plan_step
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ids, labels = cases.batch()
    layout = StageLayout.even(4, world)
    for kind in kinds:
        model = build(kind)
        ref_loss, ref_grads = cases.padded_reference(model, ids, labels)
        w = PipelineWrapper(copy.deepcopy(model), layout, rank)
        ex = PipelineExecutor(w)
        plans = [(f"recompute {r}", cases.make_plan(layout, r)) for r in cases.RECOMPUTE]
        cost = CostModel.from_hf_config(model.config, dtype_bytes=4)
        plans.append(("adaptive planner", plan_step(list(cases.SEQ_LENS), cost, layout, 0, "adaptive",
                                                    max_tokens_per_chunk=40)))
        for name, plan in plans:
            w.zero_grad(set_to_none=True)
            res = ex.run_step(plan, ids, labels, num_items_in_batch=cases.num_items(labels))
            errors = cases.gradient_errors(w.named_parameters(), ref_grads)
            if model.config.tie_word_embeddings:  # each end stage holds its part (the trainer adds them)
                errors = {k: v for k, v in errors.items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
            row, bad = cases.check_case(f"{kind} pp={world} stage {rank} {name}", res.loss, ref_loss, errors,
                                        grad_tol(kind) if grad_tol else cases.GRAD_TOL, mixer_params(kind))
            row["chunks"] = [c.kind.value for c in plan.chunks]
            report["rows"].append(row)
            report["failures"] += bad
            if row["mixer_params"] != expected(kind, layout.layer_ranges[rank]):
                report["failures"].append(f"{kind} {name}: {row['mixer_params']} {what} parameters compared")
            report["cases"] += 1


def _run(report: dict) -> None:
    """The Gated DeltaNet models (layers 0-1 and 2-3: a linear layer and an attention layer each; its
    ``A_log``, ``dt_bias``, ``conv1d.weight`` compared), then a stage of 2 sequence-parallel ranks over
    one key head refused."""
    import torch.distributed as dist

    import _linear_attention_cases as cases
    from concertina_hf.planning import StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    _check_family(report, cases.MODELS, cases.build_model, lambda kind: cases.MIXER_PARAMS, lambda kind, stage: 3,
                  "Gated DeltaNet", lambda kind: cases.GRAD_TOL_OF.get(kind, cases.GRAD_TOL))
    model = cases.build_model_with("qwen3_next", linear_num_key_heads=1)  # one key head: Ulysses cannot split it
    one = PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 1), 0)
    try:
        PipelineExecutor(one, sp_group=dist.group.WORLD)
        report["failures"].append("a stage of 2 sequence-parallel ranks over 1 key head was not refused")
    except ValueError as exc:
        if "linear_num_key_heads=1" not in str(exc) or "concertina_sequence_parallel_size=2" not in str(exc):
            report["failures"].append(f"the sequence-parallel refusal does not name the setting: {exc}")
    report["cases"] += 1


def _run_ssm(report: dict) -> None:
    """The Mamba2 (SSD) models of :data:`_ssm_cases.MODELS`: each stage's Mamba2 layers' ``A_log``,
    ``dt_bias``, ``D`` and ``conv1d.weight`` compared (Bamba's ``final_layernorm`` on the last stage)."""
    import _ssm_cases as ssm

    _check_family(report, ssm.MODELS, ssm.build_model, lambda kind: ssm.MIXER_PARAMS,
                  lambda kind, stage: 4 * sum(stage[0] <= i < stage[1] for i in ssm.MAMBA_LAYERS[kind]), "Mamba2")


def _run_recurrent(report: dict) -> None:
    """The short-convolution, lightning-attention and KDA models of :data:`_recurrent_cases.MODELS`:
    each stage one recurrent layer, its three named parameters compared (LFM2's final norm
    ``embedding_norm`` and LFM2-MoE's rotary ``pos_emb`` on their stages)."""
    import _recurrent_cases as recurrent

    _check_family(report, recurrent.MODELS, recurrent.build_model, recurrent.mixer_params, lambda kind, stage: 3,
                  "recurrent-layer")


def test_pp2_split_hybrid_and_packed_chunks_equal_hf(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import _linear_attention_cases as cases
    import _recurrent_cases
    import _ssm_cases

    run_ranks(2, _worker, str(tmp_path), logs=tmp_path / "logs", timeout=900)
    reports = read_reports(tmp_path, 2)
    for r in reports:
        for row in r["rows"]:
            print(row)
    assert [f for r in reports for f in r["failures"]] == []
    assert all(r["cases"] == 4 * len(cases.MODELS) + 1 + 4 * len(_ssm_cases.MODELS) + 4 * len(_recurrent_cases.MODELS)
               for r in reports)
    kinds = {k for r in reports for row in r["rows"] for k in row["chunks"]}
    assert {"split", "hybrid", "packed"} <= kinds, kinds
    # ConcertinaTrainer at pp=2 against Trainer on right-padded batches: loss 1e-5, every parameter 1e-3
    # relative to its update (the bounds of tests/launch/test_model_families_launch.py)
    ref = Trainer(model=cases.build_model(), args=TrainingArguments(output_dir=str(tmp_path / "ref"), **cases.COMMON),
                  train_dataset=cases.dataset(), data_collator=cases.padded)
    start = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    ref.train()
    want = [h["loss"] for h in ref.state.log_history if "loss" in h]
    got = reports[0]["trainer"]
    print("trainer losses", got["losses"], "Trainer", want)
    assert got["pp"] == 2 and len(got["losses"]) == len(want) == 3, (got, want)
    assert all(n > 0 for n in got["split"]), got["split"]  # the long sequences were split
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want)) < cases.LOSS_TOL, (got, want)
    final = ref.model.state_dict()
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trainer" / "final")).state_dict()
    worst = max((float((saved[k] - final[k]).norm() / (final[k] - start[k]).norm().clamp_min(1e-12)), k)
                for k in final if k in saved and (final[k] - start[k]).norm() > 0)
    print("worst parameter, relative to its update", worst)
    assert worst[0] < 1e-3, worst
    assert any("linear_attn.A_log" in k for k in saved) and torch.is_tensor(saved["model.layers.0.linear_attn.A_log"])
    # loaded by stage: each rank holds its stage's tensors only, equal to the saved ones, and one more
    # step gives Trainer's loss from the saved model
    a, b = (r["loaded_params"] for r in reports)
    assert a and b and not set(a) & set(b) and all(r["loaded_equal"] for r in reports), (a, b)
    assert any(".linear_attn." in k for k in a) and any(".linear_attn." in k for k in b)
    ref = Trainer(model=AutoModelForCausalLM.from_pretrained(str(tmp_path / "trainer" / "final")),
                  args=TrainingArguments(output_dir=str(tmp_path / "ref-loaded"), **dict(cases.COMMON, max_steps=1)),
                  train_dataset=cases.dataset(seed=1), data_collator=cases.padded)
    ref.train()
    want = [h["loss"] for h in ref.state.log_history if "loss" in h]
    got = reports[0]["loaded_losses"]
    assert len(got) == len(want) == 1 and abs(got[0] - want[0]) / want[0] < cases.LOSS_TOL, (got, want)
    # LoRA on the Gated DeltaNet and attention projections: Trainer's losses, the adapter's update
    # within 1e-3 of Trainer's (all its tensors together; the bound of tests/_peft_cases.py)
    import peft

    ref = Trainer(model=cases.lora_model(), args=TrainingArguments(output_dir=str(tmp_path / "ref-lora"), **cases.COMMON),
                  train_dataset=cases.dataset(), data_collator=cases.padded)
    init = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    ref.train()
    want = [h["loss"] for h in ref.state.log_history if "loss" in h]
    got = reports[0]["lora_losses"]
    assert len(got) == len(want) == 3 and max(abs(x - y) / y for x, y in zip(got, want)) < cases.LOSS_TOL, (got, want)
    have = peft.PeftModel.from_pretrained(cases.build_model(), str(tmp_path / "lora" / "final")).state_dict()
    want_sd = ref.model.state_dict()
    trained = [k for k in want_sd if "lora_" in k and not torch.equal(want_sd[k], init[k])]
    assert any("in_proj_qkvz" in k for k in trained) and any("out_proj" in k for k in trained), trained
    update = torch.cat([(want_sd[k] - init[k]).flatten() for k in trained])
    error = torch.cat([(have[k] - want_sd[k]).flatten() for k in trained])
    print("LoRA adapter update error", (error.norm() / update.norm()).item())
    assert (error.norm() / update.norm()).item() < 1e-3
