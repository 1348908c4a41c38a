"""``concertina plan --layout auto`` (planning.layouts) and the device presets: which layouts of N
GPUs the runtime can run (and why not), the ranking picks the fastest simulated layout, pruning by
lower bounds never drops it, the CLI's table and JSON."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from concertina_hf.planning import CostModel, DeviceSpec, partition_layers, plan_step  # noqa: E402
from concertina_hf.planning.coefficients import DEVICE_PRESETS  # noqa: E402
from concertina_hf.planning.layouts import (  # noqa: E402
    Layout, layout_cost, layout_lower_bound, rank_layouts, runnable_layouts, shard_parameters_refusal,
    ulysses_heads_refusal,
)
from concertina_hf.planning.presets import MODEL_PRESETS  # noqa: E402
from concertina_hf.planning.simulate import simulate  # noqa: E402
from concertina_hf.tools import cli  # noqa: E402

TINY = MODEL_PRESETS["tiny-llama"]  # 8 layers, 4 heads, 2 K/V heads
LENS = [3000, 1200, 700, 400, 300, 250, 200, 120, 90, 64, 40, 33]


@pytest.fixture(scope="module")
def tiny_cost():
    return CostModel.from_hf_config(TINY, DeviceSpec.cpu())


# ------------------------------------------------------------------ enumeration
def test_runnable_layouts_of_8_gpus(tiny_cost):
    ok, refused = runnable_layouts(tiny_cost, 8)
    assert {(x.pp, x.sp, x.dp) for x in ok} == {
        (1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)}
    assert all(x.gpus == 8 for x in ok)
    # sp=8 splits 4 heads: refused with the reason; sp=4 > 2 K/V heads replicates them (runnable)
    assert [(x.pp, x.sp, x.dp) for x, _ in refused] == [(1, 8, 1)]
    assert "does not divide the 4 attention heads" in refused[0][1]
    # the config mapping gives the same
    assert runnable_layouts(TINY, 8) == (ok, refused)


def test_empty_stages_and_kv_heads_refused():
    cfg = dict(TINY, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=4)
    ok, refused = runnable_layouts(cfg, 12)
    why = {(x.pp, x.sp): r for x, r in refused}
    assert "a stage would be empty" in why[(6, 1)] and "a stage would be empty" in why[(12, 1)]
    assert "neither divides the other" in why[(1, 3)]  # 6 heads / 3, but 4 K/V heads and 3
    assert "does not divide the 6 attention heads" in why[(1, 4)]
    assert (2, 2, 3) in {(x.pp, x.sp, x.dp) for x in ok} and (4, 1, 3) in {(x.pp, x.sp, x.dp) for x in ok}


def test_heads_rule_is_the_runtimes():
    pytest.importorskip("torch")
    from concertina_hf.runtime.ulysses import check_heads

    for heads in (1, 2, 4, 6, 8, 12, 32, 40):
        for kv in (1, 2, 3, 4, 8, 40):
            if heads % kv:
                continue
            for sp in range(2, 17):
                try:
                    check_heads(heads, kv, sp)
                    runtime_ok = True
                except ValueError:
                    runtime_ok = False
                assert (ulysses_heads_refusal(heads, kv, sp) is None) == runtime_ok, (heads, kv, sp)


# ------------------------------------------------------------------ ranking
def test_ranking_picks_the_fastest_simulated_layout(tiny_cost):
    rows = rank_layouts(LENS, tiny_cost, 8, 0, prune=False)
    ok = [r for r in rows if r.status == "ok"]
    assert len(ok) == 9 and rows[0] is ok[0]
    assert ok[0].step_time_s == min(r.step_time_s for r in ok) and ok[0].ratio_to_best == 1.0
    assert [r.step_time_s for r in ok] == sorted(r.step_time_s for r in ok)
    # a one-replica row is plan_step's plan on that layout, simulated
    for r in ok:
        if r.layout.dp == 1:
            c = layout_cost(tiny_cost, r.layout)
            plan = plan_step(LENS, c, partition_layers(c, r.layout.pp), 0, "adaptive", solver="ilp")
            assert r.step_time_s == pytest.approx(simulate(plan, c).step_time_s)
        assert r.tokens_per_s_per_gpu == pytest.approx(sum(LENS) / r.step_time_s / 8)
        assert r.lower_bound_s <= r.step_time_s * (1 + 1e-9)  # the bound is one
    ref = [r for r in rows if r.status == "reference"]
    assert len(ref) == 1 and ref[0].strategy == "sp-only" and not ref[0].runnable
    assert rows[-1].status == "refused"


def test_pruning_never_drops_the_best(tiny_cost):
    budget = int(0.05 * 2**30)  # tight: some layouts recompute, some do not fit
    skipped = 0
    for lens in (LENS, [4096, 4096, 30, 20], [700] * 6):
        full = rank_layouts(lens, tiny_cost, 8, budget, prune=False, sp_only=False)
        pruned = rank_layouts(lens, tiny_cost, 8, budget, prune=True, sp_only=False)
        assert pruned[0].layout == full[0].layout and pruned[0].step_time_s == full[0].step_time_s
        for r in full:  # every bound holds
            if r.status == "ok":
                assert r.lower_bound_s <= r.step_time_s * (1 + 1e-9), r.layout
        skipped += sum(r.status == "pruned" for r in pruned)
        kept = {r.layout: r.step_time_s for r in pruned if r.status == "ok"}
        assert all(kept[k] == v for k, v in ((r.layout, r.step_time_s) for r in full) if k in kept)
    assert skipped >= 6  # the bounds do prune


def test_lower_bound_counts_forced_recompute():
    cost = CostModel.from_hf_config(MODEL_PRESETS["llama-13b"], DeviceSpec.a800())
    c = layout_cost(cost, Layout(2, 1, 16))  # optimizer state over 16 replicas: 31 GiB static
    stages = partition_layers(c, 2)
    free = layout_lower_bound([65536], c, stages, 16)
    tight = layout_lower_bound([65536], c, stages, 16, 80 * 2**30)
    assert tight > free * 1.05
    plan = plan_step([65536], c, stages, 80 * 2**30, "adaptive", solver="greedy")
    assert tight <= plan.predicted.step_time_s


def test_sp_only_reference_holds_zero3_memory():
    """sp-only is scored with the memory the runtime holds on its layout with
    concertina_shard_parameters=True (ZeRO-3 over all 8 GPUs), less than ZeRO-1's."""
    cost = CostModel.from_hf_config(MODEL_PRESETS["llama-7b"], DeviceSpec.a800())
    lens = [32768, 8192, 4096, 2048, 1024]
    rows = rank_layouts(lens, cost, 8, 80 * 2**30)
    ref = next(r for r in rows if r.status == "reference")
    assert ref.knobs["zero3"] is True and ref.knobs["state_shards"] == 8 and ref.shard_parameters
    assert "concertina_shard_parameters=True" in ref.reason and "ZeRO-3 over all GPUs" in ref.reason
    z1 = plan_step(lens, cost.with_parallel(sp=8), partition_layers(cost.with_parallel(sp=8), 1), 80 * 2**30,
                   "sp-only", solver="greedy", zero3=False)
    assert ref.peak_memory_bytes < max(z1.predicted.peak_memory_bytes)


