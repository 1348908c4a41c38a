"""compute_metrics, preprocess_logits_for_metrics and predict() on one process, against ``Trainer``.

The metric functions are those of HF's ``examples/pytorch/language-modeling/run_clm.py`` (not
shipped with transformers: ``group_texts``, ``preprocess_logits_for_metrics`` and
``compute_metrics`` are copied here, the ``evaluate`` accuracy written out), run with the
script's ``default_data_collator``. Sequences are split into chunks smaller than a block, so
the predictions are put together from several slices. The pp=2 case is in
``test_trainer_pipeline.py``.
"""

from __future__ import annotations

import random
from itertools import chain

import datasets
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, tie_word_embeddings=False)
COMMON = dict(per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2, report_to=[], save_strategy="no",
              disable_tqdm=True, seed=3, per_device_eval_batch_size=3)
BLOCK = 16


# ---------------------------------------------------------------- run_clm.py's functions (transformers v5)
def group_texts(examples):
    concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
    total_length = len(concatenated_examples[list(examples.keys())[0]])
    total_length = (total_length // BLOCK) * BLOCK
    result = {k: [t[i: i + BLOCK] for i in range(0, total_length, BLOCK)] for k, t in concatenated_examples.items()}
    result["labels"] = result["input_ids"].copy()
    return result


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(eval_preds):
    preds, labels = eval_preds
    labels = labels[:, 1:].reshape(-1)
    preds = preds[:, :-1].reshape(-1)
    return {"accuracy": float((preds == labels).mean())}  # evaluate.load("accuracy").compute(...)


# ---------------------------------------------------------------- data and models
def _documents(n, seed):
    """Counting runs (token t+1 follows t, mod 64) from random starts: a few steps learn some of it."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        start = rng.randrange(64)
        docs.append({"input_ids": [(start + i) % 64 for i in range(rng.choice([5, 9, 17, 40]))]})
    return datasets.Dataset.from_list(docs)


def _blocks(n, seed):
    return _documents(n, seed).map(group_texts, batched=True)


def _model():
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CFG))


def _pair(tmp_path, collators, train, evals, **kw):
    ref = Trainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path / "ref"), **COMMON),
                  train_dataset=train, eval_dataset=evals, data_collator=collators[0], **kw)
    got = ConcertinaTrainer(
        model=_model(), args=ConcertinaTrainingArguments(output_dir=str(tmp_path / "got"), **COMMON,
                                                         concertina_max_tokens_per_chunk=7),
        train_dataset=train, eval_dataset=evals, data_collator=collators[1], **kw)
    ref.train()
    got.metrics_of_train = got.train().metrics
    return ref, got


def test_run_clm_metrics_and_predict_equal_trainers(tmp_path):
    """run_clm.py --do_train --do_eval with only the swap: Trainer's eval_loss and eval_accuracy;
    predict(): the same argmax predictions, label ids and metrics."""
    ref, got = _pair(tmp_path, (default_data_collator, default_data_collator), _blocks(16, 0), _blocks(12, 1),
                     compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    want, have = ref.evaluate(), got.evaluate()
    assert 0.0 < want["eval_accuracy"] < 1.0
    assert have["eval_accuracy"] == want["eval_accuracy"]
    assert have["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-5)
    p, q = ref.predict(_blocks(12, 1)), got.predict(_blocks(12, 1))
    assert q.predictions.shape == p.predictions.shape and q.predictions.dtype == p.predictions.dtype
    np.testing.assert_array_equal(q.predictions, p.predictions)
    np.testing.assert_array_equal(q.label_ids, p.label_ids)
    # Trainer also reports test_model_preparation_time after train() (the pipeline never wraps the model)
    assert set(q.metrics) - {"test_model_preparation_time"} == set(p.metrics) - {"test_model_preparation_time"}
    assert q.metrics["test_accuracy"] == p.metrics["test_accuracy"]
    assert q.metrics["test_loss"] == pytest.approx(p.metrics["test_loss"], abs=1e-5)
    # train_tokens_per_second: 4 steps x 2 blocks of 16 tokens over train_runtime
    m = got.metrics_of_train
    assert m["train_tokens_per_second"] == pytest.approx(4 * 2 * BLOCK / m["train_runtime"], rel=1e-3)
    # the loop's own preprocess hook is back after the loop (it ran once per slice, not per batch)
    assert got.preprocess_logits_for_metrics is preprocess_logits_for_metrics


def test_predict_returns_trainers_logits_for_packed_batches(tmp_path):
    """No metrics: predict() gives the logits of every token, laid out like the flattened batch
    rows and padded across batches with -100 as Trainer's nested_concat does."""
    ref, got = _pair(tmp_path, (DataCollatorWithFlattening(), None), _documents(8, 0), None)
    p, q = ref.predict(_documents(7, 1)), got.predict(_documents(7, 1))
    assert q.predictions.shape == p.predictions.shape  # [batches, longest flattened batch, vocab]
    np.testing.assert_allclose(q.predictions, p.predictions, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(q.label_ids, p.label_ids)
    assert q.metrics["test_loss"] == pytest.approx(p.metrics["test_loss"], abs=1e-5)


def test_preprocess_that_is_not_per_token_is_refused_by_name(tmp_path):
    trainer = ConcertinaTrainer(
        model=_model(), args=ConcertinaTrainingArguments(output_dir=str(tmp_path), **COMMON),
        compute_metrics=compute_metrics, preprocess_logits_for_metrics=lambda logits, labels: logits.mean())
    with pytest.raises(RuntimeError, match="preprocess_logits_for_metrics returned .* one value per token"):
        trainer.evaluate(_blocks(3, 1))


def _pad_collator(rows):
    """Right padding with attention_mask, labels -100 at pads (DataCollatorForLanguageModeling's layout)."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_predict_on_padded_batches_matches_trainer_at_every_token(tmp_path):
    """A padding collator: Trainer's [rows, longest, vocab] layout; equal logits at every real
    token, -100 at pad positions (where Trainer has the model's output on pad tokens)."""
    ref, got = _pair(tmp_path, (_pad_collator, _pad_collator), _documents(8, 0), None)
    p, q = ref.predict(_documents(7, 1)), got.predict(_documents(7, 1))
    assert q.predictions.shape == p.predictions.shape
    # the real tokens of the 7 rows, padded to the longest as Trainer's nested_concat pads its batches
    real = np.asarray(_pad_collator([{"input_ids": r} for r in _documents(7, 1)["input_ids"]])["attention_mask"])
    np.testing.assert_allclose(q.predictions[real == 1], p.predictions[real == 1], atol=1e-5, rtol=1e-5)
    assert (q.predictions[real == 0] == -100).all()
    np.testing.assert_array_equal(q.label_ids, p.label_ids)
    assert q.metrics["test_loss"] == pytest.approx(p.metrics["test_loss"], abs=1e-5)
