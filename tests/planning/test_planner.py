"""End-to-end planner properties (pure Python, no torch): chunking, every strategy of
``plan_step``, and their simulated plans.

Batches are skewed like real corpora (many short sequences, a few long ones); pipelines have
1 to 8 stages; memory budgets range from unconstrained to tight. Every plan must cover every
token once and in order (``Plan.validate``), simulate without deadlock, stay within each
stage's budget, be deterministic, and the adaptive planner must not lose to the tuned
baselines (it searches a superset of their chunkings, with better recompute).
"""

import math
import os
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from concertina_hf.planning import (
    PIPELINE_STRATEGIES, SOLVERS, STRATEGIES, ChunkKind, CostModel, DeviceSpec, InfeasiblePlanError, Plan, PlanError,
    StageLayout,
    assign_recompute, balanced_split, build_schedule, fits, ideal_step_time, plan_step, simulate, stage_budgets,
)
from concertina_hf.planning.budgets import proxy_budgets
from concertina_hf.planning.chunking import SequenceBatch
from concertina_hf.planning.strategies import REGISTRY, PlanRequest

# A small Llama-like model: attention matters for long sequences, the LM head is heavy.
MODEL = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, intermediate_size=2816,
             vocab_size=32000, num_hidden_layers=16)
COST = CostModel.from_hf_config(MODEL, DeviceSpec())
NUM_LAYERS = MODEL["num_hidden_layers"]
# the adaptive planner may lose this much to a baseline (its search is pruned by a proxy)
TOLERANCE = 0.03
# CONCERTINA_PLANNER_EXAMPLES=500 for a longer hunt
EXAMPLES = int(os.environ.get("CONCERTINA_PLANNER_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def skewed_batches(draw, max_short=40):
    """Many short sequences (a few to 2K tokens) and up to three long ones (2K-24K), shuffled."""
    shorts = draw(st.lists(st.integers(1, 2048), min_size=2, max_size=max_short))
    longs = draw(st.lists(st.integers(2049, 24576), min_size=0, max_size=3))
    return list(draw(st.permutations(shorts + longs)))


def _budget(lens, layout, pressure):
    """``pressure`` None: unconstrained (0). Otherwise the largest static memory plus that many
    times the activations of the longest sequence on stage 0 (below 1: it cannot be in flight
    whole without recompute)."""
    if pressure is None:
        return 0
    static = max(COST.static_memory(layout, s) for s in range(layout.num_stages))
    act = max(lens) * COST.act_bytes_per_token * layout.num_stage_layers(0)
    return int(static + pressure * act)


def _work(slices):
    return sum(COST.alpha_attn * ((s.context + s.length) ** 2 - s.context**2) + COST.alpha_tok * s.length
               for s in slices)


# ------------------------------------------------------------------------------ chunking
@PROPERTY
@given(seq_len=st.integers(1, 200_000), k=st.integers(1, 64))
def test_balanced_split_cuts_equal_work(seq_len, k):
    k = min(k, seq_len)
    parts = balanced_split(seq_len, k, COST)
    assert len(parts) == k and sum(parts) == seq_len and min(parts) >= 1
    starts = [sum(parts[:i]) for i in range(k)]
    works = [COST.alpha_attn * ((c + n) ** 2 - c * c) + COST.alpha_tok * n for c, n in zip(starts, parts)]
    # boundaries are rounded to whole tokens: each slice is off by at most two tokens' work
    one_token = 2 * COST.alpha_attn * seq_len + COST.alpha_tok
    if all(p > 1 for p in parts):
        assert max(works) - min(works) <= 2 * one_token * (1 + 1e-9)
    # later slices attend to more context, so they are never longer (up to rounding)
    assert all(b <= a + 1 for a, b in zip(parts, parts[1:]))


def test_balanced_split_rejects_impossible_counts():
    with pytest.raises(PlanError, match="cannot cut"):
        balanced_split(3, 4, COST)


def _chunk(lens, layout, k, token_cap, budget=None, max_groups=1):
    """Chunks and pipeline groups as the planner makes them: balanced on the layout's slowest
    stage, grouped by the DP when more than one group is allowed under a budget."""
    ch = SequenceBatch(lens, COST, layout).balanced(num_slices_longest=k, token_cap=token_cap)
    cuts: tuple[int, ...] = ()
    if max_groups > 1 and budget is not None:
        budgets = proxy_budgets(stage_budgets(budget, layout.num_stages))
        cuts, _ = ch.best_group_cuts(COST, layout, budgets, max_groups=max_groups)
    return ch.assemble(cuts)


@PROPERTY
@given(lens=skewed_batches(), p=st.integers(1, 8), k=st.sampled_from([0.5, 1, 2, 3, 8, 16]),
       cap=st.one_of(st.none(), st.integers(512, 16384)), pressure=st.sampled_from([0.5, 2.0]))
def test_chunking_invariants(lens, p, k, cap, pressure):
    layout = StageLayout.even(NUM_LAYERS, p)
    token_cap = sum(lens) if cap is None else cap
    k = k if k < 1 else min(k, max(lens))
    ch = SequenceBatch(lens, COST).balanced(num_slices_longest=k, token_cap=token_cap)
    # every chunk but a whole sequence alone is within the time target (up to one token of
    # rounding) and the token cap
    target = ch.time_target - COST.beta + 2 * COST.alpha_attn * max(lens) + COST.alpha_tok
    for c in ch.assemble()[0]:
        if not (len(c.slices) == 1 and c.slices[0].length == lens[c.slices[0].seq]):
            assert c.num_tokens <= token_cap and _work(c.slices) <= target * (1 + 1e-9), c
    budget = _budget(lens, layout, pressure)
    for max_groups in (1, 3):
        chunks, groups = _chunk(lens, layout, k, token_cap, budget, max_groups)
        plan = Plan("test", tuple(lens), layout, chunks, groups, build_schedule(chunks, groups, p, prefetch=True),
                    tuple((0,) * len(chunks) for _ in range(p))).validate()
        simulate(plan, COST)  # raises on deadlock
        for c in chunks:
            if not (len(c.slices) == 1 and c.slices[0].length == lens[c.slices[0].seq]):
                assert c.num_tokens <= token_cap, c
        # a cut sequence's chunks are consecutive, split chunks first, its hybrid last
        cut = sorted({c.split_seq for c in chunks if c.split_seq is not None}, key=lambda q: (-lens[q], q))
        for q in cut:
            ids = [ci for ci, _ in plan.slices_of(q)]
            assert ids == list(range(ids[0], ids[0] + len(ids)))
            assert [chunks[i].kind for i in ids] == [ChunkKind.SPLIT] * (len(ids) - 1) + [ChunkKind.HYBRID]
        # longest cut sequences first
        firsts = [plan.slices_of(q)[0][0] for q in cut]
        assert firsts == sorted(firsts)
    # without a binding cap the longest sequence gets exactly K slices (K >= 1)
    if k >= 1 and cap is None:
        longest = max(range(len(lens)), key=lambda q: (lens[q], -q))
        assert len(plan.slices_of(longest)) == k


def test_prefetch_schedule_only_differs_with_split_chains():
    lens = [300] * 6
    ch = SequenceBatch(lens, COST).balanced(num_slices_longest=1, token_cap=300)
    chunks, groups = ch.assemble()
    for p in (1, 2, 4):
        assert build_schedule(chunks, groups, p, prefetch=True) == build_schedule(chunks, groups, p)


# ------------------------------------------------------------------------------ plan_step
def _plans(lens, layout, budget, solver="greedy"):
    # the strategies on the pipeline's stages (sp-only runs another layout: tests/planning/test_sp_planner.py)
    out = {}
    for strategy in PIPELINE_STRATEGIES:
        try:
            out[strategy] = plan_step(lens, COST, layout, budget, strategy, solver=solver)
        except InfeasiblePlanError as e:
            out[strategy] = e
    return out


@PROPERTY
@given(lens=skewed_batches(), p=st.integers(1, 8),
       pressure=st.one_of(st.none(), st.floats(0.3, 4.0)))
# found by longer hunts: the no-recompute ablation's token-capped chunking ([1187, 862+1+1];
# [576..651, rest+1]; [346, 346, 292+2+1]) beat adaptive by 3.5% / 5.5% / 6.7% while adaptive
# added capped variants only when its proxy saw recompute
@example(lens=[1, 1, 2049], p=3, pressure=1.75)
@example(lens=[1, 1124], p=3, pressure=1.55)
@example(lens=[1, 1124], p=3, pressure=1.75)
@example(lens=[2, 1, 984], p=7, pressure=2.481)
def test_every_strategy_plans_validly_and_adaptive_wins(lens, p, pressure):
    layout = StageLayout.even(NUM_LAYERS, p)
    budget = _budget(lens, layout, pressure)
    budgets = (budget,) * p
    ideal = ideal_step_time(lens, COST, layout)
    plans = _plans(lens, layout, budget)
    times = {}
    for strategy, plan in plans.items():
        if isinstance(plan, InfeasiblePlanError):
            assert budget, f"{strategy} infeasible without a budget: {plan}"
            continue
        plan.validate()
        assert Plan.from_json(plan.to_json()) == plan
        assert plan.strategy == strategy and plan.memory_budget_bytes == budgets and plan.knobs
        sim = simulate(plan, COST)  # no deadlock
        assert plan.predicted == sim.stats()
        assert all(b == 0 or peak <= b for peak, b in zip(sim.peak_memory_bytes, budgets))
        assert sim.step_time_s >= ideal * (1 - 1e-9)
        if strategy == "no-recompute":
            assert not any(any(row) for row in plan.recompute)
        if strategy == "full-recompute":
            assert all(r == layout.num_stage_layers(s) for s, row in enumerate(plan.recompute) for r in row)
        times[strategy] = sim.step_time_s
    # deterministic: the same input gives the same plan
    again = plan_step(lens, COST, layout, budget, "adaptive", solver="greedy") if "adaptive" in times else None
    if again is not None:
        assert again.fingerprint() == plans["adaptive"].fingerprint() and again.predicted == plans["adaptive"].predicted
    others = [t for s, t in times.items() if s != "adaptive"]
    if "adaptive" not in times:
        assert not others, f"adaptive found no plan but {sorted(times)} did: {plans['adaptive']}"
    elif others:
        assert times["adaptive"] <= min(others) * (1 + TOLERANCE), times


@settings(max_examples=max(6, EXAMPLES // 4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=skewed_batches(max_short=25), p=st.sampled_from([2, 4]), pressure=st.floats(0.4, 1.2))
def test_ilp_solver_never_worse_than_greedy(lens, p, pressure):
    layout = StageLayout.even(NUM_LAYERS, p)
    budget = _budget(lens, layout, pressure)
    try:
        greedy = plan_step(lens, COST, layout, budget, solver="greedy")
    except InfeasiblePlanError:
        with pytest.raises(InfeasiblePlanError):
            plan_step(lens, COST, layout, budget, solver="ilp")
        return
    ilp = plan_step(lens, COST, layout, budget, solver="ilp", time_limit_s=5.0).validate()
    assert ilp.predicted.step_time_s <= greedy.predicted.step_time_s * (1 + 1e-12)
    assert all(pk <= budget for pk in simulate(ilp, COST).peak_memory_bytes)


def test_packed_uniform_sequences_reproduce_textbook_1f1b():
    # equal stages (no embedding / head time), free communication: every micro-batch takes F
    # forward and 2F backward on every stage, and 1F1B takes (m + p - 1) (F + B)
    cost = CostModel(num_layers=8, alpha_attn=1e-10, alpha_tok=1e-6, beta=1e-4, bwd_factor=2.0,
                     p2p_latency_s=0.0, hidden_bytes_per_token=0.0)
    length = 1000
    for p in (1, 2, 4, 8):
        layout = StageLayout.even(8, p)
        for m in (1, 3, 8, 13):
            plan = plan_step([length] * m, cost, layout, 0, "packed", token_budget=length).validate()
            assert plan.num_chunks == m and plan.knob("token_budget") == length
            f = cost.fwd_time(layout, 0, plan.chunks[0])
            expected = (m + p - 1) * (f + 2 * f)
            assert math.isclose(plan.predicted.step_time_s, expected, rel_tol=1e-9)
            assert math.isclose(plan.predicted.bubble_fraction, (p - 1) / (m + p - 1), rel_tol=1e-9, abs_tol=1e-12)


def test_extra_warmup_runs_one_forward_more_ahead_and_adaptive_keeps_it_when_faster():
    # heterogeneous chunks on 2 stages, the head on the last: in 1F1B stage 0 waits for the first
    # backward to come back; one forward more ahead fills that wait
    lens = [2048] * 4 + [1917, 1559, 1164, 1061, 1016, 902, 297]
    layout = StageLayout((NUM_LAYERS), ((0, 10), (10, NUM_LAYERS)))
    ch = SequenceBatch(lens, COST).balanced(num_slices_longest=1, token_cap=2048)
    chunks, groups = ch.assemble()
    plain, deeper = build_schedule(chunks, groups, 2, prefetch=True), build_schedule(chunks, groups, 2, prefetch=True,
                                                                                      extra_warmup=1)
    assert deeper[1] == plain[1]  # the last stage runs F, B alternately either way

    def ahead(acts):  # forwards before the first backward
        return next(i for i, a in enumerate(acts) if a.kind.value == "B")

    assert ahead(plain[0]) == 2 and ahead(deeper[0]) == 3
    with pytest.raises(ValueError, match="extra_warmup"):
        build_schedule(chunks, groups, 2, extra_warmup=-1)
    fixed = plan_step(lens, COST, layout, 0, "adaptive", extra_warmup=0).validate()
    auto = plan_step(lens, COST, layout, 0, "adaptive").validate()
    assert fixed.knob("extra_warmup") == 0
    assert auto.knob("extra_warmup") == 1  # 0.147 s against 0.159 s planned (-8%)
    assert auto.predicted.step_time_s < fixed.predicted.step_time_s * 0.97
    forced = plan_step(lens, COST, layout, 0, "adaptive", extra_warmup=1).validate()
    assert forced.knob("extra_warmup") == 1 and simulate(forced, COST).step_time_s == forced.predicted.step_time_s
    # one stage: nothing to run ahead of
    single = plan_step(lens, COST, StageLayout.even(NUM_LAYERS, 1), 0, "adaptive")
    assert single.knob("extra_warmup") == 0


# the profile of benchmarks/measured.py's CPU model (rounded): chunks are long against beta, and on
# two stages of 5 + 3 layers the first stage (embedding, more layers) is the slowest
CPU_COST = CostModel(num_layers=8, alpha_attn=4.3e-9, alpha_tok=1.8e-5, beta=1.1e-3, bwd_factor=2.1,
                     embed_time_per_call=6.5e-4, head_time_per_token=4.1e-5, head_time_per_call=2.3e-4)
CPU_LAYOUT = StageLayout(8, ((0, 5), (5, 8)))


def test_tapered_cuts_the_first_backward_of_each_group_and_keeps_every_token():
    lens = [5959, 4000, 300, 20]
    batch = SequenceBatch(lens, CPU_COST, CPU_LAYOUT)
    ch = batch.balanced(num_slices_longest=6, token_cap=4096)
    assert len(ch.chains) == 2
    for cuts in ((), (1,)):
        t = batch.tapered(ch, 0.5, cuts)
        assert t.num_chunks == ch.num_chunks + 1 + len(cuts) and t.packed == ch.packed
        for i, (old, new) in enumerate(zip(ch.chains, t.chains)):
            if i not in (0, *cuts):
                assert new == old
                continue
            assert new[:-2] == old[:-1]
            piece, final = new[-2:]
            (q, lo, n), rest = old[-1].parts[0], old[-1].parts[1:]
            assert piece.kind is ChunkKind.SPLIT and piece.parts == ((q, lo, piece.tokens),)
            assert final.kind is ChunkKind.HYBRID and final.parts == ((q, lo + piece.tokens, n - piece.tokens),) + rest
            # the tail keeps half its work: the piece's is the other half, beta counted once each
            assert math.isclose(piece.work + final.work - CPU_COST.beta, old[-1].work, rel_tol=1e-9)
            def work(k):  # of the tail's first k tokens, as balancing counts it
                return CPU_COST.alpha_attn * ((lo + k) ** 2 - lo**2) + batch.b * k

            assert abs(work(piece.tokens) / work(n) - 0.5) <= 1.0 / n  # to the token
        plan = Plan(strategy="adaptive", seq_lens=tuple(lens), layout=CPU_LAYOUT, chunks=t.assemble(cuts)[0],
                    groups=t.assemble(cuts)[1],
                    schedule=build_schedule(*t.assemble(cuts), 2, prefetch=True),
                    recompute=((0,) * t.num_chunks,) * 2)
        plan.validate()  # every token once, in order; kinds right
    assert batch.tapered(batch.by_tokens(8192, split=False), 0.5) is None  # no chain: nothing to cut
    with pytest.raises(PlanError, match="taper fraction"):
        batch.tapered(ch, 1.0)


def test_adaptive_tapers_the_first_backward_when_an_early_stage_is_slowest():
    # stage 0 waits, before its first backward, for the chain's last slice to go forward and
    # backward through stage 1; half of that slice shortens the wait for one chunk constant more
    # (on measured.py's 8K batch of one 5959-token sequence: 4.486 s -> 4.397 s planned)
    for lens, gain in (([8192], 0.015), ([5959], 0.015)):
        auto = plan_step(lens, CPU_COST, CPU_LAYOUT, 0, "adaptive").validate()
        plain = plan_step(lens, CPU_COST, CPU_LAYOUT, 0, "adaptive", taper=0).validate()
        assert auto.knob("taper") == 0.5 and plain.knob("taper") == 0
        assert auto.num_chunks == plain.num_chunks + 1
        assert auto.predicted.step_time_s < plain.predicted.step_time_s * (1 - gain)
        assert simulate(auto, CPU_COST).stats() == auto.predicted
        forced = plan_step(lens, CPU_COST, CPU_LAYOUT, 0, "adaptive", taper=0.25).validate()
        assert forced.knob("taper") == 0.25
    # where chunks are short against beta (the analytic GPU model) the cut costs more than it saves
    # and is not kept; one stage has no wait to shorten
    assert plan_step([16384], COST, StageLayout.even(NUM_LAYERS, 2), 0, "adaptive").knob("taper") == 0
    assert plan_step([8192], CPU_COST, StageLayout.even(8, 1), 0, "adaptive").knob("taper") == 0


def test_fixed_knobs_are_used_and_reported():
    lens = [5000, 300, 200, 900, 40, 4000, 1200]
    layout = StageLayout.even(NUM_LAYERS, 4)
    packed = plan_step(lens, COST, layout, 0, "packed", token_budget=4096, recompute_layers=2)
    assert packed.knob("token_budget") == 4096 and packed.knob("recompute_layers") == 2
    assert all(r == 2 for row in packed.recompute for r in row)
    split = plan_step(lens, COST, layout, 0, "split", num_slices=4)
    assert split.knob("num_slices") == 4 and len(split.slices_of(0)) == 4
    adaptive = plan_step(lens, COST, layout, 0, "adaptive", num_slices_longest=3, max_groups=1)
    assert adaptive.knob("num_slices_longest") == 3 and len(adaptive.slices_of(0)) == 3
    assert adaptive.knob("num_groups") == 1
    capped = plan_step(lens, COST, layout, 0, "adaptive", max_tokens_per_chunk=1024)
    assert max(c.num_tokens for c in capped.chunks) <= 1024


def test_no_fitting_plan_names_the_sequence():
    lens = [100] * 20 + [120_000] + [300] * 5
    giant = 20
    layout = StageLayout.even(NUM_LAYERS, 2)
    static = max(COST.static_memory(layout, s) for s in range(2))
    budget = int(static + 0.5 * 2**30)  # half a GiB of room: the giant cannot fit, even recomputed
    for strategy in STRATEGIES:
        with pytest.raises(InfeasiblePlanError) as info:
            plan_step(lens, COST, layout, budget, strategy)
        msg = str(info.value)
        assert f"sequence {giant} " in msg, (strategy, msg)
        assert "GiB" in msg and "memory_budget" in msg, (strategy, msg)


def test_bad_arguments_name_the_setting():
    layout = StageLayout.even(NUM_LAYERS, 2)
    with pytest.raises(PlanError, match="adaptive"):
        plan_step([10, 20], COST, layout, 0, "fastest")
    with pytest.raises(PlanError, match="token_budget"):
        plan_step([10, 20], COST, layout, 0, "packed", num_slices_longest=2)
    with pytest.raises(PlanError, match="one size per stage"):
        plan_step([10, 20], COST, layout, [1, 2, 3], "adaptive")
    with pytest.raises(PlanError, match="solver"):
        plan_step([10, 20], COST, layout, 0, solver="magic")
    with pytest.raises(PlanError, match="layers"):
        plan_step([10, 20], COST, StageLayout.even(8, 2), 0)


def test_strategy_registry_is_the_one_table():
    # one record per strategy, the method first; plan_step dispatches to its run and accepts
    # exactly its knobs
    assert STRATEGIES == tuple(s.name for s in REGISTRY) == (
        "adaptive", "packed", "split", "no-recompute", "full-recompute", "sp-only")
    assert PIPELINE_STRATEGIES == STRATEGIES[:-1]
    assert set(SOLVERS) == {"ilp", "greedy"}
    lens = [5000, 300, 200, 900, 40, 4000, 1200]
    layout = StageLayout.even(NUM_LAYERS, 2)
    for record in REGISTRY:
        assert record.knobs and record.description and "\n" not in record.description
        with pytest.raises(PlanError, match=re.escape(f"it accepts {list(record.knobs)}")):
            plan_step(lens, COST, layout, 0, record.name, no_such_knob=1)
        req = PlanRequest(lens=lens, batch=SequenceBatch(lens, COST, layout), cost=COST, layout=layout,
                          budgets=(0, 0), token_cap=None, solver="greedy", time_limit_s=1.0, knobs={})
        direct = record.run(req)
        assert direct.strategy == record.name
        assert direct.fingerprint() == plan_step(lens, COST, layout, 0, record.name, solver="greedy").fingerprint()


def test_stage_budgets_is_the_one_normaliser():
    assert stage_budgets(10, 3) == (10, 10, 10) and stage_budgets(2.0**31, 2) == (2**31, 2**31)
    assert stage_budgets([5], 2) == (5, 5) and stage_budgets((1, 0), 2) == (1, 0)
    with pytest.raises(PlanError, match="memory budgets must be >= 0"):
        stage_budgets([1, -1], 2)
    # every entry point taking budgets reports a wrong count the same way
    layout = StageLayout.even(NUM_LAYERS, 2)
    lens = [3000, 200, 100]
    chunks, groups = _chunk(lens, layout, 2, 4096)
    plan = Plan("test", tuple(lens), layout, chunks, groups, build_schedule(chunks, groups, 2, prefetch=True),
                tuple((0,) * len(chunks) for _ in range(2)))
    calls = [
        lambda: stage_budgets([1, 2, 3], 2),
        lambda: plan_step(lens, COST, layout, [1, 2, 3]),
        lambda: assign_recompute(plan, COST, [1, 2, 3]),
        lambda: fits(plan, COST, [1, 2, 3]),
    ]
    for call in calls:
        with pytest.raises(PlanError, match=r"need one memory budget per pipeline stage \(2\), got 3.*"
                                            "one size per stage or a single size"):
            call()


def test_ideal_step_time_is_total_compute_over_stages():
    cost = CostModel(num_layers=4, alpha_attn=2.0, alpha_tok=3.0, beta=99.0, bwd_factor=2.0,
                     embed_time_per_token=5.0, head_time_per_token=7.0)
    layout = StageLayout.even(4, 2)
    # per sequence of n tokens: 3 * (4 * (2 n^2 + 3 n) + 12 n), beta excluded
    expected = sum(3 * (4 * (2 * n * n + 3 * n) + 12 * n) for n in (1, 10)) / 2
    assert ideal_step_time([1, 10], cost, layout) == pytest.approx(expected)


def test_adaptive_fits_whenever_a_baseline_fits():
    """Regression on a real batch (256 stdlib files, longest 32K tokens) and a tight budget for
    packing whole sequences (the last stage's backward of the 32K-token chunk holds its logits'
    float32 gradients, 8 bytes per vocabulary entry and token, 2 GiB at this vocabulary; under
    3.5 GiB packing does not fit): adaptive must fit too and be no slower, falling back to the
    baselines' chunkings where it must (it can emulate them) instead of reporting that nothing fits."""
    import json
    import pathlib

    from concertina_hf.planning.presets import MODEL_PRESETS
    from concertina_hf.planning import partition_layers

    lens = json.loads((pathlib.Path(__file__).parent / "data" / "stdlib_256_lengths.json").read_text())["lengths"]
    cost = CostModel.from_hf_config(MODEL_PRESETS["tiny-llama"], DeviceSpec.cpu())
    layout = partition_layers(cost, 2)
    budget = 4 * 2**30
    packed = plan_step(lens, cost, layout, budget, strategy="packed", solver="greedy")
    with pytest.raises(InfeasiblePlanError):
        plan_step(lens, cost, layout, int(3.5 * 2**30), strategy="packed", solver="greedy")
    adaptive = plan_step(lens, cost, layout, budget, strategy="adaptive", solver="greedy").validate()
    assert max(adaptive.predicted.peak_memory_bytes) <= budget
    assert adaptive.predicted.step_time_s <= packed.predicted.step_time_s * (1 + TOLERANCE)


def test_a_budget_below_static_memory_is_refused_before_any_search():
    """No plan fits a stage whose weights, gradients and optimizer state alone exceed its budget:
    every strategy says so at once, naming the stage and the setting (a search would take
    seconds, and with tiny token caps minutes, before giving up)."""
    layout = StageLayout.even(COST.num_layers, 2)
    static = COST.static_memory(layout, 0)
    for strategy in STRATEGIES:
        with pytest.raises(InfeasiblePlanError, match="stage 0's memory budget .* below its static memory alone"):
            plan_step([9000, 300, 20], COST, layout, [int(static / 2), 0], strategy, max_tokens_per_chunk=2)


def test_planning_process_plans_what_this_process_plans_and_raises_its_errors():
    from concertina_hf.planning.process import PlanningProcess, plan_checked

    lens = [5000, 300, 200, 900, 40, 4000, 1200]
    layout = StageLayout.even(NUM_LAYERS, 2)
    proc = PlanningProcess()
    try:
        here = plan_checked(lens, COST, layout, 0, "adaptive", solver="greedy")
        there = proc.plan(lens, COST, layout, 0, "adaptive", solver="greedy")
        assert there == here and there.predicted == here.predicted and proc.last_cpu_s > 0
        with pytest.raises(InfeasiblePlanError, match="budget"):
            proc.plan(lens, COST, layout, int(COST.static_memory(layout, 0)) + 1, "adaptive")
        with pytest.raises(ValueError, match="strategy"):
            proc.plan(lens, COST, layout, 0, "no-such-strategy")
        assert proc.plan([300, 200], COST, layout, 0, "packed", token_budget=300).num_chunks == 2  # still serving
    finally:
        proc.close()
    assert proc.plan([300], COST, layout, 0, "packed", token_budget=300).num_chunks == 1  # a new child after close
    proc.close()
    # a child that dies is named as such (StepPlanner then plans in its own process)
    import subprocess
    import sys

    from concertina_hf.planning.process import PlanningProcessError

    proc._start = lambda: subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE)
    with pytest.raises(PlanningProcessError, match="ended"):
        proc.plan([300], COST, layout, 0, "packed", token_budget=300)
    proc.close()
