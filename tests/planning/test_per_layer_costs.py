"""The cost model of per-layer configs (``per_layer_config``: Gemma 4's head size per layer).

- A config whose layers differ gets :attr:`~concertina_hf.planning.cost.CostModel.layer_scales`:
  each layer's attention shape against layer 0's (``per-layer-7b``: the full layers' head size 512
  and one K/V head, twice the sliding layers' attention FLOPs per pair, the same K/V bytes); a
  config without it (or with every layer alike) none, and its file is unchanged.
- A stage's time, K/V and parameters are its own layers'; the partition follows the per-layer
  costs: on ``per-layer-7b`` at 32K tokens a boundary moves against the uniform-layer partition,
  and its slowest stage (priced per layer) is faster than the uniform partition's.
- ``concertina plan --model-config per-layer-7b`` plans with it.
"""

from __future__ import annotations

import dataclasses

from concertina_hf.planning import Chunk, ChunkKind, CostModel, DeviceSpec, Slice, StageLayout
from concertina_hf.planning.partition import partition_layers, stage_times
from concertina_hf.planning.presets import MODEL_PRESETS
from concertina_hf.tools import cli

PER_LAYER = MODEL_PRESETS["per-layer-7b"]
FULL = [i for i, t in enumerate(PER_LAYER["layer_types"]) if t == "full_attention"]


def test_layers_of_other_shapes_are_scaled():
    cost = CostModel.from_hf_config(PER_LAYER, DeviceSpec.preset("h100"))
    assert FULL == [5, 11, 17, 23, 29] and len(cost.layer_scales) == 30
    for i, row in enumerate(cost.layer_scales):
        if i in FULL:  # 8 query heads of 512 (2x the FLOPs per pair), 1 K/V head of 512 (the same K/V bytes)
            assert row[0] == 2.0 and row[3] == 1.0 and row[1] > 1.0 and row[4] > 1.0
        else:
            assert row == (1.0,) * 5
    assert CostModel.from_dict(cost.to_dict()) == cost
    plain = {k: v for k, v in PER_LAYER.items() if k != "per_layer_config"}
    uniform = CostModel.from_hf_config(plain, DeviceSpec.preset("h100"))
    assert uniform.layer_scales == () and "layer_scales" not in uniform.to_dict()
    same = dict(PER_LAYER, per_layer_config={i: dict(head_dim=256) for i in FULL})  # every layer alike
    assert CostModel.from_hf_config(same, DeviceSpec.preset("h100")) == uniform
    assert dataclasses.replace(cost, layer_scales=()) == uniform  # layer 0 is the model's attention layer


def test_a_stage_is_priced_by_its_own_layers():
    cost = CostModel.from_hf_config(PER_LAYER, DeviceSpec.preset("h100"))
    uniform = dataclasses.replace(cost, layer_scales=())
    chunk = Chunk(0, ChunkKind.SPLIT, (Slice(0, 16384, 8192),))
    lay = StageLayout(30, ((0, 5), (5, 6), (6, 30)))  # stage 0: five sliding layers, stage 1: one full layer
    assert cost.fwd_time(lay, 0, chunk) == uniform.fwd_time(lay, 0, chunk)
    one = uniform.layer_fwd_time(chunk.slices)
    full = cost.fwd_time(lay, 1, chunk)
    tok = chunk.num_tokens
    attention = one - cost.alpha_tok * tok - cost.beta  # alpha_attn x the slice's pairs
    want = one + attention + (cost.layer_scales[5][1] - 1) * cost.alpha_tok * tok  # twice the pairs' FLOPs
    assert abs(full - want) < 1e-9 * full
    assert cost.kv_grad_memory(lay, 1, 4096) == uniform.kv_grad_memory(lay, 1, 4096)  # one K/V head of 512
    more = round((cost.layer_scales[5][4] - 1) * cost.layer_params) * cost.static_bytes_per_param
    assert abs(cost.static_memory(lay, 1) - uniform.static_memory(lay, 1) - more) < 1e-6 * more


