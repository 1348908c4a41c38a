"""Whole-doc / per-doc sharding inside a stage (the planner's side): mode choice, costs,
validation, serialization, display. Pure planner, milliseconds."""

from __future__ import annotations

import dataclasses

import pytest

from concertina_hf.planning import CostModel, DeviceSpec, Plan, PlanError, StageLayout, plan_step, simulate
from concertina_hf.planning.placement import check_sp_mode, choose_placement, lpt_ranks, place_plan
from concertina_hf.planning.presets import MODEL_PRESETS
from concertina_hf.planning.sharding import (
    PER_DOC, chunk_mode, earlier_slices, plan_placement_refusal, rank_tokens, shard_rows,
)
from concertina_hf.planning.types import Chunk, ChunkKind, Slice

GIB = 2**30


def _cost(model: str = "llama-13b", sp: int = 8, **kw) -> CostModel:
    return CostModel.from_hf_config(MODEL_PRESETS[model], DeviceSpec.a800()).with_parallel(sp=sp, **kw)


def _packed(lens, index=0) -> Chunk:
    return Chunk(index, ChunkKind.PACKED, tuple(Slice(i, 0, n) for i, n in enumerate(lens)))


def test_all_short_chunk_goes_whole_doc_balanced():
    cost = _cost()
    chunk = _packed([2048] * 16 + [1024] * 8)
    for mode in ("auto", "context"):
        where = choose_placement(chunk, cost, mode)
        placed = dataclasses.replace(chunk, placement=where)
        assert chunk_mode(placed) == "whole-doc"
        toks = [rank_tokens(placed, 8, r) for r in range(8)]
        assert max(toks) == min(toks) == 5120  # LPT: two 2048s and one 1024 per rank
        # no attention traffic: cheaper than Ulysses' all-to-alls, nothing moved
        lay = StageLayout.even(cost.num_layers, 4)
        assert cost.placed_layer_time(placed) < cost.placed_layer_time(chunk)
        assert cost.stage_comm_bytes(lay, 1, placed) == 0 < cost.stage_comm_bytes(lay, 1, chunk)


def test_one_long_sequence_per_doc_in_context_mode_ulysses_in_auto_when_cheaper():
    cost = _cost()  # LLaMA-13B: as many K/V heads as query heads, so per-doc moves 4x Ulysses' bytes at sp=8
    chunk = _packed([32768, 512, 512, 512])
    where = choose_placement(chunk, cost, "context")
    assert where[0] == PER_DOC and chunk_mode(dataclasses.replace(chunk, placement=where)) == "mixed"
    assert choose_placement(chunk, cost, "auto") == ()
    # per-doc balances the long one's causal work: its ranks within 10% of each other
    placed = dataclasses.replace(chunk, placement=where)
    base = cost.rank_model()
    from concertina_hf.planning.sharding import rank_pieces
    work = [base.layer_compute_time([Slice(p.seq, p.start, p.length) for p in rank_pieces(placed, 8, r)])
            for r in range(8)]
    assert max(work) <= 1.1 * min(work)
    # with few K/V heads (GQA: 4 of 8 at sp=4 in small-llama) per-doc's K/V are small: still whole-doc
    # for the short ones beside it
    small = _cost("small-llama", sp=4)
    w = choose_placement(_packed([8192] + [256] * 12), small, "context")
    assert w[0] == PER_DOC and all(0 <= r < 4 for r in w[1:])


def test_whole_doc_unbalanced_beyond_threshold_moves_the_longest_per_doc():
    cost = _cost(sp=4)
    chunk = _packed([16384, 1024, 1024, 1024, 1024])
    where = choose_placement(chunk, cost, "context")
    assert where[0] == PER_DOC  # whole-doc would put all of it on one rank
    assert all(w != PER_DOC for w in where[1:])


def test_lpt():
    assert lpt_ranks([5, 1, 4, 3], 2) == [0, 0, 1, 1]
    assert lpt_ranks([1, 1], 2, load=[3.0, 0.0]) == [1, 1]


