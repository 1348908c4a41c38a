"""The tiny models, data, settings and one-process ``Trainer`` references the trainer tests share
(the one-process tests in ``tests/training``, the workers and checks of the launches in
``tests/launch``).

A 4-layer Llama (or Qwen2: grouped-query attention, q/k/v biases; or a Llama whose input and output
embeddings are one matrix) of hidden size 32 on a 64-token vocabulary; 24 sequences of 5 to 70
tokens; ``Trainer`` with ``DataCollatorWithFlattening`` (padding-free, the token-weighted loss) as
the reference. For the TRL tests, text: the bundled tokenizer, a 2-layer Llama of its vocabulary,
sentences of a few words.
"""

from __future__ import annotations

import os
import random

import torch

#: the tiny Llama's configuration
TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
#: the Trainer settings of the references: 4 steps of 2 micro-batches of 3 sequences, clipping at 0.5
COMMON = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=4, learning_rate=2e-3,
              logging_steps=1, report_to=[], disable_tqdm=True, seed=3, max_grad_norm=0.5,
              per_device_eval_batch_size=4)
#: :data:`COMMON` without checkpoints (the one-process trainer tests)
NO_SAVE = dict(COMMON, save_strategy="no")


def tiny_config(arch: str = "llama"):
    """``llama``, ``qwen2`` or ``llama-tied`` (the Llama with tied embeddings)."""
    from transformers import LlamaConfig, Qwen2Config

    kw = dict(TINY_LLAMA, tie_word_embeddings=arch == "llama-tied")
    return Qwen2Config(**kw) if arch == "qwen2" else LlamaConfig(**kw)


def tiny_model(arch: str = "llama"):
    """:func:`tiny_config`'s model, its weights drawn from seed 1 (the same on every call)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(tiny_config(arch))


def tiny_dataset(n: int = 24, seed: int = 0):
    """``n`` sequences of 5, 9, 17, 40 or 70 random tokens."""
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"input_ids": [rng.randrange(64) for _ in range(rng.choice([5, 9, 17, 40, 70]))]} for _ in range(n)])


def losses_of(trainer) -> list[float]:
    """The losses a trainer logged."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def logged(trainer) -> dict:
    """The losses, gradient norms, recomputed layers and split chunks a trainer logged, per step."""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs],
            "recompute": [h.get("concertina/recompute_layers", 0.0) for h in logs],
            "split_chunks": [h.get("concertina/chunks_split", 0.0) for h in logs]}


def token_accuracy(eval_preds):
    """run_clm.py's compute_metrics (with preprocess_logits_for_metrics = argmax), see test_metrics.py."""
    preds, labels = eval_preds
    return {"accuracy": float((preds[:, :-1].reshape(-1) == labels[:, 1:].reshape(-1)).mean())}


def metrics_and_predictions(trainer, logits_path: str) -> dict:
    """run_clm.py's token accuracy through evaluate() and predict(), and predict()'s raw logits
    (saved to ``logits_path``)."""
    trainer.compute_metrics = token_accuracy
    trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(dim=-1)
    ev = trainer.evaluate()
    pred = trainer.predict(tiny_dataset(8, seed=1))
    trainer.compute_metrics = trainer.preprocess_logits_for_metrics = None
    raw = trainer.predict(tiny_dataset(8, seed=1))
    os.makedirs(os.path.dirname(logits_path), exist_ok=True)
    torch.save({"logits": torch.as_tensor(raw.predictions), "labels": torch.as_tensor(raw.label_ids)}, logits_path)
    return {"eval_accuracy": ev["eval_accuracy"], "eval_loss_with_metrics": ev["eval_loss"],
            "predicted_ids": pred.predictions.tolist(), "predicted_labels": pred.label_ids.tolist(),
            "test_accuracy": pred.metrics["test_accuracy"], "test_loss": pred.metrics["test_loss"]}


def train_reference(arch: str, out, metrics: bool | None = None, **overrides) -> tuple[dict, dict]:
    """Trainer on one process (:data:`COMMON` with ``overrides``): what it logged, its evaluation
    loss and its final state dict; ``metrics``: also run_clm's metrics and predict() (default: Llama
    at the common settings), the raw logits in ``<out>/logits.pt``."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    kw = dict(COMMON, save_strategy="no", **overrides)
    ref = Trainer(model=tiny_model(arch), args=TrainingArguments(output_dir=str(out), **kw),
                  train_dataset=tiny_dataset(), eval_dataset=tiny_dataset(8, seed=1),
                  data_collator=DataCollatorWithFlattening())
    ref.train()
    info = logged(ref)
    info["eval_loss"] = ref.evaluate()["eval_loss"]
    if metrics or (metrics is None and arch == "llama" and set(overrides) <= {"per_device_train_batch_size"}):
        info.update(metrics_and_predictions(ref, str(out / "logits.pt")))
    return info, {k: v.detach().clone() for k, v in ref.model.state_dict().items()}


def load_saved(path) -> dict:
    """The state dict of a saved directory, loaded by plain transformers (not as a concertina model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.config._attn_implementation != "concertina"
    return model.state_dict()


def worst_relative(ref: dict, got: dict) -> tuple[float, str]:
    """Largest relative difference over the parameters, leaving out key biases: adding a constant
    to every key leaves softmax unchanged, so their true gradient is exactly 0 and Adam turns the
    float rounding noise (different summation orders) into full-size steps. Those get 1e-2."""
    assert set(ref) == set(got), set(ref) ^ set(got)
    rel = {k: ((ref[k] - got[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() for k in ref}
    noisy = [k for k in rel if k.endswith("k_proj.bias")]
    assert all(rel[k] < 1e-2 for k in noisy), {k: rel[k] for k in noisy}
    return max((v, k) for k, v in rel.items() if k not in noisy)


# ---------------------------------------------------------------------------------- text (the TRL tests)
WORDS = "the a pipeline stage chunk token sequence layer model plan step memory budget long short".split()


def bundled_tokenizer():
    """The tokenizer the package bundles (no Hub)."""
    from transformers import AutoTokenizer

    from concertina_hf.tools.data import bundled_tokenizer_path

    return AutoTokenizer.from_pretrained(bundled_tokenizer_path())


def text_model(tokenizer):
    """A 2-layer Llama on the tokenizer's vocabulary, from seed 1."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id))


def sentence(rng, lo, hi):
    """``lo`` to ``hi`` - 1 of :data:`WORDS`."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(lo, hi)))


def text_dataset(n=24, seed=0):
    """``n`` rows of a ``text`` column, sentences of 2 to 29 words."""
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list([{"text": sentence(rng, 2, 30)} for _ in range(n)])
