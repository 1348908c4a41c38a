"""planning/fit.py: the cost model's fits recover known coefficients (no torch, no device).

- :func:`nonneg_lstsq`: exact on consistent data, a negative coefficient dropped, ``None`` when
  none stays positive;
- :func:`fit_profile`: layer time coefficients, all 0 on samples no positive coefficient explains;
- :func:`fit_activation_bytes`: the profiler's byte terms from chunks' bytes;
- :func:`refit_cost_model` / :func:`action_samples`: the online refit from a step's actions;
  on noisy steps (sleeps on a busy machine) it keeps the planned chunk counts within 2x (floors);
  :func:`bounded_refit` keeps it only if it predicts held-out steps better;
- the planner's chunk-size floor (no slice whose work is below ``beta``).
"""

from __future__ import annotations

import dataclasses
import doctest
import random

import numpy as np
import pytest

from concertina_hf.planning import (
    Action,
    ActionKind,
    Chunk,
    ChunkKind,
    CostModel,
    DeviceSpec,
    ProfileSample,
    Slice,
    StageLayout,
    plan_step,
)
from concertina_hf.planning import cost as cost_module
from concertina_hf.planning import fit as fit_module
from concertina_hf.planning.fit import (
    ActionSample,
    action_samples,
    fit_activation_bytes,
    fit_profile,
    nonneg_lstsq,
    refit_cost_model,
    through_origin,
)

HF_CFG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)
SHAPES = [((0, 128),), ((0, 512),), ((256, 256),), ((0, 64), (0, 64)), ((1024, 128),), ((0, 2048),),
          ((0, 100), (0, 30)), ((300, 50), (0, 70))]


def test_doctests_pass():
    for module in (fit_module, cost_module):
        result = doctest.testmod(module, raise_on_error=False)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_nonneg_lstsq():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, size=(20, 3))
    assert nonneg_lstsq(a, a @ np.array([2.0, 0.5, 3.0])) == pytest.approx([2.0, 0.5, 3.0])
    # the unconstrained solution has a negative coefficient: it is dropped, the rest refitted
    y = a @ np.array([2.0, -1.0, 3.0])
    coef = nonneg_lstsq(a, y)
    assert coef[1] == 0.0 and (coef >= 0).all()
    assert coef[[0, 2]] == pytest.approx(np.linalg.lstsq(a[:, [0, 2]], y, rcond=None)[0])
    assert nonneg_lstsq(a, -a @ np.array([1.0, 1.0, 1.0])) is None
    assert through_origin([0, 0], [1, 2]) == 0.0


def test_fit_profile_recovers_layer_coefficients():
    true = CostModel(num_layers=2, alpha_attn=3e-9, alpha_tok=2e-6, beta=1e-4, bwd_factor=2.5)
    samples = []
    for sh in SHAPES:
        f = true.layer_fwd_time([Slice(i, c, s) for i, (c, s) in enumerate(sh)])
        samples.append(ProfileSample(sh, f, 2.5 * f, act_bytes=100.0 * sum(s for _, s in sh)))
    start = CostModel.from_hf_config(HF_CFG)
    fitted = fit_profile(start, samples)
    for name in ("alpha_attn", "alpha_tok", "beta"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-15), name
    assert fitted.bwd_factor == pytest.approx(2.5) and fitted.act_bytes_per_token == pytest.approx(100.0)
    assert fitted.source == "fitted" and fitted.num_layers == start.num_layers
    with pytest.raises(ValueError, match="at least 3 samples"):
        fit_profile(start, samples[:2])


def test_fit_profile_with_no_positive_coefficient_gives_zeros():
    """Samples no non-negative combination explains (negative times) fit all 0; with no positive
    forward total the start's backward factor is kept, and with no measured bytes its bytes."""
    start = CostModel.from_hf_config(HF_CFG)
    samples = [ProfileSample(sh, -1e-3 * sum(s for _, s in sh), 1e-3) for sh in SHAPES]
    fitted = fit_profile(start, samples)
    assert (fitted.alpha_attn, fitted.alpha_tok, fitted.beta) == (0.0, 0.0, 0.0)
    assert fitted.bwd_factor == start.bwd_factor and fitted.act_bytes_per_token == start.act_bytes_per_token


