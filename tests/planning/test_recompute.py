"""Adaptive recompute (ILP and greedy) and layer partition: budgets hold in simulation, never
slower than full recompute, optimal on enumerable instances, clear errors, deterministic."""

from __future__ import annotations

import dataclasses
import itertools
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from hypothesis import given, settings, strategies as st

from concertina_hf.planning import PlanError, StageLayout
from concertina_hf.planning.partition import partition_layers, stage_times
from concertina_hf.planning.recompute import InfeasiblePlanError, assign_recompute, fits, uniform_recompute
from concertina_hf.planning.simulate import simulate

from _plans import llama_cost, make_plan, skewed_lengths

GIB = 2**30


def _budgets_between(plan, cost, frac: float) -> list[int]:
    """Per stage: ``frac`` of the way from the full-recompute peak to the no-recompute peak."""
    zero = simulate(plan, cost).peak_memory_bytes
    full = simulate(uniform_recompute(plan, 10**6), cost).peak_memory_bytes
    return [int(f + frac * (z - f)) for z, f in zip(zero, full)]


# ---------------------------------------------------------------------------- recompute
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), p=st.integers(1, 8), groups=st.integers(1, 2),
       cap=st.sampled_from([4096, 16384]), frac=st.floats(0.0, 1.0))
def test_recompute_fits_budget_and_beats_full_recompute(seed, p, groups, cap, frac):
    rng = random.Random(seed)
    lens = skewed_lengths(rng, rng.randint(1, 48), max_len=8 * cap, scale=cap // 8)
    plan = make_plan(lens, p, cap, num_layers=max(p, 2 * p + rng.randint(0, 8)), num_groups=groups)
    cost = llama_cost()
    budgets = _budgets_between(plan, cost, frac)
    full = simulate(uniform_recompute(plan, 10**6), cost)
    results = {}
    for method in ("greedy", "ilp"):
        out = assign_recompute(plan, cost, budgets, method=method, time_limit_s=5.0)
        out.validate()  # recompute within each stage's layer count
        res = simulate(out, cost)
        assert fits(out, cost, budgets)
        assert all(pk <= b for pk, b in zip(res.peak_memory_bytes, budgets))
        assert res.step_time_s <= full.step_time_s * (1 + 1e-12)
        assert out.predicted == res.stats()
        assert out.memory_budget_bytes == tuple(budgets)
        assert (out.chunks, out.schedule, out.groups) == (plan.chunks, plan.schedule, plan.groups)
        # deterministic: the same input gives the same plan
        assert assign_recompute(plan, cost, budgets, method=method, time_limit_s=5.0).fingerprint() == out.fingerprint()
        results[method] = res
    # the ILP result is the faster of its own and the greedy solution
    assert results["ilp"].step_time_s <= results["greedy"].step_time_s * (1 + 1e-12)


def test_ilp_matches_exhaustive_optimum_on_tiny_instances():
    """Every recompute assignment of tiny plans enumerated: the ILP finds the fastest one that fits
    (its slack-aware objective is exact enough there); greedy is feasible and never slower than
    full recompute."""
    cost = llama_cost()
    checked = 0
    for seed in range(60):
        rng = random.Random(seed)
        p = rng.choice([1, 2, 3])
        lens = skewed_lengths(rng, rng.randint(1, 5), max_len=40000, scale=3000)
        plan = make_plan(lens, p, 16384, num_layers=2 * p)
        cells = p * plan.num_chunks
        if cells > 7 or checked >= 20:
            continue
        budgets = _budgets_between(plan, cost, rng.random())
        best = None
        for combo in itertools.product(range(3), repeat=cells):
            rows = tuple(combo[s * plan.num_chunks:(s + 1) * plan.num_chunks] for s in range(p))
            res = simulate(dataclasses.replace(plan, recompute=rows), cost)
            if all(pk <= b for pk, b in zip(res.peak_memory_bytes, budgets)):
                best = res.step_time_s if best is None else min(best, res.step_time_s)
        assert best is not None  # full recompute fits by construction
        ilp = assign_recompute(plan, cost, budgets, method="ilp", time_limit_s=5.0)
        assert ilp.predicted.step_time_s == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked >= 15


def test_per_chunk_recompute_term_is_handled_conservatively():
    """A profiled model keeps ``ckpt_chunk_bytes_per_token`` once per recomputed chunk (a step at
    ``r = 1``): the linear model over-approximates larger ``r``, so plans still fit, and a budget
    exactly at the full-recompute peak is feasible (the infeasibility check is exact)."""
    cost = llama_cost(ckpt_chunk_bytes_per_token=20000.0)
    for seed in range(4):
        rng = random.Random(seed)
        plan = make_plan(skewed_lengths(rng, 24, max_len=65536, scale=2048), 2, 8192, num_layers=8)
        full = simulate(uniform_recompute(plan, 10**6), cost).peak_memory_bytes
        for frac in (0.0, 0.3, 0.7):
            budgets = _budgets_between(plan, cost, frac)
            for method in ("greedy", "ilp"):
                out = assign_recompute(plan, cost, budgets, method=method)
                assert fits(out, cost, budgets)
        assert fits(assign_recompute(plan, cost, list(full), method="greedy"), cost, list(full))


def test_loose_and_unconstrained_budgets_need_no_recompute():
    cost = llama_cost()
    plan = make_plan(skewed_lengths(random.Random(1), 40), 4, 8192)
    zero_peak = simulate(plan, cost).peak_memory_bytes
    for budgets in ([0] * 4, list(zero_peak), [b + GIB for b in zero_peak]):
        out = assign_recompute(plan, cost, budgets)
        assert all(r == 0 for row in out.recompute for r in row)
        assert out.predicted.recompute_fraction == 0
    # tight on stage 0 only: the other stages stay at zero
    budgets = list(zero_peak)
    budgets[0] -= 4 * GIB
    out = assign_recompute(plan, cost, budgets)
    assert any(out.recompute[0]) and not any(any(row) for row in out.recompute[1:])
    assert out.predicted.peak_memory_bytes[0] <= budgets[0]


def test_infeasible_budget_names_stage_sequence_and_settings():
    cost = llama_cost()
    lens = [3000, 131072, 2000, 900, 5000, 12000]
    plan = make_plan(lens, 4, 32768)
    full_peak = simulate(uniform_recompute(plan, 10**6), cost).peak_memory_bytes
    budgets = list(full_peak)
    budgets[0] -= 1  # one byte short of what full recompute needs
    assert not fits(uniform_recompute(plan, 10**6), cost, budgets)
    for method in ("ilp", "greedy"):
        with pytest.raises(InfeasiblePlanError) as e:
            assign_recompute(plan, cost, budgets, method=method)
        msg = str(e.value)
        assert f"{budgets[0]} bytes ({budgets[0] / GIB:.2f} GiB)" in msg
        assert "stage 0" in msg and "sequence 1 (131072 tokens in 4 slices" in msg
        for knob in ("raise memory_budget", "lower max_tokens_per_chunk", "raise pipeline_size"):
            assert knob in msg
        assert [r.setting for r in e.value.remedies] == ["memory_budget", "max_tokens_per_chunk", "pipeline_size"]
    # a front end (trainer, CLI) words it like any planner error, under its own names
    assert "; raise --memory-gb, lower max_tokens_per_chunk" in e.value.worded({"memory_budget": "--memory-gb"})
    # full recompute exactly at the budget is feasible, and greedy finds it
    out = assign_recompute(plan, cost, full_peak, method="greedy")
    assert fits(out, cost, full_peak)
    # parameters alone over budget
    with pytest.raises(InfeasiblePlanError, match="optimizer state alone.*raise pipeline_size"):
        assign_recompute(plan, cost, [GIB] * 4)
    with pytest.raises(PlanError, match="one memory budget per pipeline stage"):
        assign_recompute(plan, cost, [GIB] * 3)
    with pytest.raises(PlanError, match="unknown recompute method 'magic'; set solver to 'ilp' or 'greedy'"):
        assign_recompute(plan, cost, [0] * 4, method="magic")


def test_uniform_recompute_and_fits():
    cost = llama_cost()
    lay = StageLayout(10, ((0, 2), (2, 6), (6, 10)))
    plan = make_plan([5000, 300, 40000], 3, 16384, layout=lay)
    assert uniform_recompute(plan, 3).recompute == tuple((min(3, n),) * plan.num_chunks for n in (2, 4, 4))
    assert uniform_recompute(plan, [0, 1, 9]).recompute == tuple((n,) * plan.num_chunks for n in (0, 1, 4))
    with pytest.raises(PlanError, match="one layer count per stage"):
        uniform_recompute(plan, [1, 2])
    peaks = simulate(plan, cost).peak_memory_bytes
    assert fits(plan, cost, peaks) and fits(plan, cost, [0, 0, 0])
    assert not fits(plan, cost, [peaks[0], peaks[1] - 1, peaks[2]])


def test_ilp_is_never_slower_than_greedy_on_a_512_sequence_batch():
    """~100 chunks on 4 stages: the ILP's plan is never predicted slower than greedy's (its
    search starts there), and both fit. How long each takes is benchmarks/planner_speed.py's."""
    cost = llama_cost()
    plan = make_plan(skewed_lengths(random.Random(8), 512), 4, 16384)
    assert 80 <= plan.num_chunks <= 150
    budgets = [max(_budgets_between(plan, cost, 0.5))] * 4
    out = {method: assign_recompute(plan, cost, budgets, method=method) for method in ("greedy", "ilp")}
    assert all(fits(o, cost, budgets) for o in out.values())
    assert out["ilp"].predicted.step_time_s <= out["greedy"].predicted.step_time_s


def test_a_solver_that_fails_leaves_the_greedy_plan_and_one_warning(monkeypatch, caplog):
    """CBC missing or crashing (PuLP 4 without its `cbc` extra) must not stop a step: the greedy
    recompute plans it, and the warning, which names the extra on PuLP 4, comes once a process."""
    import pulp

    from concertina_hf.planning import recompute

    def broken(*args, **kwargs):
        raise pulp.PulpSolverError("cannot execute cbc")

    monkeypatch.setattr(pulp, "COIN_CMD" if recompute._pulp4(pulp) else "PULP_CBC_CMD", broken)
    recompute._warn_once.cache_clear()
    cost = llama_cost()
    plan = make_plan(skewed_lengths(random.Random(3), 40), 2, 4096)
    budgets = _budgets_between(plan, cost, 0.4)
    greedy = assign_recompute(plan, cost, budgets, method="greedy")
    with caplog.at_level("WARNING", logger="concertina_hf.planning.recompute"):
        outs = [assign_recompute(plan, cost, budgets, method="ilp") for _ in range(2)]
    assert all(o.recompute == greedy.recompute for o in outs) and fits(outs[0], cost, budgets)
    assert any(any(row) for row in greedy.recompute)  # the budget binds: the solver was asked
    warned = [r.getMessage() for r in caplog.records if "CBC failed" in r.getMessage()]
    assert len(warned) == 1 and "cannot execute cbc" in warned[0] and "greedy" in warned[0], warned
    recompute._warn_once.cache_clear()

# ---------------------------------------------------------------------------- partition
def _brute_force_partition(cost, p, L, tokens):
    best = None
    for cuts in itertools.combinations(range(1, L), p - 1):
        b = (0, *cuts, L)
        lay = StageLayout(L, tuple((b[i], b[i + 1]) for i in range(p)))
        m = max(stage_times(cost, lay, tokens))
        best = m if best is None else min(best, m)
    return best


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 12), extra=st.integers(0, 40), tokens=st.sampled_from([512, 4096, 32768]),
       head_scale=st.sampled_from([0.0, 1.0, 20.0]))
