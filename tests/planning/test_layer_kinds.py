"""The cost model per decoder-layer kind (attention, linear attention: ``planning/mixers.py``).

- An attention-only config gets no layer kinds: its cost model, its file and its plans are
  those of before (``to_dict`` without the new fields).
- A linear layer's time has no context term and a per-slice (segment) overhead; its memory keeps
  no K/V but a state and convolution tail per non-final slice (and their gradient while the
  later slices run backward); a stage's time, memory and parameters count its layers by kind.
- The partition balances per-layer costs: on a model whose attention layers are all at the
  start, the slowest stage is the least of every contiguous layout's, below the even split's.
- Under Ulysses (sp = 2) a linear layer's share of compute, activations and state is one GPU's,
  and it moves its own tensors (two all-to-alls per direction), not attention's q, k, v, output.
- At 64K, ``hybrid-7b`` (3 Gated DeltaNet layers to 1 attention layer, LLaMA-7B's sizes) splits
  less, recomputes less and is predicted faster than the same model with attention layers only.
"""

from __future__ import annotations

import itertools

from concertina_hf.planning import Chunk, ChunkKind, CostModel, DeviceSpec, Slice, StageLayout
from concertina_hf.planning.partition import partition_layers, stage_times
from concertina_hf.planning.presets import MODEL_PRESETS
from concertina_hf.planning.strategies import ideal_step_time, plan_step

HYBRID = MODEL_PRESETS["hybrid-7b"]
ATTENTION = dict(HYBRID, layer_types=["full_attention"] * HYBRID["num_hidden_layers"])
LENGTHS = [65536] * 2 + [16384] * 4 + [4096] * 16 + [1024] * 64


def _chunk(kind, *slices):
    return Chunk(0, kind, tuple(Slice(*s) for s in slices))


def test_attention_models_are_priced_as_before():
    for cfg in (MODEL_PRESETS["llama-7b"], ATTENTION, dict(HYBRID, layer_types=["sliding_attention"] * 32)):
        cost = CostModel.from_hf_config(cfg)
        assert cost.layer_kinds == () and "layer_kinds" not in cost.to_dict()
        assert CostModel.from_dict(cost.to_dict()) == cost
    hybrid = CostModel.from_hf_config(HYBRID)
    assert hybrid.layer_kinds == ("linear", "linear", "linear", "attention") * 8
    assert CostModel.from_dict(hybrid.to_dict()) == hybrid


def test_a_linear_layer_is_linear_in_tokens_with_a_cost_per_segment():
    cost = CostModel.from_hf_config(HYBRID, DeviceSpec.preset("h100"))
    early, late = [Slice(0, 0, 4096)], [Slice(0, 60000, 4096)]
    assert cost.linear_layer_time(late) == cost.linear_layer_time(early)
    assert cost.layer_fwd_time(late) > 2 * cost.layer_fwd_time(early)  # attention's context term
    packed = [Slice(i, 0, 512) for i in range(8)]
    extra = cost.linear_layer_time(packed) - cost.linear_layer_time(early)
    assert abs(extra - 7 * cost.lin_beta_segment) < 1e-12 and cost.lin_beta_segment > 0
    # a stage's time counts its layers by kind: layers 0-3 are three linear and one attention
    lay = StageLayout(32, ((0, 4), (4, 32)))
    chunk = _chunk(ChunkKind.SPLIT, (0, 60000, 4096))
    assert cost.layer_kind_counts(lay, 0) == (1, 3) and cost.layer_kind_counts(lay, 0, 2) == (0, 2)
    middle = StageLayout(32, ((0, 4), (4, 8), (8, 32)))  # stage 1: layers 4-7, no embedding or head
    want = 3 * cost.linear_layer_time(chunk.slices) + cost.layer_fwd_time(chunk.slices)
    assert abs(cost.fwd_time(middle, 1, chunk) - want) < 1e-12 * want


def test_linear_layers_keep_a_state_per_split_slice_not_kv():
    cost = CostModel.from_hf_config(HYBRID)
    lay = StageLayout(32, ((0, 4), (4, 32)))  # stage 0: three linear layers and one attention layer
    split = _chunk(ChunkKind.SPLIT, (0, 0, 8192))
    packed = _chunk(ChunkKind.PACKED, (0, 0, 8192))
    # recomputing every layer: inputs, the attention layer's K/V, the linear layers' states
    full = cost.act_memory(lay, 0, split, 4) - cost.act_memory(lay, 0, packed, 4)
    assert abs(full - (cost.kv_bytes_per_token * 8192 + 3 * cost.lin_state_bytes)) < 1e-6 * full
    hv, dk, dv, k, conv = 32, 128, 128, 4, 2 * 16 * 128 + 32 * 128
    assert cost.lin_state_bytes == 4 * hv * dk * dv + 2 * (k - 1) * conv  # fp32 state, bf16 tail
    # linear in the recomputed layers (the recompute planner's model), exact at 0 and n
    m = [cost.act_memory(lay, 0, packed, r) for r in range(5)]
    steps = [m[r] - m[r + 1] for r in range(4)]
    assert max(steps) - min(steps) < 1e-6 * m[0]
    saved = 3 * cost.lin_act_bytes_per_token + cost.act_bytes_per_token
    assert abs((m[0] - m[4]) - (saved - 4 * cost.ckpt_bytes_per_token) * 8192) < 1e-6 * m[0]
    # the carried state's gradient while the later slices run backward
    assert cost.kv_grad_memory(lay, 0, 8192) == cost.kv_bytes_per_token * 8192 + 3 * cost.lin_state_bytes
    attn = CostModel.from_hf_config(ATTENTION)  # parameters per layer by kind
    more = 3 * (cost.lin_layer_params - cost.layer_params) * cost.static_bytes_per_param
    assert cost.static_memory(lay, 0) - attn.static_memory(lay, 0) == more


