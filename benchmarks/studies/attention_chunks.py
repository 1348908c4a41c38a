#!/usr/bin/env python
"""Forward+backward time and activation bytes of chunk shapes through the runtime's own layer
loop (:func:`concertina_hf.runtime.profiler.measure_chunk`): packed sequences, a whole sequence,
a slice with context, a tail slice packed with whole sequences; the recipe's tiny Llama (hidden
128, GQA 4/2), 2 layers, on CPU, one thread.

Run it with two source trees to compare attention backends (interleave the runs: machine load
moves every figure)::

    PYTHONPATH=<old>/src python benchmarks/studies/attention_chunks.py --label before --out /tmp/before
    PYTHONPATH=src python benchmarks/studies/attention_chunks.py --label after

Writes ``benchmarks/results/studies/attention_chunks.{md,json}`` by default. About 1 minute on an idle core.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

BENCH = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from _results import Run, write_results  # noqa: E402

RESULTS = BENCH / "results" / "studies"

SHAPES = {
    "packed 8 x 512": ((0, 512),) * 8,
    "whole 4096": ((0, 4096),),
    "slice 512 after 3584": ((3584, 512),),
    "tail (2048 + 1024) + 6 x 512": ((2048, 1024),) + ((0, 512),) * 6,
    "packed 4 x 128 (recipe size)": ((0, 128),) * 4,
    "slice 512 after 512 (recipe size)": ((512, 512),),
}


def main(argv=None) -> None:
    run = Run(__file__, argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="current")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "attention_chunks"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, LlamaConfig

    from concertina_hf.runtime import attention
    from concertina_hf.runtime.profiler import measure_chunk

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    rows = {}
    for name, shape in SHAPES.items():
        s = measure_chunk(model, shape, repeats=a.repeats, warmup=1, num_layers=2)
        rows[name] = dict(fwd_ms=1e3 * s.fwd_time_s, bwd_ms=1e3 * s.bwd_time_s, act_mib=s.act_bytes / 2**20)
    kernels = getattr(attention, "kernels_used", lambda: [])()
    lines = [f"# Attention chunk shapes ({a.label})", "",
             f"Per layer, median of {a.repeats} after 1 warm-up; "
             f"kernels: {', '.join(kernels) or 'not reported'}.", "",
             "| shape | forward ms | backward ms | activations MiB |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['act_mib']:.2f} |" for n, r in rows.items()]
    write_results(a.out, "\n".join(lines) + "\n", dict(label=a.label, shapes=rows, kernels=kernels), run)


if __name__ == "__main__":
    main()
