"""The chunking search of the adaptive strategy and its fixed-recompute ablations.

Candidates are workload-balanced chunkings (:mod:`..chunking`) for ``K`` slices of the longest
sequence (:data:`K_CANDIDATES`: 0.25, 0.5, 1, 2, 3, 4, 6, 8, ..., 64; below 1: chunks of up to
``1/K`` times its work; none with slices whose work is below the per-call constant ``beta``, the
chunk-size floor), searched coarse to fine with the analytic proxy
:meth:`~..chunking.Chunking.estimate`; token-capped variants of the leaders (at the largest
chunk needing no recompute whenever a budget is set; at the longest slice when memory binds);
on small steps, the baselines' chunkings too. The grouping DP refines the best. Then the
simulator decides (:func:`run_search`): the proxy's pick of each family gets evaluated (for
adaptive: a greedy recompute assignment and a simulation), then the next picks, then a hill
climb along each family's ladder from its fastest member, within a budget of simulated
chunk-stages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from ..budgets import proxy_budgets
from ..chunking import Chunking, SequenceBatch
from ..cost import CostModel
from ..plan import Plan
from ..types import PlanError, StageLayout
from .common import (
    ASSIGN_COST, MAX_SLICES, N_CANDIDATES, SEARCH_EFFORT, PlanRequest, max_chunks, token_budget_candidates,
    too_many_chunks,
)

__all__ = ["K_CANDIDATES", "Candidate", "ChunkingSearch", "candidate_knobs", "run_search"]

# K candidates of the adaptive search (slices of the longest sequence), clipped to its length
# and to the chunk-size floor (no slice's work below beta, see _floor_chunk_size);
# below 1: chunks of up to 1/K times the longest sequence's work (see Chunking / SequenceBatch)
K_CANDIDATES = (0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# chunk-stages under which a step counts as small (see ChunkingSearch.initial)
_SMALL_STEP = 320
# chunk-stages the adaptive search may simulate on a small step (about 40 ms)
_SMALL_STEP_SIM_BUDGET = 2400


def _k_candidates(longest: int, knobs: dict[str, Any]) -> list[float]:
    if "num_slices_longest" in knobs:
        k = knobs["num_slices_longest"]
        if not 0 < k <= longest:
            raise PlanError(f"num_slices_longest={k} must be within (0, {longest}] (the longest sequence's length)")
        return [k]
    cands = knobs.get("k_candidates", K_CANDIDATES)
    out = sorted({min(k, longest) if k >= 1 else k for k in cands if k > 0})
    if not out:
        raise PlanError(f"k_candidates {cands!r} holds no positive slice count")
    return out


def _floor_chunk_size(ks: list[float], batch: SequenceBatch) -> list[float]:
    """``ks`` with no slice of the longest sequence whose own work is below the per-call
    constant ``beta``: the chunk-size floor (a chunk of fewer than about ``beta / alpha_tok``
    tokens costs mostly its constant, so a cost model whose ``beta`` is underestimated must not
    shred the step). Unchanged when the floor does not bind."""
    beta = batch.beta
    if beta <= 0:
        return ks
    k_max = max(1, int(batch.work[batch.order[0]] / beta))
    return sorted({min(k, k_max) if k >= 1 else k for k in ks})


@dataclasses.dataclass
class Candidate:
    """One chunking of the adaptive search: ``slicing`` is ``"work"`` (workload-balanced,
    :meth:`SequenceBatch.balanced`), ``"tokens"`` (token-equal slices) or ``"whole"`` (whole
    sequences under a token budget); ``key`` identifies it."""

    key: tuple[float, int, str]
    est: float
    chunking: Chunking
    cuts: tuple[int, ...] = ()

    @property
    def k(self) -> float:
        return self.key[0]

    @property
    def slicing(self) -> str:
        return self.key[2]

    def order(self) -> tuple:
        """Best estimate first; candidates the proxy deems infeasible last, smallest chunks first."""
        if math.isinf(self.est):
            return (1, -self.k, self.chunking.token_cap, self.slicing)
        return (0, self.est, self.k, self.slicing)


class ChunkingSearch:
    """The adaptive search space: chunkings by ``(K, token cap, slicing)``, scored by the proxy
    :meth:`Chunking.estimate` (see :meth:`initial`)."""

    def __init__(self, strategy: str, req: PlanRequest):
        self.strategy, self.batch, self.cost, self.layout = strategy, req.batch, req.cost, req.layout
        self.knobs = req.knobs
        self.budgets = budgets = req.budgets
        # fixed recompute strategies are scored by simulation: rank them unconstrained
        self.proxy = proxy_budgets(budgets) if strategy == "adaptive" else None
        self.max_groups = int(self.knobs.get("max_groups", 2))
        if self.max_groups < 1:
            raise PlanError(f"max_groups must be at least 1 (got {self.max_groups})")
        self.ks = _k_candidates(self.batch.longest, self.knobs)
        if "num_slices_longest" not in self.knobs:
            self.ks = _floor_chunk_size(self.ks, self.batch)
        if self.knobs.get("time_target") is not None:
            self.ks = self.ks[:1]  # K only matters through the time target
        self.token_cap = req.token_cap
        self.user_capped = req.token_cap is not None and req.user_capped
        self.uncapped = req.token_cap if req.token_cap is not None else sum(self.batch.lens)
        self.cands: dict[tuple[float, int, str], Candidate] = {}
        # token caps / budgets below this cut the step into more chunks than a plan may have
        self.max_chunks = max_chunks(self.layout)
        self.min_cap = max(-(-sum(self.batch.lens) // self.max_chunks), -(-self.batch.longest // MAX_SLICES))
        # effort (see charge) and what evaluate_once skipped or already knows
        self.effort = 0.0
        self.evaluations = 0
        self.weight = ASSIGN_COST if strategy == "adaptive" and self.proxy is not None else 1
        self.skipped: set[tuple[float, int, str]] = set()
        self.smallest_skipped: int | None = None
        self._results: dict[tuple, Plan | None] = {}

    def charge(self, c: Candidate) -> float:
        """What evaluating ``c`` costs: its chunk-stages, times :data:`~.common.ASSIGN_COST` for
        adaptive with a memory budget (a recompute assignment, not a simulation)."""
        return c.chunking.num_chunks * self.layout.num_stages * self.weight

    def affordable(self, c: Candidate) -> bool:
        """Whether ``c`` may still be evaluated: not over :func:`~.common.max_chunks`, and
        within :data:`~.common.SEARCH_EFFORT` (the first evaluation always is) or known."""
        if self._identity(c) in self._results:
            return True
        if self._too_big(c):
            return False
        return self.evaluations == 0 or self.effort + self.charge(c) <= SEARCH_EFFORT

    def _too_big(self, c: Candidate) -> bool:
        """More chunks than :func:`~.common.max_chunks`, or a sequence in more than
        :data:`~.common.MAX_SLICES` slices."""
        ch = c.chunking
        return ch.num_chunks > self.max_chunks or max((len(x) for x in ch.chains), default=1) > MAX_SLICES

    @staticmethod
    def _identity(c: Candidate) -> tuple:
        return (c.chunking.chains, c.chunking.packed, c.cuts)

    def evaluate_once(self, c: Candidate, evaluate: Callable[[Candidate], Plan | None]) -> Plan | None:
        """``evaluate(c)``, charged to the effort; the known result when an evaluated candidate
        has the same chunks and groups; ``None`` (and ``c`` in :attr:`skipped`) when ``c`` is not
        :meth:`affordable`."""
        ident = self._identity(c)
        if ident in self._results:
            return self._results[ident]
        if not self.affordable(c):
            self.skipped.add(c.key)
            if self._too_big(c):
                n = c.chunking.num_chunks
                self.smallest_skipped = n if self.smallest_skipped is None else min(n, self.smallest_skipped)
            return None
        self.effort += self.charge(c)
        self.evaluations += 1
        plan = self._results[ident] = evaluate(c)
        return plan

    def nothing_evaluated_error(self) -> PlanError | None:
        """The error of a search whose every candidate had too many chunks (``None`` if any ran)."""
        if self.evaluations or self.smallest_skipped is None:
            return None
        return too_many_chunks(self.strategy, self.batch.lens, self.layout, self.smallest_skipped, self.token_cap)

    def get(self, k: float, cap: int, slicing: str = "work") -> Candidate:
        key = (k, cap, slicing)
        if key not in self.cands:
            if slicing == "work":
                ch = self.batch.balanced(num_slices_longest=k, token_cap=cap, time_target=self.knobs.get("time_target"),
                                         split_threshold=self.knobs.get("split_threshold"))
            else:
                ch = self.batch.by_tokens(cap, split=(slicing == "tokens"))
            self.cands[key] = Candidate(key, ch.estimate(self.cost, self.layout, self.proxy), ch)
        return self.cands[key]

    def group(self, c: Candidate) -> Candidate:
        """The candidate with the grouping DP's cuts, when it lowers the estimate."""
        if self.strategy == "adaptive" and self.max_groups > 1 and not math.isinf(c.est) and not c.cuts:
            cuts, est = c.chunking.best_group_cuts(self.cost, self.layout, self.proxy, max_groups=self.max_groups)
            if est < c.est:
                c.cuts, c.est = cuts, est
        return c

    def initial(self) -> list[Candidate]:
        """Candidates, best first.

        ``K`` is searched coarse to fine: every other candidate first (0.25, 1, 3, 6, 12, ...),
        then the skipped neighbours of the best (the proxy is close to unimodal in ``K``).
        Without a user token cap, chunks are bounded by time only; the leaders and every ``K``
        the proxy rejects (its memory view is rough) also get variants capped at the largest
        chunk that needs no recompute (packed chunks of cheap short sequences otherwise hold
        more tokens, hence activations, than any slice) and, when memory binds (for adaptive:
        when the proxy sees recompute in a leader), at their longest slice. The first whenever a
        budget is set: a capped chunking can be faster even where memory does not bind
        (``[1187, 862+1+1]`` beats ``K=2``'s ``[1064, 985, 1+1]`` for lengths ``[1, 1, 2049]``
        on 3 stages: no tiny last chunk to fill and drain), and the fixed-recompute ablations,
        which always add it, must not find a faster chunking adaptive never sees. Small steps (few
        chunks), where discrete fill and drain effects escape the proxy and simulating is cheap,
        also get the baselines' chunkings: token-equal slices (Seq1F1B-like) and whole sequences
        under a token budget (a taper of ever smaller chunks at the end can beat equal chunks
        when there are only a few). The grouping DP runs for the best candidate and the climb's,
        and only when a single group needs recompute.
        """
        ks, uncapped = self.ks, self.uncapped
        for k in ks[::2]:
            self.get(k, uncapped)
        finite = [c for c in self.cands.values() if not math.isinf(c.est)]
        if finite:
            at = ks.index(min(finite, key=Candidate.order).k)
            for nb in (at - 1, at + 1):
                if 0 <= nb < len(ks):
                    self.get(ks[nb], uncapped)
        else:
            for k in ks[1::2]:
                self.get(k, uncapped)
        if not self.user_capped:
            ranked = sorted(self.cands.values(), key=Candidate.order)
            lead = ranked[:3] if not math.isinf(ranked[0].est) else ranked
            no_rc = _no_recompute_cap(self.cost, self.layout, self.budgets)
            binds = self.strategy != "adaptive" or any(
                c.chunking.needs_recompute(self.cost, self.layout, self.proxy) for c in lead)
            for c in [c for c in ranked if c in lead or math.isinf(c.est)]:
                first = c.chunking.chains[0][0].tokens if c.chunking.chains else self.batch.longest
                for cap in sorted({first, no_rc} if binds else {no_rc}):
                    if max(1, self.min_cap) <= cap < c.key[1]:
                        self.get(c.k, cap)
        fixed = "num_slices_longest" in self.knobs or self.knobs.get("time_target") is not None
        if self.strategy == "adaptive" and not fixed:
            leader = min(self.cands.values(), key=Candidate.order).chunking
            if leader.num_chunks * self.layout.num_stages <= _SMALL_STEP:
                self.baseline_candidates()
        ranked = sorted(self.cands.values(), key=Candidate.order)
        for c in ranked[:1]:
            self.group(c)
        return sorted(self.cands.values(), key=Candidate.order)

    def baseline_candidates(self) -> list[Candidate]:
        """The baselines' chunkings (token-equal slices of the longest, Seq1F1B-like; whole
        sequences under a token budget), best estimate first: adaptive can always emulate them."""
        longest, uncapped = self.batch.longest, self.uncapped
        out = [self.get(n, -(-longest // n), "tokens") for n in self._slice_counts()]
        if longest <= uncapped:  # a whole sequence must fit the user's cap
            out += [self.get(1, size, "whole") for size in self._token_budgets()]
        return sorted(out, key=Candidate.order)

    def _slice_counts(self) -> list[int]:
        """The token-equal family's slice counts of the longest: within the user's cap and
        :meth:`affordable` in size (no slice shorter than :attr:`min_cap`)."""
        longest = self.batch.longest
        return [n for n in N_CANDIDATES if n <= longest and self.min_cap <= -(-longest // n) <= self.uncapped]

    def _token_budgets(self) -> list[int]:
        """The whole-sequence family's token budgets, none below :attr:`min_cap`."""
        return [b for b in token_budget_candidates(self.batch.longest, self.token_cap) if b >= self.min_cap]

    def neighbours(self, c: Candidate) -> list[Candidate]:
        """The candidates next to ``c`` on its own ladder (``K`` for balanced chunkings, ``N``
        for token-equal ones, the token budget for whole sequences), same cap otherwise: the
        simulator's hill climb from the proxy's pick."""
        k, cap, slicing = c.key
        if slicing == "work":
            ladder = self.ks
            if k not in ladder:
                return []
            at = ladder.index(k)
            return [self.group(self.get(ladder[i], cap)) for i in (at - 1, at + 1) if 0 <= i < len(ladder)]
        if slicing == "tokens":
            longest = self.batch.longest
            ns = self._slice_counts()
            if k not in ns:
                return []
            at = ns.index(k)
            return [self.get(ns[i], -(-longest // ns[i]), "tokens") for i in (at - 1, at + 1) if 0 <= i < len(ns)]
        sizes = self._token_budgets()
        if cap not in sizes:
            return []
        at = sizes.index(cap)
        return [self.get(1, sizes[i], "whole") for i in (at - 1, at + 1) if 0 <= i < len(sizes)]


def _no_recompute_cap(cost: CostModel, layout: StageLayout, budgets: tuple[int, ...]) -> int:
    """Tokens per chunk at which 1F1B's ``p - s`` chunks in flight on stage ``s`` (plus the
    backward's transient gradients) fit every budget without recompute: the largest chunks
    that never need any (0 if even one token does not fit)."""
    p = layout.num_stages
    cap = math.inf
    for s in range(p):
        if not budgets[s]:
            continue
        per_tok = layout.num_stage_layers(s) * cost.act_bytes_per_token + \
            (cost.logits_bytes_per_token if layout.has_head(s) else 0.0)
        room = budgets[s] - cost.static_memory(layout, s)
        cap = min(cap, room / ((p - s) * per_tok + 2 * cost.hidden_bytes_per_token))
    return 0 if cap <= 0 else (10**12 if math.isinf(cap) else int(cap))


def candidate_knobs(c: Candidate, extra: dict[str, Any]) -> dict[str, Any]:
    """The settings a plan made from ``c`` reports (``plan.knobs``), ``extra`` last."""
    ch = c.chunking
    if c.slicing == "work":
        out = {"slicing": "work", "num_slices_longest": c.k, "token_cap": ch.token_cap, "time_target_s": ch.time_target}
    else:  # a baseline's chunking, found better on a small step
        out = {"slicing": c.slicing, "num_slices_longest": c.k, "token_budget": ch.token_cap}
    return {**out, "num_groups": len(c.cuts) + 1, **extra}


def run_search(search: ChunkingSearch, evaluate: Callable[[Candidate], Plan | None],
               phases: Sequence[tuple[int, float]]) -> tuple[Candidate, Plan] | None:
    """Simulate candidates and return the fastest ``(candidate, plan)`` (``None`` when nothing
    fits). Per phase ``(num_finalists, sim_budget)``: the proxy's pick of each family (they
    differ in what the proxy misses), then the next picks in the proxy's order until
    ``num_finalists`` fit and half the budget of simulated chunk-stages is spent, then a hill
    climb along each family's ladder from its fastest member while the budget lasts. A later
    phase continues where the previous one stopped, so it can only find a faster plan. Small
    steps, where each simulation is cheap, get at least 2400 chunk-stages per phase.

    Whatever the phases say, a candidate of more than :func:`~.common.max_chunks` chunks is never
    evaluated, one whose chunking equals an evaluated one's is not evaluated again, and after the
    first evaluation none is once the search's effort (:meth:`ChunkingSearch.charge`) would pass
    :data:`~.common.SEARCH_EFFORT`: an infeasible budget ends the hunt for a fitting candidate
    there (the candidates the proxy rejects come smallest chunks first, the likeliest to fit)."""
    p = search.layout.num_stages
    done: dict[tuple, tuple[float, int, Candidate, Plan] | None] = {}
    spent = 0.0

    def run(c: Candidate) -> None:
        nonlocal spent
        plan = search.evaluate_once(c, evaluate)
        if c.key in done or (plan is None and c.key in search.skipped):
            done.setdefault(c.key, None)
            return
        spent += c.chunking.num_chunks * p
        done[c.key] = None if plan is None else (plan.predicted.step_time_s, len(done), c, plan)

    ranked = search.initial()
    small = ranked[0].chunking.num_chunks * p <= _SMALL_STEP
    leaders: dict[str, Candidate] = {}
    for c in ranked:
        leaders.setdefault(c.slicing, c)
    for c in leaders.values():
        if not math.isinf(c.est) or c is ranked[0]:
            run(c)
    for num_finalists, sim_budget in phases:
        if small:
            sim_budget = max(sim_budget, _SMALL_STEP_SIM_BUDGET)  # each simulation is cheap there
        for c in ranked:
            if c.key in done:
                continue
            if sum(1 for v in done.values() if v) >= num_finalists and spent + c.chunking.num_chunks * p > sim_budget / 2:
                break
            run(c)
        while True:
            ok = [v for v in done.values() if v]
            fresh: list[Candidate] = []
            for family in ("work", "tokens", "whole"):  # K, N and token-budget ladders
                members = [v for v in ok if v[2].slicing == family]
                if members:
                    best = min(members, key=lambda v: (v[0], v[1]))
                    fresh += [nb for nb in search.neighbours(best[2])
                              if nb.key not in done and spent + nb.chunking.num_chunks * p <= sim_budget]
            fresh = [nb for nb in fresh if search.affordable(nb)]
            if not fresh:
                break
            for nb in fresh:
                if nb.key not in done:
                    run(nb)
    ok = [v for v in done.values() if v]
    if not ok:
        return None
    best = min(ok, key=lambda v: (v[0], v[1]))
    return best[2], best[3]