def test_fit_activation_bytes_recovers_the_byte_terms():
    layers, act, ctx = 3, 1000.0, 40.0
    chunks = [(sh, False) for sh in SHAPES] + [(((512, 512),), True), (((0, 512),), True)]
    nbytes = []
    for sh, split in chunks:
        tok = sum(s for _, s in sh)
        context = sum(c + (s if split else 0) for c, s in sh if c > 0)
        nbytes.append(layers * (act * tok + ctx * context))
    assert fit_activation_bytes(chunks, nbytes, layers) == pytest.approx((act, ctx))
    assert fit_activation_bytes(chunks, [-b for b in nbytes], layers) == (0.0, 0.0)


def _chunks(rng, n):
    out = []
    for i in range(n):
        if rng.random() < 0.5:
            sl = (Slice(i, 0, rng.randrange(16, 2048)),)
        else:
            c = rng.randrange(256, 4096)
            sl = (Slice(i, c, rng.randrange(64, 1024)), Slice(n + i, 0, rng.randrange(8, 256)))
        out.append(Chunk(0, ChunkKind.PACKED, sl))
    return out


def test_refit_recovers_a_known_cost_model():
    rng = random.Random(0)
    start = CostModel.from_hf_config(HF_CFG, DeviceSpec.cpu(), dtype_bytes=4)
    truth = dataclasses.replace(start, alpha_attn=start.alpha_attn * 3.0, alpha_tok=start.alpha_tok * 0.4,
                                beta=2e-4, bwd_factor=2.3, head_time_per_token=start.head_time_per_token * 0.6,
                                embed_time_per_token=start.embed_time_per_token * 0.6)
    layout = StageLayout(6, ((0, 2), (2, 4), (4, 6)))
    samples = []
    for ch in _chunks(rng, 60):
        st = rng.randrange(3)
        r = rng.randrange(0, 3)
        noise = 1 + rng.uniform(-0.01, 0.01)
        samples.append(ActionSample(st, ch, r, truth.fwd_time(layout, st, ch) * noise,
                                    truth.bwd_time(layout, st, ch, r) * noise))
    fitted = refit_cost_model(start, layout, samples)
    assert fitted is not None and fitted.source == "online"
    for ch in _chunks(random.Random(1), 30):  # held-out shapes
        for st in range(3):
            want, got = truth.fwd_time(layout, st, ch), fitted.fwd_time(layout, st, ch)
            assert abs(got - want) / want < 0.03, (st, ch, got, want)
            assert abs(fitted.bwd_time(layout, st, ch, 1) - truth.bwd_time(layout, st, ch, 1)) \
                / truth.bwd_time(layout, st, ch, 1) < 0.03
    assert fitted.bwd_factor == pytest.approx(2.3, rel=0.03)
    # far off before: the refit is what made the predictions right
    ch = _chunks(random.Random(2), 1)[0]
    assert abs(start.fwd_time(layout, 1, ch) / truth.fwd_time(layout, 1, ch) - 1) > 0.2
    # memory: raised when measured above prediction, never lowered
    raised = refit_cost_model(start, layout, samples, memory_scale=1.5)
    assert raised.act_bytes_per_token == pytest.approx(1.5 * start.act_bytes_per_token)
    assert refit_cost_model(start, layout, samples, memory_scale=0.5).act_bytes_per_token == start.act_bytes_per_token
    assert refit_cost_model(start, layout, samples[:3]) is None  # underdetermined


