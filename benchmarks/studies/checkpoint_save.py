"""Checkpoint saving: the cost of the verified manifest (an XXH3-128 digest of every file) on the recipe's model.

    python benchmarks/studies/checkpoint_save.py                # about 30 s on 2 cores
    python benchmarks/studies/checkpoint_save.py --repeats 15

The model of ``recipes/train_long_context.py`` (a 4-layer Llama, hidden 128, the bundled 8K
tokenizer: about 3M parameters, untied), one process, AdamW state filled by two optimizer steps
on random tokens; then a checkpoint (model, optimizer shard, scheduler, RNG, trainer state,
tokenizer) saved ``--repeats`` times each way, alternating, the previous folder removed first:

- ``verified``: ``ConcertinaTrainer._save_checkpoint`` as shipped: written to
  ``tmp-checkpoint-N``, every file's XXH3-128 digest (taken in background threads as each file is
  complete, overlapping the writing of the next), the manifest, the rename;
- ``plain``: ``transformers.Trainer._save_checkpoint`` with the same hooks, i.e. the save before
  verified checkpoints: straight into ``checkpoint-N``, no hash, no manifest.

Reported: medians, min / max, the ratio verified / plain (the target: at most 1.20), and
``verify_checkpoint`` of the saved folder (the hash of every byte, as a resume does) against the
checkpoint's size. Writes benchmarks/results/studies/checkpoint_save.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402

from _results import Run, write_results  # noqa: E402
from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
from concertina_hf.training import manifest  # noqa: E402
from concertina_hf.tools.data import bundled_tokenizer_path  # noqa: E402

RESULTS = BENCH / "results" / "studies"
RECIPE_MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=2048)
TARGET_RATIO = 1.20


def run(repeats: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **RECIPE_MODEL))
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_list(
        [{"input_ids": torch.randint(len(tokenizer), (n,), generator=g).tolist()} for n in (64, 200, 128, 32) * 4])
    work = tempfile.mkdtemp(prefix="ckpt-bench-")
    try:
        args = ConcertinaTrainingArguments(output_dir=work, max_steps=2, per_device_train_batch_size=4,
                                           save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=1,
                                           concertina_max_tokens_per_chunk=512)
        trainer = ConcertinaTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        times: dict[str, list[float]] = {"verified": [], "plain": []}
        cpu: dict[str, list[float]] = {"verified": [], "plain": []}
        save = {"verified": trainer._save_checkpoint,
                "plain": lambda model, trial: Trainer._save_checkpoint(trainer, model, trial)}
        ckpt = os.path.join(work, f"checkpoint-{trainer.state.global_step}")
        for i in range(2 * repeats + 2):  # the first two: warm-up
            kind = "verified" if i % 2 == 0 else "plain"
            shutil.rmtree(ckpt, ignore_errors=True)
            t, c = time.perf_counter(), time.process_time()
            save[kind](trainer.model, None)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            if i >= 2:
                times[kind].append(dt)
                cpu[kind].append(dc)
        shutil.rmtree(ckpt, ignore_errors=True)
        trainer._save_checkpoint(trainer.model, None)
        hash_s = []
        for _ in range(repeats):
            t = time.perf_counter()
            manifest.verify_checkpoint(ckpt)
            hash_s.append(time.perf_counter() - t)
        size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        n_params = sum(p.numel() for p in model.parameters())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"num_params": n_params, "checkpoint_bytes": size, "repeats": repeats,
            "rows": [{"what": k, "median_s": med[k], "min_s": min(v), "max_s": max(v),
                      "cpu_median_s": statistics.median(cpu[k])} for k, v in times.items()],
            "ratio": med["verified"] / med["plain"], "target_ratio": TARGET_RATIO,
            "cpu_ratio": statistics.median(cpu["verified"]) / statistics.median(cpu["plain"]),
            "verify_median_s": statistics.median(hash_s)}


def main(argv: list[str] | None = None) -> int:
    run_ = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "checkpoint_save"), help="output path without extension")
    args = ap.parse_args(argv)
    res = run(args.repeats)
    mb = res["checkpoint_bytes"] / 2**20
    lines = [
        "# Checkpoint saving: cost of the verified manifest",
        "",
        f"The recipe's model ({res['num_params'] / 1e6:.2f}M parameters), one process, a {mb:.1f} MiB checkpoint "
        f"(model, AdamW shard, scheduler, RNG, trainer state, tokenizer); {res['repeats']} saves of each kind, "
        f"alternating.",
        "",
        "| save | median (ms) | min (ms) | max (ms) | CPU time, all threads, median (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['what']} | {1e3 * r['median_s']:.1f} | {1e3 * r['min_s']:.1f} | {1e3 * r['max_s']:.1f} "
                     f"| {1e3 * r['cpu_median_s']:.1f} |")
    lines += [
        "",
        f"Verified / plain: **{res['ratio']:.3f}** (target at most {res['target_ratio']:.2f}: "
        f"{'met' if res['ratio'] <= res['target_ratio'] else 'NOT met'}); CPU time verified / plain: "
        f"{res['cpu_ratio']:.3f} (what the ratio approaches on a machine with no idle core). Verifying the saved checkpoint "
        f"(reading and hashing it, as a resume does): {1e3 * res['verify_median_s']:.1f} ms, "
        f"{mb / max(res['verify_median_s'], 1e-9):.0f} MiB/s.",
    ]
    write_results(args.out, "\n".join(lines) + "\n", res, run_)
    return 0


if __name__ == "__main__":
    sys.exit(main())
