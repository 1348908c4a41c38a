"""The profiler fits the cost model from the real layers, and plans made with it hold memory.

Tiny HF models built from configs, one process (the 2-rank gloo test is in
``tests/launch/test_profiler_launch.py``). The
memory checks are exact where they can be: on CPU activation bytes are counted tensor by
tensor, so the fitted per-token terms must reproduce the bytes of chunks the profiler never
saw, and a whole step run by :class:`PipelineExecutor` must stay within the plan's simulated
peak.

Two measurements of a step are compared with the prediction (``simulate(...).peak_memory_bytes``
minus static memory), and both must stay under it:

- ``StepResult.peak_activation_bytes`` (the executor's :class:`SavedTensorMeter`): saved
  tensors and what the executor holds. It cannot see transients (the layer being recomputed in
  backward, gradients in flight) nor what checkpoint closures keep (a recomputed chunk's
  rotary tables, attention context and masks);
- :class:`LiveTensorMeter`: every live tensor (the CPU stand-in for the CUDA allocator), so
  all of those included. The honest "measured vs predicted" figure, and the error reported.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from concertina_hf.planning import (
    Chunk,
    ChunkKind,
    CostModel,
    Slice,
    StageLayout,
    simulate,
)
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
from concertina_hf.runtime.profiler import default_shapes, measure_chunk, profile_cost_model

from _memory_cases import NUM_LAYERS, RECOMPUTE, SCALAR_BYTES, SEQ_LENS, VOCAB, profiler_model, profiler_plan, step_peaks

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def profiled():
    model = profiler_model()
    # as many layers as the stage of the one-stage tests: per-chunk tensors (rotary tables, the
    # context's index tensors) are spread over the profiled layers
    cost = profile_cost_model(model, repeats=1, warmup=0, num_layers=NUM_LAYERS)
    return model, cost


# ---------------------------------------------------------------------------------- shapes
def test_default_shapes_cover_every_chunk_kind():
    shapes = default_shapes(256)
    assert len(set(shapes)) == len(shapes) >= 12
    assert all(sum(s for _, s in shp) <= 256 for shp in shapes)
    assert any(len(shp) == 1 and shp[0][0] == 0 for shp in shapes)  # whole sequence
    assert any(len(shp) >= 4 and all(c == 0 for c, _ in shp) for shp in shapes)  # packed
    assert any(len(shp) == 1 and shp[0][0] > 0 for shp in shapes)  # slice with context
    assert any(len(shp) > 1 and shp[0][0] > 0 for shp in shapes)  # hybrid
    with pytest.raises(ValueError, match="max_tokens"):
        default_shapes(8)


# ---------------------------------------------------------------------------------- fit
def test_profile_fits_exact_bytes_and_leaves_the_model_alone(profiled):
    model, cost = profiled
    h, kv_dim = 64, 2 * 16
    assert cost.source == "profiled" and cost.num_layers == NUM_LAYERS
    # the largest profiled chunk: the planner builds none larger (test_chunk_cap)
    assert cost.max_chunk_tokens == max(sum(s for _, s in shp) for shp in default_shapes(512)) == 512
    # the head timed on a ladder of chunk sizes up to it, kept as points (their total never falls)
    pts = cost.head_time_points
    assert pts[-1][0] == 512 and len(pts) >= 6 and all(b[1] >= a[1] > 0 for a, b in zip(pts, pts[1:]))
    assert cost.embed_time_per_call >= 0 and cost.embed_time_per_token + cost.embed_time_per_call > 0
    # the model itself is untouched: its attention and its gradients
    assert model.config._attn_implementation == "sdpa"
    assert all(p.grad is None for p in model.parameters())
    # times (one noisy repeat of millisecond kernels: only their shape is checked): longer
    # chunks cost more, backward more than half the forward
    short, long = (Slice(0, 0, 64),), (Slice(0, 0, 512),)
    assert 0 < cost.layer_fwd_time(short) < cost.layer_fwd_time(long)
    assert cost.bwd_factor > 0.5 and cost.head_time_per_token > 0
    # bytes of float32 tensors, exactly: a recomputed layer keeps its input; the stage's layers
    # share the chunk's rotary tables (cos, sin), once per stage whatever its layer count; the
    # checkpoint closures keep, once per chunk with any recompute, the context's int64
    # positions; a non-final slice keeps its K and V; no mask is kept (masks are per slice, built
    # in forward and again in backward); the head keeps at least the float32 log-probabilities
    assert cost.ckpt_bytes_per_token == pytest.approx(4 * h)
    assert cost.stage_bytes_per_token == pytest.approx(2 * 4 * 16)
    assert cost.ckpt_chunk_bytes_per_token == pytest.approx(8)
    assert cost.kv_bytes_per_token == pytest.approx(4 * 2 * kv_dim)
    assert 4 * VOCAB <= cost.logits_bytes_per_token <= 4 * VOCAB + 16 * h
    assert cost.hidden_bytes_per_token == cost.output_bytes_per_token == 4 * h
    n_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert cost.layer_params == n_layer and cost.embed_params == VOCAB * h
    assert cost.head_params == VOCAB * h + h
    # round trip
    assert CostModel.from_dict(cost.to_dict()) == cost


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fitted_bytes_predict_unseen_chunks(kind, profiled):
    """Chunks of shapes the profile never ran: the cost model's activation bytes match the
    measured ones within -1%..+3%, with and without recompute."""
    model, cost = profiled if kind == "llama" else (None, None)
    if kind != "llama":
        model = profiler_model(kind)
        cost = profile_cost_model(model, repeats=1, warmup=0, shapes=default_shapes(192), num_layers=NUM_LAYERS)
    lay = StageLayout(NUM_LAYERS, ((0, NUM_LAYERS),))
    cases = [  # (slices as (seq, start, length), kind, recompute layers)
        ([(0, 0, 200)], ChunkKind.PACKED, 0),
        ([(0, 0, 70), (1, 0, 50), (2, 0, 30)], ChunkKind.PACKED, 0),
        ([(0, 0, 90)], ChunkKind.SPLIT, 0),
        ([(0, 90, 120)], ChunkKind.SPLIT, 0),
        ([(0, 300, 60), (1, 0, 40), (2, 0, 40)], ChunkKind.HYBRID, 0),
        ([(0, 0, 150)], ChunkKind.SPLIT, NUM_LAYERS),
        ([(0, 0, 70), (1, 0, 50)], ChunkKind.PACKED, 1),
    ]
    for spec, ckind, rec in cases:
        chunk = Chunk(0, ckind, tuple(Slice(*s) for s in spec))
        shape = tuple((s.context, s.length) for s in chunk.slices)
        sample = measure_chunk(model, shape, split=ckind is ChunkKind.SPLIT, recompute_layers=rec,
                               repeats=0, num_layers=NUM_LAYERS)
        measured = sample.act_bytes * NUM_LAYERS
        predicted = cost.act_memory(lay, 0, chunk, rec) - cost.logits_bytes_per_token * chunk.num_tokens
        # no mask with or without recompute; index tensors over the keys of a slice with context, under
        # recompute, are not modelled (< 1%)
        assert 0.99 * measured <= predicted <= 1.03 * measured, (kind, shape, ckind, rec, measured, predicted)


def test_profile_under_bf16_autocast(profiled):
    """A mixed-precision run (float32 weights, ``bf16=True``: the executor's forwards under bf16
    autocast) is profiled under the caller's autocast: bf16 matmul outputs, K/V and mask, so
    fewer activation bytes per token than in float32; the weight copies autocast keeps for the
    step go to static memory, not to the first chunk measured. The fitted bytes predict a chunk
    the profile never ran, measured under the same autocast, exactly."""
    model, cost32 = profiled
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cost = profile_cost_model(model, repeats=1, warmup=0, num_layers=NUM_LAYERS)
    # without the caller's autocast, the argument asks for it
    explicit = profile_cost_model(model, repeats=1, warmup=0, num_layers=NUM_LAYERS, autocast_dtype=torch.bfloat16)
    assert explicit.act_bytes_per_token == cost.act_bytes_per_token
    assert cost.act_bytes_per_token < 0.8 * cost32.act_bytes_per_token
    assert cost.kv_bytes_per_token == pytest.approx(cost32.kv_bytes_per_token / 2)
    assert cost.static_bytes_per_param > cost32.static_bytes_per_param
    assert all(p.grad is None for p in model.parameters())
    lay = StageLayout(NUM_LAYERS, ((0, NUM_LAYERS),))
    for spec, ckind, rec in (([(0, 0, 200)], ChunkKind.PACKED, 0),
                             ([(0, 300, 60), (1, 0, 40), (2, 0, 40)], ChunkKind.HYBRID, 0),
                             ([(0, 0, 150)], ChunkKind.SPLIT, NUM_LAYERS),
                             ([(0, 0, 70), (1, 0, 50)], ChunkKind.PACKED, 1)):
        chunk = Chunk(0, ckind, tuple(Slice(*x) for x in spec))
        shape = tuple((x.context, x.length) for x in chunk.slices)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sample = measure_chunk(model, shape, split=ckind is ChunkKind.SPLIT, recompute_layers=rec,
                                   repeats=0, num_layers=NUM_LAYERS)
        measured = sample.act_bytes * NUM_LAYERS
        predicted = cost.act_memory(lay, 0, chunk, rec) - cost.logits_bytes_per_token * chunk.num_tokens
        assert predicted == pytest.approx(measured, rel=0.01), (shape, rec, measured, predicted)
        plain = measure_chunk(model, shape, split=ckind is ChunkKind.SPLIT, recompute_layers=rec, repeats=0,
                              num_layers=NUM_LAYERS)
        assert sample.act_bytes < plain.act_bytes


def test_wrapper_profile_matches_model_profile(profiled):
    """A PipelineWrapper's own stage (all its layers by default) profiles like the model it
    wraps; profiling fewer layers than the stage gives the same per-layer bytes (the per-chunk
    tensors the layers share are the stage's, ``stage_bytes_per_token``)."""
    model, cost = profiled
    import copy

    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(NUM_LAYERS, 1), 0)
    wcost = profile_cost_model(w, repeats=1, warmup=0)
    names = ("act_bytes_per_token", "ckpt_bytes_per_token", "ckpt_chunk_bytes_per_token", "kv_bytes_per_token",
             "logits_bytes_per_token", "bwd_transient_bytes_per_token", "head_bwd_transient_bytes_per_token",
             "bwd_transient_bytes", "head_bwd_transient_bytes", "embed_bwd_transient_bytes", "embed_bwd_bytes_per_token",
             "stage_bytes_per_token", "layer_params", "head_params", "embed_params")
    for name in names:
        assert getattr(wcost, name) == pytest.approx(getattr(cost, name), rel=1e-3), name
    assert all(p.grad is None for p in w.parameters())
    two = profile_cost_model(model, repeats=1, warmup=0, num_layers=2)
    assert two.act_bytes_per_token == pytest.approx(cost.act_bytes_per_token, rel=0.01)
    # the rotary tables are the stage's, once (index tensors: once per chunk), whatever the
    # layers profiled
    assert two.ckpt_bytes_per_token == pytest.approx(cost.ckpt_bytes_per_token)
    assert two.stage_bytes_per_token == cost.stage_bytes_per_token == 2 * 4 * 16
    assert two.ckpt_chunk_bytes_per_token == cost.ckpt_chunk_bytes_per_token


