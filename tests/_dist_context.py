"""Worker of ``tests/launch/test_context_launch.py``: whole-doc / per-doc placements on
real gloo launches, one process per (stage, sequence-parallel rank).

Each rank builds the package's ``pp x sp`` mesh, the same tiny models and the single-process HF
reference, then runs hand-built plans whose chunks carry a :attr:`Chunk.placement`
(:data:`PLACED`, ranks written for sp=4 and taken modulo sp): a packed chunk of documents of very
different lengths whole-doc (one of them split over two chunks on one rank), a sequence split
per-doc over three slices carrying K/V, mixed chunks (a per-doc tail beside whole-doc short
sequences, a whole-doc slice after per-doc ones, two per-doc slices in one chunk), one plan
mixing Ulysses chunks with placed ones, and one whose chunks leave ranks empty (a sequence shorter
than 2 x sp alone, fewer sequences than ranks, a split sequence on one rank, a whole-doc tail after
its per-doc slice); the planner's plans (``auto`` mode, and ``context`` mode at a cap of 12 tokens:
empty ranks); recompute none / partial / full. Models: Llama (K = H =
4), Qwen2 with one K/V head, Llama with 6 heads and 3 K/V heads (Ulysses refuses it at sp = 2 and
4), DeepSeek-V3 (MLA, MoE) and gpt-oss (attention sinks, sliding window 16, MoE). Per case: the
loss (1e-5) and every gradient of the stage after the sum over sp (1e-4); a forward-only step's
loss and the logits the last stage's ``on_logits`` gets (gathered in token order); the measured
activation peak per rank (``peaks``: the executor's saved-tensor meter and, for the Llama, the
allocated peak, every allocation as the benchmarks count it, beside the profiled model's prediction
of that rank, ``CostModel.at_rank``). Results to ``<outdir>/rank<r>.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import torch  # noqa: E402

from _helpers import gloo_rank  # noqa: E402
from _runtime_cases import (  # noqa: E402
    allocated_activation_peak, batch, compare_grads, make_plan, reference, tiny_config,
)

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
LOGIT_TOL = 1e-4
NUM_LAYERS = 4
SEQ_LENS = (46, 9, 7, 5, 12, 20, 3, 28)
P = "P"  # per-doc
#: chunks of (seq, start, length, rank written for sp=4 or P)
PLACED = {
    # eight documents of very different lengths (3 to 46 tokens) in one packed chunk, whole-doc
    "whole-doc": [[(0, 0, 46, 0), (1, 0, 9, 1), (2, 0, 7, 2), (3, 0, 5, 3), (4, 0, 12, 1), (5, 0, 20, 2),
                   (6, 0, 3, 3), (7, 0, 28, 3)]],
    # sequence 0 per-doc in three slices (K/V carried), one whole sequence per-doc, the rest whole-doc
    "per-doc": [[(0, 0, 16, P)], [(0, 16, 14, P)], [(0, 30, 16, P)], [(7, 0, 28, P)],
                [(1, 0, 9, 0), (2, 0, 7, 1), (3, 0, 5, 2), (4, 0, 12, 3), (5, 0, 20, 0), (6, 0, 3, 1)]],
    # a per-doc tail beside whole-doc short sequences; a whole-doc tail after a per-doc slice (whose
    # K/V every rank keeps a shard of, gathered again with the chunk's) beside two per-doc
    # sequences (one gather for all three)
    "mixed": [[(0, 0, 20, P)], [(5, 0, 10, P)],
              [(0, 20, 26, P), (1, 0, 9, 0), (2, 0, 7, 1), (3, 0, 5, 2)],
              [(5, 10, 10, 3), (4, 0, 12, P), (6, 0, 3, 1), (7, 0, 28, P)]],
    # Ulysses chunks (no placement) beside a placed one, over different sequences
    "with-ulysses": [[(0, 0, 46, None), (6, 0, 3, None)], [(7, 0, 28, P), (1, 0, 9, 1)],
                     [(2, 0, 7, None), (3, 0, 5, None), (4, 0, 12, None), (5, 0, 20, None)]],
    # ranks holding no token of a chunk: one sequence shorter than 2 x sp alone; two sequences on
    # one rank (sp=2) or two of four; a split sequence whole-doc on one rank (its K/V carried
    # there); a whole-doc tail alone after its per-doc slice (the chunk's only gather: every rank
    # sends its shard, the ranks not holding the tail read nothing); three sequences on one rank
    "empty-ranks": [[(6, 0, 3, 1)], [(1, 0, 9, 0), (2, 0, 7, 2)], [(0, 0, 20, 3)], [(7, 0, 16, P)],
                    [(0, 20, 26, 3)], [(7, 16, 12, 1)], [(3, 0, 5, 1), (4, 0, 12, 1), (5, 0, 20, 1)]],
}
PLANS = (("whole-doc", "none"), ("per-doc", "partial"), ("mixed", "full"), ("mixed", "partial"),
         ("with-ulysses", "partial"), ("empty-ranks", "partial"))
#: plans also run forward only (loss, logits gathered in token order)
EVAL_PLANS = ("mixed/full", "empty-ranks/partial")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def placed_plan(name: str, layout, recompute: str, sp: int):
    """``PLACED[name]`` as a validated plan with each chunk's placement (ranks modulo ``sp``)."""
    from concertina_hf.planning.sharding import PER_DOC

    spec = PLACED[name]
    plan = make_plan(SEQ_LENS, [[s[:3] for s in chunk] for chunk in spec], layout, recompute)
    chunks = []
    for c, chunk in zip(plan.chunks, spec):
        where = [s[3] for s in chunk]
        placement = () if where[0] is None else tuple(PER_DOC if w == P else w % sp for w in where)
        chunks.append(dataclasses.replace(c, placement=placement))
    return dataclasses.replace(plan, chunks=tuple(chunks)).validate()


