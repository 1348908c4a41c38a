"""A stage of several GPUs in the pure planner (no torch): the cost model's sequence-parallel
terms, the sharded static memory, the ``sp-only`` baseline, balanced replicas and
``concertina plan --sp``."""

import dataclasses
import math

import pytest

from concertina_hf.tools import cli
from concertina_hf.planning import (
    CostModel, DeviceSpec, InfeasiblePlanError, Plan, PlanError, StageLayout, balance_replicas, ideal_step_time,
    partition_layers, plan_step, simulate,
)
from concertina_hf.planning.lpt import lpt_assign, sequence_cost
from concertina_hf.planning.replicas import split_by_count
from concertina_hf.planning.strategies.sp_only import ulysses_degrees
from concertina_hf.planning.sharding import PER_DOC
from concertina_hf.planning.types import Chunk, ChunkKind, Slice

GIB = 2**30
# LLaMA-13B shapes (40 heads) and a GQA model with fewer K/V heads than GPUs of a stage
LLAMA13B = dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=40, intermediate_size=13824,
                vocab_size=32000, num_hidden_layers=40)
GQA = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, intermediate_size=2816,
           vocab_size=32000, num_hidden_layers=8)
SMALL = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408,
             vocab_size=8192, num_hidden_layers=8)


def _chunk(*slices, kind=ChunkKind.PACKED):
    return Chunk(0, kind, tuple(Slice(q, c, n) for q, c, n in slices))


# ------------------------------------------------------------------------------ cost model
def test_compute_and_activations_per_gpu_are_divided_by_sp():
    import dataclasses

    full = CostModel.from_hf_config(LLAMA13B, DeviceSpec.a800())
    # weight gradients before accumulation: per backward and whole on every GPU, not divided
    # and the int64 token ids and targets of the whole chunk (a rank's share is a view of them)
    consts = ("bwd_transient_bytes", "head_bwd_transient_bytes", "embed_bwd_transient_bytes", "ids_bytes_per_token")
    assert all(getattr(full.with_parallel(sp=8), k) == getattr(full, k) > 0 for k in consts)
    # (and the head's backward per token, the last stage's largest transient: a GPU's share, with
    # no layer's extra)
    one = dataclasses.replace(full, head_bwd_transient_bytes_per_token=0.0, **{k: 0.0 for k in consts})
    eight = one.with_parallel(sp=8)
    layout = StageLayout.even(40, 4)
    for chunk in (_chunk((0, 0, 8192)), _chunk((0, 0, 4096), (1, 0, 2048)),
                  _chunk((0, 16384, 4096), kind=ChunkKind.SPLIT)):
        # compute: every per-token and per-pair term over 8 GPUs; the per-call overhead is not
        c1, c8 = one.layer_compute_time(chunk.slices), eight.layer_compute_time(chunk.slices)
        assert c8 - eight.beta == pytest.approx((c1 - one.beta) / 8, rel=1e-12)
        # forward = compute + the four all-to-alls, backward = bwd_factor * compute + four more
        assert eight.layer_fwd_time(chunk.slices) == pytest.approx(c8 + eight.a2a_time(chunk.num_tokens), rel=1e-12)
        assert eight.layer_bwd_time(chunk.slices) == pytest.approx(2 * c8 + eight.a2a_time(chunk.num_tokens),
                                                                   rel=1e-12)
        # activations: 1/8 of one GPU's, plus per saved (or replayed) layer and token the attention
        # output's second storage (the kernel's, heads of the GPU, and the output projection's
        # input, its tokens): 40 heads x 128 x 2 bytes / 8 (no K/V replicated: 40 K/V heads)
        extra = 40 * 128 * 2 / 8 * chunk.num_tokens
        for stage in range(4):
            for r in (0, 3, 10):
                assert eight.act_memory(layout, stage, chunk, r) == pytest.approx(
                    one.act_memory(layout, stage, chunk, r) / 8 + (10 - r) * extra, rel=1e-12)
                assert eight.transient_memory(layout, stage, chunk, r) == pytest.approx(
                    one.transient_memory(layout, stage, chunk, r) / 8 + (extra if r == 10 else 0), rel=1e-12)
            # each sp rank sends its token shard to the same sp rank of the next stage
            assert eight.p2p_time(chunk) - eight.p2p_latency_s == pytest.approx(
                (one.p2p_time(chunk) - one.p2p_latency_s) / 8, rel=1e-12)
    # relative to the model's own sp; the ideal bound spreads over every GPU
    assert one.with_parallel(sp=2).with_parallel(sp=8).alpha_attn == pytest.approx(eight.alpha_attn, rel=1e-12)
    lens = [100_000, 3000, 20]
    assert ideal_step_time(lens, eight, layout) == pytest.approx(ideal_step_time(lens, one, layout) / 8, rel=1e-12)
    # sp = 1 is the model itself
    assert one.with_parallel(sp=1) == one