def test_shard_parameters_ranks_pp1_layouts_as_the_runtime_holds_them(tiny_cost):
    """--shard-parameters: pp=1 layouts with weights, gradients and optimizer state over dp x sp
    plus the gathered layers, their per-layer gathers timed; pp > 1 layouts refused, naming the
    setting (the trainer shards parameters at pp=1 only), so the best is a pp=1 layout."""
    rows = rank_layouts(LENS, tiny_cost, 8, 0, prune=False, sp_only=False, shard_parameters=True)
    plain = {r.layout: r for r in rank_layouts(LENS, tiny_cost, 8, 0, prune=False, sp_only=False)}
    ok = [r for r in rows if r.status == "ok"]
    assert {r.layout for r in ok} == {k for k, r in plain.items() if r.status == "ok" and k.pp == 1}
    assert rows[0].status == "ok" and rows[0].layout.pp == 1
    piped = [r for r in rows if r.layout.pp > 1]
    assert {r.layout for r in piped} == {k for k, r in plain.items() if r.status == "ok" and k.pp > 1}
    for r in piped:
        assert r.status == "refused" and not r.runnable and r.step_time_s is None, r
        assert r.reason == shard_parameters_refusal(r.layout)
        assert f"pp={r.layout.pp}: concertina_shard_parameters=True runs at concertina_pipeline_size=1 only" in r.reason
    assert shard_parameters_refusal(Layout(1, 4, 2)) is None
    for r in ok:
        assert r.shard_parameters == (r.layout.pp == 1 and r.layout.sp > 1), r.layout
        c = layout_cost(tiny_cost, r.layout, shard_parameters=True)
        assert c.zero3 == r.shard_parameters
        if r.shard_parameters and r.layout.dp == 1:
            stages = partition_layers(c, 1)
            n = r.layout.sp
            whole = tiny_cost.static_memory(stages, 0)  # one GPU's weights, gradients and Adam state
            gathered = 2 * c.layer_params + max(c.embed_params, c.head_params)
            assert c.sharded_state_memory(stages, 0) == pytest.approx(whole / n)
            assert c.static_memory(stages, 0) == pytest.approx(whole / n + gathered * c.dtype_bytes)
            plan = plan_step(LENS, c, stages, 0, "adaptive", solver="ilp")
            assert r.step_time_s == pytest.approx(simulate(plan, c).step_time_s)
            # the gathers per layer and chunk: never faster than without them
            assert r.step_time_s >= plain[r.layout].step_time_s * (1 - 1e-9)
            assert r.peak_memory_bytes < plain[r.layout].peak_memory_bytes
        if not r.shard_parameters:
            assert r.step_time_s == pytest.approx(plain[r.layout].step_time_s)