def test_refit_at_sequence_parallel_size_2_recovers_the_compute_around_the_all_to_alls():
    """A stage of 2 GPUs (Ulysses): measured forwards and backwards include each layer's four
    all-to-alls (here ~30-60% of a layer). The refit takes them from the model's link fields and
    fits the per-GPU compute around them: predictions of held-out chunks (forward, backward with
    a recomputed layer) within 3%; fitting them as compute (the refit at sp = 1) is far off."""
    rng = random.Random(0)
    start = dataclasses.replace(CostModel.from_hf_config(HF_CFG, DeviceSpec.cpu(), dtype_bytes=4),
                                intra_node_latency_s=5e-5, intra_node_bandwidth=1e8).with_parallel(sp=2)
    truth = dataclasses.replace(start, alpha_attn=start.alpha_attn * 3.0, alpha_tok=start.alpha_tok * 0.4,
                                beta=2e-4, bwd_factor=2.3, head_time_per_token=start.head_time_per_token * 0.6,
                                embed_time_per_token=start.embed_time_per_token * 0.6)
    layout = StageLayout(6, ((0, 2), (2, 4), (4, 6)))
    ch = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, 512),))
    share = truth.a2a_time(512) / truth.layer_fwd_time(ch.slices)
    assert 0.3 < share < 0.7, share
    samples = []
    for ch in _chunks(rng, 60):
        st, r = rng.randrange(3), rng.randrange(0, 3)
        noise = 1 + rng.uniform(-0.01, 0.01)
        samples.append(ActionSample(st, ch, r, truth.fwd_time(layout, st, ch) * noise,
                                    truth.bwd_time(layout, st, ch, r) * noise))
    fitted = refit_cost_model(start, layout, samples)
    assert fitted is not None and fitted.sp == 2 and fitted.source == "online"
    assert fitted.bwd_factor == pytest.approx(2.3, rel=0.03)
    assert fitted.beta == pytest.approx(2e-4, rel=0.05)
    assert (fitted.intra_node_latency_s, fitted.intra_node_bandwidth) == (5e-5, 1e8)  # the link is kept

    def worst(model):  # held-out shapes: forward, and backward with one recomputed layer
        return max(abs(got / want - 1) for ch in _chunks(random.Random(1), 30) for st in range(3)
                   for got, want in ((model.fwd_time(layout, st, ch), truth.fwd_time(layout, st, ch)),
                                     (model.bwd_time(layout, st, ch, 1), truth.bwd_time(layout, st, ch, 1))))

    assert worst(fitted) < 0.03, worst(fitted)
    # the same samples fitted as if the all-to-alls were compute (the refit before): counted twice
    as_sp1 = dataclasses.replace(refit_cost_model(dataclasses.replace(start, sp=1), layout, samples), sp=2)
    assert worst(as_sp1) > 0.2, worst(as_sp1)
    # zero3 (the sp-only baseline: a layer is max(compute, gather)) is not refitted
    zero3 = dataclasses.replace(start, zero3=True, state_shards=2)
    assert refit_cost_model(zero3, layout, samples) is None
    assert fit_module.bounded_refit(zero3, layout, samples, samples[:5]) == (None, fit_module.bounded_refit(
        zero3, layout, [], [])[1]) and "zero3" in fit_module.bounded_refit(zero3, layout, [], [])[1]


def test_refit_of_per_doc_chunks_takes_their_gathers_not_all_to_alls():
    """A per-doc chunk's measured times include its K/V all-gather forward and its
    reduce-scatter backward (fitted on the group: on gloo the reduce-scatter is several
    all-gathers), not all-to-alls. The refit subtracts those and recovers the compute (per-doc
    slices of multiples of 2 sp tokens: each GPU's share of pairs and tokens is exactly 1/sp)."""
    from concertina_hf.planning.sharding import PER_DOC

    rng = random.Random(0)
    start = dataclasses.replace(CostModel.from_hf_config(HF_CFG, DeviceSpec.cpu(), dtype_bytes=4),
                                intra_node_latency_s=5e-5, intra_node_bandwidth=1e8, all_gather_latency_s=2e-3,
                                all_gather_bandwidth=3e8, reduce_scatter_latency_s=1e-2,
                                reduce_scatter_bandwidth=7e7).with_parallel(sp=2)
    truth = dataclasses.replace(start, alpha_attn=start.alpha_attn * 3.0, alpha_tok=start.alpha_tok * 0.4,
                                beta=2e-4, bwd_factor=2.3)
    layout = StageLayout(6, ((0, 2), (2, 4), (4, 6)))

    def per_doc(rng, n):
        return [Chunk(0, ChunkKind.PACKED, tuple(Slice(10 * i + j, 0, 4 * rng.randrange(4, 256))
                                                 for j in range(rng.randrange(1, 4))),
                      ) for i in range(n)]
    samples = []
    for ch in per_doc(rng, 60):
        ch = dataclasses.replace(ch, placement=(PER_DOC,) * len(ch.slices))
        st, r = rng.randrange(3), rng.randrange(0, 3)
        samples.append(ActionSample(st, ch, r, truth.fwd_time(layout, st, ch), truth.bwd_time(layout, st, ch, r)))
    assert truth.comm_time(layout, 1, samples[0].chunk, True) > truth.comm_time(layout, 1, samples[0].chunk, False)
    fitted = refit_cost_model(start, layout, samples, floor_fraction=0)
    assert fitted is not None
    assert fitted.bwd_factor == pytest.approx(2.3, rel=0.01)
    assert fitted.beta == pytest.approx(2e-4, rel=0.01)
    assert fitted.alpha_tok == pytest.approx(truth.alpha_tok, rel=0.01)
    assert (fitted.reduce_scatter_latency_s, fitted.reduce_scatter_bandwidth) == (1e-2, 7e7)  # the fits are kept


