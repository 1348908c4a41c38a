"""TRL's SFT data on the pipeline against ``SFTTrainer`` itself on one process (pp = 1).

- ``ConcertinaSFTTrainer`` with BFD packing (padding-free: documents of a packed row must not
  attend to each other) and with completion-only loss on a prompt-completion dataset
  (padding-free, no packing): same per-step loss (1e-5) and final weights (1e-4 relative) as
  ``SFTTrainer`` with the same config, and the same eval loss;
- plain ``ConcertinaTrainer`` on the dataset ``SFTTrainer`` packed, with its default collator and
  with TRL's padding-free collator: ``remove_unused_columns`` keeps ``seq_lengths``, so the
  packed documents stay apart and the losses are ``SFTTrainer``'s;
- ``peft_config=LoraConfig(...)``: the same adapter as ``SFTTrainer``'s, trained to the same update;
- settings that would train something else are refused, naming them.
"""

from __future__ import annotations

import random

import pytest
import torch

trl = pytest.importorskip("trl")

from _models import bundled_tokenizer, sentence, text_dataset, text_model  # noqa: E402

COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-3,
              logging_steps=1, report_to=[], disable_tqdm=True, seed=3, bf16=False, save_strategy="no",
              max_grad_norm=0.5)
@pytest.fixture(scope="module")
def tokenizer():
    return bundled_tokenizer()


def _prompt_completion_dataset(n=16, seed=1):
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"prompt": sentence(rng, 2, 12), "completion": " " + sentence(rng, 1, 10)} for _ in range(n)])


