"""Whole-doc / per-doc placements (:mod:`concertina_hf.runtime.context_parallel`) in one process.

A one-rank gloo group stands for the stage's sp group: each per-doc slice is then cut into two
zig-zag pieces on the one rank, its K/V go through the gather (one rank's rows) and are rebuilt in
position order, and the second piece attends to the first through them; equal to the
single-process HF model (loss 1e-5, gradients 1e-4) with K/V carried over per-doc slices, a
whole-doc tail after them, recompute, and gpt-oss's sinks under a sliding window; the
evaluation hook's logits come back in token order; a rank holding no token of a chunk runs one
pad token with zero gradients. The multi-rank launches are in
``tests/launch/test_context_launch.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from _helpers import free_port  # noqa: E402
from _runtime_cases import batch, compare_grads, make_plan, reference, tiny_model  # noqa: E402

SEQ_LENS = (46, 9, 7)


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _placed(recompute: str, tail_rank: int = 0):
    from concertina_hf.planning import StageLayout
    from concertina_hf.planning.sharding import PER_DOC

    layout = StageLayout.even(4, 1)
    spec = [[(0, 0, 20)], [(0, 20, 14)], [(0, 34, 12), (1, 0, 9), (2, 0, 7)]]
    placement = [(PER_DOC,), (PER_DOC,), (tail_rank, PER_DOC, 0)]
    plan = make_plan(SEQ_LENS, spec, layout, recompute)
    chunks = tuple(dataclasses.replace(c, placement=p) for c, p in zip(plan.chunks, placement))
    return dataclasses.replace(plan, chunks=chunks).validate()


def _executor(model, group):
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
    from concertina_hf.runtime.ulysses import SequenceParallel

    w = PipelineWrapper(copy.deepcopy(model), _placed("none").layout, 0)
    ex = PipelineExecutor(w)
    ex.sp = SequenceParallel(group)  # a one-rank sp group (the executor makes none below two ranks)
    return w, ex


def test_piece_order():
    from concertina_hf.runtime.context_parallel import piece_order

    assert piece_order(2) == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert piece_order(3) == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_placed_chunks_on_one_rank_match_hf(kind, one_rank_group):
    if kind == "llama":
        model = tiny_model("llama", num_layers=4)
    else:
        from _dist_ulysses import _gpt_oss  # sinks, sliding window 16, MoE

        model = _gpt_oss(seed=4)
    ids, labels = batch(SEQ_LENS)
    ref_loss, ref_grads = reference(model, ids, labels)
    w, ex = _executor(model, one_rank_group)
    for rec in ("none", "partial", "full"):
        w.zero_grad(set_to_none=True)
        res = ex.run_step(_placed(rec), ids, labels)
        assert abs(res.loss - ref_loss) / ref_loss < 1e-5, (rec, res.loss, ref_loss)
        assert compare_grads(w, ref_grads, 1e-4) == [], rec
    got = {}
    res = ex.run_step(_placed("none"), ids, labels, train=False,
                      on_logits=lambda slices, lg: got.update({(s.seq, s.start): lg[0, s.offset:s.offset + s.length]
                                                               for s in slices}))
    assert abs(res.loss - ref_loss) / ref_loss < 1e-5
    with torch.no_grad():
        want = [model(input_ids=t[None]).logits[0] for t in ids]
    assert sorted(got) == [(0, 0), (0, 20), (0, 34), (1, 0), (2, 0)]
    for (seq, start), lg in got.items():
        torch.testing.assert_close(lg, want[seq][start:start + lg.shape[0]], atol=1e-4, rtol=1e-4)


def test_placement_outside_the_group_is_refused(one_rank_group):
    from concertina_hf.planning import PlanError

    model = tiny_model("llama", num_layers=4)
    ids, labels = batch(SEQ_LENS)
    _, ex = _executor(model, one_rank_group)
    with pytest.raises(PlanError, match=r"placements cannot run on this stage's 1 sequence-parallel ranks: .*"
                                        r"placed on rank 1, not in 0..0"):
        ex.run_step(_placed("none", tail_rank=1), ids, labels)


def test_segment_training_with_placements_is_refused(one_rank_group):
    """Segment-level training (plan knob segment_tokens) carries no K/V tail or detached older K/V
    across the stage's ranks: refused, naming the placements."""
    from concertina_hf.planning import PlanError, StageLayout
    from concertina_hf.planning.sharding import PER_DOC

    spec = [[(0, 0, 20)], [(0, 20, 20)], [(0, 40, 6), (1, 0, 9), (2, 0, 7)]]
    plan = make_plan(SEQ_LENS, spec, StageLayout.even(4, 1))
    chunks = tuple(dataclasses.replace(c, placement=p)
                   for c, p in zip(plan.chunks, [(PER_DOC,), (PER_DOC,), (0, 0, PER_DOC)]))
    plan = dataclasses.replace(plan, chunks=chunks, knobs=(("segment_tokens", 20),)).validate()
    ids, labels = batch(SEQ_LENS)
    _, ex = _executor(tiny_model("llama", num_layers=4), one_rank_group)
    with pytest.raises(PlanError, match="segment-level training .* sequence parallelism 1 only: neither Ulysses nor "
                                        "the whole-doc / per-doc placements carry"):
        ex.run_step(plan, ids, labels)


def test_an_empty_rank_runs_a_pad_token_with_zero_gradients():
    """Rank 1 of two holds nothing of a chunk placed whole-doc on rank 0: its context is one pad
    token at position 0, whose attention output is zeros, yet a function of query, key, value and
    the sinks (each gets a zero gradient, as FSDP's reduce-scatter needs on every rank)."""
    from types import SimpleNamespace

    from concertina_hf.runtime.attention import KVStore, SliceSpec
    from concertina_hf.runtime.context_parallel import EMPTY_RANK_TOKENS, ContextParallelContext

    plan = make_plan((5,), [[(0, 0, 5)]], _placed("none").layout)
    chunk = dataclasses.replace(plan.chunks[0], placement=(0,))
    slices = [SliceSpec(0, 0, 5, 0, True)]
    ctxs = [ContextParallelContext(chunk, slices, KVStore(), torch.device("cpu"), True,
                                   SimpleNamespace(size=2, rank=r, group=None), {}) for r in (0, 1)]
    assert (ctxs[0].pad, ctxs[0].local_tokens, ctxs[0].position_ids.tolist()) == (0, 5, [[0, 1, 2, 3, 4]])
    empty = ctxs[1]
    assert (empty.pad, empty.local_tokens, empty.pieces, empty.position_ids.tolist()) == (EMPTY_RANK_TOKENS, 1, (), [[0]])
    q, k, v = (torch.randn(1, h, 1, 8, requires_grad=True) for h in (4, 2, 2))
    sink = torch.randn(4, requires_grad=True)
    out, _ = empty.sequence_parallel_attention(None, SimpleNamespace(layer_idx=0), q, k, v, sink=sink)
    assert out.shape == (1, 1, 4, 8) and not out.any()
    out.sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in (q, k, v, sink))
