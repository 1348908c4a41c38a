"""ConcertinaTrainer with segment-level training (opt-in, ``docs/segments.md``): the options' refusals, and three
steps equal to HF's Trainer whose loss is the plain-HF segment reference (:mod:`_segment_reference`),
under gradient "previous" and under "none" with a global head."""

from __future__ import annotations

import random

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, Trainer, TrainingArguments

from _segment_reference import segment_logits

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, tie_word_embeddings=False)
COMMON = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-3,
              logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=3, max_grad_norm=0.5)
SEG = dict(concertina_segment_tokens=16, concertina_segment_gradient="previous", concertina_segment_kv_tail=12)
# gradient "none" (each segment backwarded after its forward) with a global head
SEG_NONE = dict(concertina_segment_tokens=16, concertina_segment_gradient="none", concertina_segment_kv_tail=12,
                concertina_segment_global_heads="1")


def _dataset(n=18, seed=0):
    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"input_ids": [rng.randrange(64) for _ in range(rng.choice([5, 9, 17, 40, 70]))]} for _ in range(n)])


def _model():
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CFG))


class SegmentTrainer(Trainer):
    """HF's Trainer whose loss is the segment reference, sequence by sequence of the flattened batch."""

    seg = SEG

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids, labels, pos = inputs["input_ids"][0], inputs["labels"][0], inputs["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [ids.shape[0]]
        total = 0.0
        for a, b in zip(starts[:-1], starts[1:]):
            seg = self.seg
            heads = tuple(int(h) for h in seg.get("concertina_segment_global_heads", "").split(",") if h)
            logits = segment_logits(model, ids[a:b], seg["concertina_segment_tokens"],
                                    seg["concertina_segment_gradient"], seg["concertina_segment_kv_tail"],
                                    global_heads=heads)
            total = total + F.cross_entropy(logits[:-1].float(), labels[a + 1:b], ignore_index=-100, reduction="sum")
        return total / num_items_in_batch


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("seg", [SEG, SEG_NONE], ids=["previous", "none-global-head"])
def test_three_steps_equal_the_segment_reference_trainer(tmp_path, seg, monkeypatch):
    monkeypatch.setattr(SegmentTrainer, "seg", seg)
    ref = SegmentTrainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path / "ref"), **COMMON),
                         train_dataset=_dataset(), data_collator=DataCollatorWithFlattening())
    ref.train()
    plain = Trainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path / "plain"), **COMMON),
                    train_dataset=_dataset(), data_collator=DataCollatorWithFlattening())
    plain.train()
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path / "c"), concertina_max_tokens_per_chunk=32,
                                       concertina_gantt_steps=-1, **seg, **COMMON)
    trainer = ConcertinaTrainer(model=_model(), args=args, train_dataset=_dataset())
    plan = trainer.planner.make_plan([70, 40, 5])  # the trainer's plans are cut at segments, options recorded
    assert plan.knob("segment_tokens") == 16 and plan.knob("segment_kv_tail") == 12
    assert plan.knob("segment_gradient") == seg["concertina_segment_gradient"]
    assert [s.length for _, s in plan.slices_of(0)] == [16, 16, 16, 16, 6]
    trainer.train()
    losses, want = _losses(trainer), _losses(ref)
    assert len(losses) == 3
    assert max(abs(a - b) for a, b in zip(losses, want)) < 1e-5, (losses, want)
    assert max(abs(a - b) for a, b in zip(_losses(plain), want)) > 1e-4  # a different objective
    state, ref_state = trainer.model.state_dict(), ref.model.state_dict()
    worst = max(float((ref_state[k] - state[k]).norm() / ref_state[k].norm().clamp_min(1e-12)) for k in state)
    assert worst < 1e-4, worst


@pytest.mark.parametrize("kwargs,match", [
    (dict(concertina_segment_tokens=0), "concertina_segment_tokens"),
    (dict(concertina_segment_tokens=8, concertina_segment_gradient="older"), "concertina_segment_gradient"),
    (dict(concertina_segment_tokens=8, concertina_segment_kv_tail=-1), "concertina_segment_kv_tail"),
    (dict(concertina_segment_gradient="previous"), "needs concertina_segment_tokens"),
    (dict(concertina_segment_kv_tail=4), "needs concertina_segment_tokens"),
    (dict(concertina_segment_tokens=8, concertina_segment_global_heads="0,1"), "global_heads needs concertina_segment_kv_tail"),
    (dict(concertina_segment_tokens=8, concertina_segment_kv_tail=4, concertina_segment_global_heads="0,x"),
     "concertina_segment_global_heads='0,x'"),
    (dict(concertina_segment_global_heads="0"), "needs concertina_segment_tokens"),
    (dict(concertina_segment_tokens=8, concertina_sequence_parallel_size=2), "concertina_sequence_parallel_size=1"),
])
def test_segment_options_refused_naming_the_field(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)


def test_segment_options_off_by_default(tmp_path):
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[])
    assert args.segment_options is None
    on = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], **SEG)
    assert (on.segment_options.tokens, on.segment_options.gradient, on.segment_options.kv_tail) == (16, "previous", 12)
    heads = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], concertina_segment_global_heads="3, 0",
                                        **SEG)
    assert heads.segment_options.global_heads == (0, 3)
    assert heads.segment_options.knobs()[-1] == ("segment_global_heads", "0,3")


def test_global_head_beyond_the_model_refused_at_construction(tmp_path):
    """The model has 4 query heads: head 4 is refused when the trainer is built, before any step."""
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], concertina_gantt_steps=-1,
                                       concertina_segment_tokens=16, concertina_segment_kv_tail=12,
                                       concertina_segment_global_heads="1,4")
    with pytest.raises(ValueError, match=r"concertina_segment_global_heads \[1, 4\]: the model has 4 query heads"):
        ConcertinaTrainer(model=_model(), args=args, train_dataset=_dataset())