def test_the_partition_follows_the_per_layer_costs():
    cost = CostModel.from_hf_config(PER_LAYER, DeviceSpec.preset("h100"))
    uniform = dataclasses.replace(cost, layer_scales=(), windowed_layers=())  # every layer layer 0's, unwindowed
    for p, want, even_want in ((2, ((0, 16), (16, 30)), ((0, 15), (15, 30))),
                               (4, ((0, 8), (8, 17), (17, 24), (24, 30)), ((0, 7), (7, 15), (15, 23), (23, 30)))):
        per_layer = partition_layers(cost, p, tokens_hint=32768)
        even = partition_layers(uniform, p, tokens_hint=32768)
        assert per_layer.layer_ranges == want and even.layer_ranges == even_want
        assert max(stage_times(cost, per_layer, 32768)) < max(stage_times(cost, even, 32768))


def test_sliding_layers_count_their_window():
    """A sliding layer's keys: its window of 1024 (twice-counted pairs: quadratic within the window,
    2 x 1024 per query beyond); the full layers all earlier keys."""
    from concertina_hf.planning.cost import attn_pairs, windowed_pairs

    cost = CostModel.from_hf_config(PER_LAYER, DeviceSpec.preset("h100"))
    assert cost.attention_window == 1024 and cost.windowed_layers == tuple(i for i in range(30) if i not in FULL)
    assert windowed_pairs(0, 512, 1024) == attn_pairs([Slice(0, 0, 512)])
    assert windowed_pairs(16384, 8192, 1024) == 2 * 1024 * 8192
    chunk = Chunk(0, ChunkKind.SPLIT, (Slice(0, 16384, 8192),))
    lay = StageLayout(30, ((0, 5), (5, 6), (6, 30)))  # stage 0: five sliding layers
    plain = dataclasses.replace(cost, windowed_layers=())
    saving = cost.alpha_attn * (attn_pairs(chunk.slices) - 2 * 1024 * 8192)
    assert abs(plain.fwd_time(lay, 0, chunk) - cost.fwd_time(lay, 0, chunk) - 5 * saving) < 1e-9
    assert cost.fwd_time(lay, 1, chunk) == plain.fwd_time(lay, 1, chunk)  # a full layer
    assert "windowed_layers" not in CostModel.from_hf_config(MODEL_PRESETS["llama-7b"]).to_dict()


def test_concertina_plan_takes_the_preset(tmp_path, capsys):
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(map(str, [32768, 8192, 4096, 2048, 1024, 1024, 512])) + "\n")
    rc = cli.main(["plan", "--lengths", str(lens), "--model-config", "per-layer-7b", "--pp", "2", "--device", "h100",
                   "--strategy", "packed", "--time-limit", "0.5"])
    assert rc == 0
    assert "packed" in capsys.readouterr().out


def test_layers_sharing_kv_stay_on_one_stage():
    """Gemma 4's KV sharing (the last 10 layers read the K/V of layers 18 and 19): no stage boundary
    between layer 18 and the end; too many stages for the boundaries left is refused, naming the
    pipeline size that fits."""
    import pytest

    from concertina_hf.planning import PlanError

    shared = dict(PER_LAYER, num_kv_shared_layers=10, layer_types=["sliding_attention", "full_attention"] * 15)
    cost = CostModel.from_hf_config(shared, DeviceSpec.preset("h100"))
    assert cost.kv_share_spans == ((18, 29),) and CostModel.from_dict(cost.to_dict()) == cost
    assert "kv_share_spans" not in CostModel.from_hf_config(PER_LAYER).to_dict()
    free = dataclasses.replace(cost, kv_share_spans=())
    assert partition_layers(free, 4).layer_ranges[-1][0] > 18  # the unconstrained one cuts the span
    for p in (2, 4, 8):
        ranges = partition_layers(cost, p).layer_ranges
        assert ranges[-1] == (18, 30) or ranges[-1][0] < 18, ranges
        assert not any(18 < a <= 29 for a, _ in ranges), ranges
    with pytest.raises(PlanError, match=r"cannot place 30 decoder layers on 20 pipeline stages keeping layers "
                                        r"\(\(18, 29\),\) on one stage each"):
        partition_layers(cost, 20)
