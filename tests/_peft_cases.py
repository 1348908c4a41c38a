"""The LoRA cases the PEFT tests share (one process: ``tests/training/test_peft.py``; pp = 2:
``tests/launch/test_peft_launch.py``; sp = 2: ``tests/launch/test_ulysses_launch.py``), each adapter
built from the same seed on both sides, ``Trainer`` + the same ``PeftModel`` as the reference, and
the checks of a saved adapter against it.
"""

from __future__ import annotations

import os

import peft
import torch

from _models import TINY_LLAMA, tiny_dataset

COMMON = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-2,
              logging_steps=1, report_to=[], disable_tqdm=True, seed=3, max_grad_norm=0.5)
CASES = {
    "default": dict(),
    "embed-head": dict(target_modules=["embed_tokens", "q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"]),
}
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-3


def base_model(**over):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_LLAMA, **over}))


def peft_model(case: str, **over):
    torch.manual_seed(2)  # LoRA A (and the embedding's B) are drawn at random
    return peft.get_peft_model(base_model(**over), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **CASES[case]))


def losses_and_norms(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}


def peft_reference(case: str, out) -> tuple[dict, dict]:
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    ref = Trainer(model=peft_model(case), args=TrainingArguments(output_dir=str(out), save_strategy="no", **COMMON),
                  train_dataset=tiny_dataset(), data_collator=DataCollatorWithFlattening())
    ref.train()
    return losses_and_norms(ref), ref.model


def peft_trainer(case: str, out, **extra):
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    args = ConcertinaTrainingArguments(output_dir=str(out), concertina_max_tokens_per_chunk=16,
                                       **{"save_strategy": "no", **COMMON, **extra})
    return ConcertinaTrainer(model=peft_model(case), args=args, train_dataset=tiny_dataset())


def check_adapter(case: str, saved_dir, ref_model, got: dict, ref: dict) -> None:
    """Trainer's losses and norms; the saved adapter loads with plain peft and holds Trainer's update;
    merge_and_unload gives the trained model."""
    assert len(got["losses"]) == len(ref["losses"]) == COMMON["max_steps"]
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < LOSS_TOL, (case, got, ref)
    assert max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"])) < 1e-4, (case, got, ref)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(saved_dir))
    assert not os.path.exists(os.path.join(saved_dir, "model.safetensors"))
    loaded = peft.PeftModel.from_pretrained(base_model(), str(saved_dir))
    init, want, have = peft_model(case).state_dict(), ref_model.state_dict(), loaded.state_dict()
    assert set(want) == set(have)
    trained = [k for k in want if not torch.equal(want[k], init[k])]
    assert len(trained) >= (8 if case == "default" else 27), trained  # every adapter moved (and lm_head)
    # the adapter's update (all its tensors together) within 1e-3 of Trainer's. Per tensor the
    # bound is 1e-2: a weight whose gradient is near 0 in some step takes a full-size Adam step from
    # float rounding noise (different summation orders), as the key biases in ``_models.worst_relative``
    update = torch.cat([(want[k] - init[k]).flatten() for k in trained])
    error = torch.cat([(have[k] - want[k]).flatten() for k in trained])
    worst = max((((have[k] - want[k]).norm() / (want[k] - init[k]).norm()).item(), k) for k in trained)
    print(f"{case}: loss diff {max(abs(a - b) for a, b in zip(got['losses'], ref['losses'])):.2e}, adapter update "
          f"error {(error.norm() / update.norm()).item():.2e} (worst tensor {worst[0]:.2e})")
    assert (error.norm() / update.norm()).item() < UPDATE_TOL, (case, (error.norm() / update.norm()).item())
    assert worst[0] < 10 * UPDATE_TOL, (case, worst)
    frozen = [k for k in want if k not in trained and "lora_" not in k and "modules_to_save" not in k]
    assert all(torch.equal(have[k], init[k]) for k in frozen)
    # merging gives a plain HF model computing what the adapter computes, with Trainer's update
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
        merged_model = loaded.merge_and_unload()
        assert type(merged_model) is type(base_model())
        assert (merged_model(input_ids=ids).logits - logits).abs().max().item() < 1e-5
    base, merged, ref_merged = base_model().state_dict(), merged_model.state_dict(), ref_model.merge_and_unload().state_dict()
    assert set(merged) == set(ref_merged) == set(base)
    update = torch.cat([(ref_merged[k] - base[k]).flatten() for k in base])
    error = torch.cat([(merged[k] - ref_merged[k]).flatten() for k in base])
    assert (error.norm() / update.norm()).item() < UPDATE_TOL, (case, "merged", (error.norm() / update.norm()).item())