def test_all_to_all_time_formula():
    dev = DeviceSpec(intra_node_bandwidth=100e9, intra_node_latency_s=1e-5, inter_node_bandwidth=10e9,
                     inter_node_latency_s=3e-5, gpus_per_node=8)
    one = CostModel.from_hf_config(LLAMA13B, dev)
    h, b = 5120, 2
    assert one.a2a_bytes_per_token == b * (h + h + h + h)  # q, k, v, attention output
    assert one.a2a_time(4096) == 0.0
    tokens = 65536
    # within a node: 4 latencies + the rank's shard, all but its own 1/sp of it, over NVLink
    for sp in (2, 4, 8):
        moved = 4 * h * b * tokens / sp * (sp - 1) / sp
        assert one.with_parallel(sp=sp).a2a_time(tokens) == pytest.approx(4 * 1e-5 + moved / 100e9, rel=1e-12)
    # across two nodes of 8 (sp = 20 divides 40 heads): the share leaving the node sets the time
    sp = 20
    moved = 4 * h * b * tokens / sp * (sp - 1) / sp
    expect = 4 * 3e-5 + max(moved * 12 / 19 / 10e9, moved * 7 / 19 / 100e9)
    assert one.with_parallel(sp=sp).a2a_time(tokens) == pytest.approx(expect, rel=1e-12)
    # GQA with 2 K/V heads on 4 GPUs: K and V replicated to 4 heads, as DeepSpeed's Ulysses does
    g = CostModel.from_hf_config(GQA, dev)
    head = 64 * 2
    assert g.with_parallel(sp=4).a2a_time(8192) == pytest.approx(
        4 * 1e-5 + head * (16 + 4 + 4 + 16) * 8192 / 4 * 3 / 4 / 100e9, rel=1e-12)
    # and each GPU keeps one whole K/V head of the slices later slices attend to
    assert g.with_parallel(sp=4).kv_bytes_per_token == pytest.approx(g.kv_bytes_per_token / 2, rel=1e-12)
    assert g.with_parallel(sp=2).kv_bytes_per_token == pytest.approx(g.kv_bytes_per_token / 2, rel=1e-12)
    # a saved layer's activations on one GPU: 1/sp of one GPU's plus the attention output's
    # second storage (16 heads of 64, 2 bytes, / sp) and, at sp = 4 > 2 K/V heads, the kernel's
    # replicated K and V (one head each instead of half a head: 2 x (4 - 2) heads / 4)
    assert g.with_parallel(sp=2).act_bytes_per_token == pytest.approx(g.act_bytes_per_token / 2 + 128 * 16 / 2)
    assert g.with_parallel(sp=4).act_bytes_per_token == pytest.approx(
        g.act_bytes_per_token / 4 + 128 * (16 + 2 * (4 - 2)) / 4)
    assert g.with_parallel(sp=2).with_parallel(sp=4).act_bytes_per_token == pytest.approx(
        g.with_parallel(sp=4).act_bytes_per_token, rel=1e-12)
    assert g.with_parallel(sp=4).with_parallel(sp=1).act_bytes_per_token == pytest.approx(
        g.act_bytes_per_token, rel=1e-12)
    # a backward of a stage counts one a2a per layer (plus one per recomputed layer)
    layout = StageLayout.even(40, 4)
    m8 = one.with_parallel(sp=8)
    chunk = _chunk((0, 0, tokens))
    base = m8.bwd_time(layout, 1, chunk, 0)
    assert m8.bwd_time(layout, 1, chunk, 3) - base == pytest.approx(
        3 * (m8.layer_compute_time(chunk.slices) + m8.a2a_time(tokens)), rel=1e-9)
    assert m8.comm_time(layout, 1, chunk, True, 3) == pytest.approx(13 * m8.a2a_time(tokens), rel=1e-12)
    # Ulysses gives each GPU whole heads: the error names the setting
    with pytest.raises(PlanError, match="does not divide the model's 40 attention heads.*"
                                        "set sequence_parallel_size to a divisor of 40"):
        one.with_parallel(sp=16)