def test_under_ulysses_a_linear_layer_moves_its_own_tensors():
    """sp = 2: a Gated DeltaNet layer's time is half its compute plus two all-to-alls per direction
    of its convolution input, beta, a and scan output (not attention's four of q, k, v, output);
    its activations and carried state are halved; one stage's all-to-all bytes count each kind's."""
    cost = CostModel.from_hf_config(HYBRID, DeviceSpec.preset("h100"))
    sp2 = cost.with_parallel(sp=2)
    hk, hv, dk, dv, a = 16, 32, 128, 128, 2
    assert cost.lin_a2a_bytes_per_token == a * (2 * hk * dk + hv * dv + 2 * hv + hv * dv)
    assert cost.lin_a2a_bytes_per_token != cost.a2a_bytes_per_token and cost.lin_a2a_time(4096) == 0.0
    tok = 8192
    lat, bw = sp2.intra_node_latency_s, sp2.intra_node_bandwidth
    want = 2 * lat + cost.lin_a2a_bytes_per_token * tok / 2 * (1 / 2) / bw
    assert abs(sp2.lin_a2a_time(tok) - want) <= 1e-12 * want
    whole = [Slice(0, 0, tok)]
    assert abs(sp2.linear_layer_fwd_time(whole) - (sp2.linear_layer_time(whole) + want)) <= 1e-12 * want
    assert abs(sp2.lin_alpha_tok - cost.lin_alpha_tok / 2) <= 1e-18
    assert sp2.lin_state_bytes == cost.lin_state_bytes / 2 and sp2.lin_act_bytes_per_token == cost.lin_act_bytes_per_token / 2
    lay = StageLayout(32, ((0, 4), (4, 8), (8, 32)))  # stage 1: three linear layers, one attention layer
    chunk = _chunk(ChunkKind.PACKED, (0, 0, tok))
    fwd = 3 * sp2.linear_layer_fwd_time(chunk.slices) + sp2.layer_fwd_time(chunk.slices)
    assert abs(sp2.fwd_time(lay, 1, chunk) - fwd) <= 1e-12 * fwd
    bwd = 3 * (sp2.bwd_factor * sp2.linear_layer_time(chunk.slices) + want) + sp2.layer_bwd_time(chunk.slices)
    assert abs(sp2.bwd_time(lay, 1, chunk) - bwd) <= 1e-12 * bwd
    assert abs(sp2.comm_time(lay, 1, chunk, False) - (3 * want + sp2.a2a_time(tok))) <= 1e-12 * want
    moved = 2 * (3 * cost.lin_a2a_bytes_per_token + sp2._a2a_bytes(2)) * tok / 2
    assert abs(sp2.stage_comm_bytes(lay, 1, chunk) - moved) <= 1e-9 * moved
    assert CostModel.from_dict(sp2.to_dict()) == sp2


def test_the_partition_balances_per_layer_costs():
    cfg = dict(HYBRID, num_hidden_layers=8, layer_types=["full_attention"] * 4 + ["linear_attention"] * 4)
    cost = CostModel.from_hf_config(cfg, DeviceSpec.preset("h100"))
    hint = 131072  # an attention layer costs three linear ones at this length
    for p in (2, 4):
        got = max(stage_times(cost, partition_layers(cost, p, tokens_hint=hint), hint))
        best = min(max(stage_times(cost, StageLayout(8, tuple(zip((0,) + cuts, cuts + (8,)))), hint))
                   for cuts in itertools.combinations(range(1, 8), p - 1))
        assert abs(got - best) <= 1e-9 * best
        even = max(stage_times(cost, StageLayout.even(8, p), hint))
        assert got < even  # the even split puts the attention layers together
    assert partition_layers(cost, 2, tokens_hint=hint).layer_ranges[0][1] < 4


def test_at_64k_the_hybrid_model_splits_and_recomputes_less():
    dev = DeviceSpec.preset("h100")
    rows = {}
    for name, cfg in (("hybrid", HYBRID), ("attention", ATTENTION)):
        cost = CostModel.from_hf_config(cfg, dev)
        plan = plan_step(LENGTHS, cost, partition_layers(cost, 4), 80 * 2**30, "adaptive", solver="greedy")
        pred = plan.predicted
        rows[name] = (sum(c.kind is ChunkKind.SPLIT for c in plan.chunks), pred.recompute_fraction * pred.step_time_s,
                      pred.step_time_s)
    print(rows)
    (h_split, h_rec, h_step), (a_split, a_rec, a_step) = rows["hybrid"], rows["attention"]
    assert h_split < a_split and h_rec < a_rec and h_step < a_step, rows
    # the lower bound prices the linear layers at their own rate too (and stays below the plan)
    hybrid, attention = CostModel.from_hf_config(HYBRID, dev), CostModel.from_hf_config(ATTENTION, dev)
    lay = StageLayout.even(32, 4)
    assert ideal_step_time(LENGTHS, hybrid, lay) < min(h_step, ideal_step_time(LENGTHS, attention, lay))