def test_costs_monotone():
    cost = _cost()
    assert 0 == cost.gather_kv_time(0) < cost.gather_kv_time(1024) < cost.gather_kv_time(4096)
    lay = StageLayout.even(cost.num_layers, 4)
    one = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, 16384),), (PER_DOC,))
    two = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, 32768),), (PER_DOC,))
    assert cost.fwd_time(lay, 1, one) < cost.fwd_time(lay, 1, two)
    assert cost.bwd_time(lay, 1, one) < cost.bwd_time(lay, 1, one, recompute_layers=3)
    assert cost.act_memory(lay, 1, one, 0) > cost.act_memory(lay, 1, one, 5) > 0
    # per-doc moves more bytes than Ulysses for the same tokens (K/V all-gathered: O(T) a GPU)
    uly = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, 16384),))
    assert cost.stage_comm_bytes(lay, 1, one) > cost.stage_comm_bytes(lay, 1, uly)
    # the gathered K/V take memory: a per-doc chunk holds more per GPU than a Ulysses one
    assert cost.act_memory(lay, 1, one) > cost.act_memory(lay, 1, uly)
    # a stage spanning two nodes pays the inter-node link for the all-gather
    wide = _cost("llama-7b", sp=16)
    narrow = _cost("llama-7b", sp=8)
    assert wide.gather_kv_time(8192) > narrow.gather_kv_time(8192)
    # whole-doc: the busiest rank sets the time (an unbalanced placement is slower)
    even = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, 4096), Slice(1, 0, 4096)), (0, 1))
    cost2 = _cost(sp=2)
    uneven = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, 6144), Slice(1, 0, 2048)), (0, 1))
    assert cost2.placed_layer_time(even) < cost2.placed_layer_time(uneven)


def test_no_head_limit_for_placed_modes():
    with pytest.raises(PlanError, match="does not divide the model's 52 attention heads"):
        _cost("llama-30b", sp=8)
    cost = _cost("llama-30b", sp=8, ulysses=False)
    with pytest.raises(PlanError) as e:
        check_sp_mode("ulysses", cost)
    assert "set sequence_parallel_mode to 'auto' or 'context'" in str(e.value)
    with pytest.raises(PlanError, match="unknown sequence-parallel mode 'fast'; set sequence_parallel_mode to"):
        check_sp_mode("fast", cost)
    lens = [3000, 900, 700, 500, 400, 300, 2000, 1500, 1200, 800, 600, 100]
    plan = plan_step(lens, cost, StageLayout.even(60, 4), 0, "adaptive", solver="greedy", sp_mode="auto")
    plan.validate()
    assert all(c.placement for c in plan.chunks)  # Ulysses cannot run: context only
    assert plan_placement_refusal(plan, 8) is None


def _plan(sp_mode: str, sp: int = 4, lens=(9000, 300, 200, 250, 280, 120, 600, 700, 90, 4000)):
    cost = _cost("small-llama", sp=sp)
    return cost, plan_step(list(lens), cost, StageLayout.even(16, 2), 0, "adaptive", solver="greedy",
                           num_slices_longest=3, sp_mode=sp_mode)


def test_plans_validate_round_trip_and_show_their_modes():
    cost, plan = _plan("context")
    plan.validate()
    assert any(c.placement for c in plan.chunks)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan.to_json()).fingerprint() == plan.fingerprint()
    grid = plan.grid()
    assert "per-doc [d]" in grid or "mixed [d," in grid
    # a split sequence's slices all per-doc (context mode)
    split = [c for c in plan.chunks if c.kind is ChunkKind.SPLIT]
    assert split and all(c.placement == (PER_DOC,) for c in split)
    sim = simulate(plan, cost)
    assert sim.stage_comm_bytes > 0
    _, uly = _plan("ulysses")
    assert not any(c.placement for c in uly.chunks)
    assert "whole-doc" not in uly.grid() and "per-doc" not in uly.grid()


def test_auto_never_predicted_slower_than_ulysses():
    for lens in ((9000, 300, 200, 250, 280, 120, 600, 700, 90, 4000), tuple([512] * 40), (20000,)):
        cost, auto = _plan("auto", lens=lens)
        _, uly = _plan("ulysses", lens=lens)
        assert auto.predicted.step_time_s <= uly.predicted.step_time_s * (1 + 1e-9)