def _logged(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _worst(ref: dict, got: dict) -> float:
    assert set(ref) == set(got)
    return max(((ref[k] - got[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() for k in ref)


def _sft_pair(tokenizer, tmp_path, dataset, peft_config=None, eval_dataset=None, **sft):
    """SFTTrainer and ConcertinaSFTTrainer trained on the same data with the same SFT config."""
    import copy

    from trl import SFTConfig, SFTTrainer

    from concertina_hf.integrations.trl import ConcertinaSFTConfig, ConcertinaSFTTrainer

    ref = SFTTrainer(model=text_model(tokenizer), args=SFTConfig(output_dir=str(tmp_path / "ref"), **sft, **COMMON),
                     train_dataset=dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
                     peft_config=copy.deepcopy(peft_config))
    ref.train()
    ours = ConcertinaSFTTrainer(
        model=text_model(tokenizer), train_dataset=dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
        peft_config=peft_config,
        args=ConcertinaSFTConfig(output_dir=str(tmp_path / "ours"), concertina_max_tokens_per_chunk=16, **sft,
                                 **COMMON))
    ours.train()
    return ref, ours


@pytest.fixture(scope="module")
def packed(tokenizer, tmp_path_factory):
    return _sft_pair(tokenizer, tmp_path_factory.mktemp("packed"), text_dataset(), packing=True, max_length=64,
                     eval_dataset=text_dataset(8, seed=5))


def test_packed_bfd_matches_sfttrainer(packed):
    ref, ours = packed
    # BFD packing put several documents in a row: the case where isolation matters
    rows = ref.train_dataset["seq_lengths"]
    assert sum(len(r) for r in rows) > 2 * len(rows), rows
    assert ours.train_dataset["seq_lengths"] == rows  # TRL prepared the same data
    losses, ref_losses = _logged(ours), _logged(ref)
    assert len(losses) == len(ref_losses) == COMMON["max_steps"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    assert _worst(ref.model.state_dict(), ours.model.state_dict()) < 1e-4
    # evaluation: TRL packs the eval dataset too; the pipeline's eval loss is SFTTrainer's
    assert abs(ours.evaluate()["eval_loss"] - ref.evaluate()["eval_loss"]) < 1e-5


def test_completion_only_padding_free_matches_sfttrainer(tokenizer, tmp_path):
    ref, ours = _sft_pair(tokenizer, tmp_path, _prompt_completion_dataset(), padding_free=True, max_length=None)
    labels = ref.train_dataset[0]["labels"]
    assert -100 in labels and any(x != -100 for x in labels)  # the prompt is masked, the completion trained
    losses, ref_losses = _logged(ours), _logged(ref)
    assert len(losses) == len(ref_losses) == COMMON["max_steps"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    assert _worst(ref.model.state_dict(), ours.model.state_dict()) < 1e-4


@pytest.mark.parametrize("collator", ["default", "trl-padding-free"])
def test_concertina_trainer_keeps_packed_documents_apart(packed, tokenizer, tmp_path, collator):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    ref, _ = packed
    data_collator = (None if collator == "default" else
                     DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True))
    trainer = ConcertinaTrainer(
        model=text_model(tokenizer), train_dataset=ref.train_dataset, data_collator=data_collator,
        args=ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_max_tokens_per_chunk=16, **COMMON))
    trainer.train()
    losses, ref_losses = _logged(trainer), _logged(ref)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)


def test_refusals(tokenizer, tmp_path):
    from trl import SFTConfig

    from concertina_hf.integrations.trl import ConcertinaSFTConfig, ConcertinaSFTTrainer

    with pytest.raises(TypeError, match="ConcertinaSFTConfig"):
        ConcertinaSFTTrainer(model=text_model(tokenizer), args=SFTConfig(output_dir=str(tmp_path), bf16=False),
                             train_dataset=text_dataset(4), processing_class=tokenizer)
    with pytest.raises(NotImplementedError, match="loss_type"):
        ConcertinaSFTTrainer(model=text_model(tokenizer), train_dataset=text_dataset(4), processing_class=tokenizer,
                             args=ConcertinaSFTConfig(output_dir=str(tmp_path), bf16=False, loss_type="dft"))


def test_peft_config_lora_matches_sfttrainer(tokenizer, tmp_path):
    """``peft_config``: the adapter is made (same seed as SFTTrainer) before the model is split."""
    from peft import LoraConfig

    from concertina_hf.integrations.peft import is_peft_model

    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    ref, ours = _sft_pair(tokenizer, tmp_path, text_dataset(), packing=True, max_length=64,
                          peft_config=LoraConfig(**lora))
    assert is_peft_model(ref.model) and is_peft_model(ours.peft_model)
    losses, ref_losses = _logged(ours), _logged(ref)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    want = {k.removeprefix("base_model.model."): v for k, v in ref.model.state_dict().items()}
    have = ours.model.state_dict()
    assert _worst(want, have) < 1e-4
    # the adapter's update (all its tensors together) within 1e-3 of SFTTrainer's, as in test_peft
    from peft import get_peft_model
    from transformers import set_seed

    set_seed(COMMON["seed"])
    init = {k.removeprefix("base_model.model."): v
            for k, v in get_peft_model(text_model(tokenizer), LoraConfig(**lora)).state_dict().items()}
    trained = [k for k in want if "lora_" in k]
    assert trained and all(not torch.equal(want[k], init[k]) for k in trained)
    update = torch.cat([(want[k] - init[k]).flatten() for k in trained])
    error = torch.cat([(have[k] - want[k]).flatten() for k in trained])
    assert (error.norm() / update.norm()).item() < 1e-3


def test_model_by_name_trains_as_the_object(tokenizer, tmp_path):
    """A local directory as ``model`` (read by stage, ``model_init_kwargs`` honoured) trains as the
    ``from_pretrained`` object of it: same losses, same weights."""
    from transformers import AutoModelForCausalLM

    from concertina_hf.integrations.trl import ConcertinaSFTConfig, ConcertinaSFTTrainer

    src = tmp_path / "src"
    text_model(tokenizer).save_pretrained(src)
    runs = []
    for model in (AutoModelForCausalLM.from_pretrained(src), str(src)):
        ours = ConcertinaSFTTrainer(
            model=model, train_dataset=text_dataset(), processing_class=tokenizer,
            args=ConcertinaSFTConfig(output_dir=str(tmp_path / f"run{len(runs)}"), concertina_max_tokens_per_chunk=16,
                                     packing=True, max_length=64, model_init_kwargs={"dtype": "float32"}, **COMMON))
        ours.train()
        runs.append((_logged(ours), ours.model.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert _worst(runs[0][1], runs[1][1]) == 0


def test_moe_router_loss_needs_the_per_chunk_option_and_takes_trls_coefficient(tokenizer, tmp_path):
    """TRL turns the router loss on for a MoE model (``router_aux_loss_coef``, else the config's):
    refused without ``concertina_router_aux_loss``, naming it; with it the stages weigh their
    per-chunk term by TRL's coefficient, and ``router_aux_loss_coef=0.0`` turns it off as in TRL."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from concertina_hf.integrations.trl import ConcertinaSFTConfig, ConcertinaSFTTrainer

    def moe():
        torch.manual_seed(1)
        return AutoModelForCausalLM.from_config(Qwen3MoeConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
            num_experts_per_tok=2, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id))

    def build(**over):
        return ConcertinaSFTTrainer(model=moe(), train_dataset=text_dataset(4), processing_class=tokenizer,
                                    args=ConcertinaSFTConfig(output_dir=str(tmp_path), bf16=False, **over))

    with pytest.raises(NotImplementedError, match="set concertina_router_aux_loss='per_chunk' to add it per chunk"):
        build()
    assert build(concertina_router_aux_loss="per_chunk").pipeline.router_aux.coef == 0.001  # the config's
    assert build(concertina_router_aux_loss="per_chunk", router_aux_loss_coef=0.25).pipeline.router_aux.coef == 0.25
    assert build(concertina_router_aux_loss="per_chunk", router_aux_loss_coef=0.0).pipeline.router_aux is None
