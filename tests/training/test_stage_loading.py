"""Loading by stage on one process: a model given by name trains as the same model given as an object.

``ConcertinaTrainer(model=<directory>)`` reads the safetensors files tensor by tensor into a model
built on the meta device; the reference is ``AutoModelForCausalLM.from_pretrained`` of the same
directory passed as an object. Multi-stage loading and saving by stage (shards, index, peak memory)
are in ``tests/launch/test_stage_loading_launch.py``.
"""

from __future__ import annotations

import json
import os
import random

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
from concertina_hf.training.stage_loading import model_source, write_safetensors

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2)
COMMON = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-3,
              logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=3, use_cpu=True,
              concertina_max_tokens_per_chunk=32)


def _dataset(n=18, seed=0):
    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"input_ids": [rng.randrange(64) for _ in range(rng.choice([5, 9, 17, 40]))]} for _ in range(n)])


def _saved(tmp_path, tied: bool, shard: str | None = None) -> str:
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG, tie_word_embeddings=tied))
    out = str(tmp_path / f"src-{tied}-{shard}")
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, **kw)
    return out


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("tied,shard", [(False, None), (True, "100KB")])
def test_name_trains_as_the_object(tmp_path, tied, shard):
    src = _saved(tmp_path, tied, shard)
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json")) == bool(shard)
    runs = {}
    for kind in ("object", "name"):
        model = AutoModelForCausalLM.from_pretrained(src) if kind == "object" else src
        args = ConcertinaTrainingArguments(output_dir=str(tmp_path / kind), **COMMON)
        trainer = ConcertinaTrainer(model=model, args=args, train_dataset=_dataset())
        trainer.train()
        runs[kind] = (_losses(trainer), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
        trainer.end()
    assert runs["name"][0] == runs["object"][0]
    assert runs["name"][1].keys() == runs["object"][1].keys()
    for k, v in runs["object"][1].items():
        assert torch.equal(runs["name"][1][k], v), k


def test_model_init_kwargs(tmp_path):
    src = _saved(tmp_path, tied=False)
    source = model_source(src, json.dumps({"dtype": "bfloat16", "attn_implementation": "eager"}))
    model = source.prefix_model(4)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    want = ref.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert model_source(src, None).dtype == torch.float32  # "auto": the config's dtype


def test_errors_name_the_setting(tmp_path):
    src = _saved(tmp_path, tied=False)
    with pytest.raises(ValueError, match="device_map"):
        model_source(src, {"device_map": "auto"})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no HF model config"):
        model_source(str(empty), None)
    os.remove(os.path.join(src, "model.safetensors"))
    with pytest.raises(ValueError, match="neither model.safetensors"):
        model_source(src, None)


def test_write_safetensors_reads_back(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 2).bfloat16(),
               "d": torch.zeros(0, 4), "e": torch.tensor(1.5)}
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, tensors)
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_untie_by_override_copies_the_embedding(tmp_path):
    src = _saved(tmp_path, tied=True)
    model = model_source(src, {"tie_word_embeddings": False}).prefix_model(4)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_profiled_cost_model_by_name(tmp_path):
    """The profiler runs on rank 0 on the first layers read for it (the stage's model is on meta then)."""
    src = _saved(tmp_path, tied=False)
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path / "run"), concertina_cost_model="profiled",
                                       **{k: v for k, v in COMMON.items() if k != "max_steps"}, max_steps=1)
    trainer = ConcertinaTrainer(model=src, args=args, train_dataset=_dataset())
    assert trainer.cost_model.source == "profiled"
    assert os.path.isfile(tmp_path / "run" / "cost_model.json")
    trainer.train()
    trainer.end()