def test_measure_chunk_errors(profiled):
    model, _ = profiled
    with pytest.raises(ValueError, match="context >= 0"):
        measure_chunk(model, ((0, 0),), repeats=0)
    with pytest.raises(ValueError, match="exactly one slice"):
        measure_chunk(model, ((0, 8), (0, 8)), split=True, repeats=0)
    with pytest.raises(ValueError, match="recompute_layers"):
        measure_chunk(model, ((0, 8),), recompute_layers=3, num_layers=2, repeats=0)
    with pytest.raises(ValueError, match="num_layers"):
        measure_chunk(model, ((0, 8),), num_layers=NUM_LAYERS + 1, repeats=0)
    with pytest.raises(ValueError, match="distinct chunk shapes"):
        profile_cost_model(model, shapes=[((0, 8),)] * 3)
    s = measure_chunk(model, ((16, 8), (0, 8)), repeats=1, warmup=0)
    assert s.fwd_time_s > 0 and s.bwd_time_s > 0 and s.act_bytes > 0


# ---------------------------------------------------------------------------------- a whole step
def test_stage_peak_stays_within_the_plans_prediction(profiled):
    """The issue's requirement, on one stage with recompute none / partial / full / mixed, and
    plans of the adaptive planner under binding budgets when it is there: measured activation
    memory <= predicted peak, relative error under 10%.

    Measured here (live tensors), error of the prediction: none 3%, partial 4%, full 6%, mixed
    4%, adaptive 4-5%. (Before the simulator added a recomputed layer's activations to the
    backward's peak only when every layer of the stage recomputes, as the runtime behaves: it
    recomputes the first ``r`` layers last, after the saved ones freed theirs, partial was 12%
    and adaptive 21%.)"""
    model, cost = profiled
    lay = StageLayout.even(NUM_LAYERS, 1)
    static = cost.static_memory(lay, 0)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in SEQ_LENS]
    import copy

    ex = PipelineExecutor(PipelineWrapper(copy.deepcopy(model), lay, 0))
    plans = [(name, profiler_plan(rec, lay)) for name, rec in RECOMPUTE.items()]
    try:
        from concertina_hf.planning import plan_step
    except ImportError:  # the planner's strategies have not landed
        plan_step = None
    if plan_step is not None:
        free = simulate(plans[0][1], cost).peak_memory_bytes[0]
        full = simulate(plans[2][1], cost).peak_memory_bytes[0]
        for frac in (0.2, 0.6):
            budget = int(full + frac * (free - full))
            plans.append((f"adaptive{frac}", plan_step(SEQ_LENS, cost, lay, budget, solver="greedy")))
    rows = []
    for name, plan in plans:
        predicted = simulate(plan, cost).peak_memory_bytes[0] - static
        meter, live = step_peaks(ex, plan, ids)
        rows.append((name, predicted, meter, live))
        # within the prediction, by both measures (and so within the plan's budget), but for a
        # few bytes of the executor's loss scalars during the head's backward (not modelled)
        assert meter <= predicted + SCALAR_BYTES and live <= predicted + SCALAR_BYTES, (name, predicted, meter, live)
        if plan.memory_budget_bytes:
            assert live + static <= plan.memory_budget_bytes[0] + SCALAR_BYTES
    print("\nplan         predicted       live      meter  error(live)")
    for name, pred, meter, live in rows:
        print(f"{name:11s} {pred:10.0f} {live:10d} {meter:10d} {(pred - live) / pred:11.2%}")
    for name, pred, _, live in rows:
        assert (pred - live) / pred < 0.10, (name, pred, live)
    assert len(rows) == len(RECOMPUTE) + (2 if plan_step is not None else 0)