def test_action_samples_pair_forward_and_backward_of_each_chunk():
    cost = CostModel.from_hf_config(HF_CFG, DeviceSpec.cpu(), dtype_bytes=4)
    layout = StageLayout(6, ((0, 3), (3, 6)))
    plan = plan_step([300, 40, 40, 900], cost, layout, 0, max_tokens_per_chunk=256)
    acts = []
    for st, actions in enumerate(plan.schedule):
        for i, a in enumerate(actions):
            acts.append((a, float(i), float(i) + 0.5 + a.chunk))
    acts = [x for x in acts if x[0] != Action(1, ActionKind.BACKWARD, 0)]  # one backward missing
    out = action_samples(plan, acts)
    assert len(out) == 2 * plan.num_chunks - 1
    assert all(s.fwd_s == s.bwd_s == 0.5 + plan.chunks.index(s.chunk) for s in out)


# ---------------------------------------------------------------- bounded refits
# the default recipe's tiny Llama on one stage, its start model (analytic, CPU rates) and a
# machine unlike it: slower per token, a per-call constant 40x the analytic one
RECIPE_CFG = dict(vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
RECIPE_START = CostModel.from_hf_config(RECIPE_CFG, DeviceSpec.cpu(), dtype_bytes=4)
RECIPE_TRUTH = dataclasses.replace(RECIPE_START, alpha_attn=0.7 * RECIPE_START.alpha_attn,
                                   alpha_tok=2.5 * RECIPE_START.alpha_tok, beta=2e-3, bwd_factor=1.8,
                                   head_time_per_token=0.5 * RECIPE_START.head_time_per_token)
ONE_STAGE = StageLayout(4, ((0, 4),))


def _recipe_batch(rng):
    return [1024 if rng.random() < 0.6 else rng.randrange(50, 1000) for _ in range(8)]


def _recipe_plan(lens, cost):
    return plan_step(lens, cost, ONE_STAGE, 0, max_tokens_per_chunk=512)


def _measured_steps(seed, num_steps, sleep_s=0.0, truth=RECIPE_TRUTH):
    """Per step, the samples of its plan (start model) measured on ``truth`` with 5% jitter; on
    every other step (a busy machine) some forwards also sleep ``sleep_s``, the longer ones more
    often."""
    rng = random.Random(seed)
    steps = []
    for i in range(num_steps):
        plan = _recipe_plan(_recipe_batch(rng), RECIPE_START)
        out = []
        for c in plan.chunks:
            f = truth.fwd_time(ONE_STAGE, 0, c) * rng.uniform(0.95, 1.05)
            b = truth.bwd_time(ONE_STAGE, 0, c) * rng.uniform(0.95, 1.05)
            if i % 2 and rng.random() < 0.6 * c.num_tokens / 512:
                f += sleep_s
            out.append(ActionSample(0, c, 0, f, b))
        steps.append(out)
    return steps


def test_refit_on_noisy_steps_keeps_the_chunk_counts():
    """Steps slowed by sleeps fit ``beta = 0`` without floors: small chunks look free and the next
    steps run 8-30x the chunks (the runaway of the default recipe on a loaded machine). With the
    floors the refitted model plans every later step within 2x of the start model's chunks."""
    samples = [x for step in _measured_steps(1, 5, sleep_s=0.15) for x in step]
    fitted = refit_cost_model(RECIPE_START, ONE_STAGE, samples)
    assert fitted is not None
    rng = random.Random(101)
    for _ in range(4):
        lens = _recipe_batch(rng)
        quiet, noisy = _recipe_plan(lens, RECIPE_START).num_chunks, _recipe_plan(lens, fitted).num_chunks
        assert quiet / 2 <= noisy <= 2 * quiet, (lens, quiet, noisy)
    assert fitted.beta >= fit_module.FLOOR_FRACTION * RECIPE_START.beta > 0
    # the floors are what holds: without them the same samples give beta = 0 and the runaway
    free = refit_cost_model(RECIPE_START, ONE_STAGE, samples, floor_fraction=0.0)
    assert free.beta == 0.0 and _recipe_plan(lens, free).num_chunks > 2 * _recipe_plan(lens, RECIPE_START).num_chunks


def test_refit_coefficients_stay_above_the_floor_model():
    """Samples no positive coefficient explains leave every coefficient at its floor (a fraction
    of the given floor model's, by default the refitted model's own)."""
    steps = _measured_steps(0, 5)
    neg = [dataclasses.replace(x, fwd_s=-x.fwd_s) for st in steps for x in st]
    f = fit_module.FLOOR_FRACTION
    floor = dataclasses.replace(RECIPE_START, beta=1e-3)
    got = refit_cost_model(RECIPE_START, ONE_STAGE, neg, floors=floor)
    assert (got.alpha_attn, got.alpha_tok, got.beta) == pytest.approx(
        (f * floor.alpha_attn, f * floor.alpha_tok, f * floor.beta))
    assert got.head_time_per_token == pytest.approx(f * floor.head_time_per_token)
    # quiet samples: the floors do not bind and the truth is recovered
    quiet = refit_cost_model(RECIPE_START, ONE_STAGE, [x for st in steps for x in st])
    assert quiet.beta == pytest.approx(RECIPE_TRUTH.beta, rel=0.25)
    assert quiet.alpha_tok + quiet.head_time_per_token / 4 == pytest.approx(
        RECIPE_TRUTH.alpha_tok + RECIPE_TRUTH.head_time_per_token / 4, rel=0.1)  # one stage: only their sum shows


def test_refit_recovers_the_layer_terms_on_packed_and_single_chunks():
    """Chunks of one and of several slices over two stages: the refit recovers the attention,
    per-token and per-call terms."""
    rng = random.Random(0)
    start = CostModel.from_hf_config(HF_CFG, DeviceSpec.cpu(), dtype_bytes=4)
    truth = dataclasses.replace(start, alpha_attn=2 * start.alpha_attn, beta=3e-4)
    layout = StageLayout(6, ((0, 3), (3, 6)))
    samples = []
    for ch in _chunks(rng, 60):
        st = rng.randrange(2)
        samples.append(ActionSample(st, ch, 0, truth.fwd_time(layout, st, ch), truth.bwd_time(layout, st, ch)))
    assert any(len(x.chunk.slices) > 1 for x in samples) and any(len(x.chunk.slices) == 1 for x in samples)
    fitted = refit_cost_model(start, layout, samples)
    for name in ("alpha_attn", "beta", "alpha_tok"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name


def test_bounded_refit_is_kept_only_when_it_predicts_held_out_steps_better():
    bounded_refit, prediction_error = fit_module.bounded_refit, fit_module.prediction_error
    quiet = _measured_steps(0, 6)
    fit, held = [x for st in quiet[:5] for x in st], quiet[5]
    new, why = bounded_refit(RECIPE_START, ONE_STAGE, fit, held)
    assert new is not None and "held-out" in why
    assert prediction_error(new, ONE_STAGE, held) < prediction_error(RECIPE_START, ONE_STAGE, held)
    # a model already right is not replaced by one fitted to a machine twice as slow
    slow = dataclasses.replace(RECIPE_TRUTH, alpha_attn=2 * RECIPE_TRUTH.alpha_attn, alpha_tok=2 * RECIPE_TRUTH.alpha_tok,
                               beta=2 * RECIPE_TRUTH.beta, head_time_per_token=2 * RECIPE_TRUTH.head_time_per_token)
    busy = [x for st in _measured_steps(1, 5, truth=slow) for x in st]
    rejected, why = bounded_refit(RECIPE_TRUTH, ONE_STAGE, busy, held)
    assert rejected is None and "no better" in why
    assert bounded_refit(RECIPE_START, ONE_STAGE, fit, [])[0] is None  # no evidence, no refit
    assert bounded_refit(RECIPE_START, ONE_STAGE, fit[:3], held)[1].startswith("underdetermined")
    assert prediction_error(RECIPE_TRUTH, ONE_STAGE, []) == 0.0


def test_chunk_size_floor_keeps_slices_above_the_per_call_constant():
    """The adaptive search cuts no slice of the longest sequence whose own work is below
    ``beta``: with K offered from 16 to 64, a per-call constant of a sixth of the longest
    sequence's work leaves at most 6 slices (it was 16); a negligible one leaves the search as
    it was (64)."""
    layout = StageLayout.even(8, 4)
    lens = [2048] * 4 + [300] * 20
    assert int((1e-9 * 2048**2 + 1e-6 * 2048) / 1e-3) == 6
    for beta in (1e-6, 1e-3):
        cost = CostModel(num_layers=8, alpha_attn=1e-9, alpha_tok=1e-6, beta=beta)
        plan = plan_step(lens, cost, layout, 0, k_candidates=(16, 32, 64))
        if beta < 1e-4:
            assert len(plan.slices_of(0)) == 64
        else:
            assert len(plan.slices_of(0)) <= 6
    # an explicit slice count is the user's: not floored
    assert len(plan_step(lens, cost, layout, 0, num_slices_longest=16).slices_of(0)) == 16
