"""The cost model's fitted range caps the planner's chunks (issue 13).

The time model is linear in tokens and causal pairs; on CPU, chunks larger than every profiled
one ran up to 1.6x their prediction (``benchmarks/results/pipeline_efficiency.md``: pp=1's
one-chunk plans). A profiled model records its largest chunk (``max_chunk_tokens``) and
``plan_step`` builds no larger chunk for any pipeline strategy, unless the step needs it (chunk
and slice limits). Pure Python, no torch (the profiler's side is in ``test_profiler.py``).
"""

import dataclasses

import pytest

from concertina_hf.planning import CostModel, DeviceSpec, StageLayout, plan_step
from concertina_hf.planning.strategies.common import MAX_SLICES, max_chunks

MODEL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688,
             vocab_size=8192, num_hidden_layers=8)
BASE = CostModel.from_hf_config(MODEL, DeviceSpec.cpu(), dtype_bytes=4)
LENS = [3000, 2048, 700, 600, 500, 400, 300, 200]
CAP = 1024


def _layout(pp):
    return StageLayout(8, ((0, 8),) if pp == 1 else ((0, 4), (4, 8)))


def test_uncapped_model_builds_larger_chunks():
    """The premise: without the field (saved models, analytic ones) pp=1 packs big chunks."""
    assert BASE.max_chunk_tokens == 0
    plan = plan_step(LENS, BASE, _layout(1), 0, "adaptive")
    assert max(c.num_tokens for c in plan.chunks) > CAP


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("strategy", ["adaptive", "no-recompute", "full-recompute", "split", "packed"])
def test_plans_respect_the_fitted_cap(strategy, pp):
    cost = dataclasses.replace(BASE, max_chunk_tokens=CAP)
    plan = plan_step(LENS, cost, _layout(pp), 0, strategy)
    for c in plan.chunks:
        # packed never cuts a sequence: one longer than the cap stays whole, alone
        alone_longer = strategy == "packed" and len(c.slices) == 1 and LENS[c.slices[0].seq] > CAP
        assert c.num_tokens <= CAP or alone_longer, (strategy, c)


def test_caller_cap_below_the_model_cap_wins_and_above_is_lowered():
    cost = dataclasses.replace(BASE, max_chunk_tokens=CAP)
    low = plan_step(LENS, cost, _layout(1), 0, "adaptive", max_tokens_per_chunk=512)
    assert max(c.num_tokens for c in low.chunks) <= 512
    high = plan_step(LENS, cost, _layout(1), 0, "adaptive", max_tokens_per_chunk=8192)
    assert max(c.num_tokens for c in high.chunks) <= CAP


def test_a_step_too_large_for_the_cap_is_planned_not_refused():
    """More chunks than a plan may have at the model's cap: the cap gives way (a caller's cap
    would be refused, naming the smallest that works)."""
    cost = dataclasses.replace(BASE, max_chunk_tokens=16)
    layout = _layout(2)
    lens = [4096] * 12  # 3072 chunks of 16 tokens > the 2048 a plan may have
    plan = plan_step(lens, cost, layout, 0, "adaptive")
    assert plan.num_chunks <= max_chunks(layout)
    assert max(len([c for c in plan.chunks if any(s.seq == q for s in c.slices)]) for q in range(12)) <= MAX_SLICES


def test_cap_scales_with_sp_and_old_models_load_uncapped():
    cost = dataclasses.replace(BASE, max_chunk_tokens=CAP)
    assert cost.with_parallel(sp=2).max_chunk_tokens == 2 * CAP
    assert cost.with_parallel(sp=2).with_parallel(sp=1).max_chunk_tokens == CAP
    old = {k: v for k, v in BASE.to_dict().items() if k != "max_chunk_tokens"}
    assert CostModel.from_dict(old).max_chunk_tokens == 0
    assert CostModel.from_dict(cost.to_dict()) == cost