def test_fitted_all_gather_and_reduce_scatter_time_per_doc_chunks():
    """A per-doc chunk's K/V all-gather (forward, recomputed layers) and dK/dV reduce-scatter
    (backward) at their own fitted latency and bandwidth (gloo's reduce-scatter costs several
    all-gathers); unfitted (0), both the intra-node link's."""
    dev = DeviceSpec(intra_node_bandwidth=100e9, intra_node_latency_s=1e-5, gpus_per_node=8)
    analytic = CostModel.from_hf_config(SMALL, dev).with_parallel(sp=4)
    fitted = dataclasses.replace(analytic, all_gather_latency_s=1e-3, all_gather_bandwidth=2e9,
                                 reduce_scatter_latency_s=8e-3, reduce_scatter_bandwidth=5e8)
    chunk = dataclasses.replace(_chunk((0, 0, 4096), (1, 0, 2048)), placement=(PER_DOC, PER_DOC))
    moved = analytic.rank_model().kv_bytes_per_token * 6144 * 3 / 4  # (sp - 1) / sp of the K/V
    assert analytic.gather_kv_time(6144) == analytic.gather_kv_time(6144, backward=True) == pytest.approx(
        1e-5 + moved / 100e9, rel=1e-12)
    ag, rs = 1e-3 + moved / 2e9, 8e-3 + moved / 5e8
    assert (fitted.gather_kv_time(6144), fitted.gather_kv_time(6144, backward=True)) == pytest.approx((ag, rs))
    assert fitted.placed_layer_time(chunk) - analytic.placed_layer_time(chunk) == pytest.approx(
        ag + rs - 2 * analytic.gather_kv_time(6144), rel=1e-9)
    layout = StageLayout.even(8, 2)  # 4 layers a stage; 2 recomputed: their forward gathers again
    assert fitted.comm_time(layout, 1, chunk, False) == pytest.approx(4 * ag)
    assert fitted.comm_time(layout, 1, chunk, True, 2) == pytest.approx(4 * rs + 2 * ag)
    assert (fitted.bwd_time(layout, 1, chunk, 2) - analytic.bwd_time(layout, 1, chunk, 2)) == pytest.approx(
        4 * rs + 2 * ag - 6 * analytic.gather_kv_time(6144), rel=1e-9)
    # a slow reduce-scatter makes per-doc dearer than Ulysses, which the analytic link prefers
    ulysses = _chunk((0, 0, 4096), (1, 0, 2048))
    assert analytic.placed_layer_time(chunk) < analytic.placed_layer_time(ulysses)
    assert fitted.placed_layer_time(chunk) > fitted.placed_layer_time(ulysses)
    # a stage spanning nodes keeps the links (the fit describes one node's group)
    wide = dataclasses.replace(fitted, gpus_per_node=2)
    assert wide.gather_kv_time(6144, backward=True) == wide._collective_time(moved, 1)
    assert CostModel.from_dict(fitted.to_dict()) == fitted


