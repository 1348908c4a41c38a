"""Per-rank memory of placed (whole-doc / per-doc) chunks: :meth:`CostModel.at_rank` (each rank's
allocated activation peak within 10% of it is measured in ``tests/launch/test_context_launch.py``)."""

from __future__ import annotations

from concertina_hf.planning import Chunk, ChunkKind, CostModel, Plan, Slice, StageLayout, build_schedule, simulate
from concertina_hf.planning.sharding import PER_DOC

SP = 4


def _cost() -> CostModel:
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
           "vocab_size": 256, "num_hidden_layers": 2}
    return CostModel.from_hf_config(cfg, dtype_bytes=4).with_parallel(sp=SP, state_shards=1)


def _plan(lens, spec, recompute) -> Plan:
    """One stage of 2 layers; ``spec``: per chunk, ``(seq, start, length, where)`` slices."""
    lay = StageLayout.even(2, 1)
    chunks = []
    for i, sl in enumerate(spec):
        slices = tuple(Slice(*s[:3]) for s in sl)
        chunks.append(Chunk(i, ChunkKind.of(slices, lens), slices, placement=tuple(s[3] for s in sl)))
    groups = (tuple(range(len(chunks))),)
    return Plan("t", tuple(lens), lay, tuple(chunks), groups, build_schedule(chunks, groups, 1, prefetch=True),
                (tuple(recompute),)).validate()


def _peaks(plan, cost):
    return [simulate(plan, cost.at_rank(r)).peak_memory_bytes[0] for r in range(SP)]


def test_whole_doc_peak_per_rank_follows_its_tokens_and_the_busiest_is_the_planners():
    plan = _plan([40, 8, 8, 8], [[(0, 0, 40, 0), (1, 0, 8, 1), (2, 0, 8, 2), (3, 0, 8, 3)]], [0])
    cost = _cost()
    peaks = _peaks(plan, cost)
    assert peaks[0] > peaks[1] == peaks[2] == peaks[3]
    assert max(peaks) == simulate(plan, cost).peak_memory_bytes[0]  # one chunk: the planner's is rank 0's
    assert cost.at_rank(None) is cost and cost.at_rank(2).at_rank(None) == cost
    assert "sp_rank" not in cost.to_dict() and CostModel.from_dict(cost.at_rank(1).to_dict()) == cost.at_rank(1)


def test_a_whole_doc_split_sequence_holds_kv_gradients_only_on_its_rank():
    """Its K/V (and their gradient buffers, whole: sp times a Ulysses GPU's share) exist on rank 1
    only; the planner counts them on the busiest rank."""
    plan = _plan([40, 6, 6, 6], [[(0, 0, 20, 1)], [(0, 20, 20, 1), (1, 0, 6, 0), (2, 0, 6, 2), (3, 0, 6, 3)]],
                 [0, 0])
    cost = _cost()
    first = plan.chunks[0]
    assert cost.kv_grad_scale(first, 0) == cost.at_rank(1).kv_grad_scale(first, 0) == SP
    assert cost.at_rank(0).kv_grad_scale(first, 0) == 0
    peaks = _peaks(plan, cost)
    assert peaks[1] == max(peaks) == simulate(plan, cost).peak_memory_bytes[0]
    assert peaks[0] < peaks[1]


def test_a_per_doc_saved_layer_keeps_the_whole_gathered_slice():
    """Every rank holds the gathered K/V of the per-doc slice on each saved layer, its own rows
    included (one tensor of every rank's rows); recomputed, nothing gathered stays (not split)."""
    cost = _cost()
    base = cost.rank_model()
    lay = StageLayout.even(2, 1)
    plan = _plan([64], [[(0, 0, 64, PER_DOC)]], [0])
    chunk = plan.chunks[0]
    own = Chunk(0, chunk.kind, (Slice(0, 0, 16),))  # each rank's 16 tokens, as one GPU's
    ids = 2 * cost.ids_bytes_per_token * (64 - 16)  # the whole chunk's ids and targets on every GPU
    for r in range(SP):
        got = cost.at_rank(r).act_memory(lay, 0, chunk, 0)
        assert got == base.act_memory(lay, 0, own, 0) + 2 * base.kv_bytes_per_token * 64 + ids
        assert cost.at_rank(r).act_memory(lay, 0, chunk, 2) == base.act_memory(lay, 0, own, 2) + ids


def test_a_per_doc_split_sequence_keeps_its_shard_and_gathers_it_again():
    """A non-final per-doc slice keeps only each rank's two pieces of its K/V and their gradient
    buffers (a quarter of the slice at sp=4, whole heads): recomputed, the chunk holds nothing
    beyond the rank's own tokens; the later slice's per-layer gather moves the earlier slice's
    K/V again, so its bytes count both slices."""
    cost = _cost()
    base = cost.rank_model()
    lay = StageLayout.even(2, 1)
    plan = _plan([64], [[(0, 0, 32, PER_DOC)], [(0, 32, 32, PER_DOC)]], [2, 0])
    first, second = plan.chunks
    whole = base.kv_bytes_per_token / cost.kv_bytes_per_token
    assert [cost.at_rank(r).kv_grad_scale(first, 0) for r in range(SP)] == [whole / SP] * SP
    own = Chunk(0, first.kind, (Slice(0, 0, 8),))
    ids = 2 * cost.ids_bytes_per_token * (32 - 8)
    for r in range(SP):
        assert cost.at_rank(r).act_memory(lay, 0, first, 2) == base.act_memory(lay, 0, own, 2) + ids
    assert cost.stage_comm_bytes(lay, 0, second) == 2 * cost.stage_comm_bytes(lay, 0, first) > 0