def test_sp1_and_ulysses_unchanged():
    cost = CostModel.from_hf_config(MODEL_PRESETS["small-llama"], DeviceSpec.a800())
    lens = [9000, 300, 200, 4000]
    a = plan_step(lens, cost, StageLayout.even(16, 2), 0, "adaptive", solver="greedy")
    b = plan_step(lens, cost, StageLayout.even(16, 2), 0, "adaptive", solver="greedy", sp_mode="context")
    assert a.fingerprint() == b.fingerprint()
    assert place_plan(a, cost, "auto") is a


def _unplaced_first_slice():
    """A context plan, its split sequence, its chunks with that sequence's first chunk unplaced
    (Ulysses) and that chunk's index."""
    cost, plan = _plan("context")
    split_seq = next(c for c in plan.chunks if c.kind is ChunkKind.SPLIT).slices[0].seq
    chunks = list(plan.chunks)
    first = next(i for i, c in enumerate(chunks) if any(s.seq == split_seq for s in c.slices))
    chunks[first] = dataclasses.replace(chunks[first], placement=())
    return plan, split_seq, chunks, first


def test_validate_refuses_inconsistent_placements():
    plan, split_seq, chunks, first = _unplaced_first_slice()
    with pytest.raises(PlanError, match=f"sequence {split_seq} has slices run by Ulysses and slices placed"):
        dataclasses.replace(plan, chunks=tuple(chunks)).validate()
    chunks[first] = dataclasses.replace(chunks[first], placement=(1,))
    with pytest.raises(PlanError, match=f"sequence {split_seq}: the slice at token .* placed per-doc but the "
                                        "earlier slice's K/V live on rank 1 only"):
        dataclasses.replace(plan, chunks=tuple(chunks)).validate()
    bad = dataclasses.replace(plan.chunks[0], placement=(0,) * (len(plan.chunks[0].slices) + 1))
    with pytest.raises(PlanError, match="placements for"):
        dataclasses.replace(plan, chunks=(bad,) + plan.chunks[1:]).validate()
    assert "not in 0..3" in plan_placement_refusal(
        dataclasses.replace(plan, chunks=(dataclasses.replace(plan.chunks[0], placement=tuple(
            7 for _ in plan.chunks[0].slices)),) + plan.chunks[1:]), 4)


def test_context_mode_leaves_ranks_empty_for_short_chunks():
    """Was a refusal ("cannot fill the 4 GPUs of a stage"): a chunk of fewer or shorter sequences
    than ranks runs whole-doc with some ranks empty; their messages are dropped on both ends."""
    from concertina_hf.planning import lower
    from concertina_hf.planning.lower import rank_program
    from concertina_hf.planning.sharding import placement_refusal

    cost = _cost("small-llama", sp=4)
    for lens, strategy, pp in (([5], "adaptive", 1), ([5], "adaptive", 2), ([5, 6], "packed", 1), ([3, 7], "adaptive", 2)):
        plan = plan_step(lens, cost, StageLayout.even(16, pp), 0, strategy, sp_mode="context")
        assert plan_placement_refusal(plan, 4) is None
        for c in plan.chunks:
            assert chunk_mode(c) == "whole-doc"
            toks = [rank_tokens(c, 4, r) for r in range(4)]
            assert sorted(toks) == [0] * (4 - len(c.slices)) + sorted(s.length for s in c.slices), toks
        assert simulate(plan, cost).step_time_s > 0
        program = lower(plan)
        for r in range(4):
            mine = rank_program(program, 4, r)
            holds = {c.index for c in plan.chunks if rank_tokens(c, 4, r)}
            messages = [a for steps in mine.steps for step in steps for a in step if not a.kind.is_compute]
            assert {a.chunk for a in messages} == (holds if pp > 1 else set())
            assert [a for steps in mine.steps for step in steps for a in step if a.kind.is_compute] == \
                   [a for steps in program.steps for step in steps for a in step if a.kind.is_compute]
            if pp > 1 and not holds:
                assert all(len(st) == 1 and st[0].kind.is_compute for steps in mine.steps for st in steps)
    # the placement of an empty rank is valid; a per-doc slice still needs 2 x sp tokens
    assert placement_refusal(dataclasses.replace(_packed([5]), placement=(2,)), 4) is None
    assert placement_refusal(dataclasses.replace(_packed([5]), placement=(PER_DOC,)), 4) == \
        "chunk 0: per-doc slice of sequence 0 has 5 tokens, fewer than 2 x sp = 8"


