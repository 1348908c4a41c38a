"""Two pipeline stages on two gloo ranks (the one-process checks, and the helpers used here, are
in ``tests/runtime/test_memory_model.py``): both stages' allocated activation peaks within 5% of
the plan's prediction, with many chunks (the stage outputs that sends kept alive) and short ones.
"""

from __future__ import annotations

import copy

import torch

from _helpers import Launch, gloo_rank, reports as read_reports
from concertina_hf.planning import Chunk, ChunkKind, Plan, Slice, StageLayout, build_schedule, simulate
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
from concertina_hf.runtime.profiler import profile_cost_model
from _memory_cases import allocated_step_peak, large_vocab_config


TWO_STAGE_CASES = {
    # many chunks, every layer recomputed: each forward's send held the stage output (gloo
    # reports a send complete only once waited for) until the step's end, 12% over on stage 0
    "8x64-full": ([64] * 8, [[(i, 0, 64)] for i in range(8)], [2] * 8),
    "short": ([16] * 6, [[(i, 0, 16)] for i in range(6)], [0] * 6),
}


def _two_stage_worker(outdir: str) -> None:
    gloo_rank(outdir, lambda report: _two_stages(report["rows"]), timeout_s=120, rows=[])


def _two_stages(rows: list) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    cfg = large_vocab_config()
    cfg.num_hidden_layers = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    lay = StageLayout.even(4, 2)
    cost = profile_cost_model(model, repeats=1, warmup=0, num_layers=2, max_tokens=128)
    ex = PipelineExecutor(PipelineWrapper(copy.deepcopy(model), lay, rank))
    ex.wrapper.train()
    for name, (lens, spec, rec) in TWO_STAGE_CASES.items():
        chunks = []
        for i, sl in enumerate(spec):
            slices = tuple(Slice(*s) for s in sl)
            chunks.append(Chunk(i, ChunkKind.of(slices, lens), slices))
        groups = (tuple(range(len(chunks))),)
        plan = Plan("t", tuple(lens), lay, tuple(chunks), groups,
                    build_schedule(chunks, groups, 2, prefetch=True), (tuple(rec), tuple(rec))).validate()
        predicted = simulate(plan, cost).peak_memory_bytes[rank] - cost.static_memory(lay, rank)
        rows.append((name, allocated_step_peak(ex, plan), predicted))


def test_two_stage_allocated_peaks_within_5_percent(launched):
    """Two gloo ranks (one launch): both stages' allocated peaks within 5% of the prediction, with
    many chunks (the stage outputs that sends kept alive) and short ones."""
    reports = read_reports(launched("pp2").out, 2)
    assert [r["failures"] for r in reports] == [[], []]
    for rank, r in enumerate(reports):
        for name, got, predicted in r["rows"]:
            print(f"stage {rank} {name:<10} allocated {got:>9} predicted {predicted:>11.0f} x{got / predicted:.3f}")
            assert got <= 1.05 * predicted and predicted <= 1.05 * got, (rank, name, got, predicted)


#: the launch (started by the session, read through the ``launched`` fixture)
LAUNCHES = {"pp2": Launch(2, _two_stage_worker)}
