"""The planner's contract under random calls: every ``plan_step`` call returns a plan
that passes ``validate()`` and fits its memory budget in simulation, or raises ``PlanError``.
Every search is bounded by counted work (``SEARCH_EFFORT``), not time; how long calls take (the
contract's 2 s) is measured by ``benchmarks/planner_fuzz.py``, not here: CPU and wall time
inflate on a loaded machine with shared cores (a 1.0 s call measured 2.8 s of CPU at load 12).

Calls are drawn over what users and adversaries give the planner: batches of 1 to 200 sequences
of 0 to 1M tokens (all of one token, many equal, long-tailed), pipelines of 1 to 8 stages, budgets
from below static memory to unconstrained (one for all stages or one per stage), token caps from
1 token up, every strategy of the registry, both recompute solvers, and three cost models (a
7B model at A800 rates, a tiny one at CPU rates, and the tiny one with every measured term of a
profiled model). The default test draws 150 calls (seconds). The large one (3000 calls, 3-8
minutes on 2 cores) runs with ``CONCERTINA_FUZZ_LARGE=1``, beside ``benchmarks/planner_fuzz.py``.
Derandomized: the same calls on every run.

Plus the cases the fuzz found: a tiny cap on a long step (thousands of chunks), a token cap of 1,
budgets no plan can meet (refused at once from a lower bound), near-static budgets and huge
batches (bounded search).
"""

import dataclasses
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from concertina_hf.planning.presets import MODEL_PRESETS
from concertina_hf.planning import (
    SOLVERS, STRATEGIES, Chunk, ChunkKind, CostModel, DeviceSpec, InfeasiblePlanError, PlanError, Slice, fits,
    SequenceBatch, partition_layers, plan_step, simulate, uniform_recompute,
)
from concertina_hf.planning.recompute import min_uniform_recompute
from concertina_hf.planning.strategies import PIPELINE_STRATEGIES, REGISTRY
from concertina_hf.planning.strategies.common import MAX_SLICES, max_chunks

_RECORDS = {r.name: r for r in REGISTRY}


def _no_search(monkeypatch) -> None:
    """Every strategy's search (what ``plan_step`` dispatches to once the step is checked)
    replaced by a failure: a ``PlanError`` raised with this in place came before any search."""
    from concertina_hf.planning import strategies

    def searched(request):
        raise AssertionError("plan_step searched instead of refusing the step from its bounds")

    for name, record in list(strategies._BY_NAME.items()):
        monkeypatch.setitem(strategies._BY_NAME, name, dataclasses.replace(record, run=searched))

_TINY = CostModel.from_hf_config(MODEL_PRESETS["tiny-llama"], DeviceSpec.cpu())
COSTS = {
    "llama-7b": CostModel.from_hf_config(MODEL_PRESETS["llama-7b"], DeviceSpec.a800()),
    "tiny-llama": _TINY,
    # every term the profiler measures, non-zero: K/V context kept by saved layers, stage
    # outputs, backward transients, checkpoint closures
    "tiny-profiled": dataclasses.replace(
        _TINY, context_bytes_per_token=_TINY.kv_bytes_per_token, output_bytes_per_token=_TINY.hidden_bytes_per_token,
        bwd_transient_bytes_per_token=3.0 * _TINY.hidden_bytes_per_token,
        head_bwd_transient_bytes_per_token=1.2 * _TINY.logits_bytes_per_token, ckpt_chunk_bytes_per_token=24.0,
        recompute_factor=0.9, source="profiled"),
}
# budget over a stage's static memory (0: unconstrained)
BUDGET_FACTORS = (0, 0.5, 1.0, 1.001, 1.01, 1.1, 1.5, 2, 4, 10, 100, 10**6)
# budget over a stage's static memory plus this times the longest sequence in flight at full
# recompute (below 1: refused from the lower bound; a little above: recompute and search bind)
INFLIGHT_FACTORS = (0.9, 1.0, 1.05, 1.2, 1.5, 2, 3, 5, 10, 30)


def _inflight(cost, layout, n):
    """Per stage, the bytes of an ``n``-token sequence in flight at full recompute (the bound of
    ``check_step``)."""
    whole = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, n),))
    return [cost.act_memory(layout, s, whole, layout.num_stage_layers(s)) for s in range(layout.num_stages)]