def test_static_memory_follows_the_sharding():
    one = CostModel.from_hf_config(LLAMA13B, DeviceSpec.a800())
    layout = StageLayout.even(40, 4)
    params = [one.static_memory(layout, s) / 16 for s in range(4)]
    for dp, sp in ((1, 8), (2, 4), (4, 8)):
        m = one.with_parallel(sp=sp, state_shards=dp * sp)
        assert m.state_shards == dp * sp
        # weights and gradients (bf16) whole on every GPU, fp32 master + Adam moments sharded
        assert (m.static_bytes_per_param, m.sharded_bytes_per_param) == (4.0, 12.0)
        for s in range(4):
            assert m.static_memory(layout, s) == pytest.approx(params[s] * (4 + 12 / (dp * sp)), rel=1e-12)
        # gathered once per step and reduce-scattered once: two collectives of the stage's bf16 weights
        n = dp * sp
        bw = m.intra_node_bandwidth if n <= 8 else m.inter_node_bandwidth
        lat = m.intra_node_latency_s if n <= 8 else m.inter_node_latency_s
        assert m.step_sync_time(layout, 0) == pytest.approx(2 * (lat + params[0] * 2 * (n - 1) / n / bw), rel=1e-9)
    # ZeRO-3 (sp-only): everything over all ranks plus two gathered layers and the embedding
    z = one.with_parallel(sp=8, state_shards=32, zero3=True)
    whole = StageLayout.even(40, 1)
    total = one.static_memory(whole, 0) / 16
    gathered = 2 * one.layer_params + max(one.embed_params, one.head_params)
    assert z.static_memory(whole, 0) == pytest.approx(total * 16 / 32 + 2 * gathered, rel=1e-12)
    assert z.step_sync_time(whole, 0) == 0.0
    # the motivating case: LLaMA-13B at pp=4 fits 80 GB per GPU once a stage is 8 GPUs
    assert one.static_memory(layout, 0) > 50 * 1e9
    assert one.with_parallel(sp=8).static_memory(layout, 0) < 20 * GIB


def test_a_stage_of_eight_gpus_plans_what_one_gpu_cannot():
    """LLaMA-13B at pp=4, 64 long-tailed sequences up to 64K tokens: no plan on one 80 GB GPU
    per stage (the issue's motivating case), a plan that fits 80 GB per GPU on 8 GPUs per stage,
    whose simulation counts the all-to-alls and the once-per-step state sync."""
    from concertina_hf.tools import data

    one = CostModel.from_hf_config(LLAMA13B, DeviceSpec.a800())
    lens = data.sample_lengths("github", 64, 65536, 0)
    layout = partition_layers(one, 4)
    with pytest.raises(InfeasiblePlanError):
        plan_step(lens, one, layout, 80 * GIB, "adaptive", solver="greedy")
    eight = one.with_parallel(sp=8)
    plan = plan_step(lens, eight, layout, 80 * GIB, "adaptive", solver="greedy").validate()
    sim = simulate(plan, eight)
    assert max(sim.peak_memory_bytes) <= 80 * GIB and plan.predicted == sim.stats()
    assert sim.comm_time_s > 0 and sim.sync_time_s == max(eight.step_sync_time(layout, s) for s in range(4))
    assert sim.step_time_s >= ideal_step_time(lens, eight, layout)


# ------------------------------------------------------------------------------ sp-only
def test_ulysses_degrees_divide_gpus_and_heads():
    assert ulysses_degrees(32, 40) == [8, 4, 2, 1]
    assert ulysses_degrees(32, 52) == [4, 2, 1]
    assert ulysses_degrees(8, 8) == [8, 4, 2, 1]


# (2 x 2: the 30000-token sequence whole over sp=4 holds 7500 tokens' float32 logit gradients in
# the head's backward, about 0.5 GiB a GPU)
@pytest.mark.parametrize("pp,sp,budget_gib", [(2, 1, 0), (2, 2, 1.1), (4, 2, 0.6)])
def test_sp_only_plans_are_valid_and_fit(pp, sp, budget_gib):
    base = CostModel.from_hf_config(SMALL, DeviceSpec.cpu())
    cost = base.with_parallel(sp=sp) if sp > 1 else base
    layout = StageLayout.even(8, pp)
    lens = [30000, 9000, 4000, 2500, 900, 800, 300, 200, 120, 64, 20, 7]
    budget = int(budget_gib * GIB)
    plan = plan_step(lens, cost, layout, budget, "sp-only").validate()
    assert Plan.from_json(plan.to_json()) == plan
    gpus = pp * sp
    u, d = plan.knob("sp"), plan.knob("data_parallel")
    assert u * d == gpus and 8 % u == 0 and plan.knob("zero3") is True and plan.knob("state_shards") == gpus
    assert plan.num_stages == 1 and plan.layout.layer_ranges == ((0, 8),)
    # whole sequences, never split; rounds of at most d micro-batches; uniform recompute
    assert all(c.kind is ChunkKind.PACKED for c in plan.chunks)
    assert all(len(g) <= d for g in plan.groups)
    assert len({r for row in plan.recompute for r in row}) == 1
    tb = plan.knob("token_budget")
    assert all(c.num_tokens <= tb or len(c.slices) == 1 for c in plan.chunks)
    # scored by the same simulator, under the plan's own layout
    sim = simulate(plan, cost)
    assert plan.predicted == sim.stats()
    assert budget == 0 or sim.peak_memory_bytes[0] <= budget
    assert sim.step_time_s >= ideal_step_time(lens, cost, layout) * (1 - 1e-9)
    # deterministic
    assert plan_step(lens, cost, layout, budget, "sp-only").fingerprint() == plan.fingerprint()
    # a round lasts as long as its slowest micro-batch, forward then backward
    ucost = cost.for_plan(plan)
    expect = 0.0
    for g in plan.groups:
        f = [ucost.fwd_time(plan.layout, 0, plan.chunks[c]) for c in g]
        b = [ucost.bwd_time(plan.layout, 0, plan.chunks[c], plan.recompute[0][c]) for c in g]
        expect += max(f) + max(b)
    assert sim.step_time_s == pytest.approx(expect, rel=1e-9)


