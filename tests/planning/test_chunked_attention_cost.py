"""The cost model of chunked-attention layers (Llama 4; ``planning/cost.py``): their attention term
counts the (query, key) pairs within the chunk, which a brute-force count of the mask confirms, so
a long sequence costs them linear time where a full layer's grows quadratically."""

from __future__ import annotations

import dataclasses

import pytest

from concertina_hf.planning import Chunk, ChunkKind, CostModel, StageLayout
from concertina_hf.planning.cost import attn_pairs
from concertina_hf.planning.types import Slice

#: Llama 4 Scout's text layers, rotary / chunked and NoPE / full alternating every 4th (as HF derives them)
CONFIG = dict(model_type="llama4_text", hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
              head_dim=128, intermediate_size=8192, vocab_size=202048, num_hidden_layers=8,
              attention_chunk_size=8192,
              layer_types=["chunked_attention"] * 3 + ["full_attention"] + ["chunked_attention"] * 3 + ["full_attention"])


def _mask_pairs(context: int, length: int, chunk: int) -> int:
    """Twice the visible (query, key) pairs minus the queries (``attn_pairs``' convention), counted."""
    seen = sum(1 for p in range(context, context + length) for k in range(p + 1) if k // chunk == p // chunk)
    return 2 * seen - length


@pytest.mark.parametrize("context, length", [(0, 5), (0, 16), (3, 5), (6, 4), (8, 8), (12, 21), (30, 1)])
def test_pairs_are_those_of_the_mask(context, length):
    assert attn_pairs([Slice(0, context, length)], chunk=8) == _mask_pairs(context, length, 8)
    assert attn_pairs([Slice(0, context, length)]) == _mask_pairs(context, length, 10**9)


def test_chunked_layers_cost_linear_time_in_a_long_sequence():
    cost = CostModel.from_hf_config(CONFIG)
    assert cost.chunked_layers == (0, 1, 2, 4, 5, 6) and cost.attention_chunk == 8192
    full = dataclasses.replace(cost, chunked_layers=(), attention_chunk=0)
    layout = StageLayout.even(8, 2)

    def times(model, n):
        chunk = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, n),))
        return model.fwd_time(layout, 0, chunk), model.bwd_time(layout, 0, chunk, 2)

    # within one chunk, chunked and full attention are the same
    assert times(cost, 8192) == pytest.approx(times(full, 8192))
    # a long sequence: a chunked layer's pairs double with its length, a full layer's quadruple
    one = [Slice(0, 0, 65536)]
    assert attn_pairs([Slice(0, 0, 131072)], chunk=8192) == 2 * attn_pairs(one, chunk=8192)
    assert attn_pairs([Slice(0, 0, 131072)]) == 4 * attn_pairs(one)
    (f1, b1), (g1, h1) = times(cost, 65536), times(full, 65536)
    assert f1 < g1 and b1 < h1
    attn = cost.alpha_attn
    # exactly: 3 chunked layers and 1 full on stage 0, the pairs counted per kind
    n = 65536
    tok = 4 * (cost.alpha_tok * n + cost.beta)
    expected = tok + attn * (3 * attn_pairs([Slice(0, 0, n)], chunk=8192) + attn_pairs([Slice(0, 0, n)]))
    assert f1 - cost.embed_time_per_token * n - cost.embed_time_per_call == pytest.approx(expected, rel=1e-9)
    # a later slice of a split sequence starting mid-chunk reads the earlier keys of its chunk only
    late = Chunk(1, ChunkKind.SPLIT, (Slice(0, 100000, 4096),))
    assert cost.chunked_saving(late.slices) > 0


def test_the_fields_round_trip_and_stay_out_of_other_models_files():
    cost = CostModel.from_hf_config(CONFIG)
    assert CostModel.from_dict(cost.to_dict()) == cost
    plain = CostModel.from_hf_config(dict(CONFIG, model_type="llama", layer_types=None))
    assert "chunked_layers" not in plain.to_dict() and plain.chunked_saving([Slice(0, 0, 10**5)]) == 0.0
