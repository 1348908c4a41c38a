"""ConcertinaTrainer across processes (gloo, CPU) against the plain HF Trainer on one process.

Two launches, each checking many things:

- **pp = 2** (2 ranks), for Llama and Qwen2 (grouped-query attention, q/k/v biases): per-step
  logged loss within 1e-5 and every parameter within 1e-4 (relative) of ``Trainer`` after 4
  steps of 6 sequences (2 micro-batches of 3), with sequences split into 16-token chunks and a
  memory budget that forces recomputation; the global gradient norm (clipping at 0.5) matches;
  evaluation through the pipeline gives Trainer's eval loss; ``run_clm.py``'s token accuracy
  (``compute_metrics`` with ``preprocess_logits_for_metrics`` = argmax) and ``predict()`` (argmax
  ids, raw logits, label ids) equal Trainer's on both ranks (Llama); ``train_tokens_per_second``
  is the tokens trained / ``train_runtime``; the saved directory loads with
  ``AutoModelForCausalLM.from_pretrained``; resuming from the step-2 checkpoint (one optimizer
  shard per stage) ends on the same parameters. Qwen2 also runs with HF's own
  ``DataCollatorWithFlattening`` instead of ``LengthAwareCollator``, plans with a cost model
  profiled at startup, and recomputes every layer (``full-recompute``).
- **pp = 2, tied embeddings** (same launch): a Llama whose input and output embeddings are one
  matrix; stage 0 trains the embedding, stage 1 its own copy in the head, their gradients summed
  every step: Trainer's losses, gradient norms (the shared weight counted once) and final model,
  the two copies bit-identical after 4 steps, saved once as an HF tied checkpoint.
- **pp = 2, bf16=True** (same launch): autocast mixed precision with float32 master weights,
  against ``Trainer(bf16=True)`` within bf16 tolerances.
- **pp = 2 x dp = 2** (4 ranks): two replicas, each running the share of every step the
  balancer gives it (``concertina_balance_replicas``, the default); equals one ``Trainer``
  process with twice the per-device batch size; metrics and ``predict()`` gathered over the
  replicas in the dataset's order equal that process's.
- **pp = 1 x dp = 2** (2 ranks), balanced replicas on skewed batches: every replica reads the
  whole global batch, the replicas run different numbers of sequences (the one with the longest
  sequence fewer), and after 3 steps the losses (1e-5) and each parameter's update (1e-3
  relative) equal one ``Trainer`` process's.

The reference trainings run in the pytest process; the launches (:data:`LAUNCHES`) are this
file's ``_worker_*`` functions on 2 or 4 ranks (without ``use_cpu``: ConcertinaTrainingArguments
must turn it on by itself).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from _helpers import Launch
from _models import COMMON, load_saved, logged, metrics_and_predictions, tiny_dataset, tiny_model, train_reference, worst_relative

ARCHS = ("llama", "qwen2")
BUDGET = "500KB"  # Llama: below the no-recompute peak (~0.53-0.67 MB per stage) of these steps, above full recompute


# ---------------------------------------------------------------------------------- workers
def _worker_pp2(out: str) -> None:
    from transformers import DataCollatorWithFlattening

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    for arch in ARCHS:
        d = os.path.join(out, arch)
        # Llama: the adaptive recompute under a tight budget (analytic cost model). Qwen2: a cost
        # model profiled at startup (rank 0 measures, every rank gets it), every layer recomputed.
        planning = (dict(concertina_memory_budget=BUDGET) if arch == "llama" else
                    dict(concertina_cost_model="profiled", concertina_strategy="full-recompute"))
        args = ConcertinaTrainingArguments(
            output_dir=d, save_strategy="steps", save_steps=2, concertina_max_tokens_per_chunk=16, **planning,
            **COMMON)
        assert args.use_cpu and args.world_size == 2, (args.use_cpu, args.world_size)
        collator = DataCollatorWithFlattening() if arch == "qwen2" else None
        trainer = ConcertinaTrainer(model=tiny_model(arch), args=args, train_dataset=tiny_dataset(),
                                    eval_dataset=tiny_dataset(8, seed=1), data_collator=collator)
        metrics = trainer.train().metrics
        info = logged(trainer)
        for k in ("train_samples_per_second", "train_tokens_per_second", "train_runtime"):
            info[k] = metrics[k]
        info["eval_loss"] = trainer.evaluate()["eval_loss"]
        if arch == "llama":
            info.update(metrics_and_predictions(trainer, os.path.join(d, f"logits-rank{trainer.topology.rank}.pt")))
        info["layer_ranges"] = [list(r) for r in trainer.layout.layer_ranges]
        info["stage_params"] = sorted(n for n, _ in trainer.model.named_parameters())
        info["cost_model"] = trainer.stats_callback.cost_model.to_dict()
        trainer.save_model(os.path.join(d, "final"))

        # a new profile would split the layers differently: the checkpoint given in the arguments
        # restores its layout at construction (Llama: the analytic layout is reproducible anyway)
        ckpt = os.path.join(d, "checkpoint-2")
        resumed = ConcertinaTrainer(
            model=tiny_model(arch), train_dataset=tiny_dataset(), data_collator=collator,
            args=ConcertinaTrainingArguments(output_dir=d + "-resumed", save_strategy="no",
                                             concertina_max_tokens_per_chunk=16, **planning, **COMMON,
                                             resume_from_checkpoint=ckpt if arch == "qwen2" else None))
        assert resumed.layout == trainer.layout
        resumed.train(resume_from_checkpoint=ckpt)
        resumed.save_model(os.path.join(d, "resumed"))
        info["resumed_losses"] = logged(resumed)["losses"]
        with open(os.path.join(d, f"info-rank{trainer.topology.rank}.json"), "w") as fh:
            json.dump(info, fh)

    # tied input/output embeddings (float32) and bf16 autocast: 4 steps each, no checkpoints
    for name, arch, extra in (("tied", "llama-tied", {}), ("bf16", "llama", dict(bf16=True))):
        d = os.path.join(out, name)
        args = ConcertinaTrainingArguments(output_dir=d, save_strategy="no", concertina_max_tokens_per_chunk=16,
                                           **COMMON, **extra)
        trainer = ConcertinaTrainer(model=tiny_model(arch), args=args, train_dataset=tiny_dataset())
        trainer.train()
        info = logged(trainer)
        info["stage_params"] = sorted(n for n, _ in trainer.model.named_parameters())
        if name == "tied":
            tied = trainer.pipeline.tied_weight
            torch.save(tied.detach().clone(), os.path.join(d, f"tied-rank{trainer.topology.rank}.pt"))
            trainer.save_model(os.path.join(d, "final"))
            # resuming loads each stage's copy from the one saved tensor
            saved = tied.detach().clone()
            with torch.no_grad():
                tied.add_(1.0)
            trainer.checkpointer.load_stage_weights(trainer.model, os.path.join(d, "final"))
            info["reloaded_tied_copy"] = torch.equal(tied.detach(), saved)
        with open(os.path.join(d, f"info-rank{trainer.topology.rank}.json"), "w") as fh:
            json.dump(info, fh)
    trainer.end()  # destroys the process group: a live gloo group can abort the interpreter's exit


def _worker_dp2(out: str) -> None:
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    args = ConcertinaTrainingArguments(output_dir=out, save_strategy="no", concertina_pipeline_size=2,
                                       concertina_max_tokens_per_chunk=16, **COMMON)
    trainer = ConcertinaTrainer(model=tiny_model("llama"), args=args, train_dataset=tiny_dataset(),
                                eval_dataset=tiny_dataset(8, seed=1))
    t = trainer.topology
    assert (t.pipeline_size, t.data_parallel_size) == (2, 2)
    assert t.pp_ranks == (2 * t.replica, 2 * t.replica + 1) and t.dp_ranks == (t.stage, t.stage + 2)
    metrics = trainer.train().metrics
    trainer.save_model(os.path.join(out, "final"))
    info = logged(trainer)
    info.update({k: metrics[k] for k in ("train_samples_per_second", "train_tokens_per_second", "train_runtime")})
    info["topology"] = [t.rank, t.stage, t.replica]
    # each replica evaluates its share; the loop gathers them in the dataset's order
    info.update(metrics_and_predictions(trainer, os.path.join(out, f"logits-rank{t.rank}.pt")))
    with open(os.path.join(out, f"info-rank{t.rank}.json"), "w") as fh:
        json.dump(info, fh)
    trainer.end()


def _skewed_dataset(n=18, seed=5):
    """Rows of 4-12 tokens and, in each step of 6 rows, one of 150-200: count splits are unbalanced."""
    import datasets

    rng = random.Random(seed)
    rows = [{"input_ids": [rng.randrange(64) for _ in range(rng.randrange(150, 201) if i % 6 == 2
                                                               else rng.randrange(4, 13))]} for i in range(n)]
    return datasets.Dataset.from_list(rows)


BALANCED = dict(COMMON, per_device_train_batch_size=3, gradient_accumulation_steps=1, max_steps=3,
                train_sampling_strategy="sequential")  # each step of 6 rows holds one long row


def _worker_dp2_pp1(out: str) -> None:
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    args = ConcertinaTrainingArguments(output_dir=out, save_strategy="no", concertina_pipeline_size=1,
                                       concertina_max_tokens_per_chunk=64, **BALANCED)
    trainer = ConcertinaTrainer(model=tiny_model("llama"), args=args, train_dataset=_skewed_dataset())
    t = trainer.topology
    assert (t.pipeline_size, t.data_parallel_size) == (1, 2) and trainer.steps.balancer is not None
    ran = []  # the lengths of the sequences this replica ran, per step
    submit = trainer.planner.submit
    trainer.planner.submit = lambda lens, *a, **k: (ran.append(list(lens)), submit(lens, *a, **k))[1]
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    info = logged(trainer)
    info["ran"] = ran
    info["tokens_seen"] = trainer.state.num_input_tokens_seen
    with open(os.path.join(out, f"info-rank{t.rank}.json"), "w") as fh:
        json.dump(info, fh)
    trainer.end()


#: the launches (started by the session, read through the ``launched`` fixture)
LAUNCHES = {"pp2": Launch(2, _worker_pp2), "dp2": Launch(4, _worker_dp2), "dp2pp1": Launch(2, _worker_dp2_pp1)}


def test_dp2_balanced_replicas_match_trainer(launched, tmp_path):
    out = launched("dp2pp1").out
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    ref = Trainer(model=tiny_model("llama"), train_dataset=_skewed_dataset(), data_collator=DataCollatorWithFlattening(),
                  args=TrainingArguments(output_dir=str(tmp_path / "ref"), save_strategy="no",
                                         **dict(BALANCED, per_device_train_batch_size=6)))
    ref.train()
    ranks = [json.loads((out / f"info-rank{r}.json").read_text()) for r in range(2)]
    want = logged(ref)
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    diffs = [abs(a - b) for a, b in zip(ranks[0]["losses"], want["losses"])]
    assert len(diffs) == 3 and max(diffs) < 1e-5, (ranks[0]["losses"], want["losses"])
    # each step's 6 rows over the replicas: every sequence once, in subsets of different sizes,
    # the replica with the long sequence running fewer
    for a, b in zip(ranks[0]["ran"], ranks[1]["ran"]):
        assert len(a) + len(b) == 6 and len(a) != len(b), (a, b)
        assert len(a if max(a) > max(b) else b) < 3, (a, b)
    init = tiny_model("llama").state_dict()
    got = load_saved(out / "final")
    ref_state = ref.model.state_dict()
    worst = max((((got[k] - init[k]) - (ref_state[k] - init[k])).norm()
                 / (ref_state[k] - init[k]).norm().clamp_min(1e-12)).item() for k in ref_state)
    assert worst < 1e-3, worst


# ---------------------------------------------------------------------------------- launching
def test_pp2_matches_trainer_for_llama_and_qwen2(launched, tmp_path):
    out = launched("pp2").out
    for arch in ARCHS:
        ref_info, ref_state = train_reference(arch, tmp_path / f"ref-{arch}")
        ranks = [json.loads((out / arch / f"info-rank{r}.json").read_text()) for r in (0, 1)]
        info = ranks[0]
        # both stages report the same global values
        assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["grad_norms"] == ranks[1]["grad_norms"]
        # each rank holds only its stage: disjoint parameter names covering the model
        assert not set(ranks[0]["stage_params"]) & set(ranks[1]["stage_params"])
        assert set(ranks[0]["stage_params"]) | set(ranks[1]["stage_params"]) == set(ref_state)
        assert info["layer_ranges"][0][0] == 0 and info["layer_ranges"][-1][1] == 4
        assert ranks[0]["cost_model"] == ranks[1]["cost_model"]  # every stage plans with the same model
        assert info["cost_model"]["source"] == ("profiled" if arch == "qwen2" else "analytic")
        # the plans split sequences and recomputed under the budget
        assert all(n > 0 for n in info["split_chunks"]), info["split_chunks"]
        assert sum(info["recompute"]) > 0, f"no recompute ({arch}): {info['recompute']}"
        # same training as Trainer on one process
        assert len(info["losses"]) == len(ref_info["losses"]) == 4
        diffs = [abs(a - b) for a, b in zip(info["losses"], ref_info["losses"])]
        assert max(diffs) < 1e-5, (arch, diffs)
        assert max(abs(a - b) / b for a, b in zip(info["grad_norms"], ref_info["grad_norms"])) < 1e-4
        worst, name = worst_relative(ref_state, load_saved(out / arch / "final"))
        assert worst < 1e-4, (arch, name, worst)
        assert abs(info["eval_loss"] - ref_info["eval_loss"]) < 1e-5
        # throughput counts the sequences the one replica trained on (not once per pipeline rank)
        samples = COMMON["max_steps"] * COMMON["per_device_train_batch_size"] * COMMON["gradient_accumulation_steps"]
        assert info["train_samples_per_second"] * info["train_runtime"] == pytest.approx(samples, rel=2e-2)
        # tokens per second: the replica's trained tokens (one epoch of the 24 rows) / train_runtime
        tokens = sum(len(r["input_ids"]) for r in tiny_dataset())
        assert info["train_tokens_per_second"] == pytest.approx(tokens / info["train_runtime"], rel=1e-3)
        if arch == "llama":  # run_clm.py's metrics and predict() at pp=2, on both ranks, as Trainer's
            for r in ranks:
                assert r["eval_accuracy"] == ref_info["eval_accuracy"] and 0 < r["eval_accuracy"]
                assert abs(r["eval_loss_with_metrics"] - ref_info["eval_loss"]) < 1e-5
                assert r["predicted_ids"] == ref_info["predicted_ids"]
                assert r["predicted_labels"] == ref_info["predicted_labels"]
                assert r["test_accuracy"] == ref_info["test_accuracy"]
                assert abs(r["test_loss"] - ref_info["test_loss"]) < 1e-5
                got = torch.load(out / arch / f"logits-rank{ranks.index(r)}.pt")
                want = torch.load(tmp_path / f"ref-{arch}" / "logits.pt")
                assert got["logits"].shape == want["logits"].shape
                # the trained weights already differ by up to 1e-4 (relative, see above): logits by ~5e-5
                torch.testing.assert_close(got["logits"], want["logits"], atol=1e-4, rtol=1e-4)
                assert torch.equal(got["labels"], want["labels"])
        # checkpoints: standard model files plus one optimizer shard per stage; resume = same end
        names = set(os.listdir(out / arch / "checkpoint-2"))
        # the model in HF's sharded format, one shard per stage (each written by its stage)
        assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                "config.json", "optimizer.stage0-of-2.pt", "optimizer.stage1-of-2.pt",
                "scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "concertina.json",
                "layout_cost_model.json"} <= names
        assert info["resumed_losses"] == pytest.approx(info["losses"], abs=1e-6)
        worst, name = worst_relative(load_saved(out / arch / "final"), load_saved(out / arch / "resumed"))
        assert worst < 1e-6, (arch, "resume", name, worst)


    # tied embeddings: Trainer's training, the two copies equal, one tensor in the checkpoint
    from safetensors import safe_open

    ref_info, ref_state = train_reference("llama-tied", tmp_path / "ref-tied")
    ranks = [json.loads((out / "tied" / f"info-rank{r}.json").read_text()) for r in (0, 1)]
    assert "model.embed_tokens.weight" in ranks[0]["stage_params"] and "lm_head.weight" in ranks[1]["stage_params"]
    assert ranks[0]["reloaded_tied_copy"] and ranks[1]["reloaded_tied_copy"]
    assert max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref_info["losses"])) < 1e-5
    assert max(abs(a - b) / b for a, b in zip(ranks[0]["grad_norms"], ref_info["grad_norms"])) < 1e-4
    first, last = (torch.load(out / "tied" / f"tied-rank{r}.pt") for r in (0, 1))
    assert torch.equal(first, last)  # same gradients, same optimizer steps: the same bits
    weight_map = json.loads((out / "tied" / "final" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and weight_map["model.embed_tokens.weight"].startswith("model-00001-")
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(out / "tied" / "final" / shard), framework="pt") as fh:
            assert "lm_head.weight" not in set(fh.keys())
    loaded = load_saved(out / "tied" / "final")  # tie_word_embeddings: lm_head.weight is the embedding
    assert torch.equal(loaded["lm_head.weight"], first) and torch.equal(loaded["model.embed_tokens.weight"], first)
    worst, name = worst_relative(ref_state, loaded)
    assert worst < 1e-4, ("tied", name, worst)

    # bf16 autocast: within bf16 tolerances of Trainer(bf16=True) (see test_trainer.py)
    ref_info, _ = train_reference("llama", tmp_path / "ref-bf16", bf16=True, use_cpu=True)
    info = json.loads((out / "bf16" / "info-rank0.json").read_text())
    assert max(abs(a - b) / b for a, b in zip(info["losses"], ref_info["losses"])) < 2e-4
    assert max(abs(a - b) / b for a, b in zip(info["grad_norms"], ref_info["grad_norms"])) < 5e-3


def test_pp2_dp2_matches_trainer_with_the_whole_global_batch(launched, tmp_path):
    out = launched("dp2").out
    # one process with both replicas' sequences per step: per_device_train_batch_size x 2 (24 rows: whole
    # batches on both sides, so epochs end at the same step and no replica pads its last batch)
    ref_info, ref_state = train_reference("llama", tmp_path / "ref", per_device_train_batch_size=6)
    ranks = [json.loads((out / f"info-rank{r}.json").read_text()) for r in range(4)]
    assert sorted(tuple(r["topology"]) for r in ranks) == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)  # the global loss on every rank
    diffs = [abs(a - b) for a, b in zip(ranks[0]["losses"], ref_info["losses"])]
    assert len(diffs) == 4 and max(diffs) < 1e-5, diffs
    worst, name = worst_relative(ref_state, load_saved(out / "final"))
    assert worst < 1e-4, (name, worst)
    # throughput over both replicas: 4 steps x 12 sequences = two epochs of the 24 rows
    for r in ranks:
        assert r["train_samples_per_second"] * r["train_runtime"] == pytest.approx(48, rel=2e-2)
        tokens = 2 * sum(len(x["input_ids"]) for x in tiny_dataset())
        assert r["train_tokens_per_second"] == pytest.approx(tokens / r["train_runtime"], rel=1e-3)
    # metrics and predict() over two replicas: every rank holds Trainer's, rows in the dataset's order
    want = torch.load(tmp_path / "ref" / "logits.pt")
    for r in ranks:
        assert r["eval_accuracy"] == ref_info["eval_accuracy"] and r["predicted_ids"] == ref_info["predicted_ids"]
        assert r["predicted_labels"] == ref_info["predicted_labels"]
        assert abs(r["test_loss"] - ref_info["test_loss"]) < 1e-5
        got = torch.load(out / f"logits-rank{r['topology'][0]}.pt")
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-4, rtol=1e-4)

