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

``tests/launch/test_peft_launch.py`` (its worker on 2 gloo processes, pp=2):
the same checks with every stage's adapter
gathered into the one saved directory, the optimizer holding state for the trainable parameters
only, the gradient norm counted once, checkpoint + resume.
"""

from __future__ import annotations

import os

import pytest
import torch

peft = pytest.importorskip("peft")

from _peft_cases import CASES, base_model, check_adapter, losses_and_norms, peft_reference, peft_trainer  # noqa: E402

# ---------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("case", sorted(CASES))
def test_pp1_lora_matches_trainer_and_saves_a_peft_adapter(case, tmp_path):
    ref, ref_model = peft_reference(case, tmp_path / "ref")
    trainer = peft_trainer(case, tmp_path / "run", save_strategy="steps", save_steps=2)
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
    check_adapter(case, tmp_path / "final", ref_model, losses_and_norms(trainer), ref)

    # the step-2 checkpoint holds the adapter (not the base model), verifies, and resumes to the same end
    from concertina_hf.training.manifest import verify_checkpoint

    ckpt = tmp_path / "run" / "checkpoint-2"
    names = set(os.listdir(ckpt))
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.stage0-of-1.pt"} <= names, names
    assert "model.safetensors" not in names and "config.json" not in names
    verify_checkpoint(str(ckpt))
    if case != "default":
        return
    resumed = peft_trainer(case, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert losses_and_norms(resumed)["losses"] == pytest.approx(losses_and_norms(trainer)["losses"], abs=1e-6)  # history + step 3
    end, again = trainer.model.state_dict(), resumed.model.state_dict()
    assert max((end[k] - again[k]).abs().max().item() for k in end) < 1e-6


def test_refusals():
    from concertina_hf.planning import StageLayout
    from concertina_hf.training.run_setup import pipeline_stage

    prompt = peft.get_peft_model(base_model(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(NotImplementedError, match="prompt-learning"):
        pipeline_stage(prompt, StageLayout.even(4, 1), 0)
    # tied embeddings over two stages: an adapter on either copy is refused, naming the setting
    torch.manual_seed(2)
    tied = peft.get_peft_model(base_model(tie_word_embeddings=True),
                               peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(NotImplementedError, match="modules_to_save"):
        pipeline_stage(tied, StageLayout.even(4, 2), 0)
    # frozen tied embeddings are fine (both copies stay the pretrained matrix)
    plain = peft.get_peft_model(base_model(tie_word_embeddings=True), peft.LoraConfig(r=4))
    assert pipeline_stage(plain, StageLayout.even(4, 2), 1)[1] is plain
