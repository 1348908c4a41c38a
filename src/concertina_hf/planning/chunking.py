"""Workload-balanced chunking, ordering and pipeline grouping of one step.

Work is measured per decoder layer and forward, as in :mod:`.cost`: a slice of length ``s``
with context ``C`` costs ``alpha_attn * ((C+s)^2 - C^2) + alpha_tok * s`` and a chunk adds
``beta``. Given a stage layout (``SequenceBatch(lens, cost, layout)``, the planner), the per-token time of
the embedding or LM head on the stage slowest for a typical chunk is added to ``alpha_tok``
(spread over its layers), so chunks are balanced where the pipeline is slowest. The work of the first ``x`` tokens of a sequence, ``W(x) = alpha_attn x^2 +
alpha_tok x``, is convex, so equal-work slices get shorter towards the end of the sequence
(:func:`balanced_split` inverts ``W`` in closed form).

Chunking (:meth:`SequenceBatch.balanced`):

1. The longest sequence is cut into ``K`` equal-work slices (more if a slice would exceed the
   token cap); one slice's work plus ``beta`` is the time target ``T`` of every chunk (unless
   ``time_target`` is given). When that takes more than twice ``K`` and twice the fewest slices
   the cap allows (equal-work slices under a cap need about ``(longest / cap)^2`` of them: a
   153K-token sequence under a 4096 cap 1024 instead of 38), the longest is cut like the others
   (step 2) at the time target of ``K`` slices.
2. Every other sequence whose work exceeds ``T`` or whose length exceeds the token cap is cut
   too (sequences of at most ``split_threshold`` tokens never are; alone they may exceed
   ``T``): into slices of exactly the target work (or the cap) from its start, and a lighter
   tail. Measured against equal-work slices of the same count, this keeps every non-final
   chunk at the target instead of below it, and the pipeline idles less (on 512 long-tailed
   sequences at pp=4, 3% of the step).
3. The tail slice of each cut sequence opens a bucket; the remaining (short) sequences, by
   decreasing work, go best-fit into the bucket with the least room left that still fits them
   under ``T`` and the cap, else open a new bucket. Buckets with a tail become *hybrid* chunks
   (tail listed first), the others *packed* chunks; a chunk never holds two cut sequences.

Whole-doc packing (``balanced(whole_doc=(sp, L))``, for a stage of ``sp`` GPUs that runs packed
chunks whole-doc, each sequence on one GPU at one GPU's rates): the uncut sequences of at most
``L`` tokens leave step 3 and are packed into chunks of ``sp`` per-GPU bins instead, longest first,
each to the least loaded bin of the chunk while it fits the bin capacity (the time target's
``1/sp`` share, or the chunk's first sequence when longer): every chunk's GPUs carry about equal
work. Step 3 packs for Ulysses, by total work, and leaves chunks of 4 or 5 sequences that no
placement balances over 8 GPUs.

Order: cut sequences longest first, each as its *split* chunks followed by its hybrid chunk,
with the packed chunks (largest first) spread evenly behind the chains. Two chains back to back
make 1F1B stall: a stage finishing one chain's backward needs the whole next chain forwarded
upstream; a packed chunk in between resumes the one-forward-one-backward rhythm (the schedule's
``prefetch`` does the rest, see :func:`~.schedule.build_schedule`).

Grouping (:meth:`Chunking.best_group_cuts`): a dynamic program over the cut sequences sorted
by chunk count chooses where new pipeline groups start. Each extra group pays a fill and drain
of about ``(p - 1)`` mean chunk times but its in-flight window on stage ``s`` is
``p - s - 1 + n`` chunks with ``n`` its own longest chain, so it may need less recompute.
Groupings are scored with :meth:`Chunking.estimate`, an analytic proxy of the simulator:
bottleneck stage busy time, plus fill and drain, plus the recompute that brings each 1F1B
in-flight window under the stage budget (the exact choice is the simulator's, after
:func:`~concertina_hf.planning.recompute.assign_recompute`).

Cost: chunking ``n`` sequences is ``O(n log n)`` (a sort, done once per step by
:class:`SequenceBatch`, and a bisect-based best fit: well under a millisecond for 512
sequences); the proxy is ``O(chunks * stages)``; the DP only cuts where the chain length
changes, ``O(d^2)`` proxy calls for ``d`` distinct lengths.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from .cost import CostModel
from .segments import SegmentOptions, segment_cuts
from .types import Chunk, ChunkKind, PlanError, Remedy, Slice, StageLayout

__all__ = ["Chunking", "SequenceBatch", "balanced_split"]

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


def _work_coefficients(cost: CostModel) -> tuple[float, float, float]:
    a, b = float(cost.alpha_attn), float(cost.alpha_tok)
    if a <= 0 and b <= 0:
        a, b = 0.0, 1.0  # no work model: balance tokens
    return a, b, float(cost.beta)


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
    a, b, _ = _work_coefficients(cost)
    total = _prefix_work(seq_len, a, b)
    bounds = [0]
    for i in range(1, num_slices):
        x = round(_inverse_work(total * i / num_slices, a, b))
        # at least one token per slice, before and after
        bounds.append(max(bounds[-1] + 1, min(x, seq_len - (num_slices - i))))
    bounds.append(seq_len)
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def _slices_needed(seq_len: int, work_cap: float, token_cap: int, a: float, b: float) -> int:
    """Fewest equal-work slices of a sequence with each slice's work within ``work_cap`` and
    length within ``token_cap`` (the first slice is the longest)."""
    total = _prefix_work(seq_len, a, b)
    n = min(seq_len, max(1, math.ceil(total / work_cap * (1 - _TOL)))) if work_cap > 0 else seq_len
    # (float slack: the exact inverse of a whole sequence's work is its length)
    while n < seq_len and _inverse_work(total / n, a, b) > token_cap * (1 + 1e-7):
        # the first slice shrinks at least like 1/sqrt(n): this jump never overshoots
        n = min(seq_len, max(n + 1, math.ceil(n * _inverse_work(total / n, a, b) / token_cap)))
    return n


def _target_split(seq_len: int, target_work: float, token_cap: int, a: float, b: float) -> list[int]:
    """Slices of exactly ``target_work`` (or ``token_cap`` tokens, whichever is shorter) from the
    start, the remainder as the tail (see the module docstring)."""
    bounds = [0]
    while True:
        lo = bounds[-1]
        rest = seq_len - lo
        # (a last token heavier than the target is the tail alone: slices hold at least one token)
        if rest <= token_cap and (rest == 1 or a * (seq_len * seq_len - lo * lo) + b * rest
                                  <= target_work * (1 + _TOL)):
            break
        x = int(_inverse_work(_prefix_work(lo, a, b) + target_work, a, b) + _TOL * seq_len)
        bounds.append(max(lo + 1, min(x, lo + token_cap, seq_len - 1)))
    bounds.append(seq_len)
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


@dataclass(frozen=True, slots=True)
class _ChunkInfo:
    """A chunk before it has an index: ``parts`` are ``(seq, start, length)``."""

    kind: ChunkKind
    parts: tuple[tuple[int, int, int], ...]
    tokens: int
    work: float  # per-layer forward seconds, beta included
    split_tokens: int  # tokens of cut sequences (they keep K/V when recomputed)


@dataclass(frozen=True, slots=True)
class Chunking:
    """Chunks of one step before grouping.

    ``chains``: one entry per cut sequence, longest first: its chunks in order (split chunks,
    then the hybrid chunk). ``packed``: packed chunks, largest sequence first.
    ``time_target``: per-layer forward seconds a chunk aims at (``beta`` included; ``inf`` for
    token-budget chunkings); ``token_cap``: the cap used.
    """

    seq_lens: tuple[int, ...]
    time_target: float
    token_cap: int
    chains: tuple[tuple[_ChunkInfo, ...], ...]
    packed: tuple[_ChunkInfo, ...]
    #: segment-level training (:mod:`.segments`): the plans of this chunking carry its knobs, so the
    #: strategies simulate them under the options (``None``: off)
    segment: SegmentOptions | None = None

    @property
    def num_chunks(self) -> int:
        return sum(len(c) for c in self.chains) + len(self.packed)

    def layout_groups(self, group_cuts: Sequence[int] = ()) -> list[list[list[_ChunkInfo]]]:
        """Groups in forward order, each a list of units (a chain, or one packed chunk).

        ``group_cuts``: increasing indices into ``chains`` at which a new group starts. The
        ``i``-th of ``m`` chains is followed by packed chunks ``floor(iP/m) .. floor((i+1)P/m)``
        of the ``P`` (see the module docstring).
        """
        m, num_packed = len(self.chains), len(self.packed)
        if not m:
            if group_cuts:
                raise PlanError("group cuts need split chains to cut between")
            return [[[ci] for ci in self.packed]]
        cuts = [0, *group_cuts, m]
        if any(hi <= lo for lo, hi in zip(cuts, cuts[1:])):
            raise PlanError(f"group cuts {list(group_cuts)} must be increasing within 1..{m - 1}")
        groups: list[list[list[_ChunkInfo]]] = []
        for lo, hi in zip(cuts, cuts[1:]):
            units: list[list[_ChunkInfo]] = []
            for i in range(lo, hi):
                units.append(list(self.chains[i]))
                units.extend([ci] for ci in self.packed[(i * num_packed) // m:((i + 1) * num_packed) // m])
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
                    chunks.append(Chunk(len(chunks), ci.kind, tuple(Slice(q, s, n) for q, s, n in ci.parts)))
            groups.append(tuple(range(start, len(chunks))))
        return tuple(chunks), tuple(groups)

    # ------------------------------------------------------------------ analytic proxy
    def estimate(self, cost: CostModel, layout: StageLayout, budgets: Sequence[float] | None,
                 group_cuts: Sequence[int] = ()) -> float:
        """Predicted step time (seconds) of this chunking and grouping; ``inf`` if some 1F1B
        in-flight window cannot fit its stage budget even with full recompute.

        Per group: the busiest stage's compute, plus the fill (the first chunk's forward through
        the other stages) and the drain (the last backward through them), plus on each stage the recompute that brings each window (a chain and the
        ``p - s - 1`` chunks after it, or ``p - s`` chunks) under budget, charged as a uniform
        fraction of the window's layers. ``budgets`` (bytes per stage) ``None``: unconstrained.
        """
        return sum(_group_estimate(u, cost, layout, budgets)[0] for u in self.layout_groups(group_cuts))

    def needs_recompute(self, cost: CostModel, layout: StageLayout, budgets: Sequence[float] | None) -> bool:
        """Whether the proxy sees a window over budget in a single group."""
        return _group_estimate(self.layout_groups()[0], cost, layout, budgets)[1]

    def best_group_cuts(self, cost: CostModel, layout: StageLayout, budgets: Sequence[float] | None,
                        max_groups: int = 2) -> tuple[tuple[int, ...], float]:
        """The grouping (cuts into :attr:`chains`, at most ``max_groups`` groups) with the lowest
        :meth:`estimate`, by dynamic programming over the cut points where the chain length
        changes; ``(cuts, estimate)``. Grouping only pays off against recompute, so a single
        group is returned at once when it needs none."""
        m = len(self.chains)
        units_all = self.layout_groups()[0]
        single, needs = _group_estimate(units_all, cost, layout, budgets)
        if m <= 1 or max_groups <= 1 or layout.num_stages == 1 or not needs:
            return (), single
        points = [i for i in range(1, m) if len(self.chains[i]) != len(self.chains[i - 1])]
        # where each chain's unit starts in the single-group unit list
        starts = [k for k, u in enumerate(units_all) if u[0].kind is not ChunkKind.PACKED] + [len(units_all)]
        memo: dict[tuple[int, int], float] = {(0, m): single}

        def seg(i: int, j: int) -> float:
            if (i, j) not in memo:
                memo[(i, j)] = _group_estimate(units_all[starts[i]:starts[j]], cost, layout, budgets)[0]
            return memo[(i, j)]

        best = (single, ())
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


def _group_estimate(units: list[list[_ChunkInfo]], cost: CostModel, layout: StageLayout,
                    budgets: Sequence[float] | None) -> tuple[float, bool]:
    """:meth:`Chunking.estimate` of one group of ``units`` (chains or single packed chunks, in
    forward order), and whether any window needs recompute."""
    p = layout.num_stages
    infos = [ci for u in units for ci in u]
    n = len(infos)
    if n == 0:
        return 0.0, False
    bf = 1.0 + cost.bwd_factor
    sum_work = sum(ci.work for ci in infos)
    sum_tok = sum(ci.tokens for ci in infos)
    busy, per_stage = [], []
    for s in range(p):
        e = (cost.embed_time_per_token if layout.has_embedding(s) else 0.0) + \
            (cost.head_time_per_token if layout.has_head(s) else 0.0)
        # the embedding's and head's per-call times, once per chunk
        c = (cost.embed_time_per_call if layout.has_embedding(s) else 0.0) + \
            (cost.head_time_per_call if layout.has_head(s) else 0.0)
        per_stage.append((layout.num_stage_layers(s), e, c))
        busy.append(bf * (layout.num_stage_layers(s) * sum_work + e * sum_tok + c * n))
    # Fill and drain: the busiest stage waits while the first chunks go forward through the
    # other stages, and they work off their last backwards after it ends; 1F1B keeps up to
    # p - 1 chunks in that warm-up and cool-down, so the mean of the first and of the last
    # p - 1 chunks prices them (a lone small last chunk does not shorten the drain much).
    m = max(1, min(n, p - 1))
    head_w, head_t = sum(ci.work for ci in infos[:m]) / m, sum(ci.tokens for ci in infos[:m]) / m
    tail_w, tail_t = sum(ci.work for ci in infos[-m:]) / m, sum(ci.tokens for ci in infos[-m:]) / m
    b = max(range(p), key=lambda q: busy[q])
    fill = sum(nl * head_w + e * head_t + cost.bwd_factor * (nl * tail_w + e * tail_t) + bf * c
               for q, (nl, e, c) in enumerate(per_stage) if q != b)
    if p > 1:
        fill += (p - 1) * (2 * cost.p2p_latency_s + cost.hidden_bytes_per_token * (head_t + tail_t)
                           / cost.p2p_bandwidth)
    if budgets is None:
        return max(busy) + fill, False
    ptok, psplit = [0], [0]
    for ci in infos:
        ptok.append(ptok[-1] + ci.tokens)
        psplit.append(psplit[-1] + ci.split_tokens)
    bounds = []  # (first, last) position of each unit, and the tokens of its earlier slices
    pos = 0
    for u in units:
        bounds.append((pos, pos + len(u) - 1, ptok[pos + len(u) - 1] - ptok[pos]))
        pos += len(u)
    worst = 0.0
    needs = False
    for s in range(p):
        nl = layout.num_stage_layers(s)
        per_tok = nl * cost.act_bytes_per_token + (cost.logits_bytes_per_token if layout.has_head(s) else 0.0)
        save_tok = nl * (cost.act_bytes_per_token - cost.ckpt_bytes_per_token)
        kv = nl * cost.kv_bytes_per_token
        room = float(budgets[s]) - cost.static_memory(layout, s)
        look = p - s - 1
        frac: list[float] | None = None
        for lo, hi, earlier in bounds:
            end = min(n - 1, hi + look)
            tok = ptok[end + 1] - ptok[lo]
            excess = per_tok * tok + kv * earlier + 2 * cost.hidden_bytes_per_token * infos[hi].tokens - room
            if excess <= 0:
                continue
            saving = save_tok * tok - kv * (psplit[end + 1] - psplit[lo])
            if saving <= 0 or excess > saving:
                return math.inf, True
            f = excess / saving
            if frac is None:
                frac = [0.0] * n
            for c in range(lo, end + 1):
                if frac[c] < f:
                    frac[c] = f
        rc = 0.0 if frac is None else nl * sum(f * ci.work for f, ci in zip(frac, infos))
        needs = needs or frac is not None
        worst = max(worst, busy[s] + rc)
    return worst + fill, needs


def _per_token_overhead(cost: CostModel, layout: StageLayout, tokens_hint: int = 4096) -> float:
    """Embedding / head seconds per token and layer of the stage slowest on a typical chunk."""
    a, b, beta = _work_coefficients(cost)
    layer = a * tokens_hint * tokens_hint + b * tokens_hint + beta
    best, extra = -1.0, 0.0
    for s in range(layout.num_stages):
        e = (cost.embed_time_per_token if layout.has_embedding(s) else 0.0) + \
            (cost.head_time_per_token if layout.has_head(s) else 0.0)
        n = layout.num_stage_layers(s)
        t = n * layer + e * tokens_hint
        if t > best * (1 + 1e-12):
            best, extra = t, e / n
    return extra


class SequenceBatch:
    """A step's lengths prepared once (sorted, with their work) for chunking it many ways."""

    def __init__(self, seq_lens: Sequence[int], cost: CostModel, layout: StageLayout | None = None,
                 segment: SegmentOptions | None = None):
        #: segment-level training (:mod:`.segments`): every sequence longer than ``segment.tokens``
        #: is cut at every multiple of it, whatever the chunking asks for (``None``: off)
        self.segment = segment
        self.segment_tokens = None if segment is None else int(segment.tokens)
        lens = [int(x) for x in seq_lens]
        if not lens or max(lens) <= 0:
            raise PlanError("a step needs at least one non-empty sequence")
        if min(lens) < 0:
            raise PlanError(f"sequence {lens.index(min(lens))} has a negative length {min(lens)}")
        self.lens = lens
        self.cost = cost
        self.a, self.b, self.beta = _work_coefficients(cost)
        self.extra = 0.0
        if layout is not None:
            # balance chunks on the busiest stage: its per-token embedding / head time counts
            # as extra per-token work of each of its layers
            self.extra = _per_token_overhead(cost, layout)
            self.b += self.extra
            self.cost = dataclasses.replace(cost, alpha_tok=self.b) if cost.alpha_attn > 0 or cost.alpha_tok > 0 else cost
        a, b = self.a, self.b
        self.work = [a * n * n + b * n for n in lens]
        # longest first, ties by index: every choice below is deterministic
        self.order = sorted((i for i, n in enumerate(lens) if n > 0), key=lambda i: (-lens[i], i))
        self.longest = lens[self.order[0]]

    def tokens_of_work(self, work: float) -> int:
        """The longest sequence whose work (per layer, ``beta`` excluded) is at most ``work``."""
        return int(_inverse_work(work * (1 + _TOL), self.a, self.b))

    def balanced(self, *, num_slices_longest: float, token_cap: int, time_target: float | None = None,
                 split_threshold: int | None = None, whole_doc: tuple[int, int] | None = None) -> Chunking:
        """Workload-balanced chunking of the step (the module docstring), before grouping.
        ``num_slices_longest`` below 1 means a time target of
        ``W(longest) / num_slices_longest``: chunks up to that many times the longest
        sequence's work, none cut (fewer, larger chunks where bubbles are cheap, e.g. one
        stage). ``whole_doc=(sp, max_len)``: the uncut sequences of at most ``max_len`` tokens
        are packed into chunks of ``sp`` balanced per-GPU bins instead (:meth:`_pack_ranks`), for a
        stage of ``sp`` GPUs running them whole-doc."""
        if token_cap < 1:
            raise PlanError(f"the token cap per chunk must be at least 1 (got {token_cap})",
                            Remedy("max_tokens_per_chunk", "raise", 1, "tokens"))
        if not num_slices_longest > 0:
            raise PlanError(f"num_slices_longest must be positive (got {num_slices_longest})")
        a, b, beta, lens = self.a, self.b, self.beta, self.lens
        longest = self.longest
        whole = _prefix_work(longest, a, b)
        k_long = 1
        if time_target is not None:
            target_work = float(time_target) - beta
            if target_work <= 0:
                raise PlanError(f"time_target {time_target} s is not above the per-chunk overhead beta={beta} s")
        elif num_slices_longest < 1:
            target_work = whole / num_slices_longest
        else:
            k = min(int(num_slices_longest), longest)
            k_long = _slices_needed(longest, whole / k * (1 + _TOL), token_cap, a, b)
            target_work = whole / k_long  # per chunk, beta excluded
            if k_long > 2 * max(k, -(-longest // token_cap)):
                # the cap binds hard: equal-work slices under it need about (longest / cap)^2
                # of them (the first slice is the longest), so the longest is cut like the
                # others, cap-sized slices first, at the time target of K slices
                k_long, target_work = 1, whole / k
        threshold = 0 if split_threshold is None else int(split_threshold)
        limit = target_work * (1 + _TOL)
        cuts: list[tuple[int, list[int]]] = []
        for i in self.order:  # being cut is monotone in length: stop at the first short one
            n = lens[i]
            if n <= threshold or (n <= token_cap and self.work[i] <= limit):
                break
            if n == longest and k_long > 1:
                cuts.append((i, balanced_split(n, k_long, self.cost)))
            else:
                cuts.append((i, _target_split(n, target_work, token_cap, a, b)))
        if self.segment_tokens is not None:
            cuts = self._segment_cuts()
        short = self.order[len(cuts):]
        ranked: list[int] = []
        if whole_doc is not None and whole_doc[0] > 1:
            ranked = [i for i in short if lens[i] <= whole_doc[1]]
            short = [i for i in short if lens[i] > whole_doc[1]]
        chains, packed = self._pack(cuts, short, target_work, token_cap, by_work=True)
        if ranked:
            # largest sequence first, as _pack orders its packed chunks (a stable sort)
            packed = tuple(sorted(packed + self._pack_ranks(ranked, whole_doc[0], target_work, token_cap),
                                  key=lambda ci: -max(q[2] for q in ci.parts)))
        return Chunking(tuple(lens), target_work + beta, int(token_cap), chains, packed, self.segment)

    def _pack_ranks(self, seqs: list[int], sp: int, target_work: float, token_cap: int) -> tuple[_ChunkInfo, ...]:
        """Packed chunks of whole sequences ``seqs`` (longest first) for a stage of ``sp`` GPUs
        running them whole-doc, each GPU its own sequences at one GPU's rates (``sp`` times the
        per-GPU coefficients here): per chunk, ``sp`` bins filled longest processing time first
        (each sequence to the least loaded bin, the lowest of equals, as
        :func:`~.lpt.lpt_ranks` places them) up to a bin capacity of the time target's share,
        ``target_work / sp``, or the chunk's first sequence's work when larger; a sequence that
        fits no bin of the chunk waits for the next chunk, smaller ones after it still fill the
        gaps; the chunk's tokens within ``token_cap``. So every chunk's GPUs carry about equal
        work (the short sequences fill what the longer ones leave), and a chunk takes about the
        time of its largest bin. ``O(n x chunks)`` at worst, ``n`` the sequences."""
        lens, work, x, beta = self.lens, self.work, self.extra, self.beta
        rest = list(seqs)
        out: list[_ChunkInfo] = []
        while rest:
            cap = max(target_work / sp, work[rest[0]]) * (1 + _TOL)
            heap = [(0.0, r) for r in range(sp)]
            load, own = [0.0] * sp, [0.0] * sp
            members: list[int] = []
            left: list[int] = []
            tokens = 0
            for k, i in enumerate(rest):  # the first always fits (an uncut sequence is within the cap)
                t, r = heap[0]
                if t + work[rest[-1]] > cap:  # not even the smallest fits: the chunk is full
                    left.extend(rest[k:])
                    break
                if t + work[i] > cap or tokens + lens[i] > token_cap:
                    left.append(i)
                    continue
                heapq.heapreplace(heap, (t + work[i], r))
                load[r] += work[i]
                own[r] += work[i] - x * lens[i]
                tokens += lens[i]
                members.append(i)
            busiest = max(range(sp), key=lambda r: (load[r], -r))
            out.append(_ChunkInfo(ChunkKind.PACKED, tuple((q, 0, lens[q]) for q in sorted(members)), tokens,
                                  sp * own[busiest] + beta, 0))
            rest = left
        return tuple(out)

    def _segment_cuts(self) -> list[tuple[int, list[int]]]:
        """Segment-level training: the sequences longer than ``segment_tokens`` (longest first), cut
        into their segments."""
        seg = self.segment_tokens
        return [(i, segment_cuts(self.lens[i], seg)) for i in self.order if self.lens[i] > seg]

    def by_tokens(self, token_budget: int, split: bool) -> Chunking:
        """Token-budget chunking of the baselines (no work balancing).

        ``split=False`` (*packed*): whole sequences best-fit decreasing into micro-batches of at
        most ``token_budget`` tokens; a longer sequence gets a micro-batch of its own (tokens are
        never dropped). ``split=True`` (*split*, Seq1F1B-like): a sequence longer than
        ``token_budget`` is cut into ``ceil(len / token_budget)`` equal-length slices; short
        sequences are packed up to ``token_budget`` tokens, tails included."""
        if token_budget < 1:
            raise PlanError(f"the token budget per micro-batch must be at least 1 (got {token_budget})")
        lens = self.lens
        cuts: list[tuple[int, list[int]]] = []
        if split:
            for i in self.order:
                n = lens[i]
                if n <= token_budget:
                    break
                k = -(-n // token_budget)
                q, r = divmod(n, k)
                cuts.append((i, [q + 1] * r + [q] * (k - r)))
        if self.segment_tokens is not None:
            cuts = self._segment_cuts()
        chains, packed = self._pack(cuts, self.order[len(cuts):], math.inf, token_budget, by_work=False)
        return Chunking(tuple(lens), math.inf, int(token_budget), chains, packed, self.segment)

    def tapered(self, ch: Chunking, fraction: float, group_cuts: Sequence[int] = ()) -> Chunking | None:
        """``ch`` with the first backward of each pipeline group made lighter: the last chunk of
        the group's first chain (its sequence's tail slice, plus the short sequences packed with
        it) keeps ``fraction`` of its tail slice's work, a split chunk before it takes the rest
        (``group_cuts``: as for :meth:`Chunking.assemble`).

        Before its first backward a stage waits for that chunk's forward and backward through
        every later stage, less the forwards it runs meanwhile: what an early stage that is the
        slowest one (the embedding, more layers) loses once per group. The cut shortens that wait
        for one per-chunk constant more, so it pays where chunks are long against ``beta`` (few
        chunks per step, e.g. on CPU). ``None`` when there is nothing to cut (no chain, or a tail
        slice of one token)."""
        if not 0.0 < fraction < 1.0:
            raise PlanError(f"taper fraction must be within (0, 1) (got {fraction})")
        if self.segment_tokens is not None:  # slices are the segments: nothing to cut
            return None
        a, b, beta, x = self.a, self.b, self.beta, self.extra

        def info(kind: ChunkKind, q: int, lo: int, n: int, rest: tuple = (), rest_work: float = 0.0) -> _ChunkInfo:
            hi = lo + n
            return _ChunkInfo(kind, ((q, lo, n),) + rest, n + sum(r[2] for r in rest),
                              a * (hi * hi - lo * lo) + (b - x) * n + rest_work + beta, n)

        chains = list(ch.chains)
        changed = False
        for i in sorted({0, *group_cuts}):
            if i >= len(chains):
                continue
            *head, last = chains[i]
            (q, lo, n), rest = last.parts[0], last.parts[1:]
            if n < 2:
                continue
            base = _prefix_work(lo, a, b)
            tail = a * ((lo + n) ** 2 - lo * lo) + (b - x) * n  # the tail slice's work in the chunk's
            m = max(1, min(n - 1, round(_inverse_work(base + (1.0 - fraction) * (tail + x * n), a, b)) - lo))
            # the short sequences' work as the chunk had it (per layer; beta left out)
            rest_work = last.work - beta - tail
            chains[i] = (*head, info(ChunkKind.SPLIT, q, lo, m), info(ChunkKind.HYBRID, q, lo + m, n - m, rest, rest_work))
            changed = True
        return dataclasses.replace(ch, chains=tuple(chains)) if changed else None

    def _pack(self, cuts: list[tuple[int, list[int]]], short: list[int], target_work: float, token_cap: int,
              *, by_work: bool) -> tuple[tuple[tuple[_ChunkInfo, ...], ...], tuple[_ChunkInfo, ...]]:
        """Chains of the cut sequences (in the given order) and packed chunks: ``short``
        sequences (longest first) go best-fit decreasing into the tail buckets and new buckets,
        under ``target_work`` (if ``by_work``) and ``token_cap``."""
        a, b, beta, lens, work = self.a, self.b, self.beta, self.lens, self.work
        x = self.extra  # balancing counts it per token; the chunk's layer work does not
        chains: list[list[_ChunkInfo]] = []
        tails: list[tuple[int, int, int] | None] = []
        members: list[list[int]] = []
        bwork: list[float] = []
        btok: list[int] = []
        for i, parts in cuts:
            chain, start = [], 0
            for length in parts[:-1]:
                end = start + length
                chain.append(_ChunkInfo(ChunkKind.SPLIT, ((i, start, length),), length,
                                        a * (end * end - start * start) + (b - x) * length + beta, length))
                start = end
            chains.append(chain)
            n = lens[i]
            tails.append((i, start, n - start))
            members.append([])
            bwork.append(a * (n * n - start * start) + b * (n - start))
            btok.append(n - start)
        # Best fit: `keys` sorted by (room left, bucket id) in the binding resource (work, or
        # tokens when the cap is reached before the time target); the tightest bucket that
        # fits first, the other resource checked while scanning up.
        if by_work and math.isfinite(target_work) and b * token_cap < target_work:
            by_work = False
        if by_work:
            keys = sorted((target_work - w, k) for k, w in enumerate(bwork))
        else:
            keys = sorted((float(token_cap - t), k) for k, t in enumerate(btok))
        slack = target_work * _TOL if math.isfinite(target_work) else 0.0
        limit = target_work + slack
        insort, bisect_left = bisect.insort, bisect.bisect_left
        for i in short:
            n = lens[i]
            w = work[i]
            j = bisect_left(keys, ((w - slack) if by_work else n,))
            if by_work:
                while j < len(keys) and btok[keys[j][1]] + n > token_cap:
                    j += 1
            else:
                while j < len(keys) and bwork[keys[j][1]] + w > limit:
                    j += 1
            if j == len(keys):
                k = len(tails)
                tails.append(None)
                members.append([i])
                bwork.append(w)
                btok.append(n)
            else:
                k = keys.pop(j)[1]
                members[k].append(i)
                bwork[k] += w
                btok[k] += n
            insort(keys, ((target_work - bwork[k]) if by_work else float(token_cap - btok[k]), k))
        full_chains: list[tuple[_ChunkInfo, ...]] = []
        packed: list[_ChunkInfo] = []
        for k, tail in enumerate(tails):
            rest = tuple((q, 0, lens[q]) for q in sorted(members[k]))
            if tail is not None:
                hybrid = _ChunkInfo(ChunkKind.HYBRID, (tail,) + rest, btok[k], bwork[k] - x * btok[k] + beta, tail[2])
                full_chains.append(tuple(chains[k]) + (hybrid,))
            else:
                # buckets open in decreasing length of their first sequence: largest first
                packed.append(_ChunkInfo(ChunkKind.PACKED, rest, btok[k], bwork[k] - x * btok[k] + beta, 0))
        return tuple(full_chains), tuple(packed)

