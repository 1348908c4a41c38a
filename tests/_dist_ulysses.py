"""Worker of ``tests/launch/test_ulysses_launch.py``: one process per (stage, sequence-parallel rank)
on a gloo group.

The ranks form the package's own ``dp x pp x sp`` mesh (:meth:`Topology.build`); each rank builds
the same tiny models, computes the single-process HF reference itself, runs a set of hand-made
plans (packed chunks whose sequences straddle the shard boundary, split sequences carrying K/V,
hybrid chunks, recompute none / partial / full, chunk token counts not divisible by ``sp``) with
Ulysses inside every stage, reduces the gradients over the stage's ranks
(:func:`reduce_gradients`) and compares the loss and its stage's gradients. Models: Llama with
``K = H`` K/V heads (split over ``sp``), Qwen2 with ``K = 2`` (split) and ``K = 1 < sp``
(replicated), gpt-oss (attention sinks, sliding layers, MoE; with K = 1 replicated too at pp=1),
and a tied-embedding Llama when the pipeline has two stages; the sink layouts each rank's attention gets (per head, per head and token); one plan also under
bf16 autocast (bf16 tolerances). At pp=1 each rank also
runs the plans alone (no sp) for the activation peaks. With two replicas (dp=2) each replica runs
its share of the batch instead (:func:`_replicas`). Results go to ``<outdir>/rank<r>.json``; the
test asserts on them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _helpers import gloo_rank  # noqa: E402
from _runtime_cases import (  # noqa: E402
    CHUNKINGS, GROUPED, SEQ_LENS, allocated_activation_peak, batch, compare_grads, grad_error, make_plan, reference,
    tiny_config,
)

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
# bf16 autocast: the tolerances of tests/_dist_runtime.py (see tests/runtime/test_runtime.py, AMP_*)
AMP_LOSS_TOL = 1e-3
AMP_GRAD_TOL = 5e-2
AMP_ROUNDED = 2.0**-8  # computed in bf16: at least its unit roundoff away from float32 (_dist_runtime.py)
NUM_LAYERS = 4
PLANS = (("packed", "none"), ("split", "partial"), ("hybrid", "full"), ("hybrid-2groups", "partial"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def worker(outdir: str, pp: int, sp: int, dp: int = 1) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gloo_rank(outdir, lambda report: _run(rank, world, pp, sp, dp, report), timeout_s=300,
              cases=[], memory=[], allocated=[])


def _model(kind: str, kv_heads: int | None = None, tied: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(kind, NUM_LAYERS)
    if kv_heads is not None:
        cfg.num_key_value_heads = kv_heads
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model.float()


def _gpt_oss(seed: int = 5, kv_heads: int | None = None):
    """gpt-oss (attention sinks ``s_aux``: one logit per query head; 4 heads, 2 K/V heads; sliding
    and full layers; MoE) from the model-support tiny config, the sinks drawn away from zero."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import model_support

    cfg = model_support.tiny_config("gpt_oss", num_hidden_layers=NUM_LAYERS, use_cache=False)
    if kv_heads is not None:
        cfg.num_key_value_heads = kv_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
    return model.float()


