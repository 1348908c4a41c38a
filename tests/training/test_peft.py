"""PEFT (LoRA) through ConcertinaTrainer against ``Trainer`` + the same ``PeftModel`` on one process.

Two adapter configurations, each built from the same seed on both sides:

- ``default``: PEFT's default Llama targets (``q_proj``, ``v_proj``): the embedding is frozen, so
  on stage 0 the keys of the first layer depend on nothing trainable (the backward that crashed);
- ``embed-head``: LoRA on ``embed_tokens`` (a ``lora.Embedding``), ``q_proj``, ``v_proj`` and
  ``down_proj``, and ``lm_head`` fully trained through ``modules_to_save``.

Default tier (one process, pp=1): the losses equal Trainer's (1e-5), the adapter's update after 3
steps is within 1e-3 (relative, all adapter tensors together; 1e-2 per tensor) of Trainer's, ``save_model`` writes a PEFT adapter directory that
``PeftModel.from_pretrained`` loads, ``merge_and_unload`` gives the trained model; a checkpoint
holds the adapter (no full model) and resuming from it ends on the same adapter; prompt learning
and adapted tied embeddings over several stages are refused.

``tests/launch/test_peft_launch.py`` (this file's :func:`_worker_pp2` on 2 gloo processes, pp=2):
the same checks with every stage's adapter
gathered into the one saved directory, the optimizer holding state for the trainable parameters
only, the gradient norm counted once, checkpoint + resume.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

peft = pytest.importorskip("peft")

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, tie_word_embeddings=False)
COMMON = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-2,
              logging_steps=1, report_to=[], disable_tqdm=True, seed=3, max_grad_norm=0.5)
CASES = {
    "default": dict(),
    "embed-head": dict(target_modules=["embed_tokens", "q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"]),
}
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-3


def _base(**over):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**CFG, **over}))


def _peft_model(case: str, **over):
    torch.manual_seed(2)  # LoRA A (and the embedding's B) are drawn at random
    return peft.get_peft_model(_base(**over), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **CASES[case]))


def _dataset(n=24, seed=0):
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"input_ids": [rng.randrange(64) for _ in range(rng.choice([5, 9, 17, 40, 70]))]} for _ in range(n)])


def _logged(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}


def _reference(case: str, out) -> tuple[dict, dict]:
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    ref = Trainer(model=_peft_model(case), args=TrainingArguments(output_dir=str(out), save_strategy="no", **COMMON),
                  train_dataset=_dataset(), data_collator=DataCollatorWithFlattening())
    ref.train()
    return _logged(ref), ref.model


def _concertina(case: str, out, **extra):
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    args = ConcertinaTrainingArguments(output_dir=str(out), concertina_max_tokens_per_chunk=16,
                                       **{"save_strategy": "no", **COMMON, **extra})
    return ConcertinaTrainer(model=_peft_model(case), args=args, train_dataset=_dataset())


def _check_adapter(case: str, saved_dir, ref_model, got: dict, ref: dict) -> None:
    """Trainer's losses and norms; the saved adapter loads with plain peft and holds Trainer's update;
    merge_and_unload gives the trained model."""
    assert len(got["losses"]) == len(ref["losses"]) == COMMON["max_steps"]
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < LOSS_TOL, (case, got, ref)
    assert max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"])) < 1e-4, (case, got, ref)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(saved_dir))
    assert not os.path.exists(os.path.join(saved_dir, "model.safetensors"))
    loaded = peft.PeftModel.from_pretrained(_base(), str(saved_dir))
    init, want, have = _peft_model(case).state_dict(), ref_model.state_dict(), loaded.state_dict()
    assert set(want) == set(have)
    trained = [k for k in want if not torch.equal(want[k], init[k])]
    assert len(trained) >= (8 if case == "default" else 27), trained  # every adapter moved (and lm_head)
    # the adapter's update (all its tensors together) within 1e-3 of Trainer's. Per tensor the
    # bound is 1e-2: a weight whose gradient is near 0 in some step takes a full-size Adam step from
    # float rounding noise (different summation orders), as the key biases in test_trainer_pipeline
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
        assert type(merged_model) is type(_base())
        assert (merged_model(input_ids=ids).logits - logits).abs().max().item() < 1e-5
    base, merged, ref_merged = _base().state_dict(), merged_model.state_dict(), ref_model.merge_and_unload().state_dict()
    assert set(merged) == set(ref_merged) == set(base)
    update = torch.cat([(ref_merged[k] - base[k]).flatten() for k in base])
    error = torch.cat([(merged[k] - ref_merged[k]).flatten() for k in base])
    assert (error.norm() / update.norm()).item() < UPDATE_TOL, (case, "merged", (error.norm() / update.norm()).item())


# ---------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("case", sorted(CASES))
def test_pp1_lora_matches_trainer_and_saves_a_peft_adapter(case, tmp_path):
    ref, ref_model = _reference(case, tmp_path / "ref")
    trainer = _concertina(case, tmp_path / "run", save_strategy="steps", save_steps=2)
    trainer.train()
    # only the adapter (and modules_to_save) is trained: the optimizer holds nothing else
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trainable)
    assert len(trainable) < len(list(trainer.model.parameters()))
    # the planner's static memory counts gradients and optimizer state for them only (float32
    # frozen weights: 4 bytes; trainable: 16)
    if case == "default":
        assert 4 < trainer.cost_model.static_bytes_per_param < 5, trainer.cost_model.static_bytes_per_param
    trainer.save_model(str(tmp_path / "final"))
    _check_adapter(case, tmp_path / "final", ref_model, _logged(trainer), ref)

    # the step-2 checkpoint holds the adapter (not the base model), verifies, and resumes to the same end
    from concertina_hf.training.manifest import verify_checkpoint

    ckpt = tmp_path / "run" / "checkpoint-2"
    names = set(os.listdir(ckpt))
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.stage0-of-1.pt"} <= names, names
    assert "model.safetensors" not in names and "config.json" not in names
    verify_checkpoint(str(ckpt))
    if case != "default":
        return
    resumed = _concertina(case, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert _logged(resumed)["losses"] == pytest.approx(_logged(trainer)["losses"], abs=1e-6)  # history + step 3
    end, again = trainer.model.state_dict(), resumed.model.state_dict()
    assert max((end[k] - again[k]).abs().max().item() for k in end) < 1e-6


def test_refusals():
    from concertina_hf.planning import StageLayout
    from concertina_hf.training.run_setup import pipeline_stage

    prompt = peft.get_peft_model(_base(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(NotImplementedError, match="prompt-learning"):
        pipeline_stage(prompt, StageLayout.even(4, 1), 0)
    # tied embeddings over two stages: an adapter on either copy is refused, naming the setting
    torch.manual_seed(2)
    tied = peft.get_peft_model(_base(tie_word_embeddings=True),
                               peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(NotImplementedError, match="modules_to_save"):
        pipeline_stage(tied, StageLayout.even(4, 2), 0)
    # frozen tied embeddings are fine (both copies stay the pretrained matrix)
    plain = peft.get_peft_model(_base(tie_word_embeddings=True), peft.LoraConfig(r=4))
    assert pipeline_stage(plain, StageLayout.even(4, 2), 1)[1] is plain


# ---------------------------------------------------------------------------------- pp = 2
def _worker_pp2(out: str) -> None:
    for case in sorted(CASES):
        d = os.path.join(out, case)
        trainer = _concertina(case, d, save_strategy="steps", save_steps=2)
        assert trainer.topology.pipeline_size == 2
        trainer.train()
        rank = trainer.topology.rank
        info = _logged(trainer)
        trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
        info["trainable"] = sorted(trainable)
        info["optimizer_params"] = sum(len(g["params"]) for g in trainer.optimizer.param_groups)
        info["optimizer_states"] = len(trainer.optimizer.state_dict()["state"])
        torch.save({n: p.detach().clone() for n, p in trainable.items()}, os.path.join(d, f"trained-rank{rank}.pt"))
        trainer.save_model(os.path.join(d, "final"))
        if case == "default":
            resumed = _concertina(case, d + "-resumed")
            resumed.train(resume_from_checkpoint=os.path.join(d, "checkpoint-2"))
            info["resumed_losses"] = _logged(resumed)["losses"]
            end = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
            info["resumed_max_diff"] = max((end[n] - trainable[n]).abs().max().item() for n in end)
        with open(os.path.join(d, f"info-rank{rank}.json"), "w") as fh:
            json.dump(info, fh)
    trainer.end()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    {"pp2": _worker_pp2}[sys.argv[1]](sys.argv[2])
