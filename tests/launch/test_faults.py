"""Faults across processes (gloo, CPU): no rank is left waiting for a peer that stalled or failed.

Two ranks (pp = 2), each started as a plain process (no torchrun, which would kill the survivors
itself), with the failure injected on stage 1:

- **a stalled rank** (``ddp_timeout=10``): stage 1 sleeps :data:`STALL_S` seconds. Stage 0 must
  give up after the timeout naming the stage, rank and action it waited for; both ranks must exit
  non-zero well before the stall would end.
- **an exception caught by the user** (default ``ddp_timeout``, 30 minutes): stage 1 raises in
  a training step, in ``evaluate()`` or in ``save_model()``, and the worker's ``try`` swallows it
  and goes on with other work. Both ranks must exit non-zero before that work (a sleep of
  :data:`STALL_S`) would end (measured: within seconds), printing the
  original message.

The four launches (:data:`MODES`, this file's :func:`_worker` on two ranks of
:func:`_helpers.start_ranks`) run at once, started by one module fixture: each mostly waits (on
the timeout, the abort flag, the grace), and each test asserts on its own launch.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import pytest

from _helpers import start_ranks

TIMEOUT_S = 10
#: how long the failing rank stalls (or, having caught the fault, sleeps): every rank ending before
#: then shows that none waited for its peer (the ranks' exit seconds are printed; the time they take
#: is no test's business: the timeout, the abort flag polled every 0.5 s, a 5 s grace, the exit)
STALL_S = 60
FAULT = "injected fault in stage 1"
MODES = ("stall", "step", "eval", "save")


def _worker(mode: str, out: str) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    rng = random.Random(0)
    data = datasets.Dataset.from_list([{"input_ids": [rng.randrange(64) for _ in range(rng.choice([9, 17, 40]))]}
                                       for _ in range(24)])
    args = ConcertinaTrainingArguments(
        output_dir=out, save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=1,
        max_steps=4 if mode in ("stall", "step") else 1, per_device_train_batch_size=3, gradient_accumulation_steps=2,
        per_device_eval_batch_size=4, concertina_max_tokens_per_chunk=16,
        **(dict(ddp_timeout=TIMEOUT_S) if mode == "stall" else {}))
    trainer = ConcertinaTrainer(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)))

    def fault():
        with open(os.path.join(out, "fault.json"), "w") as fh:
            json.dump({"t": time.time()}, fh)
        if mode == "stall":
            time.sleep(STALL_S)
        else:
            raise RuntimeError(FAULT)

    if trainer.topology.stage == 1:  # the fault: stage 1's second step, its evaluation or its save
        run_step, run_layers, save_model = (trainer.executor.run_step, trainer.pipeline.run_layers,
                                            trainer.checkpointer.save_model)
        state = {"steps": 0, "faulted": False}

        def counting_run_step(*a, **kw):
            if mode == "eval" and kw.get("train") is False:
                fault()
            state["steps"] += 1
            return run_step(*a, **kw)

        def failing_run_layers(*a, **kw):
            if mode in ("stall", "step") and state["steps"] == 2 and not state["faulted"]:
                state["faulted"] = True
                fault()
            return run_layers(*a, **kw)

        def failing_save_model(*a, **kw):
            fault()
            return save_model(*a, **kw)

        trainer.executor.run_step = counting_run_step
        trainer.pipeline.run_layers = failing_run_layers
        if mode == "save":
            trainer.checkpointer.save_model = failing_save_model
    try:  # the user's try: a failure is caught and the script goes on with something else
        trainer.train()
        if mode == "eval":
            trainer.evaluate()
        if mode == "save":
            trainer.save_model(os.path.join(out, "final"))
    except RuntimeError as exc:
        if mode == "stall":
            raise
        print(f"caught: {exc}", file=sys.stderr, flush=True)
        time.sleep(STALL_S)
    trainer.end()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every mode's 2 ranks, all started at once; ranks still running :data:`STALL_S` + 30 s after
    the start are killed. Per mode, the ranks and the output folder."""
    root = tmp_path_factory.mktemp("faults")
    # the stalled rank is ended through the flag in the store that rank 0, failing, hosts: rank 0
    # (forked: it exits at once after its atexit handlers) stays until the peer has polled the flag
    started = {mode: start_ranks(2, _worker, mode, str(root / mode), logs=root / mode) for mode in MODES}
    deadline = time.time() + STALL_S + 30
    while not all([ranks.poll() for ranks in started.values()]) and time.time() < deadline:
        time.sleep(0.1)
    for ranks in started.values():
        ranks.kill()
    return {mode: (ranks, root / mode) for mode, ranks in started.items()}


def _run_ranks(launches, mode: str) -> tuple[list[int], list[float], list[str]]:
    """The 2 ranks of ``mode``: their exit codes, the seconds from the injected fault to each one's
    exit, and their stderr."""
    ranks, out = launches[mode]
    stderr = [ranks.stderr(r) for r in range(2)]
    fault = out / "fault.json"
    assert fault.exists(), f"stage 1 never reached its second step:\n{stderr[1][-6000:]}\n{stderr[0][-3000:]}"
    t0 = json.loads(fault.read_text())["t"]
    seconds = [float("inf") if e is None else e - t0 for e in ranks.ended]
    print(f"{mode}: seconds from the fault to each rank's exit: {[round(x, 1) for x in seconds]}, "
          f"exit codes {ranks.codes}")
    return ranks.codes, seconds, stderr


def test_a_stalled_rank_ends_every_rank_within_ddp_timeout(launches):
    codes, seconds, stderr = _run_ranks(launches, "stall")
    assert max(seconds) < STALL_S, (seconds, stderr[0][-4000:])  # before the stall would end
    assert all(c != 0 for c in codes), (codes, stderr[0][-4000:])
    # stage 0 names what it waited for: the gradient of a chunk from stage 1 (rank 1); the stalled
    # rank is ended with that message
    assert "pipeline stage 0 (rank 0) failed after" in stderr[0], stderr[0][-6000:]
    assert "from stage 1 (rank 1)" in stderr[0] and "RECV_B" in stderr[0], stderr[0][-6000:]
    assert "from stage 1 (rank 1)" in stderr[1], stderr[1][-4000:]


@pytest.mark.parametrize("phase", ["step", "eval", "save"])
def test_an_exception_caught_on_one_rank_ends_every_rank(launches, phase):
    codes, seconds, stderr = _run_ranks(launches, phase)
    assert "caught: " in stderr[1], stderr[1][-4000:]
    assert max(seconds) < STALL_S, (seconds, stderr[0][-4000:])  # before the caught rank's sleep would end
    assert all(c != 0 for c in codes), (codes, stderr[0][-4000:])
    assert all(FAULT in e for e in stderr), [e[-3000:] for e in stderr]