def test_tied_embeddings_cost_the_last_stage_a_copy_at_pp_above_1():
    """tied_embeddings: the last of several stages holds its own copy of the embedding (weight,
    gradient, optimizer state), as run_setup counts it; one stage holds the one weight."""
    tied = CostModel.from_hf_config(dict(TINY, tie_word_embeddings=True), DeviceSpec.cpu())
    assert tied.head_params < tied.embed_params
    rows = {r.layout: r for r in rank_layouts(LENS, tied, 4, 0, prune=False, sp_only=False, tied_embeddings=True)}
    plain = {r.layout: r for r in rank_layouts(LENS, tied, 4, 0, prune=False, sp_only=False)}
    for lay, r in rows.items():
        c = layout_cost(tied, lay, tied_embeddings=True)
        if lay.pp == 1:
            assert c.head_params == tied.head_params and r.peak_memory_bytes == plain[lay].peak_memory_bytes, lay
        else:
            assert c.head_params == tied.head_params + tied.embed_params, lay
            stages = partition_layers(c, lay.pp)
            last = stages.num_stages - 1
            before = layout_cost(tied, lay).static_memory(partition_layers(layout_cost(tied, lay), lay.pp), last)
            assert c.static_memory(stages, last) > before
            assert r.peak_memory_bytes > plain[lay].peak_memory_bytes, lay


