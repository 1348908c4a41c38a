"""ReplanCallback: the online refit recovers a known cost model; statistics reach a real tracker."""

from __future__ import annotations

import dataclasses
import random

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
from concertina_hf.planning.fit import ActionSample, action_samples, refit_cost_model
from concertina_hf.planning import (
    Action,
    ActionKind,
    Chunk,
    ChunkKind,
    CostModel,
    DeviceSpec,
    Slice,
    StageLayout,
    plan_step,
)

HF_CFG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)


def _chunks(rng, n):
    out = []
    for i in range(n):
        if rng.random() < 0.5:
            sl = (Slice(i, 0, rng.randrange(16, 2048)),)
        else:
            c = rng.randrange(256, 4096)
            sl = (Slice(i, c, rng.randrange(64, 1024)), Slice(n + i, 0, rng.randrange(8, 256)))
        out.append(Chunk(0, ChunkKind.PACKED, sl))
    return out


def test_refit_recovers_a_known_cost_model():
    rng = random.Random(0)
    start = CostModel.from_hf_config(HF_CFG, DeviceSpec.cpu(), dtype_bytes=4)
    truth = dataclasses.replace(start, alpha_attn=start.alpha_attn * 3.0, alpha_tok=start.alpha_tok * 0.4,
                                beta=2e-4, bwd_factor=2.3, head_time_per_token=start.head_time_per_token * 0.6,
                                embed_time_per_token=start.embed_time_per_token * 0.6)
    layout = StageLayout(6, ((0, 2), (2, 4), (4, 6)))
    samples = []
    for ch in _chunks(rng, 60):
        st = rng.randrange(3)
        r = rng.randrange(0, 3)
        noise = 1 + rng.uniform(-0.01, 0.01)
        samples.append(ActionSample(st, ch, r, truth.fwd_time(layout, st, ch) * noise,
                                    truth.bwd_time(layout, st, ch, r) * noise))
    fitted = refit_cost_model(start, layout, samples)
    assert fitted is not None and fitted.source == "online"
    for ch in _chunks(random.Random(1), 30):  # held-out shapes
        for st in range(3):
            want, got = truth.fwd_time(layout, st, ch), fitted.fwd_time(layout, st, ch)
            assert abs(got - want) / want < 0.03, (st, ch, got, want)
            assert abs(fitted.bwd_time(layout, st, ch, 1) - truth.bwd_time(layout, st, ch, 1)) \
                / truth.bwd_time(layout, st, ch, 1) < 0.03
    assert fitted.bwd_factor == pytest.approx(2.3, rel=0.03)
    # far off before: the refit is what made the predictions right
    ch = _chunks(random.Random(2), 1)[0]
    assert abs(start.fwd_time(layout, 1, ch) / truth.fwd_time(layout, 1, ch) - 1) > 0.2
    # memory: raised when measured above prediction, never lowered
    raised = refit_cost_model(start, layout, samples, memory_scale=1.5)
    assert raised.act_bytes_per_token == pytest.approx(1.5 * start.act_bytes_per_token)
    assert refit_cost_model(start, layout, samples, memory_scale=0.5).act_bytes_per_token == start.act_bytes_per_token
    assert refit_cost_model(start, layout, samples[:3]) is None  # underdetermined


def test_action_samples_pair_forward_and_backward_of_each_chunk():
    cost = CostModel.from_hf_config(HF_CFG, DeviceSpec.cpu(), dtype_bytes=4)
    layout = StageLayout(6, ((0, 3), (3, 6)))
    plan = plan_step([300, 40, 40, 900], cost, layout, 0, max_tokens_per_chunk=256)
    acts = []
    for st, actions in enumerate(plan.schedule):
        for i, a in enumerate(actions):
            acts.append((a, float(i), float(i) + 0.5 + a.chunk))
    acts = [x for x in acts if x[0] != Action(1, ActionKind.BACKWARD, 0)]  # one backward missing
    out = action_samples(plan, acts)
    assert len(out) == 2 * plan.num_chunks - 1
    assert all(s.fwd_s == s.bwd_s == 0.5 + plan.chunks.index(s.chunk) for s in out)


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