def _run(rank: int, world: int, pp: int, sp: int, dp: int, report: dict) -> None:
    from concertina_hf.runtime.distributed import Topology, reduce_gradients
    from concertina_hf.planning import StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    fail = report["failures"]
    topo = Topology.build(pp=pp, dp=dp, sp=sp, timeout=timedelta(seconds=300))
    # the mesh: sp innermost, then pp, then dp
    (want_replica, want_stage), want_sp = divmod(rank // sp, pp), rank % sp
    if (topo.stage, topo.sp_rank, topo.replica) != (want_stage, want_sp, want_replica):
        fail.append(f"mesh: rank {rank} is stage {topo.stage} sp rank {topo.sp_rank} replica {topo.replica}")
    lane = (want_replica * pp) * sp + want_sp
    if topo.sp_ranks != tuple(rank - want_sp + s for s in range(sp)):
        fail.append(f"mesh: sp ranks {topo.sp_ranks}")
    if topo.pp_ranks != tuple(lane + s * sp for s in range(pp)):
        fail.append(f"mesh: pp ranks {topo.pp_ranks}")
    if topo.dp_ranks != tuple((d * pp + want_stage) * sp + want_sp for d in range(dp)):
        fail.append(f"mesh: dp ranks {topo.dp_ranks}")
    if dp > 1:
        _replicas(topo, report)
        return
    _sink_layouts(topo, report)
    _linear_attention(topo, pp, report)
    ids, labels = batch()
    layout = StageLayout.even(NUM_LAYERS, pp)
    plans = {f"{name}/{rec}": make_plan(SEQ_LENS, CHUNKINGS[name], layout, rec) for name, rec in PLANS
             if name in CHUNKINGS}
    plans[f"{GROUPED[0]}-2groups/partial"] = make_plan(SEQ_LENS, CHUNKINGS[GROUPED[0]], layout, "partial",
                                                       groups=GROUPED[1])
    models = [("llama K=4", _model("llama")), ("qwen2 K=2", _model("qwen2")),
              ("qwen2 K=1 (replicated)", _model("qwen2", kv_heads=1, seed=3)), ("gpt_oss sinks", _gpt_oss())]
    if pp > 1:
        models.append(("llama tied", _model("llama", tied=True, seed=4)))
    else:  # sinks with K/V heads replicated (K = 1 < sp): the sinks follow the query heads
        models.append(("gpt_oss K=1 sinks (replicated)", _gpt_oss(seed=6, kv_heads=1)))
    for kind, model in models:
        ref_loss, ref_grads = reference(model, ids, labels)
        w = PipelineWrapper(copy.deepcopy(model), layout, topo.stage)
        ex = PipelineExecutor(w, pp_group=topo.pp_group, sp_group=topo.sp_group,
                                channels=topo.p2p_channels)
        params = [p for p in w.parameters() if p.requires_grad]
        for name, plan in plans.items():
            w.zero_grad(set_to_none=True)
            res = ex.run_step(plan, ids, labels)
            if not compare_grads(w, ref_grads, 1e-2):  # each rank holds its own tokens' share only
                fail.append(f"{kind} {name} rank {rank}: the gradients are complete before the reduction over sp")
            reduce_gradients(params, topo, average=False)
            ex.sync_tied_gradients()
            report["cases"].append(f"{kind} {name}")
            if not _rel(res.loss, ref_loss) < LOSS_TOL:
                fail.append(f"{kind} {name}: loss {res.loss} vs {ref_loss}")
            fail.extend(f"{kind} {name} rank {rank}: {b}" for b in compare_grads(w, ref_grads, GRAD_TOL))
        if pp == 1 and kind.startswith("llama"):  # the same plans on this rank alone: activation peaks
            from concertina_hf.planning import CostModel
            from concertina_hf.planning.simulate import simulate

            cost1 = CostModel.from_hf_config(model.config, dtype_bytes=4)
            cost = cost1.with_parallel(sp=sp, state_shards=1)
            alone = PipelineExecutor(PipelineWrapper(copy.deepcopy(model), layout, 0))
            for name, plan in plans.items():
                peak_sp = ex.run_step(plan, ids, labels).peak_activation_bytes
                predicted = simulate(plan, cost).peak_memory_bytes[0] - cost.static_memory(layout, 0)
                predicted1 = simulate(plan, cost1).peak_memory_bytes[0] - cost1.static_memory(layout, 0)
                report["memory"].append((name, peak_sp, alone.run_step(plan, ids, labels).peak_activation_bytes,
                                         predicted, predicted1))
            # the allocated peak (every op output, as the benchmarks count it: all-to-all
            # buffers and transients included; .grad absent at the start) of the same plans at sp
            # and alone, against the profiled model's prediction (profiled alone, per GPU at sp)
            from concertina_hf.runtime.profiler import profile_cost_model

            prof1 = profile_cost_model(model, repeats=1, warmup=0, num_layers=NUM_LAYERS, max_tokens=64)
            prof = prof1.with_parallel(sp=sp, state_shards=1)

            for name, plan in plans.items():
                report["allocated"].append((name, allocated_activation_peak(ex, plan, ids, labels),
                                            allocated_activation_peak(alone, plan, ids, labels),
                                            simulate(plan, prof).peak_memory_bytes[0] - prof.static_memory(layout, 0),
                                            simulate(plan, prof1).peak_memory_bytes[0] - prof1.static_memory(layout, 0)))
        if kind == "llama K=4":  # bf16 autocast (float32 weights; bf16 all-to-alls): HF under autocast
            amp_loss, amp_grads = reference(model, ids, labels, autocast=torch.bfloat16)
            w.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                res = ex.run_step(plans["split/partial"], ids, labels)
            reduce_gradients(params, topo, average=False)
            err, err_fp32 = grad_error(w, amp_grads), grad_error(w, ref_grads)
            report["cases"].append(f"{kind} split/partial autocast")
            if not (_rel(res.loss, amp_loss) < AMP_LOSS_TOL and err < AMP_GRAD_TOL and err_fp32 > AMP_ROUNDED):
                fail.append(f"{kind} autocast rank {rank}: loss {res.loss} vs {amp_loss}, grad err {err:.2e} "
                            f"(vs float32 reference {err_fp32:.2e})")
        # evaluation: forward only, the whole batch's loss on every rank
        w.zero_grad(set_to_none=True)
        res = ex.run_step(plans["hybrid/full"], ids, labels, train=False)
        report["cases"].append(f"{kind} eval")
        if not _rel(res.loss, ref_loss) < LOSS_TOL:
            fail.append(f"{kind} eval: loss {res.loss} vs {ref_loss}")


def _linear_attention(topo, pp: int, report: dict) -> None:
    """Gated DeltaNet layers under Ulysses: the models of :mod:`_linear_attention_cases` (Qwen3-Next
    under recompute none / partial / full, Qwen3.5 under partial; 2 key heads for 4 value heads, one
    key head per rank) on their split, hybrid and packed chunks, against HF on the right-padded batch, the
    gradients reduced over the stage's ranks; then a placed (whole-doc) chunk is refused, naming
    the mode to set."""
    import _linear_attention_cases as cases
    from concertina_hf.planning import PlanError, StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
    from concertina_hf.runtime.distributed import reduce_gradients

    ids, labels = cases.batch()
    layout = StageLayout.even(4, pp)
    for kind, recomputes in (("qwen3_next", cases.RECOMPUTE), ("qwen3_5_text", ("partial",))):
        model = cases.build_model(kind)
        ref_loss, ref_grads = cases.padded_reference(model, ids, labels)
        w = PipelineWrapper(copy.deepcopy(model), layout, topo.stage)
        ex = PipelineExecutor(w, pp_group=topo.pp_group, sp_group=topo.sp_group, channels=topo.p2p_channels)
        params = [p for p in w.parameters() if p.requires_grad]
        for recompute in recomputes:
            w.zero_grad(set_to_none=True)
            res = ex.run_step(cases.make_plan(layout, recompute), ids, labels, num_items_in_batch=cases.num_items(labels))
            reduce_gradients(params, topo, average=False)
            ex.sync_tied_gradients()
            errors = cases.gradient_errors(w.named_parameters(), ref_grads)
            if model.config.tie_word_embeddings:  # each end stage holds its part
                errors = {k: v for k, v in errors.items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
            name = f"gated deltanet {kind} pp={pp} sp={topo.sequence_parallel_size} stage {topo.stage} {recompute}"
            row, bad = cases.check_case(name, res.loss, ref_loss, errors)
            report["cases"].append(name)
            report["failures"].extend(bad)
            if row["mixer_params"] != 3 * (2 // pp):  # A_log, dt_bias, conv1d.weight of the stage's linear layers
                report["failures"].append(f"{name}: {row['mixer_params']} Gated DeltaNet parameters compared")
    plan = cases.make_plan(layout, "none", chunks=(((0, 0, 9), (1, 0, 7)),), seq_lens=(9, 7))
    placed = dataclasses.replace(plan, chunks=tuple(dataclasses.replace(c, placement=(0, 1)) for c in plan.chunks))
    try:
        ex.run_step(placed.validate(), ids[1:3], labels[1:3])
        report["failures"].append("a whole-doc chunk of a Gated DeltaNet model was not refused")
    except PlanError as exc:
        if "concertina_sequence_parallel_mode='ulysses'" not in str(exc):
            report["failures"].append(f"the placed-chunk refusal does not name the mode: {exc}")
    report["cases"].append("gated deltanet placed chunk refused")


def _sink_layouts(topo, report: dict) -> None:
    """Attention sinks as each rank's attention gets them (``UlyssesContext._rank_sinks``): one per
    query head ``[H]`` and ``[1, H, 1, 1]`` sliced to the rank's heads; per query head and token
    ``[1, H, t, 1]`` of the local tokens through the all-to-all, all tokens of the rank's heads."""
    from concertina_hf.runtime.ulysses import SequenceParallel, UlyssesContext, local_shard

    sp, r = topo.sequence_parallel_size, topo.sp_rank
    heads, n = 2 * sp, 7  # 7 tokens: the last rank's shard padded
    ctx = UlyssesContext(SimpleNamespace(num_tokens=n, position_ids=torch.arange(n)[None]),
                         SequenceParallel(topo.sp_group))
    g = torch.Generator().manual_seed(0)
    per_head, per_query = torch.randn(heads, generator=g), torch.randn(1, heads, n, 1, generator=g)
    mine = slice(r * heads // sp, (r + 1) * heads // sp)
    local = local_shard(per_query[0].transpose(0, 1), sp, r).transpose(0, 1)[None]  # [1, H, t, 1]
    got = (ctx._rank_sinks(None, per_head, heads), ctx._rank_sinks(None, per_head.view(1, heads, 1, 1), heads),
           ctx._rank_sinks(None, local, heads))
    want = (per_head[mine], per_head.view(1, heads, 1, 1)[:, mine], per_query[:, mine])
    report["cases"].append("sink layouts")
    if not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want)):
        report["failures"].append(f"sink layouts rank {topo.rank}: {[tuple(a.shape) for a in got]}")
    try:
        ctx._rank_sinks(None, torch.zeros(heads + 1), heads)
        report["failures"].append("sinks of the wrong size were accepted")
    except NotImplementedError as exc:
        if f"attention sinks of shape ({heads + 1},)" not in str(exc):
            report["failures"].append(f"sink refusal: {exc}")


# each replica's sequences (of SEQ_LENS) and its chunks, over its own sequences: a split sequence
# and a packed chunk straddling the shard boundary on replica 0, odd chunk sizes on replica 1
REPLICA_SEQS = ((0, 1, 2), (3, 4, 5))
REPLICA_CHUNKS = ([[(0, 0, 20)], [(0, 20, 26)], [(1, 0, 9), (2, 0, 7)]],
                  [[(2, 0, 20), (0, 0, 5)], [(1, 0, 12)]])


def _replicas(topo, report: dict) -> None:
    """dp x pp x sp: each replica runs its share of the batch with the whole batch's token count;
    gradients reduced over the stage's dp x sp ranks (one all-reduce), the loss summed over the
    replicas: the single-process reference over the whole batch. With two pipeline stages
    (dp=2 x pp=2 x sp=2, 8 processes) one model and one step only (recompute full)."""
    from concertina_hf.runtime.distributed import reduce_gradients
    from concertina_hf.planning import StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    fail = report["failures"]
    ids, labels = batch()
    total = int(sum(int((lab[1:] != -100).sum()) for lab in labels))
    mine = REPLICA_SEQS[topo.replica]
    my_ids, my_labels = [ids[i] for i in mine], [labels[i] for i in mine]
    layout = StageLayout.even(NUM_LAYERS, topo.pipeline_size)
    models = (("llama K=4", lambda: _model("llama")), ("qwen2 K=1 (replicated)", lambda: _model("qwen2", kv_heads=1)))
    recomputes = ("none", "full")
    if topo.pipeline_size > 1:  # dp x pp x sp (8 processes on 2 cores): one model, one step
        models, recomputes = models[:1], ("full",)
    for kind, make in models:
        model = make()
        ref_loss, ref_grads = reference(model, ids, labels)
        w = PipelineWrapper(copy.deepcopy(model), layout, topo.stage)
        ex = PipelineExecutor(w, pp_group=topo.pp_group, sp_group=topo.sp_group,
                                channels=topo.p2p_channels)
        for rec in recomputes:
            plan = make_plan([len(t) for t in my_ids], REPLICA_CHUNKS[topo.replica], layout, rec)
            w.zero_grad(set_to_none=True)
            res = ex.run_step(plan, my_ids, my_labels, num_items_in_batch=total)
            reduce_gradients([p for p in w.parameters()], topo, average=False)
            loss = topo.all_reduce_replicas(res.loss, dtype=torch.float64)
            report["cases"].append(f"{kind} replicas/{rec}")
            if not _rel(loss, ref_loss) < LOSS_TOL:
                fail.append(f"{kind} replicas/{rec}: loss {loss} vs {ref_loss}")
            fail.extend(f"{kind} replicas/{rec} rank {topo.rank}: {b}" for b in compare_grads(w, ref_grads, GRAD_TOL))


def a2a_worker(outdir: str) -> None:
    """The profiler's all-to-all on a real sp=2 gloo group: fit latency and bandwidth on three
    chunk sizes, measure a fourth (held out); the fitted fields and both times to ``a2a.json``."""
    gloo_rank(outdir, lambda report: _a2a(outdir), timeout_s=300)


def _a2a(outdir: str) -> None:
    from concertina_hf.planning import CostModel
    from concertina_hf.runtime.ulysses import (measure_all_gather, measure_all_to_all, profile_all_gather,
                                               profile_all_to_all)

    rank, world = dist.get_rank(), dist.get_world_size()

    cost = CostModel.from_hf_config(tiny_config("llama", NUM_LAYERS), dtype_bytes=4)
    group = dist.new_group(list(range(world)))
    fitted = profile_all_to_all(cost, group, [512, 2048, 8192, 32768], repeats=5)
    (_, measured), = measure_all_to_all(cost, group, [16384], repeats=5)
    predicted = fitted.with_parallel(sp=world).a2a_time(16384)
    # the per-doc K/V collectives: all-gather and reduce-scatter fitted apart
    gathered = profile_all_gather(cost, group, [512, 2048, 8192, 32768], repeats=5)
    (moved, _, _), = measure_all_gather(cost, group, [16384], repeats=1)
    placed = gathered.with_parallel(sp=world)
    gather_fit = {"all_gather": [gathered.all_gather_latency_s, gathered.all_gather_bandwidth],
                  "reduce_scatter": [gathered.reduce_scatter_latency_s, gathered.reduce_scatter_bandwidth],
                  "moved": moved, "kv_bytes": placed.rank_model().kv_bytes_per_token * 16384 * (world - 1) / world,
                  "predicted": [placed.gather_kv_time(16384), placed.gather_kv_time(16384, backward=True)]}
    # the trainer's path: run_setup fits on the mesh's sp group and rewrites cost_model.json
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.run_setup import _profile_collectives

    topo = Topology.build(pp=1, dp=1, sp=world, timeout=timedelta(seconds=300))
    trainer_cost = _profile_collectives(SimpleNamespace(output_dir=outdir, concertina_max_tokens_per_chunk=4096,
                                                       sequence_parallel_mode="auto"), cost, topo)
    if rank == 0:
        with open(os.path.join(outdir, "a2a.json"), "w") as f:
            json.dump({"latency": fitted.intra_node_latency_s, "bandwidth": fitted.intra_node_bandwidth,
                       "measured": measured, "predicted": predicted, "gather": gather_fit,
                       "trainer": [trainer_cost.intra_node_latency_s, trainer_cost.intra_node_bandwidth],
                       "trainer_gather": [trainer_cost.all_gather_latency_s, trainer_cost.all_gather_bandwidth,
                                          trainer_cost.reduce_scatter_latency_s,
                                          trainer_cost.reduce_scatter_bandwidth]}, f)


# ---------------------------------------------------------------------- allocated peaks at sp = 4
MEM_TOKENS = 512  # one sequence (whole, or two slices): 128 tokens a rank at sp = 4
MEM_LAYERS = 3
MEM_KV_HEADS = (2, 4)  # of 4 query heads: replicated to 4 at sp = 4, or split
MEM_RECOMPUTE = ("none", "full")
MEM_RELEASE_CALLS = 200  # without the wait, about one all-to-all in five returned before gloo let go


def memory_model(kv_heads: int):
    """A Llama with the benchmark's head shape (``measured_sp.py``: 4 heads of 64), 3 layers,
    a 1024-token vocabulary; fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=MEM_LAYERS,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=4 * MEM_TOKENS,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def memory_profiles() -> dict[int, dict]:
    """The profiled cost model of each ``memory_model`` (one process, as ``run_setup`` profiles)."""
    from concertina_hf.runtime.profiler import profile_cost_model

    return {kv: profile_cost_model(memory_model(kv), repeats=1, warmup=0, num_layers=2,
                                   max_tokens=MEM_TOKENS).to_dict() for kv in MEM_KV_HEADS}


def memory_worker(outdir: str, profiles: dict) -> None:
    """Four processes: the allocated activation peak (``AllocationTracker``, parameters and their
    gradients left out, as the benchmarks count it) of one-stage plans at ``sp = 4`` (all ranks)
    and ``sp = 2`` (ranks {0, 1} and {2, 3}) and, on rank 0, alone; each next to the profiled
    model's per-GPU prediction (:meth:`CostModel.with_parallel`). Rows in the report of each rank
    (``<outdir>/rank<r>.json``, ``rows``): ``[kv_heads, sp, plan, allocated, predicted]``."""
    gloo_rank(outdir, lambda report: _memory(report["rows"], profiles), timeout_s=300, rows=[])


def _memory(rows: list, profiles: dict) -> None:
    from concertina_hf.planning import CostModel, StageLayout
    from concertina_hf.planning.simulate import simulate
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    rank, world = dist.get_rank(), dist.get_world_size()

    groups = {4: dist.new_group(list(range(world))), 2: None}
    for pair in ([0, 1], [2, 3]):
        g = dist.new_group(pair)
        if rank in pair:
            groups[2] = g
    layout = StageLayout.even(MEM_LAYERS, 1)
    n = MEM_TOKENS
    ids = [torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(1))]
    plans = {f"{name}/{rec}": make_plan([n], chunks, layout, rec)
             for name, chunks in (("whole", [[(0, 0, n)]]), ("split", [[(0, 0, n // 2)], [(0, n // 2, n // 2)]]))
             for rec in MEM_RECOMPUTE}
    for kv in MEM_KV_HEADS:
        model = memory_model(kv)
        cost1 = CostModel.from_dict(profiles[kv])
        for sp in (4, 2, 1):
            if sp == 1 and rank:
                continue
            w = PipelineWrapper(copy.deepcopy(model), layout, 0)
            ex = PipelineExecutor(w, sp_group=groups.get(sp))
            cost = cost1.with_parallel(sp=sp, state_shards=1)
            for name, plan in plans.items():
                peak = allocated_activation_peak(ex, plan, ids, runs=2)  # all-to-alls: see its runs
                predicted = simulate(plan, cost).peak_memory_bytes[0] - cost.static_memory(layout, 0)
                rows.append([kv, sp, name, peak, predicted])
    # the send buffer of every all-to-all is let go by gloo before the call returns
    from concertina_hf.runtime.ulysses import _all_to_all_single

    x, held = torch.randn(4 * 128, 64), []
    for _ in range(MEM_RELEASE_CALLS):
        _all_to_all_single(x, groups[4])
        held.append(x._use_count())
    rows.append(["release", max(held)])