@st.composite
def batches(draw):
    """1-200 sequence lengths in 0..1M: all of one token, many equal, or long-tailed (with
    some 1s and 0s mixed in); at least one non-empty."""
    n = draw(st.sampled_from([1, 2, 5, 30, 200]) | st.integers(1, 200))
    kind = draw(st.sampled_from(["ones", "equal", "tailed"]))
    if kind == "ones":
        lens = [1] * n
    elif kind == "equal":
        lens = [draw(st.sampled_from([1, 2, 7, 4096, 65536, 10**6]) | st.integers(1, 10**6))] * n
    else:
        scale = draw(st.sampled_from([10, 300, 3000, 30000]))
        lens = draw(st.lists(st.integers(0, 100 * scale) | st.just(1) | st.integers(1, scale), min_size=n, max_size=n))
        lens = [min(10**6, x) for x in lens]
    if draw(st.booleans()) and n > 1:
        lens[draw(st.integers(0, n - 1))] = 0
    if max(lens) == 0:
        lens[0] = 1
    return lens


@st.composite
def calls(draw):
    name = draw(st.sampled_from(sorted(COSTS)))
    cost = COSTS[name]
    p = draw(st.integers(1, min(8, cost.num_layers)))
    layout = partition_layers(cost, p)
    lens = draw(batches())
    static = [cost.static_memory(layout, s) for s in range(p)]
    if draw(st.booleans()):  # around static memory
        factor = draw(st.sampled_from(BUDGET_FACTORS))
        per_stage = [s * factor for s in static]
    else:  # around the lower bound: static plus the longest sequence in flight, fully recomputed
        factor = draw(st.sampled_from(INFLIGHT_FACTORS))
        per_stage = [s + factor * a for s, a in zip(static, _inflight(cost, layout, max(lens)))]
    # one for all stages (the largest), or one per stage
    budget = int(max(per_stage)) if draw(st.booleans()) else [int(x) for x in per_stage]
    cap = draw(st.none() | st.sampled_from([1, 2, 16, 512, 4096, 65536]) | st.integers(1, 10**6))
    return dict(model=name, cost=cost, layout=layout, lens=lens, budget=budget, cap=cap,
                strategy=draw(st.sampled_from(STRATEGIES)), solver=draw(st.sampled_from(SOLVERS)))


def _check(call):
    cost, layout = call["cost"], call["layout"]
    try:
        plan = plan_step(call["lens"], cost, layout, call["budget"], call["strategy"],
                         max_tokens_per_chunk=call["cap"], solver=call["solver"])
    except PlanError:
        plan = None
    desc = {k: v for k, v in call.items() if k not in ("cost", "layout", "lens")}
    desc.update(stages=layout.num_stages, sequences=len(call["lens"]), longest=max(call["lens"]),
                tokens=sum(call["lens"]))
    if plan is None:
        return
    plan.validate()
    budgets = call["budget"] if isinstance(call["budget"], list) else [call["budget"]] * layout.num_stages
    if not _RECORDS[call["strategy"]].pipeline:  # sp-only: one stage of all GPUs, the tightest budget
        budgets = [min([b for b in budgets if b], default=0)]
    assert fits(plan, cost, budgets), f"plan over its budget: {desc}"
    assert plan.seq_lens == tuple(call["lens"])
    if call["cap"] is not None and call["strategy"] != "packed":  # packed keeps a long sequence whole
        long_alone = {i for i, n in enumerate(call["lens"]) if n > call["cap"]}
        assert all(c.num_tokens <= call["cap"] for c in plan.chunks
                   if not (len(c.slices) == 1 and c.slices[0].seq in long_alone
                           and c.slices[0].length == call["lens"][c.slices[0].seq])), desc


FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(call=calls())
def test_every_call_plans_or_refuses(call):
    _check(call)


@pytest.mark.skipif(os.environ.get("CONCERTINA_FUZZ_LARGE") != "1",
                    reason="3000 calls; set CONCERTINA_FUZZ_LARGE=1 (see the module docstring)")
@settings(FUZZ, max_examples=3000)
@given(call=calls())
def test_every_call_plans_or_refuses_large(call):
    _check(call)


