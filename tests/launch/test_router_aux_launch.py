"""``concertina_router_aux_loss='per_chunk'`` at pp = 2: the routers of both stages learn to balance.

A tiny Qwen3-MoE (4 decoder layers, 2 per stage, 8 experts, top-2, routers initialised peaky:
``initializer_range=0.2``) trained for :data:`STEPS` steps on 2 gloo ranks (this file's
:func:`_worker`), twice from the same weights and data: without the term (``output_router_logits``
off, HF's way of training without it) and with it (``output_router_logits=True``, coefficient
:data:`COEF`). The expert load is then measured on a fixed batch of 200 random tokens through the
saved model (HF's forward): per layer, the coefficient of variation (std / mean) of the tokens each
expert receives among their top-2.

- with the term every layer's load is more even than without, on both stages, and the mean
  coefficient of variation falls below :data:`RATIO` x the run without it (printed; measured per
  layer 1.11 / 1.64 / 1.73 / 1.49 without, 0.20 / 0.71 / 0.67 / 1.03 with: mean 1.49 -> 0.65);
- ``concertina/router_aux_loss`` is logged at every step beside the loss, is the sum of the two
  stages' shares, and falls; the run without the term logs none.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from _helpers import Launch  # noqa: E402

STEPS = 20
COEF = 1.0
RATIO = 0.6
EXPERTS, TOP_K, VOCAB = 8, 2, 64


def _model(router_logits: bool):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        initializer_range=0.2, router_aux_loss_coef=COEF, output_router_logits=router_logits,
        tie_word_embeddings=False))


def _dataset(n=48, seed=0):
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"input_ids": [rng.randrange(VOCAB) for _ in range(rng.choice([9, 17, 33, 60]))]} for _ in range(n)])


def _worker(out: str) -> None:
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    for case, on in (("off", False), ("on", True)):
        d = os.path.join(out, case)
        args = ConcertinaTrainingArguments(
            output_dir=d, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-2, logging_steps=1,
            report_to=[], disable_tqdm=True, seed=3, save_strategy="no", concertina_max_tokens_per_chunk=32,
            concertina_router_aux_loss="per_chunk" if on else None)
        trainer = ConcertinaTrainer(model=_model(on), args=args, train_dataset=_dataset())
        assert trainer.topology.pipeline_size == 2
        shares = []  # this stage's share of each step's term
        run_step = trainer.executor.run_step

        def recording(*a, **kw):
            result = run_step(*a, **kw)
            shares.append(result.router_aux_loss)
            return result

        trainer.executor.run_step = recording
        trainer.train()
        trainer.save_model(os.path.join(d, "final"))
        rank = trainer.topology.rank
        logged = [h.get("concertina/router_aux_loss") for h in trainer.state.log_history if "loss" in h]
        with open(os.path.join(d, f"info-rank{rank}.json"), "w") as fh:
            json.dump({"shares": shares, "logged": logged}, fh)
    trainer.end()


def _expert_load_cv(path) -> list[float]:
    """Per layer: std / mean of the tokens each expert gets among their top-k, on a fixed batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    cvs = []
    for logits in out.router_logits:
        chosen = logits.float().softmax(-1).topk(TOP_K, dim=-1).indices.flatten()
        load = torch.bincount(chosen, minlength=EXPERTS).float()
        cvs.append(float(load.std(unbiased=False) / load.mean()))
    return cvs


def test_per_chunk_router_loss_balances_the_experts_of_both_stages(launched):
    out = launched("pp2").out
    cv = {case: _expert_load_cv(out / case / "final") for case in ("off", "on")}
    mean = {case: sum(v) / len(v) for case, v in cv.items()}
    print(f"expert load, coefficient of variation per layer after {STEPS} steps: {cv}; mean {mean}")
    assert all(a < b for a, b in zip(cv["on"], cv["off"])), cv  # every layer, both stages' routers
    assert mean["on"] < RATIO * mean["off"], mean
    off = [json.loads((out / "off" / f"info-rank{r}.json").read_text()) for r in (0, 1)]
    on = [json.loads((out / "on" / f"info-rank{r}.json").read_text()) for r in (0, 1)]
    assert all(v is None for r in off for v in r["shares"] + r["logged"]), off
    logged = on[0]["logged"]  # the planner rank's log history
    assert len(logged) == STEPS and all(isinstance(v, float) for v in logged), logged
    for step, value in enumerate(logged):  # both stages' shares, summed
        shares = [r["shares"][step] for r in on]
        assert all(s > 0 for s in shares), (step, shares)
        assert value == pytest.approx(sum(shares), rel=1e-6), (step, value, shares)
    assert logged[-1] < 0.8 * logged[0], logged


#: the launch (started by the session, read through the ``launched`` fixture)
LAUNCHES = {"pp2": Launch(2, _worker, timeout=900)}