def test_sp_only_fixed_knobs_and_refusals():
    cost = CostModel.from_hf_config(SMALL, DeviceSpec.cpu())
    layout = StageLayout.even(8, 4)
    lens = [5000, 300, 200, 900]
    plan = plan_step(lens, cost, layout, 0, "sp-only", sp=2, token_budget=1024, recompute_layers=3)
    assert (plan.knob("sp"), plan.knob("data_parallel"), plan.knob("token_budget")) == (2, 2, 1024)
    assert all(r == 3 for r in plan.recompute[0])
    with pytest.raises(PlanError, match="sp=3 must divide"):
        plan_step(lens, cost, layout, 0, "sp-only", sp=3)
    with pytest.raises(InfeasiblePlanError, match="GiB.*sequence 0 .*memory_budget"):
        plan_step([2_000_000, 20], cost, layout, int(0.5 * GIB), "sp-only")
    with pytest.raises(InfeasiblePlanError, match="below its static memory alone"):
        plan_step(lens, cost, layout, 1000, "sp-only")


# ------------------------------------------------------------------------------ replicas
def test_replica_splits_are_deterministic_helpers():
    assert lpt_assign([5, 1, 4, 3, 3], 2) == [[0, 4], [1, 2, 3]]
    assert split_by_count(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    cost = CostModel.from_hf_config(SMALL, DeviceSpec.cpu())
    # attention makes the cost superlinear
    assert sequence_cost(20000, cost) > 2 * sequence_cost(10000, cost)


def test_balanced_replicas_beat_count_split_on_a_skewed_batch():
    cost = CostModel.from_hf_config(SMALL, DeviceSpec.cpu())
    layout = StageLayout.even(8, 2)
    # the long documents first in batch order: a count split gives them all to replica 0
    lens = [24000, 20000, 16000, 12000] + [600 + 37 * i % 900 for i in range(60)]
    kw = dict(solver="greedy")
    count = balance_replicas(lens, 4, cost, layout, 0, method="count", **kw)
    tokens = balance_replicas(lens, 4, cost, layout, 0, method="tokens", **kw)
    bal = balance_replicas(lens, 4, cost, layout, 0, method="balanced", **kw)
    for split in (count, tokens, bal):
        # every sequence runs once, on one replica; each replica's plan covers its sequences
        flat = sorted(i for g in split.assignment for i in g)
        assert flat == list(range(len(lens)))
        for g, plan, t in zip(split.assignment, split.plans, split.step_times_s):
            assert list(plan.seq_lens) == [lens[i] for i in g] and plan.predicted.step_time_s == t
        # no split beats its lower bound
        assert split.step_time_s >= split.lower_bound_s * (1 - 1e-12)
        assert 0 <= split.idle_fraction < 1
    assert bal.step_time_s < count.step_time_s
    assert bal.step_time_s <= tokens.step_time_s * (1 + 1e-12)
    assert bal.step_time_s <= 1.05 * bal.lower_bound_s
    again = balance_replicas(lens, 4, cost, layout, 0, method="balanced", **kw)
    assert again.assignment == bal.assignment and again.step_times_s == bal.step_times_s
    with pytest.raises(PlanError, match="unknown replica split"):
        balance_replicas(lens, 4, cost, layout, 0, method="random")


# ------------------------------------------------------------------------------ CLI
def test_cli_plan_with_sp(tmp_path, capsys):
    base = ["plan", "--distribution", "github", "--num-seqs", "64", "--max-len", "65536", "--seed", "0",
            "--model-config", "llama-13b", "--pp", "4", "--device", "a800",
            "--solver", "greedy"]
    out = tmp_path / "o.json"
    rc = cli.main([*base, "--strategy", "adaptive,sp-only", "--sp", "8", "--memory-gb", "80", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "8 GPUs each (--sp-mode auto)" in text and "80.0 GiB per GPU" in text and "sp-only" in text
    import json

    recs = {r["strategy"]: r for r in json.loads(out.read_text())}
    assert recs["adaptive"]["fits"] and recs["sp-only"]["fits"]
    assert max(recs["adaptive"]["peak_memory_bytes"]) <= 80 * GIB
    assert len(recs["sp-only"]["peak_memory_bytes"]) == 1
    # one GPU per stage: nothing fits (the motivating case)
    assert cli.main([*base, "--strategy", "adaptive", "--memory-gb", "80", "--json", str(out)]) == 1
    # --gpus-per-stage (a former alias of --sp) is gone
    with pytest.raises(SystemExit):
        cli.main([*base, "--gpus-per-stage", "8", "--memory-gb", "80", "--strategy", "adaptive"])
    with pytest.raises(SystemExit, match="--sp 16: .*40 attention heads.*set --sp to a divisor of 40"):
        cli.main([*base, "--sp", "16", "--strategy", "adaptive", "--sp-mode", "ulysses"])


def test_old_cost_model_files_still_load():
    d = CostModel.from_hf_config(SMALL, DeviceSpec.cpu()).to_dict()
    for name in [f.name for f in dataclasses.fields(CostModel)][-14:]:
        d.pop(name, None)
    m = CostModel.from_dict(d)
    assert m.sp == 1 and m.state_shards == 1 and not m.zero3 and math.isfinite(m.alpha_attn)
    # the dense-mask terms of a former CPU backend: loaded when 0, refused otherwise
    assert CostModel.from_dict({**d, "alpha_mask": 0.0, "mask_bytes_per_pair": 0.0}) == m
    with pytest.raises(ValueError, match="dense-mask attention backend.*profile the model again"):
        CostModel.from_dict({**d, "alpha_mask": 5e-9})


def test_doctests_pass():
    import doctest

    from concertina_hf.planning import lpt, replicas
    from concertina_hf.planning.strategies import sp_only

    for module in (lpt, replicas, sp_only):
        result = doctest.testmod(module)
        assert result.attempted >= 1 and result.failed == 0, module.__name__


def test_gantt_draws_all_to_alls_and_rounds(tmp_path):
    pytest.importorskip("matplotlib")
    from concertina_hf.planning.viz import describe_parallelism, plot_gantt

    cost = CostModel.from_hf_config(SMALL, DeviceSpec.cpu()).with_parallel(sp=2)
    layout = StageLayout.even(8, 2)
    lens = [9000, 4000, 2500, 900, 300, 120, 20]
    for strategy in ("adaptive", "sp-only"):
        plan = plan_step(lens, cost, layout, 0, strategy, solver="greedy")
        sim = simulate(plan, cost)
        out = plot_gantt(plan, sim, tmp_path / f"{strategy}.png", cost=cost)
        assert (tmp_path / f"{strategy}.png").stat().st_size > 10_000 and out.endswith(".png")
        # the title says what runs: sp-only is one stage in Ulysses groups, not the requested pp x sp
        u, d = plan.knob("sp"), plan.knob("data_parallel")
        want = ("pp 2 x sp 2" if strategy == "adaptive" else
                f"1 stage: {d} Ulysses group{'s' if d > 1 else ''} of sp {u}"
                f"{' (data parallel, ZeRO-3)' if d > 1 else ' (ZeRO-3)'} on 4 GPUs")
        assert describe_parallelism(plan, 2, 2) == want
        svg = tmp_path / f"{strategy}.svg"
        plot_gantt(plan, sim, svg, cost=cost)
        assert f"{strategy}: {plan.num_chunks} chunks, {want}" in svg.read_text()
