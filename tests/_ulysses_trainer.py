"""Worker of ``tests/launch/test_ulysses_launch.py::test_trainer_pp2_sp2_matches_trainer`` on 4
CPU ranks: ``ConcertinaTrainer`` at pp=2 x sp=2 (Ulysses inside each stage; the model perturbed on
ranks 1-3, so rank 0's weights must reach them) for 3 steps with sequences split into 16-token
chunks, then evaluation (run_clm's metrics, ``predict()``), ``save_model`` and a run resumed from the
step-2 checkpoint, and a LoRA model (``_peft_cases``' "embed-head") trained with label smoothing and
the online cost-model refit, and a Gated DeltaNet model (Qwen3-Next, ``_linear_attention_cases``)
for 3 steps; each rank writes what it saw to ``<out>/info-rank<r>.json``. The
models, data and Trainer settings are ``_models``', so ``_models.train_reference`` (``Trainer`` on one
process) is the reference.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 3
PEFT_SMOOTHING = 0.2  # label_smoothing_factor of the PEFT run


def main(out: str) -> None:
    from _models import COMMON, logged, metrics_and_predictions, tiny_dataset, tiny_model

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    sizes = dict(concertina_pipeline_size=2, concertina_sequence_parallel_size=2, concertina_max_tokens_per_chunk=16)
    args = ConcertinaTrainingArguments(output_dir=out, save_strategy="steps", save_steps=2, **sizes,
                                       **dict(COMMON, max_steps=STEPS))
    info: dict = {}
    model = tiny_model("llama")
    if int(os.environ["RANK"]):  # built differently on the other processes: rank 0's weights are used, as DDP does
        import torch

        torch.manual_seed(int(os.environ["RANK"]))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    trainer = ConcertinaTrainer(model=model, args=args, train_dataset=tiny_dataset(), eval_dataset=tiny_dataset(8, seed=1))
    info["synced"] = len(trainer.weights_synced)
    t = trainer.topology
    trainer.train()
    info.update(logged(trainer))
    info["eval_loss"] = trainer.evaluate()["eval_loss"]
    # run_clm's accuracy (preprocess_logits_for_metrics = argmax), predict(), predict()'s raw logits:
    # the last stage gathers its sp ranks' logit shards before the hooks
    info.update(metrics_and_predictions(trainer, os.path.join(out, f"logits-rank{t.rank}.pt")))
    info["topology"] = [t.rank, t.replica, t.stage, t.sp_rank]
    info["stage_params"] = sorted(n for n, _ in trainer.model.named_parameters())
    trainer.save_model(os.path.join(out, "final"))
    # resuming from the step-2 checkpoint (sp rank 0 of each stage wrote the stage's files) ends the same
    resumed = ConcertinaTrainer(model=tiny_model("llama"), train_dataset=tiny_dataset(), args=ConcertinaTrainingArguments(
        output_dir=out + "-resumed", save_strategy="no", **sizes, **dict(COMMON, max_steps=STEPS)))
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed.save_model(os.path.join(out, "resumed"))
    info["resumed_losses"] = logged(resumed)["losses"]
    # PEFT at sp=2 with label smoothing: LoRA on the embedding (run on each rank's token shard), the
    # q / v / down projections, lm_head trained whole (the "embed-head" case of ``_peft_cases``)
    import _peft_cases

    lora = ConcertinaTrainer(model=_peft_cases.peft_model("embed-head"), train_dataset=tiny_dataset(),
                             args=ConcertinaTrainingArguments(
                                 output_dir=out + "-peft", save_strategy="no", label_smoothing_factor=PEFT_SMOOTHING,
                                 concertina_cost_model="online", concertina_replan_interval=1,
                                 **sizes, **_peft_cases.COMMON))
    lora.train()
    info["peft"] = _peft_cases.losses_and_norms(lora)
    info["peft_synced"] = len(lora.weights_synced)  # built alike everywhere: nothing to broadcast
    # the online refit at sp=2 (every step, on the measured actions, all-to-alls included)
    stats = lora.stats_callback
    info["peft_refits"] = [stats.refits, stats.rejected_refits, stats.cost_model.sp]
    # ... whose all-to-alls were timed on the sp group at the start (the refit takes them from the model)
    info["peft_link"] = [stats.cost_model.intra_node_latency_s, stats.cost_model.intra_node_bandwidth]
    lora.save_model(os.path.join(out, "peft"))
    # Gated DeltaNet layers (Qwen3-Next) at pp=2 x sp=2: Ulysses splits their heads too
    import _linear_attention_cases as lin

    linear = ConcertinaTrainer(model=lin.build_model(), train_dataset=lin.dataset(), args=ConcertinaTrainingArguments(
        output_dir=out + "-linear", concertina_pipeline_size=2, concertina_sequence_parallel_size=2,
        concertina_max_tokens_per_chunk=32, **lin.COMMON))
    linear.train()
    info["linear"] = logged(linear)
    linear.save_model(os.path.join(out, "linear"))
    with open(os.path.join(out, f"info-rank{t.rank}.json"), "w") as fh:
        json.dump(info, fh)
    resumed.end()