# ------------------------------------------------------------------------------ found cases
def _layout(name, p):
    return COSTS[name], partition_layers(COSTS[name], p)


def _static(cost, layout):
    return max(cost.static_memory(layout, s) for s in range(layout.num_stages))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_token_cap_of_one_plans_a_small_step_and_names_the_field_on_a_long_one(strategy, monkeypatch):
    """``max_tokens_per_chunk=1``: a few tokens get a valid plan of one-token chunks (``packed``
    keeps each longer sequence whole, and full-recompute's plan passes its own validate()); a long step is refused at once, naming the
    setting and the smallest cap that works, and that cap plans."""
    cost, layout = _layout("tiny-llama", 2)
    splits = _RECORDS[strategy].splits_sequences
    plan = plan_step([5, 3, 1], cost, layout, 0, strategy, max_tokens_per_chunk=1).validate()
    if not splits:  # packed, sp-only: whole sequences
        assert sorted(c.num_tokens for c in plan.chunks) == [1, 3, 5]
    else:
        assert max(c.num_tokens for c in plan.chunks) == 1 and plan.num_chunks == 9
    lens = [4000, 3000, 1000] + [1] * 4000
    with monkeypatch.context() as m, pytest.raises(
            PlanError, match=r"a token cap of 1 per chunk cuts this step's 12000 tokens into at least "
                             r"\d+ chunks, more than the 2048 .* raise max_tokens_per_chunk to at least \d+ tokens") as e:
        _no_search(m)  # refused before any search
        plan_step(lens, cost, layout, 0, strategy, max_tokens_per_chunk=1)
    smallest = int(re.search(r"at least (\d+) tokens", str(e.value)).group(1))
    assert smallest == (16 if splits else 2)  # 4000 tokens in at most 256 slices; 2003 chunks
    assert (e.value.setting, e.value.limit) == ("max_tokens_per_chunk", smallest)
    plan_step(lens, cost, layout, 0, strategy, max_tokens_per_chunk=smallest).validate()
    with pytest.raises(PlanError, match="raise max_tokens_per_chunk to at least"):
        plan_step(lens, cost, layout, 0, strategy, max_tokens_per_chunk=smallest - 1)


