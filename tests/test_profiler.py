"""The profiler fits the cost model from the real layers, and plans made with it hold memory.

Single process, tiny HF models built from configs. The memory checks are exact where they can
be: on CPU activation bytes are counted tensor by tensor, so the fitted per-token terms must
reproduce the bytes of chunks the profiler never saw, and a whole step run by
:class:`PipelineExecutor` must stay within the plan's simulated peak.

Two measurements of a step are compared with the prediction (``simulate(...).peak_memory_bytes``
minus static memory):

- ``StepResult.peak_activation_bytes`` (the executor's :class:`SavedTensorMeter`): saved
  tensors and what the executor holds. It cannot see transients (the layer being recomputed in
  backward, gradients in flight) nor a chunk's mask when every layer is recomputed.
- :class:`LiveTensorMeter`: every live tensor (the CPU stand-in for the CUDA allocator), so
  transients included. The honest "measured vs predicted" figure.

Both must stay under the prediction; replays of the plan with exactly what each one sees
(:func:`_replay_peak`) must match them within 2-3%, which checks every fitted term.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from concertina_hf.planning import (
    ActionKind,
    Chunk,
    ChunkKind,
    CostModel,
    Plan,
    Slice,
    StageLayout,
    build_schedule,
    simulate,
)
from concertina_hf.planning.simulate import split_sequences
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
from concertina_hf.runtime.profiler import LiveTensorMeter, default_shapes, measure_chunk, profile_cost_model

torch.set_num_threads(1)

VOCAB = 256
NUM_LAYERS = 4
SEQ_LENS = (300, 90, 60, 40, 30, 20)
# the long sequence in 3 slices (the tail in a hybrid chunk), the short ones packed
CHUNKS = [[(0, 0, 120)], [(0, 120, 100)], [(0, 220, 80), (1, 0, 90)], [(2, 0, 60), (3, 0, 40), (4, 0, 30), (5, 0, 20)]]
RECOMPUTE = {"none": (0, 0, 0, 0), "partial": (2, 1, 3, 0), "full": (4, 4, 4, 4), "mixed": (4, 0, 4, 2)}


def _config(kind: str = "llama"):
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_LAYERS,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                           tie_word_embeddings=False)
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=False, use_sliding_window=False)


def _model(kind: str = "llama", seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(kind), attn_implementation="sdpa")


def _plan(recompute: tuple[int, ...], layout: StageLayout) -> Plan:
    chunks = []
    for i, spec in enumerate(CHUNKS):
        slices = tuple(Slice(*s) for s in spec)
        split = [s for s in slices if s.length != SEQ_LENS[s.seq]]
        kind = ChunkKind.PACKED if not split else (
            ChunkKind.HYBRID if split[0].end == SEQ_LENS[split[0].seq] else ChunkKind.SPLIT)
        chunks.append(Chunk(i, kind, slices))
    groups = (tuple(range(len(chunks))),)
    return Plan("test", SEQ_LENS, layout, tuple(chunks), groups,
                build_schedule(chunks, groups, 1, prefetch=True), (tuple(recompute),)).validate()


def _replay_peak(plan: Plan, cost: CostModel, view: str) -> float:
    """Peak activation memory of a one-stage plan, replayed from the cost model's terms with
    what a measurement sees instead of the simulator's conservative choices.

    ``view="meter"``: what the executor's SavedTensorMeter counts: no transients, no mask for a
    chunk whose layers are all recomputed (only checkpoint closures keep it), K/V gradients
    from the end of the backward that makes them. ``view="runtime"``: every live tensor, as the
    runtime really behaves where the simulator is conservative on purpose:

    1. a hybrid's tail slice keeps no K/V on recomputed layers (it is final; the cost model
       counts K/V for every slice of a split sequence);
    2. with ``0 < r < n`` recomputed layers the backward recomputes them after the saved later
       layers have freed theirs: no transient beyond the no-recompute one (the cost model adds
       a layer's activations whenever ``r > 0``);
    3. K/V gradients of earlier slices grow while the last slice's activations are freed (the
       simulator adds them on top of all of them at the start of its backward).

    Both views share every fitted term with the prediction: matching the measurements checks
    the fit, and the difference to the prediction is the cost of the three choices above.
    """
    lay = plan.layout
    n = lay.num_stage_layers(0)
    split = split_sequences(plan)

    def act(c: int) -> float:
        ch, r = plan.chunks[c], plan.recompute[0][c]
        a = cost.act_memory(lay, 0, ch, r, split)
        if ch.kind is ChunkKind.HYBRID:  # 1.
            a -= r * cost.kv_bytes_per_token * ch.slices[0].length
        masked = len(ch.slices) > 1 or ch.slices[0].context > 0
        if view == "meter" and r == n and masked:
            a -= cost.mask_bytes_per_pair * ch.num_tokens * sum(s.end for s in ch.slices)
        return a

    def transient(c: int) -> float:
        if view == "meter":
            return 0.0
        r = plan.recompute[0][c]
        return cost.transient_memory(lay, 0, plan.chunks[c], r if r == n else 0)  # 2.

    in_flight: dict[int, float] = {}
    kv_grads: dict[tuple[int, int], float] = {}
    peak = 0.0
    for a in plan.schedule[0]:
        ch = plan.chunks[a.chunk]
        if a.kind is ActionKind.FORWARD:
            in_flight[a.chunk] = act(a.chunk)
            peak = max(peak, sum(in_flight.values()) + sum(kv_grads.values()))
            continue
        peak = max(peak, sum(in_flight.values()) + sum(kv_grads.values()) + transient(a.chunk))
        del in_flight[a.chunk]
        for s in ch.slices:
            kv_grads.pop((s.seq, s.start), None)
            for _, e in plan.slices_of(s.seq):
                if e.start < s.start:
                    kv_grads[(e.seq, e.start)] = cost.kv_grad_memory(lay, 0, e.length)
        peak = max(peak, sum(in_flight.values()) + sum(kv_grads.values()))  # 3.
    return peak


@pytest.fixture(scope="module")
def profiled():
    model = _model()
    cost = profile_cost_model(model, repeats=1, warmup=0)
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
    # the model itself is untouched: its attention and its gradients
    assert model.config._attn_implementation == "sdpa"
    assert all(p.grad is None for p in model.parameters())
    # times (one noisy repeat of millisecond kernels: only their shape is checked): longer
    # chunks cost more, backward more than half the forward; the CPU SDPA path attends densely
    # over T x S when a chunk needs a mask, and that is fitted
    short, long = (Slice(0, 0, 64),), (Slice(0, 0, 512),)
    assert 0 < cost.layer_fwd_time(short) < cost.layer_fwd_time(long)
    assert cost.bwd_factor > 0.5 and cost.head_time_per_token > 0
    assert cost.alpha_mask > 0
    # bytes of float32 tensors, exactly: the recomputed layer keeps its input, a non-final slice
    # its K and V; the mask is one float per (query, key); the head keeps at least the logits
    assert cost.ckpt_bytes_per_token == pytest.approx(4 * h)
    assert cost.kv_bytes_per_token == pytest.approx(4 * 2 * kv_dim)
    assert cost.mask_bytes_per_pair == pytest.approx(4.0, rel=1e-3)
    assert 4 * VOCAB <= cost.logits_bytes_per_token <= 4 * VOCAB + 16 * h
    assert cost.hidden_bytes_per_token == cost.output_bytes_per_token == 4 * h
    n_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert cost.layer_params == n_layer and cost.embed_params == VOCAB * h
    assert cost.head_params == VOCAB * h + h
    # round trip
    assert CostModel.from_dict(cost.to_dict()) == cost


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fitted_bytes_predict_unseen_chunks(kind, profiled):
    """Chunks of shapes the profile never ran, on all 4 layers (the profile ran 2): the cost
    model's activation bytes match the meter within 2%, with and without recompute."""
    model, cost = profiled if kind == "llama" else (None, None)
    if kind != "llama":
        model = _model(kind)
        cost = profile_cost_model(model, repeats=1, warmup=0, shapes=default_shapes(192))
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
        split = {0} if ckind is not ChunkKind.PACKED else set()
        predicted = cost.act_memory(lay, 0, chunk, rec, split) - cost.logits_bytes_per_token * chunk.num_tokens
        assert measured == pytest.approx(predicted, rel=0.02), (kind, shape, ckind, rec)


