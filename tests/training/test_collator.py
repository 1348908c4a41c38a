"""LengthAwareCollator and split_sequences: exact tensors, truncation, labels, HF-compatible layout."""

from __future__ import annotations

import doctest

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, DataCollatorWithPadding, LlamaConfig

from concertina_hf.training import collator as collator_module
from concertina_hf.training.collator import LengthAwareCollator, split_sequences


def test_doctests_pass():
    result = doctest.testmod(collator_module, raise_on_error=False)
    assert result.attempted >= 5 and result.failed == 0


def test_exact_tensors_truncation_and_labels():
    rows = [
        {"input_ids": [3, 4, 5, 6, 7, 8], "length": 6},
        {"input_ids": torch.tensor([9]), "labels": torch.tensor([-100])},
        {"input_ids": []},  # empty rows are dropped
        {"input_ids": [10, 11, 12], "labels": [10, -100, 12]},
    ]
    out = LengthAwareCollator(max_length=4)(rows)
    assert out["input_ids"].tolist() == [[3, 4, 5, 6, 9, 10, 11, 12]]
    assert out["labels"].tolist() == [[-100, 4, 5, 6, -100, -100, -100, 12]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 0, 1, 2]]
    assert out["seq_lens"].tolist() == [4, 1, 3]
    assert all(t.dtype == torch.long for t in out.values())
    seqs, labels = split_sequences(out)
    assert [s.tolist() for s in seqs] == [[3, 4, 5, 6], [9], [10, 11, 12]]
    assert [y.tolist() for y in labels] == [[-100, 4, 5, 6], [-100], [-100, -100, 12]]
    no_pos = LengthAwareCollator(return_position_ids=False)(rows[:1])
    assert set(no_pos) == {"input_ids", "labels", "seq_lens"}


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="max_length"):
        LengthAwareCollator(max_length=0)
    with pytest.raises(ValueError, match="input_ids"):
        LengthAwareCollator()([{"text": "x"}])
    with pytest.raises(ValueError, match="labels"):
        LengthAwareCollator()([{"input_ids": [1, 2], "labels": [1]}])


def test_split_understands_flattening_padding_and_cu_seqlens():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9]}]
    want = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    flat = DataCollatorWithFlattening()(rows)
    seqs, labels = split_sequences(flat)
    assert [s.tolist() for s in seqs] == want
    assert [y.tolist()[1:] for y in labels] == [w[1:] for w in want]
    cu = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)(rows)
    assert [s.tolist() for s in split_sequences(cu)[0]] == want

    class _Tok:  # the minimal tokenizer interface DataCollatorWithPadding needs
        pad_token_id, padding_side, model_input_names = 0, "left", ["input_ids", "attention_mask"]

        def pad(self, feats, **kw):
            n = max(len(f["input_ids"]) for f in feats)
            ids = [[0] * (n - len(f["input_ids"])) + f["input_ids"] for f in feats]
            mask = [[0] * (n - len(f["input_ids"])) + [1] * len(f["input_ids"]) for f in feats]
            return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}

    padded = DataCollatorWithPadding(_Tok())(rows)
    seqs, labels = split_sequences(padded)  # no labels: the inputs are the labels
    assert [s.tolist() for s in seqs] == want and [y.tolist() for y in labels] == want
    unmasked = {"input_ids": torch.tensor([[1, 2], [3, 4]])}
    assert [s.tolist() for s in split_sequences(unmasked)[0]] == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="sum to"):
        split_sequences({"input_ids": torch.tensor([[1, 2, 3]]), "seq_lens": torch.tensor([1, 1])})


def test_flat_batch_trains_a_plain_hf_model_like_separate_sequences():
    """The collator's layout keeps sequences apart in HF's own forward (position ids restart)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(cfg)
    rows = [{"input_ids": [int(x) for x in torch.randint(0, 50, (n,))]} for n in (7, 3, 12)]
    batch = LengthAwareCollator()(rows)
    batch.pop("seq_lens")
    flat_loss = model(**batch, use_cache=False).loss
    total, count = 0.0, 0
    for r in rows:
        x = torch.tensor([r["input_ids"]])
        logits = model(x, use_cache=False).logits[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
        count += x.shape[1] - 1
    assert torch.allclose(flat_loss, total / count, rtol=1e-5, atol=1e-6)


def test_works_on_tokenized_dataset_rows():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7, 8]], "length": [3, 5]})
    out = LengthAwareCollator(max_length=3)([ds[0], ds[1]])
    assert out["seq_lens"].tolist() == [3, 3]
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
