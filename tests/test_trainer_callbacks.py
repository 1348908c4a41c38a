"""ReplanCallback: plan statistics reach a real tracker (the refit it runs: tests/test_fit.py)."""

from __future__ import annotations

import random

import datasets
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

HF_CFG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)


def test_plan_statistics_reach_tensorboard(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    rng = random.Random(0)
    ds = datasets.Dataset.from_list([{"input_ids": [rng.randrange(64) for _ in range(rng.choice([6, 30, 80]))]}
                                     for _ in range(12)])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**dict(HF_CFG, vocab_size=64, num_hidden_layers=2)))
    args = ConcertinaTrainingArguments(
        output_dir=str(tmp_path), report_to=["tensorboard"], max_steps=3,
        per_device_train_batch_size=4, logging_steps=1, save_strategy="no", disable_tqdm=True,
        concertina_max_tokens_per_chunk=32)
    ConcertinaTrainer(model=model, args=args, train_dataset=ds).train()
    runs = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert runs
    acc = EventAccumulator(str(runs[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/concertina/chunks_split", "train/concertina/measured_step_time_s",
                "train/concertina/predicted_step_time_s", "train/concertina/peak_activation_stage0_bytes",
                "train/concertina/recompute_layers", "train/concertina/planning_time_s"):
        assert tag in tags, (tag, sorted(tags))
    assert len(acc.Scalars("train/concertina/chunks")) == 3
