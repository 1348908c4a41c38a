"""Workload-balanced chunking, ordering and pipeline grouping of one step (DESIGN.md 4.1-4.3).

Work is measured per decoder layer and forward, as in :mod:`.cost`: a slice of length ``s``
with context ``C`` costs ``alpha_attn * ((C+s)^2 - C^2) + alpha_tok * s`` and a chunk adds
``beta``. The work of the first ``x`` tokens of a sequence, ``W(x) = alpha_attn x^2 +
alpha_tok x``, is convex, so equal-work slices get shorter towards the end of the sequence
(:func:`balanced_split` inverts ``W`` in closed form).

Chunking (:func:`make_chunking`):

1. The longest sequence is cut into ``K`` equal-work slices; one slice's work plus ``beta`` is
   the time target ``T`` of every chunk (unless ``time_target`` is given).
2. Every other sequence whose work exceeds ``T`` or whose length exceeds the token cap is cut
   into the fewest equal-work slices that meet both (sequences of at most ``split_threshold``
   tokens are never cut; alone they may exceed ``T``).
3. The tail slice of each cut sequence opens a bucket; the remaining (short) sequences, by
   decreasing work, go best-fit into the bucket with the least room left that still fits them
   under ``T`` and the cap, else open a new bucket. Buckets with a tail become *hybrid* chunks
   (tail listed first), the others *packed* chunks; a chunk never holds two cut sequences.

Order: cut sequences longest first, each as its *split* chunks followed by its hybrid chunk,
then the packed chunks, the one with the longest sequence first (a short chunk early would
stall the steady phase of 1F1B).

Grouping (:meth:`Chunking.best_group_cuts`): a dynamic program over the cut sequences sorted
by chunk count chooses where new pipeline groups start (packed chunks join the last group).
Each extra group pays a fill and drain of about ``(p - 1)`` mean chunk times but its in-flight
window on stage ``s`` is ``p - s - 1 + n`` chunks with ``n`` its own longest chain, so it may
need less recompute. Groups are scored with :meth:`Chunking.estimate`, an analytic proxy of the
simulator: bottleneck stage busy time + fill/drain + the recompute needed to bring each 1F1B
in-flight window under the stage budget (the exact choice is the simulator's, after
:func:`~concertina_hf.planning.recompute.assign_recompute`).

Cost: chunking ``n`` sequences is ``O(n log n)`` (a sort and a bisect-based best fit, about a
millisecond for 512 sequences); the proxy is ``O(chunks * stages)``; the grouping DP only cuts
where the chunk count changes, so it makes ``O(d^2)`` proxy calls for ``d`` distinct counts.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

from .cost import CostModel
from .types import Chunk, ChunkKind, PlanError, Slice, StageLayout

__all__ = ["Chunking", "balanced_split", "chunk_sequences", "make_chunking", "token_chunking"]

# Relative slack when comparing work against the time target: slices of the longest sequence
# are exactly at the target up to rounding, and must not be cut once more because of it.
_TOL = 1e-9


def _prefix_work(x: float, a: float, b: float) -> float:
    return a * x * x + b * x


def _inverse_work(y: float, a: float, b: float) -> float:
    """The ``x >= 0`` with ``a x^2 + b x = y`` (stable form of the quadratic root)."""
    if y <= 0:
        return 0.0
    if a <= 0:
        return y / b
    return 2.0 * y / (b + math.sqrt(b * b + 4.0 * a * y))


def balanced_split(seq_len: int, num_slices: int, cost: CostModel) -> list[int]:
    """Lengths of ``num_slices`` contiguous slices of a ``seq_len``-token sequence with equal
    work ``alpha_attn*((C+s)^2-C^2) + alpha_tok*s`` (later slices shorter).

    Boundaries are rounded to whole tokens; every slice has at least one token.

    >>> from concertina_hf.planning import CostModel
    >>> balanced_split(100, 4, CostModel(num_layers=1, alpha_attn=0.0, alpha_tok=1.0, beta=0.0))
    [25, 25, 25, 25]
    >>> balanced_split(100, 2, CostModel(num_layers=1, alpha_attn=1.0, alpha_tok=0.0, beta=0.0))
    [71, 29]
    """
    if seq_len < 1:
        raise PlanError(f"cannot split a sequence of {seq_len} tokens")
    if not 1 <= num_slices <= seq_len:
        raise PlanError(f"cannot cut a {seq_len}-token sequence into {num_slices} slices (need 1..{seq_len})")
    a, b = float(cost.alpha_attn), float(cost.alpha_tok)
    if a <= 0 and b <= 0:
        a, b = 0.0, 1.0  # no work model: equal lengths
    total = _prefix_work(seq_len, a, b)
    bounds = [0]
    for i in range(1, num_slices):
        x = round(_inverse_work(total * i / num_slices, a, b))
        # at least one token per slice, before and after
        x = max(bounds[-1] + 1, min(x, seq_len - (num_slices - i)))
        bounds.append(x)
    bounds.append(seq_len)
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def _slices_needed(seq_len: int, work_cap: float, token_cap: int, a: float, b: float) -> int:
    """Fewest equal-work slices of a sequence with each slice's work within ``work_cap`` and
    length within ``token_cap`` (the first slice is the longest)."""
    total = _prefix_work(seq_len, a, b)
    n = max(1, math.ceil(total / work_cap * (1 - _TOL))) if work_cap > 0 else seq_len
    n = min(n, seq_len)
    # the first slice is the longest; one more slice until it fits the cap
    while n < seq_len and _inverse_work(total / n, a, b) > token_cap:
        n = min(seq_len, max(n + 1, math.ceil(n * _inverse_work(total / n, a, b) / token_cap)))
    return n


@dataclass(frozen=True, slots=True)
class _ChunkInfo:
    kind: ChunkKind
    slices: tuple[Slice, ...]
    tokens: int
    work: float  # per-layer forward seconds, beta included
    split_tokens: int  # tokens of cut sequences (they keep K/V when recomputed)


@dataclass(frozen=True, slots=True)
class Chunking:
    """Chunks of one step before grouping.

    ``chains``: one entry per cut sequence, longest first: its chunks in order (split chunks,
    then the hybrid chunk). ``packed``: packed chunks, in order. ``time_target``: per-layer
    forward seconds a chunk aims at (``beta`` included); ``token_cap``: the cap used.
    """

    seq_lens: tuple[int, ...]
    time_target: float
    token_cap: int
    chains: tuple[tuple[_ChunkInfo, ...], ...]
    packed: tuple[_ChunkInfo, ...]

    @property
    def num_chunks(self) -> int:
        return sum(len(c) for c in self.chains) + len(self.packed)

    def layout_groups(self, group_cuts: Sequence[int] = ()) -> list[list[list[_ChunkInfo]]]:
        """Groups in forward order, each a list of units (a chain, or one packed chunk).

        ``group_cuts``: increasing indices into ``chains`` at which a new group starts. Packed
        chunks are spread evenly behind the chains (the ``i``-th chain is followed by
        ``floor((i+1)P/m) - floor(iP/m)`` of the ``P`` packed chunks, largest first): when two
        chains are back to back, a stage that finishes the first chain's backward needs the
        whole next chain forwarded upstream, which 1F1B's ``p - s - 1`` look-ahead does not
        provide, so it idles about one backward per chain; a packed chunk between them resumes
        the one-forward-one-backward rhythm.
        """
        m, num_packed = len(self.chains), len(self.packed)
        cuts = [0, *group_cuts, m]
        if m and any(b <= a for a, b in zip(cuts, cuts[1:])):
            raise PlanError(f"group cuts {list(group_cuts)} must be increasing within 1..{m - 1}")
        if not m:
            return [[[ci] for ci in self.packed]]
        groups: list[list[list[_ChunkInfo]]] = []
        for a, b in zip(cuts, cuts[1:]):
            units: list[list[_ChunkInfo]] = []
            for i in range(a, b):
                units.append(list(self.chains[i]))
                lo, hi = (i * num_packed) // m, ((i + 1) * num_packed) // m
                units.extend([ci] for ci in self.packed[lo:hi])
            groups.append(units)
        return groups

    def assemble(self, group_cuts: Sequence[int] = ()) -> tuple[tuple[Chunk, ...], tuple[tuple[int, ...], ...]]:
        """Chunks in global forward order and the pipeline groups (see :meth:`layout_groups`)."""
        chunks: list[Chunk] = []
        groups: list[tuple[int, ...]] = []
        for units in self.layout_groups(group_cuts):
            start = len(chunks)
            for u in units:
                for ci in u:
                    chunks.append(Chunk(len(chunks), ci.kind, ci.slices))
            groups.append(tuple(range(start, len(chunks))))
        return tuple(chunks), tuple(groups)

    # ------------------------------------------------------------------ analytic proxy
    def estimate(self, cost: CostModel, layout: StageLayout, budgets: Sequence[float] | None,
                 group_cuts: Sequence[int] = ()) -> float:
        """Predicted step time (seconds) of this chunking and grouping; ``inf`` if some 1F1B
        in-flight window cannot fit its stage budget even with full recompute.

        A proxy of the simulator for searching: per group, the busiest stage's compute, plus
        ``(p - 1)`` mean chunk times of fill and drain, plus the recompute that brings each
        window (a chain and the ``p - s - 1`` chunks after it, or ``p - s`` chunks) under
        budget, charged on its stage at a uniform fraction of the window's layers.
        """
        return sum(_group_estimate(units, cost, layout, budgets) for units in self.layout_groups(group_cuts))

    def best_group_cuts(self, cost: CostModel, layout: StageLayout, budgets: Sequence[float] | None,
                        max_groups: int = 4) -> tuple[tuple[int, ...], float]:
        """The grouping (cuts into :attr:`chains`) with the lowest :meth:`estimate`, by dynamic
        programming over cut points where the chain length changes; ``(cuts, estimate)``."""
        m = len(self.chains)
        if m <= 1 or max_groups <= 1 or layout.num_stages == 1:
            return (), self.estimate(cost, layout, budgets)
        points = [i for i in range(1, m) if len(self.chains[i]) != len(self.chains[i - 1])]
        units_all = self.layout_groups()[0]
        # where each chain's unit starts in the single-group unit list
        starts = [k for k, u in enumerate(units_all) if u[0].kind is not ChunkKind.PACKED]
        starts.append(len(units_all))
        memo: dict[tuple[int, int], float] = {}

        def seg(i: int, j: int) -> float:
            if (i, j) not in memo:
                memo[(i, j)] = _group_estimate(units_all[starts[i]:starts[j]], cost, layout, budgets)
            return memo[(i, j)]

        best = (seg(0, m), ())
        frontier: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
        for _ in range(max_groups - 1):
            nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
            for i, (t, cuts) in frontier.items():
                for j in points:
                    if j > i:
                        cand = t + seg(i, j)
                        if cand < nxt.get(j, (math.inf,))[0]:
                            nxt[j] = (cand, cuts + (j,))
            for j, (t, cuts) in nxt.items():
                full = t + seg(j, m)
                if full < best[0] * (1 - 1e-12):
                    best = (full, cuts)
            frontier = nxt
        return best[1], best[0]


def _group_estimate(members: list[list[_ChunkInfo]], cost: CostModel, layout: StageLayout,
                    budgets: Sequence[float] | None) -> float:
    """:meth:`Chunking.estimate` of one group; ``members`` are its units (a chain, or one
    packed chunk) in forward order."""
    p = layout.num_stages
    infos = [ci for u in members for ci in u]
    n = len(infos)
    if n == 0:
        return 0.0
    bf = 1.0 + cost.bwd_factor
    sum_work = sum(ci.work for ci in infos)
    sum_tok = sum(ci.tokens for ci in infos)
    busy = []
    for s in range(p):
        e = (cost.embed_time_per_token if layout.has_embedding(s) else 0.0) + \
            (cost.head_time_per_token if layout.has_head(s) else 0.0)
        busy.append(bf * (layout.num_stage_layers(s) * sum_work + e * sum_tok))
    fill = (p - 1) * (sum(busy) / p) / n
    if p > 1:
        fill += 2 * (p - 1) * (cost.p2p_latency_s + cost.hidden_bytes_per_token * sum_tok / n / cost.p2p_bandwidth)
    if budgets is None:
        return max(busy) + fill
    # prefix sums over the group's chunks
    ptok = [0]
    pwork = [0.0]
    psplit = [0]
    for ci in infos:
        ptok.append(ptok[-1] + ci.tokens)
        pwork.append(pwork[-1] + ci.work)
        psplit.append(psplit[-1] + ci.split_tokens)
    bounds = []  # (first, last) positions of each unit, and tokens of its earlier slices
    pos = 0
    for u in members:
        earlier = sum(ci.tokens for ci in u[:-1]) if len(u) > 1 else 0
        bounds.append((pos, pos + len(u) - 1, earlier))
        pos += len(u)
    worst = 0.0
    for s in range(p):
        nl = layout.num_stage_layers(s)
        per_tok = nl * cost.act_bytes_per_token + (cost.logits_bytes_per_token if layout.has_head(s) else 0.0)
        save_tok = nl * (cost.act_bytes_per_token - cost.ckpt_bytes_per_token)
        room = float(budgets[s]) - cost.static_memory(layout, s)
        look = p - s - 1
        frac = [0.0] * n
        need = False
        for a, b, earlier in bounds:
            hi = min(n - 1, b + look)
            tok = ptok[hi + 1] - ptok[a]
            mem = per_tok * tok + nl * cost.kv_bytes_per_token * earlier + \
                2 * cost.hidden_bytes_per_token * infos[b].tokens
            excess = mem - room
            if excess <= 0:
                continue
            saving = save_tok * tok - nl * cost.kv_bytes_per_token * (psplit[hi + 1] - psplit[a])
            if saving <= 0 or excess > saving:
                return math.inf
            f = excess / saving
            need = True
            for c in range(a, hi + 1):
                if frac[c] < f:
                    frac[c] = f
        if need:
            rc = nl * sum(f * ci.work for f, ci in zip(frac, infos))
            worst = max(worst, busy[s] + rc)
        else:
            worst = max(worst, busy[s])
    return worst + fill


def _info(kind: ChunkKind, slices: tuple[Slice, ...], split_tokens: int, a: float, b: float, beta: float) -> _ChunkInfo:
    tok = 0
    work = beta
    for s in slices:
        tok += s.length
        end = s.start + s.length
        work += a * (end * end - s.start * s.start) + b * s.length
    return _ChunkInfo(kind, slices, tok, work, split_tokens)


def _work_coefficients(cost: CostModel) -> tuple[float, float, float]:
    a, b = float(cost.alpha_attn), float(cost.alpha_tok)
    if a <= 0 and b <= 0:
        a, b = 0.0, 1.0  # no work model: balance tokens
    return a, b, float(cost.beta)


def _check_lens(seq_lens: Sequence[int], token_cap: int) -> list[int]:
    lens = [int(x) for x in seq_lens]
    if not lens or max(lens) <= 0:
        raise PlanError("a step needs at least one non-empty sequence")
    if min(lens) < 0:
        raise PlanError(f"sequence {lens.index(min(lens))} has a negative length {min(lens)}")
    if token_cap < 1:
        raise PlanError(f"the token cap per chunk must be at least 1 (got {token_cap}); set max_tokens_per_chunk")
    return lens


def _target_split(seq_len: int, target_work: float, token_cap: int, a: float, b: float) -> list[int]:
    """Slices of exactly ``target_work`` (or ``token_cap`` tokens, whichever is shorter) from the
    start, the remainder as the tail: every non-final chunk is at the target, and the lighter
    tail leaves room in its hybrid chunk for short sequences."""
    bounds = [0]
    while True:
        lo = bounds[-1]
        rest = seq_len - lo
        if rest <= token_cap and a * (seq_len * seq_len - lo * lo) + b * rest <= target_work * (1 + _TOL):
            break
        x = int(_inverse_work(_prefix_work(lo, a, b) + target_work, a, b) + _TOL * seq_len)
        x = max(lo + 1, min(x, lo + token_cap, seq_len - 1))
        bounds.append(x)
    bounds.append(seq_len)
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def _build(lens: list[int], cuts: dict[int, list[int]], a: float, b: float, beta: float, *,
           target_work: float, token_cap: int, by_work: bool) -> tuple[tuple[tuple[_ChunkInfo, ...], ...], tuple[_ChunkInfo, ...]]:
    """Chains of the cut sequences (``cuts[seq]``: slice lengths; longest sequence first) and
    packed chunks: the other sequences go best-fit decreasing into the tail buckets and new
    buckets, under ``target_work`` (if ``by_work``) and ``token_cap``."""
    cut_order = sorted(cuts, key=lambda i: (-lens[i], i))
    chains: list[tuple[_ChunkInfo, ...]] = []
    # a bucket: [tail slice or None, short sequence ids, work, tokens]
    buckets: list[list] = []
    for i in cut_order:
        slices, start = [], 0
        for length in cuts[i]:
            slices.append(Slice(i, start, length))
            start += length
        chains.append(tuple(_info(ChunkKind.SPLIT, (sl,), sl.length, a, b, beta) for sl in slices[:-1]))
        tail = slices[-1]
        buckets.append([tail, [], a * (start * start - tail.start * tail.start) + b * tail.length, tail.length])
    short = sorted((i for i, n in enumerate(lens) if n > 0 and i not in cuts), key=lambda i: (-lens[i], i))

    def room(bk: list) -> float:
        return target_work - bk[2] if by_work else float(token_cap - bk[3])

    # best fit: `keys` sorted by (room left, bucket id); the tightest bucket that fits first
    keys = sorted((room(bk), bi) for bi, bk in enumerate(buckets))
    slack = (target_work if by_work else 1.0) * _TOL
    for i in short:
        n = lens[i]
        w = _prefix_work(n, a, b)
        size = w if by_work else float(n)
        j = bisect.bisect_left(keys, (size - slack, -1))
        while j < len(keys) and buckets[keys[j][1]][3] + n > token_cap:
            j += 1
        if j == len(keys):
            buckets.append([None, [i], w, n])
            bisect.insort(keys, (room(buckets[-1]), len(buckets) - 1))
            continue
        _, bi = keys.pop(j)
        bk = buckets[bi]
        bk[1].append(i)
        bk[2] += w
        bk[3] += n
        bisect.insort(keys, (room(bk), bi))

    full_chains: list[tuple[_ChunkInfo, ...]] = []
    packed: list[tuple[int, _ChunkInfo]] = []
    for bi, (tail, members, _, _) in enumerate(buckets):
        rest = tuple(Slice(q, 0, lens[q]) for q in sorted(members))
        if tail is not None:
            full_chains.append(chains[bi] + (_info(ChunkKind.HYBRID, (tail,) + rest, tail.length, a, b, beta),))
        else:
            packed.append((max(lens[q] for q in members), _info(ChunkKind.PACKED, rest, 0, a, b, beta)))
    packed.sort(key=lambda li: (-li[0], li[1].slices[0].seq))
    return tuple(full_chains), tuple(info for _, info in packed)


def make_chunking(seq_lens: Sequence[int], cost: CostModel, *, num_slices_longest: int, token_cap: int,
                  time_target: float | None = None, split_threshold: int | None = None) -> Chunking:
    """Workload-balanced chunking of a step (see the module docstring); the ungrouped result.

    The longest sequence gets ``num_slices_longest`` equal-work slices (more if its first
    slice would exceed ``token_cap``). Other cut sequences get slices of exactly the target
    work from their start and a lighter tail (rather than equal-work slices): every non-final
    chunk then runs at the target, and the tail's hybrid chunk takes short sequences up to it.
    """
    lens = _check_lens(seq_lens, token_cap)
    if num_slices_longest < 1:
        raise PlanError(f"num_slices_longest must be at least 1 (got {num_slices_longest})")
    a, b, beta = _work_coefficients(cost)
    threshold = 0 if split_threshold is None else int(split_threshold)
    longest = max(lens)
    if time_target is None:
        k_long = _slices_needed(longest, _prefix_work(longest, a, b) / min(num_slices_longest, longest) * (1 + _TOL),
                                token_cap, a, b)
        target_work = _prefix_work(longest, a, b) / k_long  # per chunk, beta excluded
    else:
        target_work = float(time_target) - beta
        if target_work <= 0:
            raise PlanError(f"time_target {time_target} s is not above the per-chunk overhead beta={beta} s")
    cuts: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        if n <= threshold or (n <= token_cap and _prefix_work(n, a, b) <= target_work * (1 + _TOL)):
            continue
        if n == longest and time_target is None:
            cuts[i] = balanced_split(n, k_long, cost)
        else:
            cuts[i] = _target_split(n, target_work, token_cap, a, b)
    chains, packed = _build(lens, cuts, a, b, beta, target_work=target_work, token_cap=token_cap, by_work=True)
    return Chunking(tuple(lens), target_work + beta, int(token_cap), chains, packed)


def token_chunking(seq_lens: Sequence[int], cost: CostModel, *, token_budget: int, split: bool = False) -> Chunking:
    """Token-budget chunking of the baselines (no work balancing).

    ``split=False`` (*packed*): whole sequences best-fit decreasing into micro-batches of at
    most ``token_budget`` tokens; a longer sequence gets a micro-batch of its own (tokens are
    never dropped). ``split=True`` (*split*, Seq1F1B-like): a sequence longer than
    ``token_budget`` is cut into ``ceil(len / token_budget)`` equal-length slices; short
    sequences are packed up to ``token_budget`` tokens, tails included.
    """
    lens = _check_lens(seq_lens, token_budget)
    a, b, beta = _work_coefficients(cost)
    cuts: dict[int, list[int]] = {}
    if split:
        for i, n in enumerate(lens):
            if n > token_budget:
                k = -(-n // token_budget)
                q, r = divmod(n, k)
                cuts[i] = [q + 1] * r + [q] * (k - r)
    chains, packed = _build(lens, cuts, a, b, beta, target_work=math.inf, token_cap=token_budget, by_work=False)
    return Chunking(tuple(lens), math.inf, int(token_budget), chains, packed)


def chunk_sequences(
    seq_lens: Sequence[int],
    cost: CostModel,
    layout: StageLayout,
    *,
    num_slices_longest: int,
    token_cap: int,
    time_target: float | None = None,
    split_threshold: int | None = None,
    memory_budget_bytes: int | Sequence[int] | None = None,
    max_groups: int = 1,
) -> tuple[tuple[Chunk, ...], tuple[tuple[int, ...], ...]]:
    """Chunks of a step in global forward order, and its pipeline groups.

    ``num_slices_longest`` (K) slices of the longest sequence set the time target (unless
    ``time_target``, per-layer forward seconds of a chunk, is given); ``token_cap`` bounds the
    tokens of every chunk made of more than one sequence or of a cut sequence's slice;
    sequences of at most ``split_threshold`` tokens are never cut. With ``max_groups > 1`` and a
    ``memory_budget_bytes`` (per stage, or one for all), the grouping DP picks up to that many
    pipeline groups; otherwise all chunks form one group.
    """
    ch = make_chunking(seq_lens, cost, num_slices_longest=num_slices_longest, token_cap=token_cap,
                       time_target=time_target, split_threshold=split_threshold)
    cuts: tuple[int, ...] = ()
    if max_groups > 1:
        budgets = _budgets(memory_budget_bytes, layout.num_stages)
        cuts, _ = ch.best_group_cuts(cost, layout, budgets, max_groups=max_groups)
    return ch.assemble(cuts)


def _budgets(memory_budget_bytes: int | Sequence[int] | None, num_stages: int) -> tuple[float, ...] | None:
    if memory_budget_bytes is None:
        return None
    if isinstance(memory_budget_bytes, (int, float)):
        return (float(memory_budget_bytes),) * num_stages
    vals = tuple(float(x) for x in memory_budget_bytes)
    if len(vals) != num_stages:
        raise PlanError(f"memory_budget_bytes has {len(vals)} entries for {num_stages} stages; give one per stage or one int")
    return vals
