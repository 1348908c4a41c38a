"""A TRL SFT script with only the swap trains what ``SFTTrainer.train()`` trains, at pp = 2.

The script (:data:`SCRIPT`): BFD packing, padding-free batches, 3 SGD steps; ``bf16`` is left to
TRL's default (``not fp16``: bfloat16 autocast, on CPU too). ``ConcertinaSFTConfig`` /
``ConcertinaSFTTrainer`` run it on 2 gloo ranks (this file's :func:`_worker`), ``SFTConfig`` /
``SFTTrainer`` on one process, each twice: as written, and with ``bf16=False``.

- bf16: every decoder layer of both stages runs under bfloat16 autocast, and the parameters after
  3 steps are within bfloat16 noise of ``SFTTrainer``'s: max abs difference under
  :data:`BF16_MARGIN` and under 4 x ``SFTTrainer``'s own bf16-vs-fp32 difference (the scale of
  bfloat16 rounding at this learning rate: chunks of other sizes than ``SFTTrainer``'s rows sum
  the matmuls in another order, and a bfloat16 output rounds that to whole units in the last
  place). Measured: 1.1e-4, against 1.5e-4 between ``SFTTrainer`` in bf16 and in fp32. The
  parameters alone could not tell a float32 run from a bfloat16 one at this size (the gap is
  the noise's order): the autocast each layer ran under does.
- fp32 (``bf16=False``): no autocast, parameters within :data:`FP32_MARGIN` (max abs; measured
  1.5e-8, the update's largest entry is 8.5e-2), and the same ``train_loss``.

The learning rate and the logging interval are set by the script (SGD at TRL's default 2e-5 moves
these weights by ~4e-6, too little to compare); that their defaults are TRL's is
``tests/training/test_argument_defaults.py``'s check.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

trl = pytest.importorskip("trl")

from _helpers import Launch  # noqa: E402
from _models import bundled_tokenizer, text_dataset, text_model  # noqa: E402

SCRIPT = dict(packing=True, packing_strategy="bfd", padding_free=True, max_length=64, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, max_steps=3, optim="sgd", learning_rate=0.5, seed=3, report_to=[],
              save_strategy="no", disable_tqdm=True, use_cpu=True)
#: case -> what the script adds to SCRIPT
CASES = {"bf16": {}, "fp32": {"bf16": False}}
BF16_MARGIN = 1e-3
FP32_MARGIN = 1e-6


def _worker(out: str) -> None:
    from concertina_hf.integrations.trl import ConcertinaSFTConfig, ConcertinaSFTTrainer

    tok = bundled_tokenizer()
    for case, extra in CASES.items():
        d = os.path.join(out, case)
        trainer = ConcertinaSFTTrainer(
            model=text_model(tok), train_dataset=text_dataset(), processing_class=tok,
            args=ConcertinaSFTConfig(output_dir=d, **SCRIPT, **extra))
        assert trainer.topology.pipeline_size == 2
        seen = set()  # the autocast state every decoder layer of this stage ran its forward under
        hooks = [layer.register_forward_pre_hook(
            lambda *_: seen.add(str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else "off"))
            for layer in trainer.pipeline.decoder_layers]
        metrics = trainer.train().metrics
        for h in hooks:
            h.remove()
        rank = trainer.topology.rank
        torch.save({n: p.detach().float().clone() for n, p in trainer.model.named_parameters()},
                   os.path.join(d, f"params-rank{rank}.pt"))
        with open(os.path.join(d, f"info-rank{rank}.json"), "w") as fh:
            json.dump({"autocast": sorted(seen), "bf16": trainer.args.bf16, "train_loss": metrics["train_loss"],
                       "mixed_precision": str(trainer.accelerator.mixed_precision)}, fh)
    trainer.end()


def _reference(case: str, out) -> tuple[dict, float]:
    from trl import SFTConfig, SFTTrainer

    tok = bundled_tokenizer()
    ref = SFTTrainer(model=text_model(tok), args=SFTConfig(output_dir=str(out), **SCRIPT, **CASES[case]),
                     train_dataset=text_dataset(), processing_class=tok)
    assert ref.args.bf16 is (case == "bf16")
    metrics = ref.train().metrics
    return {k: v.detach().float().clone() for k, v in ref.model.state_dict().items()}, metrics["train_loss"]


def _max_abs(ref: dict, got: dict) -> float:
    assert set(ref) == set(got), set(ref) ^ set(got)
    return max((ref[k] - got[k]).abs().max().item() for k in ref)


def test_sft_script_with_only_the_swap_trains_what_sfttrainer_trains(launched, tmp_path):
    out = launched("pp2").out
    refs = {case: _reference(case, tmp_path / f"ref-{case}") for case in CASES}
    gap = _max_abs(refs["bf16"][0], refs["fp32"][0])  # SFTTrainer's own bf16 vs fp32
    report = {"sfttrainer_bf16_vs_fp32": gap}
    for case in CASES:
        d = out / case
        infos = [json.loads((d / f"info-rank{r}.json").read_text()) for r in (0, 1)]
        ours = {}
        for r in (0, 1):
            ours.update(torch.load(d / f"params-rank{r}.pt"))
        ref, ref_loss = refs[case]
        worst = report[case] = _max_abs(ref, ours)
        for info in infos:
            assert info["bf16"] is (case == "bf16"), info
            assert info["autocast"] == (["torch.bfloat16"] if case == "bf16" else ["off"]), info
        if case == "bf16":
            assert infos[0]["mixed_precision"] == "bf16", infos[0]
            assert worst < min(BF16_MARGIN, 4 * gap), report
        else:
            assert worst < FP32_MARGIN, report
            assert infos[0]["train_loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-7), (infos[0], ref_loss)
    print("max abs parameter difference after 3 steps:", report)


#: the launch (started by the session, read through the ``launched`` fixture)
LAUNCHES = {"pp2": Launch(2, _worker, timeout=900)}
