"""Whole-doc packing: short sequences packed into chunks of ``sp`` balanced per-GPU bins
(``SequenceBatch.balanced(whole_doc=...)``), a candidate adaptive keeps only when it simulates faster."""

from __future__ import annotations

import random

from concertina_hf.planning import CostModel, DeviceSpec, partition_layers, plan_step, simulate
from concertina_hf.planning.chunking import SequenceBatch
from concertina_hf.planning.lpt import lpt_ranks
from concertina_hf.planning.presets import MODEL_PRESETS
from concertina_hf.planning.sharding import chunk_mode
from concertina_hf.planning.types import ChunkKind, Slice

SP = 4


def _case():
    """LLaMA-7B on pp=2 x sp=4 (A800 rates), two long sequences and 120 long-tailed short ones."""
    cost = CostModel.from_hf_config(MODEL_PRESETS["llama-7b"], DeviceSpec.a800()).with_parallel(sp=SP)
    rng = random.Random(2)
    lens = [16384, 12000] + [int(min(8000, 100 / rng.random() ** 0.9)) for _ in range(120)]
    return cost, partition_layers(cost, 2), lens


def _imbalance(cost: CostModel, parts) -> float:
    """Busiest over mean GPU of the stage when the chunk's sequences are placed whole-doc by LPT
    (as placement.choose_placement places them), by one GPU's layer time."""
    base = cost.rank_model()
    work = [base.layer_compute_time((Slice(q, 0, n),)) - base.beta for q, _, n in parts]
    ranks = lpt_ranks(work, SP)
    load = [sum(w for w, r in zip(work, ranks) if r == k) for k in range(SP)]
    return max(load) / (sum(load) / SP)


def test_packing_into_per_gpu_bins_balances_every_chunk_and_keeps_every_token():
    cost, layout, lens = _case()
    batch = SequenceBatch(lens, cost, layout)
    plain = batch.balanced(num_slices_longest=2, token_cap=10**9)
    short = 3747
    packed = batch.balanced(num_slices_longest=2, token_cap=10**9, whole_doc=(SP, short))
    # the cut sequences are sliced as before
    assert [[ci.parts[0] for ci in ch] for ch in packed.chains] == [[ci.parts[0] for ci in ch] for ch in plain.chains]
    # every token once: the chains' slices and the packed chunks' whole sequences
    seen = sorted((q, s, n) for ch in packed.chains for ci in ch for q, s, n in ci.parts if q not in (0, 1))
    seen += sorted((q, s, n) for ci in packed.packed for q, s, n in ci.parts)
    assert sorted(q for q, _, _ in seen) == list(range(2, len(lens)))
    assert all(s == 0 and n == lens[q] for q, s, n in seen)
    # the short sequences are all in packed chunks of their own (none beside a cut sequence's tail)
    for ch in packed.chains:
        assert all(lens[q] > short for q, _, _ in ch[-1].parts[1:])
    # token packing (made for Ulysses) leaves packed chunks that no LPT balances over 4 GPUs;
    # the per-GPU bins balance every chunk but the last (the leftovers of the smallest sequences)
    assert max(_imbalance(cost, ci.parts) for ci in plain.packed) > 1.05
    by_size = sorted(packed.packed, key=lambda ci: -ci.tokens)
    assert len(by_size) >= 3
    assert all(_imbalance(cost, ci.parts) < 1.02 for ci in by_size[:-1])
    # and each chunk's predicted time is its busiest GPU's bin, within the chunk's time target or
    # its first sequence alone
    a, b = batch.a, batch.b
    for ci in packed.packed:
        first = max(n for _, _, n in ci.parts)
        assert ci.work <= max(packed.time_target, SP * (a * first * first + b * first) + batch.beta) * 1.001


def test_adaptive_keeps_the_packing_only_when_faster_and_never_in_ulysses_mode():
    cost, layout, lens = _case()
    plan = plan_step(lens, cost, layout, 0, "adaptive", solver="greedy", sp_mode="auto")
    before = plan_step(lens, cost, layout, 0, "adaptive", solver="greedy", sp_mode="auto", whole_doc_tokens=0)
    assert before.knob("whole_doc_tokens") == 0
    plan.validate()
    # chosen here: predicted faster than the chunking made for Ulysses, and fewer bytes moved
    assert plan.knob("whole_doc_tokens") > 0
    assert plan.predicted.step_time_s < before.predicted.step_time_s
    assert simulate(plan, cost).stage_comm_bytes < 0.7 * simulate(before, cost).stage_comm_bytes
    whole = [c for c in plan.chunks if c.kind is ChunkKind.PACKED and chunk_mode(c) == "whole-doc"]
    assert len(whole) >= 3
    # the knob forces a packing (at the search's K): one of fewer sequences simulates slower here
    forced = plan_step(lens, cost, layout, 0, "adaptive", solver="greedy", sp_mode="auto", whole_doc_tokens=2000,
                       num_slices_longest=plan.knob("num_slices_longest"))
    assert forced.knob("whole_doc_tokens") == 2000
    assert forced.predicted.step_time_s > plan.predicted.step_time_s
    # context mode (every chunk placed) never slower either
    ctx = plan_step(lens, cost, layout, 0, "adaptive", solver="greedy", sp_mode="context")
    ctx0 = plan_step(lens, cost, layout, 0, "adaptive", solver="greedy", sp_mode="context", whole_doc_tokens=0)
    assert ctx.predicted.step_time_s <= ctx0.predicted.step_time_s
    # Ulysses mode: the chunking of today's plans
    uly = plan_step(lens, cost, layout, 0, "adaptive", solver="greedy", sp_mode="ulysses")
    assert uly.knob("whole_doc_tokens") == 0 and not any(c.placement for c in uly.chunks)
