"""The cost model's concurrent-stage factor (``CostModel.concurrent_compute_factor``).

On CPU the stages of a pipeline compute at the same time on one host's cores, sharing caches and
memory bandwidth, while the profiler times a stage alone. The factor (measured by
:meth:`Probe.concurrent_factor`, ``benchmarks/stage_contention.py``) multiplies every compute time
of a plan with more than one stage (``CostModel.for_plan``), never communication, and never a
one-stage plan; the online refit divides it out of measured actions, so refitted coefficients stay
those of a stage alone. Pure Python except the last test (a tiny Llama's probe).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from concertina_hf.planning import CostModel, DeviceSpec, StageLayout, partition_layers, plan_step, simulate

MODEL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688,
             vocab_size=8192, num_hidden_layers=8)
BASE = dataclasses.replace(CostModel.from_hf_config(MODEL, DeviceSpec.cpu(), dtype_bytes=4),
                           head_time_per_call=5e-4, embed_time_per_call=1e-3,
                           head_time_points=((64.0, 0.003), (256.0, 0.011), (1024.0, 0.05)))
LENS = [3000, 2048, 700, 600, 500, 400, 300, 200]
F = 1.25


def _layout(pp):
    return StageLayout(8, ((0, 8),) if pp == 1 else ((0, 4), (4, 8)))


def test_two_stage_plans_compute_at_the_factor_one_stage_plans_not():
    slow = dataclasses.replace(BASE, concurrent_compute_factor=F)
    two = plan_step(LENS, BASE, _layout(2), 0, "packed", token_budget=1024)
    a, b = simulate(two, BASE), simulate(two, slow)
    for x, y in zip(a.stage_busy_s, b.stage_busy_s):
        assert y == pytest.approx(F * x, rel=1e-12)
    for act, (t0, t1) in a.action_times.items():
        u0, u1 = b.action_times[act]
        assert u1 - u0 == pytest.approx(F * (t1 - t0), rel=1e-12)
    # communication is not compute: the step grows by less than the factor only through P2P
    assert b.step_time_s <= F * a.step_time_s + 1e-12
    one = plan_step(LENS, BASE, _layout(1), 0, "packed", token_budget=1024)
    assert simulate(one, slow).step_time_s == simulate(one, BASE).step_time_s
    # applied once: the model a plan runs under has the factor in its coefficients, and 1.0
    once = slow.for_plan(two)
    assert once.concurrent_compute_factor == 1.0 and once.for_plan(two) == once
    assert once.head_time(500) == pytest.approx(F * BASE.head_time(500))
    assert once.p2p_latency_s == BASE.p2p_latency_s and once.p2p_bandwidth == BASE.p2p_bandwidth
    # a uniform factor moves no layer between stages; it survives JSON; old files load at 1.0
    assert partition_layers(slow, 2) == partition_layers(BASE, 2)
    assert CostModel.from_dict(json.loads(json.dumps(slow.to_dict()))) == slow
    d = BASE.to_dict()
    d.pop("concurrent_compute_factor")
    assert CostModel.from_dict(d).concurrent_compute_factor == 1.0


def test_online_refit_keeps_the_coefficients_of_a_stage_alone():
    """Actions measured on two concurrent stages (simulated at the factor) refit to the alone
    coefficients the model had, not to ones inflated by the factor (which for_plan would then
    apply a second time)."""
    from concertina_hf.planning.fit import action_samples, prediction_error, refit_cost_model

    truth = dataclasses.replace(BASE, concurrent_compute_factor=F)
    start = dataclasses.replace(truth, alpha_tok=0.7 * BASE.alpha_tok, beta=1.5 * BASE.beta)
    layout = _layout(2)
    plan = plan_step([700, 500, 300, 200, 120, 90], truth, layout, 0, "packed", token_budget=256)
    acts = [(a, t0, t1) for a, (t0, t1) in simulate(plan, truth).action_times.items()]
    samples = action_samples(plan, acts)
    new = refit_cost_model(start, layout, samples, floor_fraction=0.0)
    assert new is not None and new.concurrent_compute_factor == F
    assert new.alpha_tok == pytest.approx(BASE.alpha_tok, rel=0.02)
    assert new.beta == pytest.approx(BASE.beta, rel=0.05)
    assert prediction_error(truth, layout, samples) == pytest.approx(0.0, abs=1e-9)
    assert prediction_error(new, layout, samples) < 0.01


def test_probe_measures_a_factor_on_cpu_and_the_profile_records_it():
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from concertina_hf.runtime.probe import build_probe
    from concertina_hf.runtime.profiler import profile_cost_model

    cfg = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                               intermediate_size=176, num_hidden_layers=2, vocab_size=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    pr = build_probe(model, 2)
    with pr.measuring():
        f = pr.concurrent_factor(((0, 64),), 3, 1)
    # at least 1 (a peer never speeds a stage up), and far below 2 (the peer thread's kernels run
    # in parallel: a serialized peer would double the stage's time on a core it has to share)
    assert 1.0 <= f < 1.9, f
    shapes = [((0, 32),), ((0, 64),), ((0, 32), (0, 32)), ((32, 32),)]
    off = profile_cost_model(model, shapes=shapes, repeats=1, warmup=0, num_layers=1, concurrency=False)
    assert off.concurrent_compute_factor == 1.0
    if torch.get_num_threads() == 1:
        on = profile_cost_model(model, shapes=shapes, repeats=1, warmup=0, num_layers=1)
        assert on.concurrent_compute_factor >= 1.0