def test_one_five_token_sequence_at_sp4_plans_in_context_mode():
    cost = _cost("small-llama", sp=4)
    plan = plan_step([5], cost, StageLayout.even(16, 1), 0, "adaptive", sp_mode="context")
    (chunk,) = plan.chunks
    assert chunk.slices == (Slice(0, 0, 5),) and len(chunk.placement) == 1 and 0 <= chunk.placement[0] < 4
    assert plan.predicted.step_time_s > 0


def test_a_chunk_of_fewer_sequences_than_ranks_is_scored_by_its_busiest_rank():
    """An empty rank costs nothing: a whole-doc chunk's score is its busiest rank's compute, on
    whichever rank; and the choice is the cheapest of whole-doc (ranks left empty), per-doc and
    Ulysses, each of which wins somewhere (per-doc of every sequence is a candidate of the
    ladder for one sequence; for several the ladder stops at the first balanced step)."""
    cost = _cost(sp=4)
    base = cost.rank_model()
    one = _packed([3000])
    t = [cost.placed_layer_time(dataclasses.replace(one, placement=(r,))) for r in range(4)]
    assert t[0] == t[1] == t[2] == t[3] == pytest.approx((1 + cost.bwd_factor) * base.layer_compute_time(one.slices))
    two = _packed([3000, 1000])
    assert cost.placed_layer_time(dataclasses.replace(two, placement=(0, 3))) == pytest.approx(t[0])
    assert cost.placed_layer_time(dataclasses.replace(two, placement=(1, 1))) > t[0]
    chosen = {}
    for lens in ([5], [5, 6, 7], [200], [200, 300], [8192], [65536], [32768, 700]):
        chunk = _packed(lens)
        for mode in ("auto", "context"):
            where = choose_placement(chunk, cost, mode)
            options = [dataclasses.replace(chunk, placement=w) for w in
                       [tuple(range(len(lens))), (PER_DOC,) if lens[0] >= 8 and len(lens) == 1 else None,
                        () if mode == "auto" else None] if w is not None]
            best = min(cost.placed_layer_time(o) for o in options)
            assert cost.placed_layer_time(dataclasses.replace(chunk, placement=where)) <= best * (1 + 1e-9), (lens, mode)
            chosen.setdefault(chunk_mode(dataclasses.replace(chunk, placement=where)), []).append((lens, mode))
    assert {"whole-doc", "per-doc", "ulysses"} <= set(chosen), chosen
    assert ([5], "context") in chosen["whole-doc"] and ([5, 6, 7], "context") in chosen["whole-doc"], chosen
    assert sorted(choose_placement(_packed([5, 6, 7]), cost, "context")) == [0, 1, 2]  # LPT: one a rank, one empty