def _cost(sp: int):
    from concertina_hf.planning import CostModel

    return CostModel.from_hf_config(tiny_config("llama", NUM_LAYERS), dtype_bytes=4).with_parallel(sp=sp, state_shards=1)


def planner_plans(layout, cost) -> dict:
    """The adaptive planner's plans with ``sp_mode="auto"`` (modes chosen per chunk; the tiny
    Llama's cost model) at chunk caps 24 and 32, and at 24 under a budget of 60% of the way from
    the static memory to the unconstrained peak (recompute on some chunks); and with
    ``sp_mode="context"`` at a cap of 12 (chunks of short slices whole-doc, ranks left empty)."""
    from concertina_hf.planning import plan_step
    from concertina_hf.planning.simulate import simulate

    out = {}
    for cap in (24, 32):
        out[f"planner-auto/{cap}"] = plan_step(list(SEQ_LENS), cost, layout, 0, "adaptive", sp_mode="auto",
                                               max_tokens_per_chunk=cap)
    free = out["planner-auto/24"]
    static = [cost.static_memory(layout, s) for s in range(layout.num_stages)]
    budget = [int(st + 0.6 * (pk - st)) for st, pk in zip(static, simulate(free, cost).peak_memory_bytes)]
    out["planner-auto/24-tight"] = plan_step(list(SEQ_LENS), cost, layout, budget, "adaptive", sp_mode="auto",
                                             max_tokens_per_chunk=24)
    out["planner-context/12"] = plan_step(list(SEQ_LENS), cost, layout, 0, "adaptive", sp_mode="context",
                                          max_tokens_per_chunk=12)
    return out


def worker(outdir: str, pp: int, sp: int) -> None:
    rank = int(os.environ["RANK"])
    gloo_rank(outdir, lambda report: _run(rank, pp, sp, report), timeout_s=300,
              cases=[], peaks=[], refusals=[], skipped=[], plans=0)


def _models():
    """The five models, their weights drawn at 0.2 (``_dist_ulysses``'s gpt-oss: sinks at 1)."""
    from transformers import AutoModelForCausalLM

    from _dist_ulysses import _gpt_oss
    from model_support import tiny_config as family_config

    def hf(cfg, seed):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        with torch.no_grad():
            for p in (p for p in model.parameters() if p.dim() > 1):
                p.normal_(0.0, 0.2)
        return model.float()

    one_kv = tiny_config("qwen2", NUM_LAYERS)
    one_kv.num_key_value_heads = 1
    odd = tiny_config("llama", NUM_LAYERS)
    odd.num_attention_heads, odd.num_key_value_heads, odd.head_dim = 6, 3, 8
    return [("llama K=4", hf(tiny_config("llama", NUM_LAYERS), 0)), ("qwen2 K=1", hf(one_kv, 1)),
            ("llama H=6 K=3", hf(odd, 2)),
            ("deepseek_v3 MLA", hf(family_config("deepseek_v3", num_hidden_layers=NUM_LAYERS, use_cache=False), 3)),
            ("gpt_oss sinks+window", _gpt_oss(seed=4))]


