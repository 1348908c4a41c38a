"""What ``torch_compile=True`` would buy: the stage's decoder layers compiled, against eager, on CPU.

    python benchmarks/studies/compile_cpu.py               # a few minutes on 2 cores (inductor compiles)
    python benchmarks/studies/compile_cpu.py --steps 12

``ConcertinaTrainer`` ignores ``torch_compile`` (a warning says why). This measures the reason:
the model of ``recipes/train_long_context.py`` (a 4-layer Llama, hidden 128, 8K vocabulary), one
process, the recipe's chunk cap (512 tokens), long-tailed batches (so chunk shapes change every
step), trained ``--steps`` steps eagerly and then with every decoder layer's ``forward`` replaced
by ``torch.compile(forward, dynamic=True)`` (inductor), the same seed and data. Reported: the
compiled run's time over the eager run's for the whole run (compilation included) and for the
steps after the first two, the graphs compiled, the graph breaks (dynamo's counters), and the
largest loss difference. Writes benchmarks/results/studies/compile_cpu.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import datasets  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback  # noqa: E402

from _results import Run, write_results  # noqa: E402
from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments  # noqa: E402

CFG = dict(vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, tie_word_embeddings=False)


class _StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t)


def _dataset(n: int) -> datasets.Dataset:
    rng = random.Random(0)
    lens = [rng.choice([40, 90, 200, 400, 900, 1500]) for _ in range(n)]
    return datasets.Dataset.from_list([{"input_ids": [rng.randrange(8192) for _ in range(k)]} for k in lens])


def _run(steps: int, compiled: bool, out: str) -> dict:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    args = ConcertinaTrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3, logging_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=True, seed=0, concertina_max_tokens_per_chunk=512,
        concertina_gantt_steps=-1)
    timer = _StepTimes()
    trainer = ConcertinaTrainer(model=model, args=args, train_dataset=_dataset(8 * steps), callbacks=[timer])
    if compiled:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for layer in trainer.pipeline.decoder_layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    rec = {"total_s": total, "step_s": timer.times,
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if compiled:
        c = torch._dynamo.utils.counters
        rec["graphs"] = int(c["stats"]["unique_graphs"])
        rec["graph_breaks"] = int(sum(c["graph_break"].values()))
        rec["graph_break_reasons"] = sorted({k.strip().split("\n")[0][:160] for k in c["graph_break"]})[:8]
    return rec


def main(argv=None) -> None:
    run = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(BENCH / "results" / "studies" / "compile_cpu"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        eager = _run(a.steps, False, os.path.join(d, "eager"))
        comp = _run(a.steps, True, os.path.join(d, "compiled"))
    later = lambda r: sum(r["step_s"][2:])  # noqa: E731
    diff = max(abs(x - y) for x, y in zip(eager["losses"], comp["losses"]))
    text = "\n".join([
        f"# torch.compile of the decoder layers, CPU ({a.steps} steps, recipe model, 1 thread)",
        "",
        "| run | total (s) | steps 3.. (s) |",
        "|---|---|---|",
        f"| eager | {eager['total_s']:.2f} | {later(eager):.2f} |",
        f"| compiled (inductor, dynamic=True) | {comp['total_s']:.2f} | {later(comp):.2f} |",
        "",
        f"compiled / eager: {comp['total_s'] / eager['total_s']:.2f}x over the run (compilation included), "
        f"{later(comp) / later(eager):.2f}x over steps 3..{a.steps}; {comp['graphs']} graphs compiled, "
        f"{comp['graph_breaks']} graph breaks; largest loss difference {diff:.2e}.",
        "",
        "Graph breaks (first reasons): " + "; ".join(comp["graph_break_reasons"]),
        "",
    ])
    write_results(a.out, text, {"eager": eager, "compiled": comp, "steps": a.steps}, run)


if __name__ == "__main__":
    main()