@pytest.mark.parametrize("strategy", [r.name for r in REGISTRY if r.splits_sequences])
def test_a_cap_cutting_a_sequence_into_too_many_slices_is_refused_naming_the_smallest_cap(strategy):
    """All of a sequence's slices are in flight at once: the planner cuts a sequence into at most
    MAX_SLICES slices (one 4096-token sequence under a cap of 2 took seconds in the recompute
    model), and says which cap does."""
    cost, layout = _layout("llama-7b", 1)
    with pytest.raises(PlanError, match=rf"a token cap of 2 per chunk cuts sequence 0 \(4096 tokens\) into 2048 "
                                        rf"slices, more than the {MAX_SLICES} .* raise max_tokens_per_chunk to at "
                                        rf"least {4096 // MAX_SLICES} tokens"):
        plan_step([4096], cost, layout, 0, strategy, max_tokens_per_chunk=2)
    plan_step([4096], cost, layout, 0, strategy, max_tokens_per_chunk=4096 // MAX_SLICES).validate()


def test_a_last_token_heavier_than_the_time_target_is_a_tail_of_its_own():
    """With the longest sequence in one-token slices, the time target is its mean token's work,
    below the last token's of a sequence of more than half its length: that token ends the
    sequence as its tail (it became a split chunk holding a final slice, and an empty tail)."""
    cost = COSTS["llama-7b"]
    ch = SequenceBatch([100, 90, 60], cost).balanced(num_slices_longest=100, token_cap=1000)
    chunks, groups = ch.assemble()
    for c in chunks:
        for sl in c.slices:
            assert sl.length >= 1
            if c.kind.value == "split":
                assert sl.end < (100, 90, 60)[sl.seq]


def test_a_capped_longest_sequence_is_cut_in_cap_sized_slices_not_thousands():
    """Equal-work slices under a token cap need about (longest / cap)^2 of them; the longest is
    cut like the others instead (cap-sized slices first): a 153K-token sequence under a 4096
    cap in 38 slices, not 1024."""
    cost = _TINY
    ch = SequenceBatch([153308, 2000, 300], cost).balanced(num_slices_longest=1, token_cap=4096)
    chain = ch.chains[0]
    assert len(chain) == -(-153308 // 4096)
    assert all(ci.tokens <= 4096 for ci in chain)


@pytest.mark.parametrize("strategy", PIPELINE_STRATEGIES)  # (sp-only checks its own layout's memory)
@pytest.mark.parametrize("model,p,factor", [("llama-7b", 5, 1.01), ("llama-7b", 8, 2), ("tiny-llama", 2, 1.5)])
def test_a_budget_below_the_longest_sequence_in_flight_is_refused_at_once(strategy, model, p, factor, monkeypatch):
    """All of a sequence's tokens are in flight at once on every stage (its slices run backward
    in reverse order), so a stage whose budget cannot hold its static memory plus the longest
    sequence at the smallest bytes per token (every layer recomputed) admits no plan: refused
    from that bound before any search, not after seconds of it."""
    cost, layout = _layout(model, p)
    lens = [10**6] + [3000] * 199
    _no_search(monkeypatch)
    with pytest.raises(InfeasiblePlanError, match=r"sequence 0 \(1000000 tokens\) cannot fit stage \d+'s memory "
                                                  r"budget .* even recomputing every layer.*raise memory_budget"):
        plan_step(lens, cost, layout, int(_static(cost, layout) * factor), strategy, max_tokens_per_chunk=16)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_near_static_budgets_and_huge_batches_end_within_the_bound(strategy):
    """Budgets just above static memory with many chunks, and 200 long-tailed sequences up to 1M
    tokens on 8 stages: a plan within its budget or a PlanError, from a search bounded by counted
    work (these took over 10 s before; their time is the benchmark's business)."""
    cost, layout = _layout("llama-7b", 8)
    big = [10**6] + [int(3000 * 1.07**i) for i in range(199)]
    cases = [
        (cost, layout, [14118] + [1500] * 29, 1.01, None),
        (cost, layout, big, 0, None),
        (cost, layout, big, 10, 4096),
        (*_layout("tiny-llama", 8), [381325] + [5000] * 199, 1.01, 16),
        (*_layout("tiny-llama", 2), [3006, 12], 2, 2),
    ]
    for cost, layout, lens, factor, cap in cases:
        budget = int(_static(cost, layout) * factor)
        try:
            plan = plan_step(lens, cost, layout, budget, strategy, max_tokens_per_chunk=cap).validate()
            assert fits(plan, cost, [budget] * layout.num_stages)
        except PlanError as e:
            assert re.search(r"memory budget|max_tokens_per_chunk|chunks", str(e)), e


def test_the_chunk_limit_is_documented_per_pipeline_size():
    assert [max_chunks(partition_layers(COSTS["llama-7b"], p)) for p in (1, 4, 8)] == [2048, 2048, 1024]


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(name=st.sampled_from(sorted(COSTS)), p=st.integers(1, 8), n=st.integers(1, 12),
       lens=st.lists(st.integers(1, 4000), min_size=1, max_size=40), where=st.floats(0, 1.2))
def test_min_uniform_recompute_is_the_fewest_layers_that_fit_in_simulation(name, p, n, lens, where):
    """The baselines' uniform recompute comes from the recompute planner's memory model (no
    binary search of simulations): the layers it names fit in simulation and one fewer does not
    (or it is 0); ``None`` exactly when full recompute does not fit."""
    cost, layout = _layout(name, min(p, COSTS[name].num_layers))
    plan = plan_step(lens, cost, layout, 0, "split", num_slices=min(n, max(lens)), recompute_layers=0)
    zero = simulate(plan, cost).peak_memory_bytes
    full = simulate(uniform_recompute(plan, 10**6), cost).peak_memory_bytes
    budgets = [max(1, int(f + where * (z - f))) for z, f in zip(zero, full)]
    r = min_uniform_recompute(plan, cost, budgets)
    if r is None:
        assert not fits(uniform_recompute(plan, 10**6), cost, budgets)
        return
    assert fits(uniform_recompute(plan, r), cost, budgets)
    assert r == 0 or not fits(uniform_recompute(plan, r - 1), cost, budgets)
