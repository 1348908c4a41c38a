"""Worker of ``tests/launch/test_segments_dist.py``: segment-level training at pp = 2 and 4 on gloo.

Each rank computes the plain-HF segment reference itself and runs hand-made segment plans (every
recompute setting) and a planner plan with the segment options on its stage; failures go to
``<outdir>/rank<r>.json``.
"""

from __future__ import annotations

import copy
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime"))

from _helpers import gloo_rank  # noqa: E402

# (gradient, tail, global heads)
CASES = (("previous", 5, ()), ("previous", 12, ()), ("full", 12, ()), ("full", None, ()), ("previous", 5, (1, 2)),
         ("none", 5, ()), ("none", 12, (1,)))


def worker(outdir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gloo_rank(outdir, lambda report: _run(rank, world, report))


def _run(rank: int, world: int, report: dict) -> None:
    from _runtime_cases import SEQ_LENS, batch, compare_grads, tiny_config, tiny_model
    from _segment_reference import GRAD_TOL, LOSS_TOL, S, segment_plan, segment_reference

    from concertina_hf.planning import CostModel, StageLayout
    from concertina_hf.planning.segments import SegmentOptions
    from concertina_hf.planning.strategies import plan_step
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    fail = report["failures"]
    ids, labels = batch()
    layout = StageLayout.even(4, world)
    cost = CostModel.from_hf_config(tiny_config("llama", 4), dtype_bytes=4)
    for kind in ("llama", "qwen2"):
        model = tiny_model(kind, num_layers=4)
        w = PipelineWrapper(copy.deepcopy(model), layout, rank)
        ex = PipelineExecutor(w)
        for gradient, tail, heads in CASES:
            opts = SegmentOptions(S, gradient, tail, heads)
            ref_loss, ref_grads = segment_reference(model, ids, labels, opts)
            plans = [(rec, segment_plan(layout, opts, rec)) for rec in ("none", "partial", "full")]
            plans.append(("adaptive", plan_step(list(SEQ_LENS), cost, layout, 0, "adaptive", max_tokens_per_chunk=24,
                                                segment=opts)))
            for name, plan in plans:
                w.zero_grad(set_to_none=True)
                res = ex.run_step(plan, ids, labels)
                report["cases"] += 1
                if not abs(res.loss - ref_loss) < LOSS_TOL * abs(ref_loss):
                    fail.append(f"{kind} {gradient}/{tail}/{heads} {name}: loss {res.loss} vs {ref_loss}")
                fail.extend(f"{kind} {gradient}/{tail}/{heads} {name} stage {rank}: {b}"
                            for b in compare_grads(w, ref_grads, GRAD_TOL))
        # forward only: the tail's K/V dropped (but the global heads'), the same loss
        for heads in ((), (1, 2)):
            opts = SegmentOptions(S, "previous", 5, heads)
            ref_loss, _ = segment_reference(model, ids, labels, opts)
            res = ex.run_step(segment_plan(layout, opts, "none"), ids, labels, train=False)
            report["cases"] += 1
            if not abs(res.loss - ref_loss) < LOSS_TOL * abs(ref_loss):
                fail.append(f"{kind} eval {heads}: loss {res.loss} vs {ref_loss}")
