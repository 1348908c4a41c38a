"""Safety of a step on two processes (pp = 2, gloo), one launch of the worker of
``tests/training/test_step_safety.py`` on two ranks (:data:`LAUNCHES`): a wrong model
refused on both ranks with rank 0's verdict (caught, the ranks go on), each stage's own dropout
stream, resume with dropout, a NaN on stage 1 skipped, then raised on both ranks.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

from _helpers import Launch
from _step_safety import DROPOUT, NAN_STEP, NaNAt, bypassing_layer, realistic_model, snapshot


def test_pp2_dropout_streams_resume_and_nonfinite_steps(launched):
    run = launched("pp2")
    out, codes, stderr = run.out, run.codes, run.stderr
    infos = []
    for r in range(2):
        path = out / f"info-rank{r}.json"
        assert path.exists(), f"rank {r} did not finish the first scenarios:\n{stderr[r][-6000:]}"
        infos.append(json.loads(path.read_text()))

    # the self-check's verdict reached both ranks
    assert infos[0]["refused"] and infos[0]["refused"] == infos[1]["refused"], infos
    assert "model type 'qwen2'" in infos[1]["refused"]
    # stage 0's layer 0 and stage 1's layer 1 (its layer 0 of the stage) draw different numbers
    assert infos[0]["draws"] and infos[1]["draws"]
    assert infos[0]["draws"][0] != infos[1]["draws"][0], infos
    # resume restores each stage's stream: bit-identical weights, which dropout did change
    for info in infos:
        assert info["resume_max_diff"] == 0.0 and info["resume_changed"] > 0, info
        assert info["skip_step2_equal_step1"] and info["skip_step3_trained"], info
        assert info["skip_losses_nan"] == [False, True, False, False], info
        assert info["skip_counter"] == [0, 1, 1, 1], info
    # "raise": both ranks exit non-zero naming the step, the plan, stage 1 and the sequences
    for code, text in zip(codes, stderr):
        assert code not in (0, None), text[-3000:]
        assert "raise mode trained through the NaN" not in text
        assert f"optimizer step {NAN_STEP} (plan " in text and "on pipeline stage 1 (rank 1" in text, text[-4000:]
        assert "holds sequence(s)" in text, text[-4000:]


def _worker(out: str) -> None:
    """pp = 2: dropout streams, resume with dropout, a NaN on stage 1 skipped, then raised."""
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainerCallback

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from _models import NO_SAVE, TINY_LLAMA, tiny_dataset

    def model(dropout=DROPOUT):
        torch.manual_seed(1)
        return AutoModelForCausalLM.from_config(LlamaConfig(**dict(TINY_LLAMA, num_hidden_layers=2),
                                                            attention_dropout=dropout))

    def args(d, **kw):
        return ConcertinaTrainingArguments(output_dir=os.path.join(out, d), concertina_max_tokens_per_chunk=16,
                                           **dict(NO_SAVE, **kw))

    info: dict = {}
    # 0. a model the runtime does not reproduce: refused on every rank with rank 0's verdict
    from concertina_hf.training.self_check import SelfCheckError

    try:
        ConcertinaTrainer(model=bypassing_layer(realistic_model("qwen2")), args=args("refused"), train_dataset=tiny_dataset())
        info["refused"] = None
    except SelfCheckError as exc:
        info["refused"] = str(exc)
    # raised alike on every rank, the refusal raised no abort flag: caught, the ranks go on past
    # the grace a caught one-rank failure gets before its rank ends
    from concertina_hf.runtime.distributed import ABORT_GRACE_S, ABORT_POLL_S

    time.sleep(ABORT_GRACE_S + 2 * ABORT_POLL_S)

    # 1. each stage's layer draws from its own stream: the first numbers drawn inside layer i
    trainer = ConcertinaTrainer(model=model(), args=args("streams", max_steps=1), train_dataset=tiny_dataset())
    rank = trainer.topology.rank
    draws = []
    trainer.pipeline.decoder_layers[0].register_forward_pre_hook(
        lambda m, a: draws.append(torch.rand(4).tolist()) if len(draws) < 2 else None)
    trainer.train()
    info["draws"] = draws

    # 2. resume at pp = 2 with dropout: the uninterrupted run's weights
    full = ConcertinaTrainer(model=model(), args=args("full", save_strategy="steps", save_steps=2),
                             train_dataset=tiny_dataset())
    full.train()
    resumed = ConcertinaTrainer(model=model(), args=args("resumed"), train_dataset=tiny_dataset())
    resumed.train(resume_from_checkpoint=os.path.join(out, "full", "checkpoint-2"))
    a, b = snapshot(full.model), snapshot(resumed.model)
    info["resume_max_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    info["resume_changed"] = max(float((a[k] - snapshot(model())[k]).abs().max()) for k in a)

    # 3. a NaN on stage 1 at step 2, skipped
    class Snap(TrainerCallback):
        def __init__(self, nan, model):
            self.nan, self.model, self.shots = nan, model, {}

        def on_step_begin(self, args, state, control, **kw):
            self.nan.active = state.global_step + 1 == self.nan.step

        def on_step_end(self, args, state, control, **kw):
            self.nan.active = False
            self.shots[state.global_step] = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def nan_trainer(mode):
        t = ConcertinaTrainer(model=model(0.0), args=args(mode, concertina_nonfinite=mode), train_dataset=tiny_dataset())
        nan = NaNAt(NAN_STEP)
        if t.topology.stage == 1:
            t.pipeline.decoder_layers[0].register_forward_hook(nan)
        snap = Snap(nan, t.model)
        t.add_callback(snap)
        return t, snap

    t, snap = nan_trainer("skip")
    t.train()
    info["skip_step2_equal_step1"] = all(torch.equal(w, snap.shots[1][n]) for n, w in snap.shots[2].items())
    info["skip_step3_trained"] = any(not torch.equal(w, snap.shots[2][n]) for n, w in snap.shots[3].items())
    logs = [h for h in t.state.log_history if "loss" in h]
    info["skip_losses_nan"] = [math.isnan(h["loss"]) for h in logs]
    info["skip_counter"] = [h["concertina/nonfinite_steps_skipped"] for h in logs]
    with open(os.path.join(out, f"info-rank{rank}.json"), "w") as fh:
        json.dump(info, fh)

    # 4. the same NaN with "raise": every rank ends with the message (the process exits non-zero)
    t, _ = nan_trainer("raise")
    t.train()
    print("raise mode trained through the NaN", file=sys.stderr, flush=True)


#: the launch (started by the session, read through the ``launched`` fixture); its ranks exit
#: non-zero by design (the "raise" scenario), the test reads the codes (the timeout only ends a hung run)
LAUNCHES = {"pp2": Launch(2, _worker, check=False, timeout=600)}