def test_cli_sp_mode_shows_modes_and_lifts_the_head_rule(capsys):
    from concertina_hf.tools import cli

    base = ["plan", "--distribution", "github", "--max-len", "16384", "--num-seqs", "24", "--strategy", "adaptive",
            "--solver", "greedy", "--memory-gb", "80"]
    assert cli.main(base + ["--model-config", "small-llama", "--pp", "2", "--sp", "4", "--sp-mode", "context"]) == 0
    out = capsys.readouterr().out
    assert "modes u/w/d/m" in out and "(--sp-mode context)" in out
    with pytest.raises(SystemExit) as e:
        cli.main(base + ["--model-config", "llama-30b", "--pp", "4", "--sp", "8", "--sp-mode", "ulysses"])
    assert "does not divide the model's 52 attention heads" in str(e.value)
    assert "set --sp to a divisor of 52 or set --sp-mode to 'auto' or 'context'" in str(e.value)
    assert cli.main(base + ["--model-config", "llama-30b", "--pp", "4", "--sp", "8"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("adaptive"))
    assert " 0/" in row  # no Ulysses chunk: sp=8 does not divide 52 heads


def test_context_plans_fit_a_binding_budget_with_recompute():
    """The recompute planner prices placed chunks: under a budget that binds, the plan's simulated
    peaks stay within it (gathered K/V included) and some layers recompute."""
    cost = _cost("small-llama", sp=4)
    lens = [30000, 6000, 500, 400, 300, 200, 800, 700, 2500, 3000]
    layout = StageLayout.even(16, 2)
    free = plan_step(lens, cost, layout, 0, "adaptive", solver="greedy", sp_mode="context")
    budget = int(0.7 * max(free.predicted.peak_memory_bytes))
    plan = plan_step(lens, cost, layout, budget, "adaptive", solver="greedy", sp_mode="context")
    plan.validate()
    sim = simulate(plan, cost)
    assert max(sim.peak_memory_bytes) <= budget
    assert any(c.placement for c in plan.chunks)
    assert sum(map(sum, plan.recompute)) > 0


def test_plan_placement_refusal_names_an_inconsistent_split_sequence():
    plan, split_seq, chunks, first = _unplaced_first_slice()
    why = plan_placement_refusal(dataclasses.replace(plan, chunks=tuple(chunks)), 4)
    assert why.startswith(f"sequence {split_seq} has slices run by Ulysses and slices placed whole-doc / per-doc")


def test_a_split_sequence_with_a_short_last_slice_runs_per_doc_then_whole_doc():
    """The last slice of a split sequence too short to cut into 2 sp pieces (3 tokens at sp=4)
    goes whole-doc where its chunk's LPT puts it, after per-doc slices whose K/V it reads through
    the stage's gather (was: the whole sequence whole-doc on rank 0); in the simulator (the plan
    through ``for_plan``) its chunk gathers the 64 tokens before it every layer. A short first
    slice puts every slice on rank 0; in auto mode where Ulysses can run, a short slice leaves the
    sequence to Ulysses."""
    from concertina_hf.planning import build_schedule

    cost = _cost("small-llama", sp=4)
    lay = StageLayout.even(16, 1)

    def plan_of(spec, lens):
        chunks = []
        for i, sl in enumerate(spec):
            slices = tuple(Slice(*s) for s in sl)
            chunks.append(Chunk(i, ChunkKind.of(slices, lens), slices))
        groups = (tuple(range(len(chunks))),)
        return Plan("t", tuple(lens), lay, tuple(chunks), groups, build_schedule(chunks, groups, 1),
                    (tuple([0] * len(chunks)),)).validate()

    lens = (67, 40, 30, 20)
    plan = place_plan(plan_of([[(0, 0, 32)], [(0, 32, 32)], [(0, 64, 3), (1, 0, 40), (2, 0, 30), (3, 0, 20)]],
                              lens), cost, "context").validate()
    first, second, tail = plan.chunks
    assert first.placement == second.placement == (PER_DOC,)
    assert 0 <= tail.placement[0] < 4 and PER_DOC not in tail.placement
    assert cost.for_plan(plan).whole_doc_carried == ((0, 64, 64),)
    # what the runtime gathers for it: the two per-doc slices, each rank its two pieces of each
    assert earlier_slices(plan, tail) == {0: ((Slice(0, 0, 32), True), (Slice(0, 32, 32), True))}
    assert earlier_slices(plan, first) == {}
    assert [shard_rows(32, 4, r) for r in range(4)] == [8] * 4 and sum(shard_rows(35, 4, r) for r in range(4)) == 35
    placed = cost.for_plan(plan)
    assert placed.stage_comm_bytes(lay, 0, tail) == 2 * placed.stage_comm_bytes(lay, 0, first) > 0
    short_first = place_plan(plan_of([[(0, 0, 3)], [(0, 3, 32), (1, 0, 40)]], (35, 40)), cost, "context")
    assert [c.placement[0] for c in short_first.chunks] == [0, 0]
    assert place_plan(plan_of([[(0, 0, 32)], [(0, 32, 3), (1, 0, 40)]], (35, 40)), cost, "auto").chunks[1].placement == ()
