"""Ulysses sequence parallelism inside a pipeline stage (``runtime/ulysses.py``).

One process: the layout functions, the all-to-all simulated by moving blocks between the ranks'
tensors (shard / unshard round trip, padding, head blocks, GQA replication, refusals). The real
gloo launches are in ``tests/launch/test_ulysses_launch.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from concertina_hf.runtime.ulysses import (
    check_heads, heads_to_tokens_recv, heads_to_tokens_send, local_shard, shard_length, tokens_to_heads_recv,
    tokens_to_heads_send,
)


def _simulated_all_to_all(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ``all_to_all_single`` gives each rank: block ``r`` of rank ``j``'s input is block ``j``
    of rank ``r``'s output."""
    sp = len(inputs)
    return [torch.stack([inputs[j][r] for j in range(sp)]) for r in range(sp)]


@pytest.mark.parametrize("num_tokens,sp", [(8, 2), (7, 2), (29, 4), (3, 4), (1, 2)])
def test_shard_layout_round_trip(num_tokens, sp):
    heads, dim = 2 * sp, 3
    full = torch.randn(1, heads, num_tokens, dim)  # [1, H, T, D]: what one process would have
    t = shard_length(num_tokens, sp)
    assert t * sp >= num_tokens > (t - 1) * sp
    # token shards: contiguous, padded with the pad value on the last ranks
    ids = torch.arange(num_tokens)
    shards = [local_shard(ids, sp, r, pad_value=-1) for r in range(sp)]
    assert all(s.shape == (t,) for s in shards)
    cat = torch.cat(shards)
    assert torch.equal(cat[:num_tokens], ids) and bool((cat[num_tokens:] == -1).all())
    # each rank's local tokens of all heads ...
    local = [local_shard(full[0].transpose(0, 1), sp, r).transpose(0, 1)[None] for r in range(sp)]  # [1, H, t, D]
    # ... become all tokens of its H/sp heads
    gathered = [heads_to_tokens_recv(y) for y in _simulated_all_to_all([heads_to_tokens_send(x, sp) for x in local])]
    for r, g in enumerate(gathered):
        assert g.shape == (1, heads // sp, t * sp, dim)
        block = full[:, r * heads // sp:(r + 1) * heads // sp]
        assert torch.equal(g[:, :, :num_tokens], block)
        assert bool((g[:, :, num_tokens:] == 0).all())  # padding
    # and back: the attention output layout [1, T_pad, H/sp, D] -> local tokens of all heads [1, t, H, D]
    outs = [g.transpose(1, 2) for g in gathered]
    back = [tokens_to_heads_recv(y) for y in _simulated_all_to_all([tokens_to_heads_send(o, sp) for o in outs])]
    for r, b in enumerate(back):
        assert torch.equal(b, local[r].transpose(1, 2))


def test_kv_heads_split_replicated_or_refused():
    assert check_heads(8, 8, 4) == 1
    assert check_heads(8, 4, 2) == 1
    assert check_heads(8, 2, 4) == 2  # fewer K/V heads than sp: replicated
    assert check_heads(8, 1, 8) == 8
    with pytest.raises(ValueError, match="num_attention_heads=6"):
        check_heads(6, 6, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_heads(12, 3, 2)  # neither divides the other
    # replication puts on rank r the K/V head its query heads use
    heads, kv, sp = 8, 2, 4
    rep = check_heads(heads, kv, sp)
    kv_ids = torch.arange(kv).repeat_interleave(rep)  # the head index after replication, per slot
    for r in range(sp):
        q_heads = range(r * heads // sp, (r + 1) * heads // sp)
        assert {h // (heads // kv) for h in q_heads} == {int(kv_ids[r])}


def test_parallel_sizes_with_sequence_parallelism():
    from concertina_hf.training.args import resolve_parallel_sizes

    assert resolve_parallel_sizes(8, 2, None, 2) == (2, 2)
    assert resolve_parallel_sizes(4, None, None, 2) == (2, 1)
    assert resolve_parallel_sizes(8, None, 1, 4) == (2, 1)
    with pytest.raises(ValueError, match="concertina_sequence_parallel_size=3"):
        resolve_parallel_sizes(8, None, None, 3)
    with pytest.raises(ValueError, match="concertina_sequence_parallel_size=2"):
        resolve_parallel_sizes(8, 2, 1, 2)


def test_fit_all_to_all_recovers_the_link():
    from concertina_hf.runtime.ulysses import default_a2a_token_counts, fit_all_to_all

    lat, bw = 2e-5, 5e9
    samples = [(b, 4 * lat + b / bw) for b in (1e5, 1e6, 1e7)]
    got_lat, got_bw = fit_all_to_all(samples)
    assert got_lat == pytest.approx(lat, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)
    assert fit_all_to_all([(1e5, 0.0), (1e6, 1e-3)])[0] == 0.0  # negative intercept clamped
    with pytest.raises(ValueError, match="do not grow"):
        fit_all_to_all([(1e5, 1e-3), (1e6, 1e-4)])
    assert default_a2a_token_counts(8192, 2) == [128, 512, 2048, 8192]


def test_fit_latency_bound_keeps_a_profiled_run_going_on_a_latency_bound_link():
    """gloo on processes sharing cores: a layer's all-to-alls took 4.6, 5.1, 7.6, 4.8 ms for 0.6-37
    KB (not growing): the fit keeps their mean latency per call instead of stopping the run."""
    from concertina_hf.runtime.ulysses import LATENCY_BOUND_BANDWIDTH, fit_all_to_all, fit_latency_bound

    samples = [(576.0, 4.6e-3), (2304.0, 5.1e-3), (9216.0, 7.6e-3), (36864.0, 4.8e-3)]
    assert fit_latency_bound(samples, calls=4) == (pytest.approx(22.1e-3 / 4 / 4), LATENCY_BOUND_BANDWIDTH)
    growing = [(b, 1e-3 + b / 1e9) for b in (1e5, 1e6)]
    assert fit_latency_bound(growing) == fit_all_to_all(growing, calls=1)
    with pytest.raises(ValueError, match="at least two distinct sizes"):
        fit_latency_bound([(1e5, 1e-3), (1e5, 2e-3)])


class _ThreadGroup:
    """The sp group's object all-gather for ranks run as threads of one process."""

    def __init__(self, size: int) -> None:
        import threading

        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size)

    def member(self, rank: int):
        from types import SimpleNamespace

        def gather_objects(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return SimpleNamespace(rank=rank, size=self.size, gather_objects=gather_objects)


def _run_ranks(sp: int, fn):
    import threading

    group, results = _ThreadGroup(sp), [None] * sp

    def run(r):
        try:
            results[r] = fn(group.member(r))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(sp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    return results


@pytest.mark.parametrize("sp", [2, 4])
def test_evaluation_pieces_from_token_shards_equal_the_whole_chunks(sp):
    """``preprocess_logits_for_metrics`` at sp > 1: each rank preprocesses its shard of a chunk's
    logits (slices straddling the shard boundary, padding on the last rank, at sp=4 a rank with no
    token at all) and the gathered per-token results lay out as at sp = 1; a preprocess that fails
    on one rank's tokens raises on every rank (none left waiting in the gather)."""
    from concertina_hf.training.evaluation import _Pieces
    from concertina_hf.runtime.attention import SliceSpec

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (n,), generator=g) for n in (5, 9, 3)]
    labels = [s.clone() for s in seqs]
    labels[1][4] = -100
    # sequence 1 split over three chunks of 9, 6 and 2 tokens (at sp=4: 3, 2 and 1 tokens a rank; the
    # last rank holds padding only in the last two, and slices cross every shard boundary)
    chunks = [[SliceSpec(0, 0, 5, 0, True), SliceSpec(1, 0, 4, 5, False)],
              [SliceSpec(1, 4, 3, 0, False), SliceSpec(2, 0, 3, 3, True)],
              [SliceSpec(1, 7, 2, 0, True)]]
    logits = [torch.randn(1, sum(s.length for s in c), 50, generator=g) for c in chunks]

    def argmax_and_label(lg, lab):  # a tuple of per-token outputs, one depending on the labels
        return lg.argmax(-1), lab * 2

    whole = _Pieces(labels, argmax_and_label)
    for c, lg in zip(chunks, logits):
        whole(c, lg)
    batch = {"input_ids": torch.cat(seqs)[None], "position_ids": torch.cat([torch.arange(len(s)) for s in seqs])[None]}
    want = whole.assemble(batch)

    def rank(member):
        pieces = _Pieces(labels, argmax_and_label)
        assert pieces.takes_sp_shards
        for c, lg in zip(chunks, logits):
            pieces(c, local_shard(lg[0], sp, member.rank, 0.0)[None], member)
        return pieces.assemble(batch)

    for got in _run_ranks(sp, rank):
        assert not isinstance(got, Exception), got
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not _Pieces(labels, None).takes_sp_shards  # raw logits: gathered by the executor

    def failing(member):
        pieces = _Pieces(labels, lambda lg, lab: lg.mean() if lg.shape[1] == 1 else lg.argmax(-1))
        for c, lg in zip(chunks, logits):
            pieces(c, local_shard(lg[0], sp, member.rank, 0.0)[None], member)

    for got in _run_ranks(sp, failing):
        assert isinstance(got, ValueError), got
        assert re.search(r"failed on sequence-parallel rank \d: ValueError: preprocess_logits_for_metrics "
                         r"returned \(\) .* one value per token", str(got)), str(got)