def _run(rank: int, pp: int, sp: int, report: dict) -> None:
    from concertina_hf.planning import PlanError, StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
    from concertina_hf.planning.simulate import simulate
    from concertina_hf.runtime.distributed import Topology, reduce_gradients
    from concertina_hf.runtime.profiler import profile_cost_model

    fail = report["failures"]
    topo = Topology.build(pp=pp, dp=1, sp=sp, timeout=timedelta(seconds=300))
    ids, labels = batch(SEQ_LENS)
    layout = StageLayout.even(NUM_LAYERS, pp)
    plans = {f"{name}/{rec}": placed_plan(name, layout, rec, sp) for name, rec in PLANS}
    cost = _cost(sp)
    plans.update(planner_plans(layout, cost))
    report["plans"] = len(plans)
    for kind, model in _models():
        ref_loss, ref_grads = reference(model, ids, labels)
        if kind == "llama K=4":  # its memory as run_setup profiles it (one process), per GPU at sp
            prof = profile_cost_model(model, repeats=1, warmup=0, num_layers=NUM_LAYERS, max_tokens=64
                                      ).with_parallel(sp=sp, state_shards=1)
        w = PipelineWrapper(copy.deepcopy(model), layout, topo.stage)
        ex = PipelineExecutor(w, pp_group=topo.pp_group, sp_group=topo.sp_group, channels=topo.p2p_channels)
        params = [p for p in w.parameters() if p.requires_grad]
        heads = (int(model.config.num_attention_heads), int(model.config.num_key_value_heads))
        ulysses_ok = heads[0] % sp == 0 and (heads[1] % sp == 0 or sp % heads[1] == 0)
        for name, plan in plans.items():
            if name.startswith("planner") and not ulysses_ok and any(not c.placement for c in plan.chunks):
                report["skipped"].append(f"{kind} {name}")  # Ulysses chunks: this model is the refusal case
                continue
            if name.startswith("with-ulysses") and not ulysses_ok:
                try:  # Ulysses chunks on heads it cannot split: refused, naming the way out
                    ex.run_step(plan, ids, labels)
                    fail.append(f"{kind} {name}: Ulysses chunks with heads {heads} at sp={sp} ran")
                except PlanError as exc:
                    report["refusals"].append(str(exc))
                    if "concertina_sequence_parallel_mode='context'" not in str(exc):
                        fail.append(f"{kind} {name}: refusal {exc}")
                continue
            allocated = predicted = None
            if kind == "llama K=4":  # this rank's allocated activation peak and the profiled model's of this rank
                allocated = allocated_activation_peak(ex, plan, ids, labels, runs=2)
                predicted = (simulate(plan, prof.at_rank(topo.sp_rank)).peak_memory_bytes[topo.stage]
                             - prof.static_memory(layout, topo.stage))
            w.zero_grad(set_to_none=True)
            res = ex.run_step(plan, ids, labels)
            reduce_gradients(params, topo, average=False)
            ex.sync_tied_gradients()
            report["cases"].append(f"{kind} {name}")
            report["peaks"].append([kind, name, topo.stage, rank, res.peak_activation_bytes, allocated, predicted])
            if not _rel(res.loss, ref_loss) < LOSS_TOL:
                fail.append(f"{kind} {name}: loss {res.loss} vs {ref_loss}")
            fail.extend(f"{kind} {name} rank {rank}: {b}" for b in compare_grads(w, ref_grads, GRAD_TOL))
        # forward only: the loss, and the logits every last-stage rank gets, in token order
        for name in EVAL_PLANS:
            _eval(f"{kind} {name}", model, ex, plans[name], ids, labels, ref_loss, report)


def _eval(kind, model, ex, plan, ids, labels, ref_loss, report) -> None:
    fail = report["failures"]
    got: dict[tuple[int, int], torch.Tensor] = {}

    def keep(slices, logits):
        for s in slices:
            got[(s.seq, s.start)] = logits[0, s.offset:s.offset + s.length].clone()

    res = ex.run_step(plan, ids, labels, train=False, on_logits=keep if ex.wrapper.is_last else None)
    report["cases"].append(f"{kind} eval")
    if not _rel(res.loss, ref_loss) < LOSS_TOL:
        fail.append(f"{kind} eval: loss {res.loss} vs {ref_loss}")
    if not ex.wrapper.is_last:
        return
    with torch.no_grad():
        want = [model(input_ids=t[None]).logits[0] for t in ids]
    if sorted(got) != sorted((s.seq, s.start) for c in plan.chunks for s in c.slices):
        fail.append(f"{kind} eval: logits of {sorted(got)}")
        return
    for (seq, start), lg in got.items():
        ref = want[seq][start:start + lg.shape[0]]
        err = float((lg - ref).abs().max() / ref.abs().max())
        if not err < LOGIT_TOL:
            fail.append(f"{kind} eval: logits of sequence {seq} from {start}: rel err {err:.2e}")
