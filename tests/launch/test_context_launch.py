"""Whole-doc / per-doc placements inside a stage (:mod:`concertina_hf.runtime.context_parallel`)
on real gloo launches: pp=1 x sp=2, pp=2 x sp=2 and pp=1 x sp=4, one launch each running every
plan of ``_dist_context.py`` on five tiny models (Llama, one K/V head, 6 heads / 3 K/V heads, MLA,
sinks with a sliding window) against the single-process HF model: loss 1e-5, every gradient of
the stage 1e-4 after the sum over sp, forward-only loss and gathered logits; Ulysses chunks on
heads Ulysses cannot split are refused naming ``concertina_sequence_parallel_mode``. Plans with
ranks holding no token of a chunk (they run a pad token and exchange no message for it) among
them; pp=2 x sp=2 runs under the emulation of NCCL's message semantics
(``CONCERTINA_EMULATE_NCCL=direction``, :mod:`concertina_hf.runtime.p2p`), so both ends of a
stage-to-stage message, rank ``r`` to rank ``r``, must derive the same messages from the plan.
Prints each rank's measured activation peak per plan; the Llama's allocated peak on each rank
within 10% of the profiled model's prediction of that rank (:data:`MEMORY_WITHIN_10`), never more
than 10% over it.
"""

from __future__ import annotations

import json

import pytest

import _context_trainer
import _dist_context
from _helpers import Launch, reports as read_reports

#: NCCL's rendezvous semantics on the P2P between stages (module docstring)
EMULATED = {"CONCERTINA_EMULATE_NCCL": "direction", "CONCERTINA_EMULATE_NCCL_TIMEOUT_S": "120"}
LAUNCHES = {f"pp{pp}-sp{sp}": Launch(pp * sp, _dist_context.worker, pp, sp, env=EMULATED if pp > 1 else None)
            for pp, sp in [(1, 2), (2, 2), (1, 4)]}
LAUNCHES["trainer"] = Launch(4, _context_trainer.main)


#: plans whose every rank's allocated activation peak lies within 10% of the profiled model's
#: prediction of that rank (:meth:`CostModel.at_rank`); on every other plan the peak is at most
#: 10% over it. Measured over the three launches, allocated / predicted: whole-doc x0.979-1.003,
#: Ulysses beside placed x0.981-1.032, empty ranks x0.928-1.021, mixed (saved layers)
#: x0.920-1.008, the planner's x0.913-1.008; at the edge, over-predicted, per-doc x0.900-1.031 and
#: mixed with every layer recomputed x0.901-1.064: a layer's gathered dK/dV is counted on top of
#: its attention's backward (``CostModel._placed_transient``), where the runtime holds them partly
#: at once (counted as the larger of the two instead, these plans measured up to x1.144)
MEMORY_WITHIN_10 = ("whole-doc/none", "with-ulysses/partial", "empty-ranks/partial", "mixed/partial",
                    "planner-auto/24", "planner-auto/32", "planner-auto/24-tight", "planner-context/12")


@pytest.mark.parametrize("pp,sp", [(1, 2), (2, 2), (1, 4)])
def test_placed_chunks_match_hf(pp, sp, launched):
    reports = read_reports(launched(f"pp{pp}-sp{sp}").out, pp * sp)
    for r in reports:
        print(f"rank {r['rank']}: {len(r['cases'])} cases; activation peak per plan (bytes: saved-tensor meter; llama: "
              "allocated, and the profiled model's prediction of this rank):")
        for kind, name, stage, _, peak, allocated, predicted in r["peaks"]:
            vs = "" if predicted is None else \
                f"  allocated {allocated:>9}  predicted {predicted:>9.0f}  x{allocated / predicted:.3f}"
            print(f"  {kind:<22} {name:<24} stage {stage} {peak:>9}{vs}")
    failures = [f for r in reports for f in r["failures"]]
    assert failures == []
    # memory: each rank's allocated activation peak of every plan against the profiled
    # model's prediction of that rank; see MEMORY_WITHIN_10
    rows = [(name, r["rank"], allocated, predicted) for r in reports
            for kind, name, _, _, _, allocated, predicted in r["peaks"] if kind == "llama K=4"]
    assert len(rows) == sum(r["plans"] for r in reports)
    for name, rank, allocated, predicted in rows:
        assert allocated <= 1.10 * predicted, (name, rank, allocated, predicted)
        if name in MEMORY_WITHIN_10:
            assert allocated >= 0.90 * predicted, (name, rank, allocated, predicted)
    models = 5
    for r in reports:  # every model x plan ran, was refused (Ulysses chunks, 6 heads) or skipped (the same), + evals
        assert len(r["cases"]) + len(r["refusals"]) + len(r["skipped"]) == \
            models * (r["plans"] + len(_dist_context.EVAL_PLANS)), r
        assert len(r["refusals"]) == 1 and all(k.startswith("llama H=6") for k in r["skipped"])
        assert r["plans"] == len(_dist_context.PLANS) + 4
        # the plans with empty ranks ran on every model, forward and backward and forward only
        assert sum(c.endswith(("empty-ranks/partial", "planner-context/12")) for c in r["cases"]) == 2 * models
        assert sum(c.endswith("empty-ranks/partial eval") for c in r["cases"]) == models


def test_trainer_pp2_sp2_with_planner_modes(launched, tmp_path):
    """ConcertinaTrainer at pp=2 x sp=2 with the modes the planner chooses (whole-doc / per-doc
    chunks among them) equals Trainer on one process after 3 steps: logged losses 1e-5, gradient
    norms 1e-4, evaluation loss 1e-5, run_clm's accuracy and predict() (argmax ids; raw logits
    1e-4) on every rank."""
    import torch

    from _context_trainer import STEPS
    from _models import train_reference

    out = launched("trainer").out
    ranks = [json.loads((out / f"info-rank{r}.json").read_text()) for r in range(4)]
    print("modes run:", ranks[0]["train_modes"], ranks[0]["modes"])
    assert {"whole-doc", "per-doc"} & set(ranks[0]["train_modes"]), ranks[0]["train_modes"]
    ref_info, _ = train_reference("llama", tmp_path / "ref", metrics=True, max_steps=STEPS)
    want = torch.load(tmp_path / "ref" / "logits.pt")
    for rank, r in enumerate(ranks):
        assert len(r["losses"]) == len(ref_info["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_info["losses"])) < 1e-5
        assert max(abs(a - b) / b for a, b in zip(r["grad_norms"], ref_info["grad_norms"])) < 1e-4
        assert abs(r["eval_loss"] - ref_info["eval_loss"]) < 1e-5
        assert r["eval_accuracy"] == ref_info["eval_accuracy"]
        assert r["predicted_ids"] == ref_info["predicted_ids"]
        assert abs(r["test_loss"] - ref_info["test_loss"]) < 1e-5
        got = torch.load(out / f"logits-rank{rank}.pt")
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-4, rtol=1e-4)
