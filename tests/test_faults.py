"""Faults across processes (gloo, CPU): a stalled rank ends the job within ``ddp_timeout``.

Two ranks (pp = 2) train with ``ddp_timeout=10``; at the second step stage 1 stalls for
:data:`STALL_S` seconds in its first forward (a hung device, a dead host). Stage 0 waits for that
chunk's gradient and must give up after the timeout, naming the stage, rank and action it waited
for, and the job must end with a non-zero status well before the stall would end. Before the
process groups carried the run's timeout, torch's default of 30 minutes applied (the job simply
waited for the stalled rank). The workers are this file run by torchrun.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

TIMEOUT_S = 10
STALL_S = 60
# the timeout, then the failing rank's exit and torchrun stopping the others
BOUND_S = TIMEOUT_S + 20


def _worker_stall(out: str) -> None:
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
        output_dir=out, save_strategy="no", report_to=[], disable_tqdm=True, max_steps=4, logging_steps=1,
        per_device_train_batch_size=3, gradient_accumulation_steps=2, concertina_max_tokens_per_chunk=16,
        ddp_timeout=TIMEOUT_S)
    trainer = ConcertinaTrainer(model=model, args=args, train_dataset=data)
    if trainer.topology.stage == 1:
        run_step, run_layers = trainer.executor.run_step, trainer.pipeline.run_layers
        state = {"steps": 0, "stalled": False}

        def counting_run_step(*a, **kw):
            state["steps"] += 1
            return run_step(*a, **kw)

        def stalling_run_layers(*a, **kw):
            if state["steps"] == 2 and not state["stalled"]:
                state["stalled"] = True
                with open(os.path.join(out, "stall.json"), "w") as fh:
                    json.dump({"t": time.time()}, fh)
                time.sleep(STALL_S)
            return run_layers(*a, **kw)

        trainer.executor.run_step = counting_run_step
        trainer.pipeline.run_layers = stalling_run_layers
    trainer.train()
    trainer.end()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_within_ddp_timeout(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false")
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, "stall", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=STALL_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the job still ran {STALL_S + 30} s after its start:\n{stderr[-4000:]}")
    ended = time.time()
    stall = tmp_path / "stall.json"
    assert stall.exists(), f"stage 1 never reached its second step ({proc.returncode}):\n{stderr[-6000:]}"
    seconds = ended - json.loads(stall.read_text())["t"]
    print(f"stall to every rank exiting: {seconds:.1f} s (ddp_timeout={TIMEOUT_S})")
    assert proc.returncode != 0, stderr[-4000:]
    assert seconds < BOUND_S, (seconds, stderr[-4000:])
    # stage 0 names what it waited for: the gradient of a chunk from stage 1 (rank 1)
    assert "pipeline stage 0 (rank 0) failed after" in stderr, stderr[-6000:]
    assert "from stage 1 (rank 1)" in stderr and "RECV_B" in stderr, stderr[-6000:]


if __name__ == "__main__":
    {"stall": _worker_stall}[sys.argv[1]](sys.argv[2])
