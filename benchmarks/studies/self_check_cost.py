"""The self-check's share of start-up: ``ConcertinaTrainer`` construction with and without it.

    python benchmarks/studies/self_check_cost.py                # about 20 s on 2 cores
    python benchmarks/studies/self_check_cost.py --repeats 9

The model of ``recipes/train_long_context.py`` (a 4-layer Llama, hidden 128, the bundled 8K
tokenizer, untied, float32), one process, the recipe's planning settings; each repeat builds the
model afresh and times ``ConcertinaTrainer(...)`` with ``concertina_self_check`` on and off,
alternating (the first construction of the process, which pays first calls, is left out).
Reported: medians; the self-check's share of the construction alone, and of start-up as a run
sees it (importing torch, transformers, datasets and concertina_hf in a fresh interpreter, timed
in a subprocess, plus building the model, plus the construction; the recipe also loads its
tokenizer and data, not counted). The target: under 5% of start-up. Writes
benchmarks/results/studies/self_check_cost.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from _results import Run, write_results  # noqa: E402
from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments  # noqa: E402
from concertina_hf.tools.data import bundled_tokenizer_path  # noqa: E402

RESULTS = BENCH / "results" / "studies"
RECIPE_MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=2048)
TARGET_SHARE = 0.05


def _start(tokenizer, data, work: str, self_check: bool) -> tuple[float, float]:
    """(seconds to build the model, seconds to construct the trainer)."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **RECIPE_MODEL))
    t1 = time.perf_counter()
    args = ConcertinaTrainingArguments(
        output_dir=work, report_to=[], disable_tqdm=True, max_steps=30, per_device_train_batch_size=8,
        concertina_max_tokens_per_chunk=512, concertina_cost_model="online", concertina_replan_interval=5,
        concertina_self_check=self_check)
    trainer = ConcertinaTrainer(model=model, args=args, train_dataset=data)
    t2 = time.perf_counter()
    trainer.planner.close()
    return t1 - t0, t2 - t1


def _import_seconds(repeats: int = 3) -> float:
    code = "import time; t = time.perf_counter(); import torch, transformers, datasets, concertina_hf; " \
           "from concertina_hf import ConcertinaTrainer; print(time.perf_counter() - t)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env=env).stdout.strip().splitlines()[-1]) for _ in range(repeats)]
    return statistics.median(runs)


def run(repeats: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_list(
        [{"input_ids": torch.randint(len(tokenizer), (n,), generator=g).tolist()} for n in (64, 200, 128, 32) * 4])
    work = tempfile.mkdtemp(prefix="selfcheck-bench-")
    _start(tokenizer, data, work, True)  # imports, first calls
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(repeats):
        for on in (True, False):
            times[on].append(_start(tokenizer, data, work, on))
    med = {on: (statistics.median(m for m, _ in t), statistics.median(c for _, c in t)) for on, t in times.items()}
    imports = _import_seconds()
    with_s, without_s = imports + sum(med[True]), imports + sum(med[False])
    check_s = med[True][1] - med[False][1]
    return {"repeats": repeats, "imports_s": imports, "model_build_s": med[False][0],
            "construct_with_s": med[True][1], "construct_without_s": med[False][1], "self_check_s": check_s,
            "startup_with_s": with_s, "startup_without_s": without_s, "self_check_share": check_s / with_s,
            "self_check_share_of_construction": check_s / med[True][1], "target_share": TARGET_SHARE,
            "all_with_s": [sum(t) for t in times[True]], "all_without_s": [sum(t) for t in times[False]]}


def main(argv: list[str] | None = None) -> None:
    run_ = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "self_check_cost"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = run(a.repeats)
    text = ("# Self-check cost at start-up (1 thread)\n\n"
            f"Recipe model (4-layer Llama, hidden 128, 8K vocabulary, float32), one process, medians of {a.repeats}.\n\n"
            "| | imports (s) | model built (s) | ConcertinaTrainer(...) (s) | start-up (s) |\n|---|---|---|---|---|\n"
            f"| concertina_self_check=True | {r['imports_s']:.2f} | {r['model_build_s']:.3f} | "
            f"{r['construct_with_s']:.3f} | {r['startup_with_s']:.2f} |\n"
            f"| concertina_self_check=False | {r['imports_s']:.2f} | {r['model_build_s']:.3f} | "
            f"{r['construct_without_s']:.3f} | {r['startup_without_s']:.2f} |\n\n"
            f"The self-check takes {1e3 * r['self_check_s']:.0f} ms: "
            f"{100 * r['self_check_share']:.1f}% of start-up (target < {100 * TARGET_SHARE:.0f}%), "
            f"{100 * r['self_check_share_of_construction']:.0f}% of the construction alone (which, on this tiny "
            "model with the analytic cost model, does little else).\n")
    write_results(a.out, text, r, run_)


if __name__ == "__main__":
    main()