# ------------------------------------------------------------------ CLI
def test_cli_layout_auto_prints_the_table_and_writes_json(tmp_path, capsys):
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(map(str, LENS)) + "\n")
    out = tmp_path / "auto.json"
    rc = cli.main(["plan", "--lengths", str(lens), "--model-config", "tiny-llama", "--device", "cpu",
                   "--gpus", "8", "--layout", "auto", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "tok/s/GPU" in text and "peak GiB/GPU" in text and "chosen: pp" in text
    assert "refused: sp=8 does not divide the 4 attention heads" in text
    assert "is a reference, never chosen" in text and "solver greedy" in text
    data = json.loads(out.read_text())
    assert data["gpus"] == 8 and data["rows"][0]["ratio_to_best"] == 1.0
    assert data["chosen"] == data["rows"][0]["layout"]
    statuses = {r["status"] for r in data["rows"]}
    assert {"ok", "reference", "refused"} <= statuses
    assert all({"pp", "sp", "dp", "step_time_s", "peak_memory_bytes", "reason"} <= set(r) for r in data["rows"])


def test_cli_layout_auto_needs_gpus_and_gpus_needs_auto(tmp_path):
    lens = tmp_path / "lens.txt"
    lens.write_text("100\n200\n")
    with pytest.raises(SystemExit, match="needs --gpus"):
        cli.main(["plan", "--lengths", str(lens), "--model-config", "tiny-llama", "--layout", "auto"])
    with pytest.raises(SystemExit, match="goes with --layout auto"):
        cli.main(["plan", "--lengths", str(lens), "--model-config", "tiny-llama", "--gpus", "4"])


# ------------------------------------------------------------------ device presets
@pytest.mark.parametrize("name", [n for n in DEVICE_PRESETS if n != "cpu"])
def test_device_preset_is_sane_and_plans_at_paper_scale(name):
    dev = DeviceSpec.preset(name)
    a800 = DeviceSpec.a800()
    assert dev == getattr(DeviceSpec, name)()
    assert dev.flops >= a800.flops and dev.mem_bandwidth >= a800.mem_bandwidth
    assert 70 * 2**30 <= dev.memory_bytes <= 200 * 2**30
    assert dev.intra_node_bandwidth >= a800.intra_node_bandwidth >= dev.inter_node_bandwidth > 0
    assert 0 < dev.p2p_bandwidth <= dev.intra_node_bandwidth and dev.gpus_per_node == 8
    # LLaMA-13B at the paper's layout (pp4 x sp8, 32 GPUs), a 128K long tail, in the device's memory
    cost = CostModel.from_hf_config(MODEL_PRESETS["llama-13b"], dev).with_parallel(sp=8)
    lens = [131072, 65536, 16384, 8192, 4096, 2048, 1024, 512]
    plan = plan_step(lens, cost, partition_layers(cost, 4), dev.memory_bytes, "adaptive", solver="greedy")
    assert max(plan.predicted.peak_memory_bytes) <= dev.memory_bytes
    if name != "a800":  # faster than on the A800
        slow = CostModel.from_hf_config(MODEL_PRESETS["llama-13b"], a800).with_parallel(sp=8)
        ref = plan_step(lens, slow, partition_layers(slow, 4), dev.memory_bytes, "adaptive", solver="greedy")
        assert plan.predicted.step_time_s < ref.predicted.step_time_s


def test_cli_device_choices():
    for name in ("h100", "h200", "b200"):
        args = cli.build_parser().parse_args(["plan", "--distribution", "github", "--device", name])
        assert cli._device(args) == DeviceSpec.preset(name)


def test_cli_shard_parameters_names_the_option(tmp_path, capsys):
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(map(str, LENS)) + "\n")
    out = tmp_path / "auto.json"
    rc = cli.main(["plan", "--lengths", str(lens), "--model-config", "tiny-llama", "--device", "cpu", "--gpus", "4",
                   "--layout", "auto", "--shard-parameters", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "pp=1: weights and gradients sharded too (concertina_shard_parameters=True)" in text
    rows = json.loads(out.read_text())["rows"]
    assert all(r["shard_parameters"] == (r["pp"] == 1 and r["sp"] > 1) for r in rows if r["status"] == "ok")
    chosen = next(r for r in rows if r["status"] == "ok")
    assert f"concertina_shard_{'parameters' if chosen['shard_parameters'] else 'optimizer'}=True" in text
    # the pick runs with parameter sharding: pp=1; pp > 1 refused, the reason in the table and the JSON
    assert chosen["pp"] == 1 and json.loads(out.read_text())["shard_parameters"] is True
    assert "pp > 1 refused (the trainer shards parameters at concertina_pipeline_size=1 only)" in text
    piped = [r for r in rows if r["pp"] > 1]
    assert {(r["pp"], r["sp"], r["dp"]) for r in piped} == {(2, 1, 2), (2, 2, 1), (4, 1, 1)}
    for r in piped:
        assert r["status"] == "refused" and "concertina_shard_parameters=True runs at concertina_pipeline_size=1 " \
            "only; set concertina_shard_parameters=False" in r["reason"], r
        assert any(f" {r['layout']} " in ln and f"refused: pp={r['pp']}: concertina_shard_parameters=True" in ln
                   for ln in text.splitlines()), r


@pytest.mark.parametrize("mode", [None, "ulysses", "context", "auto"])
def test_cli_chosen_line_names_the_sequence_parallel_mode(tmp_path, capsys, mode):
    """The chosen line names the mode the stages run (--sp-mode; Ulysses when unset) where sp > 1."""
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(map(str, LENS)) + "\n")
    out = tmp_path / "auto.json"
    rc = cli.main(["plan", "--lengths", str(lens), "--model-config", "tiny-llama", "--device", "cpu", "--gpus", "2",
                   "--layout", "auto", "--json", str(out)] + (["--sp-mode", mode] if mode else []))
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    chosen = next(r for r in data["rows"] if r["status"] == "ok")
    line = next(ln for ln in text.splitlines() if ln.startswith("chosen: "))
    assert rc == 0 and chosen["layout"] == data["chosen"] and chosen["sp"] == 2  # the 3000-token sequence
    assert f"concertina_sequence_parallel_mode={mode or 'ulysses'} " in line
    assert data["sequence_parallel_mode"] == (mode or "ulysses")


def test_cli_fixed_layout_refuses_shard_parameters_at_pp_above_1(tmp_path):
    lens = tmp_path / "lens.txt"
    lens.write_text("100\n200\n")
    with pytest.raises(SystemExit, match=r"--shard-parameters with --pp 2: pp=2: concertina_shard_parameters=True runs "
                                         r"at concertina_pipeline_size=1 only; set concertina_shard_parameters=False"):
        cli.main(["plan", "--lengths", str(lens), "--model-config", "tiny-llama", "--pp", "2", "--sp", "2",
                  "--shard-parameters"])


def test_cli_fixed_layout_counts_the_last_stages_copy_of_tied_embeddings(tmp_path, capsys):
    """--pp 2 with tied embeddings: the last stage holds its own copy (as the trainer does), so its
    peak equals the untied model's (same shapes); one stage holds the one weight."""
    peaks = {}
    for tied in (False, True):
        cfg, out = tmp_path / f"cfg{tied}.json", tmp_path / f"out{tied}.json"
        cfg.write_text(json.dumps(dict(TINY, tie_word_embeddings=tied)))
        (tmp_path / "lens.txt").write_text("\n".join(map(str, LENS)) + "\n")
        for pp in (1, 2):
            assert cli.main(["plan", "--lengths", str(tmp_path / "lens.txt"), "--model-config", str(cfg), "--device",
                             "cpu", "--pp", str(pp), "--strategy", "adaptive", "--solver", "greedy",
                             "--json", str(out)]) == 0
            peaks[tied, pp] = json.loads(out.read_text())[0]["peak_memory_bytes"]
    capsys.readouterr()
    assert peaks[True, 2] == peaks[False, 2]
    assert peaks[True, 1][0] < peaks[False, 1][0]  # one stage: the shared weight once
