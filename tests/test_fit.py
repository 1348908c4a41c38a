"""planning/fit.py: the cost model's fits recover known coefficients (no torch, no device).

- :func:`nonneg_lstsq`: exact on consistent data, a negative coefficient dropped, ``None`` when
  none stays positive;
- :func:`fit_profile` (what ``CostModel.fit`` runs): layer time coefficients, ``alpha_mask`` on
  dense-mask backends, all 0 on samples no positive coefficient explains;
- :func:`fit_activation_bytes`: the profiler's byte terms from chunks' bytes;
- :func:`refit_cost_model` / :func:`action_samples`: the online refit from a step's actions.
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


@pytest.mark.parametrize("dense_mask", [False, True])
def test_fit_profile_recovers_layer_coefficients(dense_mask):
    true = CostModel(num_layers=2, alpha_attn=3e-9, alpha_tok=2e-6, beta=1e-4, bwd_factor=2.5,
                     alpha_mask=5e-9 if dense_mask else 0.0)
    samples = []
    for sh in SHAPES:
        f = true.layer_fwd_time([Slice(i, c, s) for i, (c, s) in enumerate(sh)])
        samples.append(ProfileSample(sh, f, 2.5 * f, act_bytes=100.0 * sum(s for _, s in sh)))
    start = CostModel.from_hf_config(HF_CFG)
    fitted = fit_profile(start, samples, dense_mask=dense_mask)
    for name in ("alpha_attn", "alpha_tok", "beta", "alpha_mask"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-15), name
    assert fitted.bwd_factor == pytest.approx(2.5) and fitted.act_bytes_per_token == pytest.approx(100.0)
    assert fitted.source == "fitted" and fitted.num_layers == start.num_layers
    assert start.fit(samples, dense_mask=dense_mask) == fitted  # the method delegates
    with pytest.raises(ValueError, match="at least 3 samples"):
        fit_profile(start, samples[:2])


def test_fit_profile_with_no_positive_coefficient_gives_zeros():
    """Samples no non-negative combination explains (negative times) fit all 0; with no positive
    forward total the start's backward factor is kept, and with no measured bytes its bytes."""
    start = CostModel.from_hf_config(HF_CFG)
    samples = [ProfileSample(sh, -1e-3 * sum(s for _, s in sh), 1e-3) for sh in SHAPES]
    for dense_mask in (False, True):
        fitted = fit_profile(start, samples, dense_mask=dense_mask)
        assert (fitted.alpha_attn, fitted.alpha_tok, fitted.beta) == (0.0, 0.0, 0.0)
        assert fitted.alpha_mask == 0.0
        assert fitted.bwd_factor == start.bwd_factor and fitted.act_bytes_per_token == start.act_bytes_per_token


def test_fit_activation_bytes_recovers_the_byte_terms():
    layers, act, ctx, mask = 3, 1000.0, 40.0, 2.0
    chunks = [(sh, False) for sh in SHAPES] + [(((512, 512),), True), (((0, 512),), True)]
    nbytes = []
    for sh, split in chunks:
        tok = sum(s for _, s in sh)
        keys = sum(c + s for c, s in sh)
        context = sum(c + (s if split else 0) for c, s in sh if c > 0)
        masked = not (len(sh) == 1 and sh[0][0] == 0)
        nbytes.append(layers * (act * tok + ctx * context) + (mask * tok * keys if masked else 0.0))
    assert fit_activation_bytes(chunks, nbytes, layers) == pytest.approx((act, ctx, mask))
    assert fit_activation_bytes(chunks, [-b for b in nbytes], layers) == (0.0, 0.0, 0.0)


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