def test_partition_balances_stage_times(p, extra, tokens, head_scale):
    L = p + extra
    base = llama_cost()
    cost = dataclasses.replace(base, num_layers=L, head_time_per_token=base.head_time_per_token * head_scale)
    lay = partition_layers(cost, p, tokens_hint=tokens)
    assert lay.num_layers == L and lay.num_stages == p
    assert lay.layer_ranges[0][0] == 0 and lay.layer_ranges[-1][1] == L
    assert all(b > a for a, b in lay.layer_ranges)
    assert all(lay.layer_ranges[i][1] == lay.layer_ranges[i + 1][0] for i in range(p - 1))
    times = stage_times(cost, lay, tokens)
    one = StageLayout(3, ((0, 1), (1, 2), (2, 3)))
    layer = stage_times(cost, one, tokens)[1]
    # no layout beats: the average, or the embedding / head stage holding a single layer
    lower = max(sum(times) / p, times[0] - layer * lay.num_stage_layers(0) + layer,
                times[-1] - layer * lay.num_stage_layers(p - 1) + layer) if p > 1 else sum(times)
    assert max(times) <= lower + layer * (1 + 1e-9)
    if L <= 14:  # exact: equal to the best of all contiguous layouts
        assert max(times) == pytest.approx(_brute_force_partition(cost, p, L, tokens), rel=1e-12)


def test_partition_errors_and_defaults():
    cost = llama_cost()
    assert partition_layers(cost, 1).layer_ranges == ((0, 32),)
    # a heavy head pushes layers off the last stage; spare layers go to later stages
    lay = partition_layers(cost, 4)
    times = stage_times(cost, lay)
    assert lay.num_stage_layers(3) < lay.num_stage_layers(1)
    assert max(times) < max(stage_times(cost, StageLayout.even(32, 4)))
    with pytest.raises(PlanError, match="32 decoder layers on 33 pipeline stages.*lower pipeline_size to at most 32"):
        partition_layers(cost, 33)
    with pytest.raises(PlanError, match="pipeline size"):
        partition_layers(cost, 0)
    assert partition_layers(cost, 3, num_layers=3).layer_ranges == ((0, 1), (1, 2), (2, 3))
    # the head's cost is what moved those layers: without it, the even split
    light = dataclasses.replace(cost, head_time_per_token=0.0)
    assert partition_layers(light, 4).layer_ranges == StageLayout.even(32, 4).layer_ranges
