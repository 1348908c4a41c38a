"""Ulysses sequence parallelism on real gloo launches (the one-process checks are in
``tests/runtime/test_ulysses.py``).

pp=1 x sp=2 (2 processes), pp=2 x sp=2 and dp=2 x sp=2 (4 processes), dp=2 x pp=2 x sp=2 (8
processes, one model and one step), each rank comparing many plans with the single-process HF
model (``_dist_ulysses.py``); the allocated peak at sp=4 against the prediction; the profiler's
all-to-all fit on a 2-process group; ``ConcertinaTrainer`` at pp=2 x sp=2 against ``Trainer``
(``_ulysses_trainer.py``'s ``main`` on 4 ranks). Gated DeltaNet layers (Qwen3-Next; Qwen3.5 under one recompute) at
pp=1 x sp=2 and pp=2 x sp=2 in the same launches (``_dist_ulysses._linear_attention``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import _dist_ulysses
import _ulysses_trainer
from _helpers import Launch, reports as read_reports, run_ranks

LAUNCHES = {f"dp{dp}-pp{pp}-sp{sp}": Launch(dp * pp * sp, _dist_ulysses.worker, pp, sp, dp)
            for dp, pp, sp in [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2)]}
LAUNCHES["trainer"] = Launch(4, _ulysses_trainer.main)


@pytest.mark.parametrize("dp,pp,sp", [(1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2)])
def test_ulysses_matches_hf(dp, pp, sp, launched):
    reports = read_reports(launched(f"dp{dp}-pp{pp}-sp{sp}").out, dp * pp * sp)
    for r in reports:
        print(f"rank {r['rank']}: {len(r['cases'])} cases; activation peak at sp={sp}, at sp=1, predicted at sp={sp} "
              "(bytes):")
        for name, at_sp, alone, predicted, predicted1 in r["memory"]:
            print(f"  {name:<24} {at_sp:>9} {alone:>9}  x{at_sp / alone:.2f}  {predicted:>11.0f}  "
                  f"measured/predicted x{at_sp / predicted:.2f} (at sp=1: x{alone / predicted1:.2f})")
        print(f"rank {r['rank']}: allocated peak at sp={sp}, alone, x, predicted (profiled) at sp={sp}, alone:")
        for name, at_sp, alone, predicted, predicted1 in r["allocated"]:
            print(f"  {name:<24} {at_sp:>9} {alone:>9}  x{at_sp / alone:.2f}  {predicted:>11.0f} "
                  f"measured/predicted x{at_sp / predicted:.3f} (alone: x{alone / predicted1:.3f})")
    failures = [f for r in reports for f in r["failures"]]
    assert failures == []
    # each rank's activation peak: within 60% of the same plan's on one rank (tokens and heads / sp)
    assert all(at_sp <= 0.6 * alone for r in reports for _, at_sp, alone, _, _ in r["memory"])
    assert all(len(r["memory"]) == (4 if pp == dp == 1 else 0) for r in reports)
    # memory, counted as the benchmarks count (every allocation: all-to-all buffers, transients):
    # each rank's allocated activation peak within 60% of the same plan's alone (measured x0.52 to
    # x0.54), and the profiled model's per-GPU prediction at sp within 10% of it (measured: the
    # prediction 4% under to 2% over)
    assert all(len(r["allocated"]) == len(r["memory"]) for r in reports)
    for r in reports:
        for name, at_sp, alone, predicted, _ in r["allocated"]:
            assert at_sp <= 0.6 * alone, (r["rank"], name, at_sp, alone)
            assert abs(predicted - at_sp) <= 0.10 * at_sp, (r["rank"], name, at_sp, predicted)
    # + the sink layouts; + Gated DeltaNet (3 + 1 recomputes, the placed chunk's refusal)
    cases = (1 if pp > 1 else 2 * 2) if dp > 1 else 5 * 5 + 1 + 1 + 4 + 1
    assert all(len(r["cases"]) == cases for r in reports)
    assert dp > 1 or all(sum(c.startswith("gated deltanet") for c in r["cases"]) == 5 for r in reports)


def test_allocated_peak_at_sp4_matches_prediction(tmp_path):
    """Allocated peaks at sp = 4 (4 processes, one launch): a one-stage Llama with the benchmark's heads
    (4 of 64; K/V heads 2, replicated to 4, and 4, split), one 512-token sequence whole or in two
    slices, no and full recompute, at sp = 4 and sp = 2: each rank's allocated activation peak
    within 10% under to 3% over the profiled model's per-GPU prediction (measured x0.91 to x1.00;
    alone the same plans read x0.91 to x1.00 too). Before the model counted the attention output
    twice and the replicated K/V the kernel keeps, sp = 4 with K = 2 read x1.09 and sp = 2 x1.04.
    Each all-to-all returns only once gloo has let go of its send buffer (200 calls a rank; without
    the runtime's wait one in four returned before, and a fresh-clone CI run read x1.033: one
    rank's q/k/v shard alive at the peak)."""
    profiles = _dist_ulysses.memory_profiles()
    run_ranks(4, _dist_ulysses.memory_worker, str(tmp_path), profiles, logs=tmp_path / "logs")
    reports = read_reports(tmp_path, 4)
    rows = [row for r in reports for row in r["rows"]]
    assert [f for r in reports for f in r["failures"]] == []
    assert [row for row in rows if row[0] == "release"] == [["release", 1]] * 4  # only x holds x
    rows = [row for row in rows if row[0] != "release"]
    for kv, sp, name, peak, predicted in sorted({tuple(row) for row in rows}, key=lambda row: (row[0], -row[1], row[2])):
        print(f"K={kv} sp={sp} {name:<12} allocated {peak / 2**20:7.3f} MiB  predicted {predicted / 2**20:7.3f} MiB  "
              f"x{peak / predicted:.3f}")
    per_rank = len(_dist_ulysses.MEM_KV_HEADS) * 2 * len(_dist_ulysses.MEM_RECOMPUTE)
    assert len(rows) == per_rank * (2 * 4 + 1)
    for kv, sp, name, peak, predicted in rows:
        assert 0.90 * predicted <= peak <= 1.02 * predicted, (kv, sp, name, peak, predicted)


def test_trainer_pp2_sp2_matches_trainer(launched, tmp_path):
    """ConcertinaTrainer on 4 processes (pp=2 x sp=2), given a model built differently on ranks 1-3
    (rank 0's weights are used, as DDP does), equals Trainer on one process after 3 steps:
    logged losses 1e-5, gradient norms 1e-4, every parameter of the saved model 1e-4 (relative),
    evaluation loss 1e-5, run_clm's accuracy and predict() (argmax ids, raw logits 1e-4) on every
    rank; resuming from the step-2 checkpoint ends on the same model; a LoRA model trained with label
    smoothing (and the online cost-model refit each step) equals Trainer's (losses 1e-5, adapter
    update 1e-3); a Gated DeltaNet model (Qwen3-Next: Ulysses splits its linear-attention heads)
    equals Trainer on right-padded batches (losses 1e-5, parameters 1e-3 of their update)."""
    from _ulysses_trainer import STEPS
    from _models import load_saved, tiny_dataset, train_reference, worst_relative

    out = launched("trainer").out
    ranks = [json.loads((out / f"info-rank{r}.json").read_text()) for r in range(4)]
    # dp x pp x sp, sp innermost: (rank, replica, stage, sp rank)
    assert [r["topology"] for r in ranks] == [[0, 0, 0, 0], [1, 0, 0, 1], [2, 0, 1, 0], [3, 0, 1, 1]]
    assert ranks[0]["stage_params"] == ranks[1]["stage_params"] != ranks[2]["stage_params"]
    assert all(r["losses"] == ranks[0]["losses"] and r["grad_norms"] == ranks[0]["grad_norms"] for r in ranks)
    assert all(n > 0 for n in ranks[0]["split_chunks"]), ranks[0]["split_chunks"]
    # the model was perturbed on ranks 1-3: every parameter broadcast from rank 0 (reported on every rank)
    assert all(r["synced"] == ranks[0]["synced"] >= 39 for r in ranks), [r["synced"] for r in ranks]
    assert all(r["peft_synced"] == 0 for r in ranks)
    ref_info, ref_state = train_reference("llama", tmp_path / "ref", metrics=True, max_steps=STEPS)
    info = ranks[0]
    assert len(info["losses"]) == len(ref_info["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(info["losses"], ref_info["losses"])) < 1e-5
    assert max(abs(a - b) / b for a, b in zip(info["grad_norms"], ref_info["grad_norms"])) < 1e-4
    assert abs(info["eval_loss"] - ref_info["eval_loss"]) < 1e-5
    # run_clm's metrics and predict() at sp=2, on every rank (each holds its shard of the logits,
    # gathered over the last stage's sp group), as Trainer's
    want = torch.load(tmp_path / "ref" / "logits.pt")
    for rank, r in enumerate(ranks):
        assert r["eval_accuracy"] == ref_info["eval_accuracy"] and 0 < r["eval_accuracy"]
        assert abs(r["eval_loss_with_metrics"] - ref_info["eval_loss"]) < 1e-5
        assert r["predicted_ids"] == ref_info["predicted_ids"]
        assert r["predicted_labels"] == ref_info["predicted_labels"]
        assert r["test_accuracy"] == ref_info["test_accuracy"]
        assert abs(r["test_loss"] - ref_info["test_loss"]) < 1e-5
        got = torch.load(out / f"logits-rank{rank}.pt")
        assert got["logits"].shape == want["logits"].shape
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-4, rtol=1e-4)
        assert torch.equal(got["labels"], want["labels"])
    worst, name = worst_relative(ref_state, load_saved(out / "final"))
    assert worst < 1e-4, (name, worst)
    # the checkpoint: one optimizer shard per stage, every process's RNG; resuming ends the same
    names = set(os.listdir(out / "checkpoint-2"))
    assert {"optimizer.stage0-of-2.pt", "optimizer.stage1-of-2.pt", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json"} <= names
    assert {f"rng_state_{r}.pth" for r in range(4)} <= names
    assert json.loads((out / "checkpoint-2" / "concertina.json").read_text())["sequence_parallel_size"] == 2
    assert info["resumed_losses"] == pytest.approx(info["losses"], abs=1e-6)
    worst, name = worst_relative(load_saved(out / "final"), load_saved(out / "resumed"))
    assert worst < 1e-6, ("resume", name, worst)
    # PEFT (LoRA on the embedding, q/v/down, lm_head trained) with label smoothing: Trainer's losses
    # and norms, the saved adapter holds Trainer's update (``_peft_cases.check_adapter``)
    import _peft_cases
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from _ulysses_trainer import PEFT_SMOOTHING

    assert all(r["peft"] == info["peft"] for r in ranks)
    refits, rejected, sp = info["peft_refits"]  # the planner rank: one refit tried each step, at sp=2
    assert refits + rejected == 3 and sp == 2, info["peft_refits"]
    # the online run timed the all-to-alls on its sp group at the start (not DeviceSpec.cpu()'s link)
    from concertina_hf.planning import DeviceSpec

    cpu = DeviceSpec.cpu()
    assert info["peft_link"] != [cpu.intra_node_latency_s, cpu.intra_node_bandwidth], info["peft_link"]
    assert info["peft_link"][1] > 0 and info["peft_link"][0] >= 0
    ref = Trainer(model=_peft_cases.peft_model("embed-head"), train_dataset=tiny_dataset(),
                  data_collator=DataCollatorWithFlattening(),
                  args=TrainingArguments(output_dir=str(tmp_path / "ref-peft"), save_strategy="no",
                                         label_smoothing_factor=PEFT_SMOOTHING, **_peft_cases.COMMON))
    ref.train()
    _peft_cases.check_adapter("embed-head", out / "peft", ref.model, info["peft"], _peft_cases.losses_and_norms(ref))
    # Gated DeltaNet (Qwen3-Next) at pp=2 x sp=2 against Trainer on right-padded batches: losses
    # 1e-5 (relative), every parameter 1e-3 relative to its update (the pp=2 launch's bounds)
    import _linear_attention_cases as lin

    ref = Trainer(model=lin.build_model(), train_dataset=lin.dataset(), data_collator=lin.padded,
                  args=TrainingArguments(output_dir=str(tmp_path / "ref-linear"), **lin.COMMON))
    start = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    ref.train()
    want = [h["loss"] for h in ref.state.log_history if "loss" in h]
    got = info["linear"]
    print("Gated DeltaNet pp=2 x sp=2 losses", got["losses"], "Trainer", want)
    assert all(r["linear"]["losses"] == got["losses"] and r["linear"]["grad_norms"] == got["grad_norms"] for r in ranks)
    assert len(got["losses"]) == len(want) == 3 and all(n > 0 for n in got["split_chunks"]), got
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want)) < lin.LOSS_TOL, (got["losses"], want)
    final, saved = ref.model.state_dict(), load_saved(out / "linear")
    worst = max((float((saved[k] - final[k]).norm() / (final[k] - start[k]).norm().clamp_min(1e-12)), k)
                for k in final if (final[k] - start[k]).norm() > 0)
    print("Gated DeltaNet pp=2 x sp=2: worst parameter, relative to its update", worst)
    assert worst[0] < 1e-3, worst


def test_profiler_fits_the_all_to_all_on_a_real_group(tmp_path):
    """The profiler's all-to-all (``profile_all_to_all``) on a 2-process gloo sp group: the fitted
    bandwidth positive, the latency >= 0, and the cost model's prediction for a held-out chunk
    size within a factor 3 of its measured time (one layer's four all-to-alls); run_setup's profile
    path on the mesh's sp group writes the fitted fields into ``cost_model.json``; the per-doc K/V
    all-gather and reduce-scatter (``profile_all_gather``) fitted and saved likewise, their bytes
    those the cost model counts. ~25 s (slow: timings under shared-core load)."""
    run_ranks(2, _dist_ulysses.a2a_worker, str(tmp_path), logs=tmp_path / "logs")
    assert [f for r in read_reports(tmp_path, 2) for f in r["failures"]] == []
    r = json.loads((tmp_path / "a2a.json").read_text())
    print(r)
    assert r["bandwidth"] > 0 and r["latency"] >= 0
    assert r["measured"] / 3 < r["predicted"] < 3 * r["measured"], r
    # run_setup's profile path (sp > 1): the same fit on the mesh's sp group, kept in cost_model.json
    saved = json.loads((tmp_path / "cost_model.json").read_text())
    lat, bw = r["trainer"]
    assert bw > 0 and lat >= 0 and bw != 150e9
    assert (saved["intra_node_latency_s"], saved["intra_node_bandwidth"]) == (lat, bw)
    # the per-doc K/V all-gather and reduce-scatter: fitted apart, the bytes measured
    # those gather_kv_time counts, its forward / backward the two fits; the trainer's path saves them
    g = r["gather"]
    for name in ("all_gather", "reduce_scatter"):
        assert g[name][0] >= 0 and g[name][1] > 0, g
    assert g["moved"] == g["kv_bytes"], g
    for (glat, gbw), predicted in zip((g["all_gather"], g["reduce_scatter"]), g["predicted"]):
        assert predicted == glat + g["kv_bytes"] / gbw, g
    ag_lat, ag_bw, rs_lat, rs_bw = r["trainer_gather"]
    assert ag_bw > 0 and rs_bw > 0 and ag_lat >= 0 and rs_lat >= 0
    assert [saved[k] for k in ("all_gather_latency_s", "all_gather_bandwidth", "reduce_scatter_latency_s",
                               "reduce_scatter_bandwidth")] == r["trainer_gather"]