def test_wrapper_profile_matches_model_profile(profiled):
    model, cost = profiled
    import copy

    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(NUM_LAYERS, 1), 0)
    wcost = profile_cost_model(w, repeats=1, warmup=0, num_layers=2)
    for name in ("act_bytes_per_token", "ckpt_bytes_per_token", "kv_bytes_per_token", "mask_bytes_per_pair",
                 "logits_bytes_per_token", "layer_params", "head_params", "embed_params"):
        assert getattr(wcost, name) == pytest.approx(getattr(cost, name), rel=1e-3), name
    assert all(p.grad is None for p in w.parameters())


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
def _step_peaks(ex: PipelineExecutor, plan: Plan, ids) -> tuple[int, int]:
    """(executor meter peak, live-tensor peak) of one step; gradients exist beforehand so that
    their accumulation is not counted as activation memory."""
    w = ex.wrapper
    for p in w.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    exclude = [*w.parameters(), *w.buffers(), *(p.grad for p in w.parameters())]
    with LiveTensorMeter(exclude) as live:
        res = ex.run_step(plan, ids)
    return res.peak_activation_bytes, live.peak_bytes


def test_stage_peak_stays_within_the_plans_prediction(profiled):
    """The issue's requirement, on one stage with recompute none / partial / full / mixed, and
    plans of the adaptive planner under binding budgets when it is there: measured activation
    memory <= predicted peak, and the relative error (target under 10%).

    Measured on this model (live tensors): none 3%, partial 15%, full 11%, mixed 8%, adaptive
    1-31% (it recomputes 2-3 of 4 layers of every chunk at tight budgets). The over-prediction
    is the simulator's deliberate conservatism (see :func:`_replay_peak`): with it replayed the
    way the runtime behaves, every plan lands within 3% of the live peak, so the fitted terms
    are right and the rest is the three modelling choices listed there."""
    model, cost = profiled
    lay = StageLayout.even(NUM_LAYERS, 1)
    static = cost.static_memory(lay, 0)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in SEQ_LENS]
    import copy

    ex = PipelineExecutor(PipelineWrapper(copy.deepcopy(model), lay, 0))
    plans = [(name, _plan(rec, lay)) for name, rec in RECOMPUTE.items()]
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
        meter, live = _step_peaks(ex, plan, ids)
        rows.append((name, predicted, meter, live, _replay_peak(plan, cost, "runtime")))
        # within the prediction, by both measures (and so within the plan's budget)
        assert meter <= predicted and live <= predicted, (name, predicted, meter, live)
        if plan.memory_budget_bytes:
            assert live + static <= plan.memory_budget_bytes[0]
        # every fitted term is right: replays of what each measurement sees match it
        assert meter == pytest.approx(_replay_peak(plan, cost, "meter"), rel=0.02), name
        assert live == pytest.approx(rows[-1][4], rel=0.03), name
    print("\nplan         predicted       live      meter  error(live)  runtime replay")
    for name, pred, meter, live, replay in rows:
        print(f"{name:11s} {pred:10.0f} {live:10d} {meter:10d} {(pred - live) / pred:11.2%} {replay:15.0f}")
    err = {name: (pred - live) / pred for name, pred, _, live, _ in rows}
    assert err["none"] < 0.10
