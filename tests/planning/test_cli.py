"""``concertina plan``: in-process runs on a small batch with a tiny model, one installed-script run."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from concertina_hf.tools import cli  # noqa: E402
from concertina_hf.planning import Plan  # noqa: E402

LENGTHS = [3000, 1200, 700, 400, 300, 250, 200, 120, 90, 64, 40, 33]
TINY = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 8, "intermediate_size": 352, "vocab_size": 8192}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "lens.txt").write_text("\n".join(map(str, LENGTHS)) + "\n")
    (d / "tiny.json").write_text(json.dumps(TINY))
    return d


def _base(files, *extra):
    return ["plan", "--lengths", str(files / "lens.txt"), "--model-config", str(files / "tiny.json"),
            "--pp", "2", "--device", "cpu", "--time-limit", "0.5", *extra]


def test_plan_all_strategies_table_json_and_gantt(files, capsys):
    from concertina_hf.planning.strategies import STRATEGIES

    out_json, png = files / "out.json", files / "gantt.png"
    # 0.19 GiB binds for this batch: the last stage (LM head, logits) needs recompute to fit
    rc = cli.main(_base(files, "--memory-gb", "0.19", "--strategy", "all", "--json", str(out_json), "--gantt", str(png)))
    text = capsys.readouterr().out
    assert rc == 0
    assert "strategy" in text and "vs best" in text and "ideal step time" in text
    for s in STRATEGIES:
        assert s in text
    recs = json.loads(out_json.read_text())
    assert [r["strategy"] for r in recs] == list(STRATEGIES)
    fit = [r for r in recs if r["fits"]]
    assert fit
    assert min(r["ratio_to_best"] for r in fit) == pytest.approx(1.0)
    budget = int(0.19 * 2**30)
    assert recs[0]["strategy"] == "adaptive" and recs[0]["fits"]
    assert any(r["recompute_fraction"] > 0 for r in fit)  # the budget binds
    for r in fit:
        for key in ("step_time_s", "bubble_fraction", "recompute_fraction", "peak_memory_bytes",
                    "num_chunks", "plan_time_s", "plan", "ideal_step_time_s"):
            assert key in r, key
        plan = Plan.from_dict(r["plan"]).validate()
        stages = 1 if r["strategy"] == "sp-only" else 2  # sp-only: the replica's GPUs as one stage
        assert list(plan.seq_lens) == LENGTHS and plan.num_stages == stages
        assert plan.predicted.step_time_s == pytest.approx(r["step_time_s"])
        assert r["num_chunks"]["total"] == plan.num_chunks
        assert sum(r["num_chunks"][k] for k in ("packed", "split", "hybrid")) == plan.num_chunks
        assert len(r["peak_memory_bytes"]) == stages and max(r["peak_memory_bytes"]) <= budget
        assert 0 <= r["bubble_fraction"] < 1 and 0 <= r["recompute_fraction"] < 1
        # no schedule beats the bound with every stage busy and nothing recomputed
        assert r["step_time_s"] >= r["ideal_step_time_s"] * (1 - 1e-9)
        assert f"{r['step_time_s']:.4g}" in text
    by = {r["strategy"]: r for r in fit}
    # the budget binds: recomputing nothing fits no chunking (said in the table), recomputing every
    # layer fits but costs step time against the adaptive plan, which recomputes only some
    assert "no-recompute" not in by and re.search(r"no-recompute +does not fit", text), text
    assert by["full-recompute"]["step_time_s"] > by["adaptive"]["step_time_s"]
    assert 0 < by["adaptive"]["recompute_fraction"] < by["full-recompute"]["recompute_fraction"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_infeasible_budget_says_does_not_fit(files, capsys):
    rc = cli.main(_base(files, "--memory-gb", "0.0001", "--strategy", "adaptive,packed", "--strategy", "split",
                        "--json", str(files / "none.json")))
    text = capsys.readouterr().out
    assert rc == 1
    assert text.count("does not fit:") == 3
    recs = json.loads((files / "none.json").read_text())
    assert [r["fits"] for r in recs] == [False, False, False] and all(r["reason"] for r in recs)


def test_distribution_source_grid_and_errors(files, capsys):
    rc = cli.main(["plan", "--distribution", "github", "--num-seqs", "24", "--max-len", "8192", "--seed", "3",
                   "--model-config", "tiny-llama", "--pp", "4", "--device", "cpu", "--solver", "greedy",
                   "--strategy", "adaptive", "--show-grid"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "batch: 24 sequences" in text and "distribution github" in text
    assert "stage 3 [L" in text and "chunk   0" in text
    # a local JSON-lines file through load_dataset, tokenized with the bundled tokenizer
    docs = files / "docs.jsonl"
    docs.write_text("".join(json.dumps({"body": "def f():\n    return 1\n" * k}) + "\n" for k in (1, 10, 200, 40)))
    rc = cli.main(["plan", "--dataset", str(docs), "--text-column", "body", "--model-config", "tiny-llama",
                   "--pp", "2", "--device", "cpu", "--solver", "greedy", "--strategy", "adaptive,packed",
                   "--json", str(files / "ds.json"), "--gantt", str(files / "g.png"), "--gantt-all"])
    text = capsys.readouterr().out
    assert rc == 0 and "batch: 4 sequences" in text and "column body" in text
    recs = json.loads((files / "ds.json").read_text())
    lens = recs[0]["plan"]["seq_lens"]
    assert lens[2] > lens[3] > lens[1] > lens[0] > 1
    assert (files / "g-adaptive.png").is_file() and (files / "g-packed.png").is_file()
    with pytest.raises(SystemExit, match="--text-column"):
        cli.main(["plan", "--dataset", str(docs), "--model-config", "tiny-llama", "--pp", "2"])
    with pytest.raises(SystemExit, match="--pp"):
        cli.main(_base(files, "--pp", "99"))
    with pytest.raises(SystemExit, match="--model-config"):
        cli.main(["plan", "--lengths", str(files / "lens.txt"), "--model-config", str(files / "lens.txt")])
    with pytest.raises(SystemExit, match="--strategy"):
        cli.main(_base(files, "--strategy", "fastest"))


def test_installed_console_script(files):
    exe = pathlib.Path(sys.executable).with_name("concertina")
    assert exe.exists(), "the console script is missing; reinstall the package (pip install -e .)"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    help_ = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert help_.returncode == 0 and "plan" in help_.stdout
    run = subprocess.run([str(exe), *_base(files, "--strategy", "packed")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "packed" in run.stdout and "step (s)" in run.stdout


def test_gantt_with_measured_schedule_and_missing_matplotlib(files, tmp_path, monkeypatch):
    from concertina_hf.planning import CostModel, DeviceSpec, StageLayout
    from concertina_hf.planning.simulate import simulate
    from concertina_hf.planning.strategies import plan_step
    from concertina_hf.planning.viz import plot_gantt

    cost = CostModel.from_hf_config(TINY, DeviceSpec.cpu())
    plan = plan_step(LENGTHS, cost, StageLayout.even(8, 2), int(0.19 * 2**30), "adaptive", solver="greedy")
    sim = simulate(plan, cost)
    # measured: 10% slower, absolute clock, string actions, per stage
    measured = {s: [(str(a), 1e4 + 1.1 * t0, 1e4 + 1.1 * t1) for a, (t0, t1) in sim.action_times.items()
                    if a.stage == s] for s in range(2)}
    for path, meas in [(tmp_path / "m.png", measured), (tmp_path / "m.svg", [r for v in measured.values() for r in v])]:
        assert plot_gantt(plan, sim, path, measured=meas, cost=cost, title="measured") == str(path)
        assert path.stat().st_size > 10_000
    assert "+10.0%" in (tmp_path / "m.svg").read_text()  # measured vs planned step, in the subtitle
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install concertina_hf\[viz\]"):
        plot_gantt(plan, sim, tmp_path / "x.png")


def test_help_lists_strategies_and_each_default_once(capsys):
    from concertina_hf.planning import STRATEGIES

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    out = capsys.readouterr().out
    entries = {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=--)", out)[1:]}  # one per option
    strategy = entries["--strategy"].replace("- ", "-")  # argparse wraps lines at hyphens
    assert all(name in strategy for name in STRATEGIES), strategy
    assert "(default: None)" not in out and "(default: False)" not in out
    for flag, entry in entries.items():
        assert entry.count("default") <= 1, entry
    for flag in ("--seed", "--pp", "--solver", "--model-config", "--strategy", "--memory-gb"):
        assert entries[flag].count("default") == 1, entries[flag]
    assert "dataset) (default: 0)" in entries["--seed"]


def test_budget_errors_name_the_commands_flags(files, capsys):
    """`concertina plan --memory-gb 1` style errors name --memory-gb / --pp, not trainer fields."""
    rc = cli.main(_base(files, "--memory-gb", "0.0001", "--strategy", "all"))
    out = capsys.readouterr().out
    assert rc == 1 and "does not fit" in out
    assert "concertina_" not in out and "--memory-gb" in out and "--pp" in out, out


def test_token_cap_errors_name_the_flag_and_the_smallest_cap_that_plans(files):
    """A cap cutting the 3000-token sequence into more slices than the planner makes is refused
    in the command's words, naming the smallest cap that works; that cap plans."""
    out = files / "cap.json"
    assert cli.main(_base(files, "--max-tokens-per-chunk", "1", "--strategy", "adaptive", "--json", str(out))) == 1
    reason = json.loads(out.read_text())[0]["reason"]
    found = re.search(r"raise --max-tokens-per-chunk to at least (\d+) tokens", reason)
    assert found and "concertina_" not in reason and "max_tokens_per_chunk" not in reason, reason
    smallest = int(found.group(1))
    assert cli.main(_base(files, "--max-tokens-per-chunk", str(smallest), "--strategy", "adaptive",
                          "--solver", "greedy")) == 0


def test_the_command_checks_a_model_config_as_the_planner_does(files):
    """One check of a model's config, the planner's: an MoE config without ``intermediate_size``
    (the active experts' width stands for it) plans, with the cost model ``CostModel.from_hf_config``
    makes of it; a config the planner cannot read is refused in the planner's words."""
    from concertina_hf.planning import CostModel, DeviceSpec

    moe = {k: v for k, v in TINY.items() if k != "intermediate_size"}
    moe.update(model_type="qwen2_moe", moe_intermediate_size=64, num_experts_per_tok=2,
               shared_expert_intermediate_size=128)
    (files / "moe.json").write_text(json.dumps(moe))
    args = cli.build_parser().parse_args(["plan", "--lengths", str(files / "lens.txt"), "--model-config",
                                          str(files / "moe.json"), "--pp", "2", "--device", "cpu",
                                          "--strategy", "adaptive", "--solver", "greedy"])
    (rec,) = cli.run_plan(args)
    assert rec["fits"] and args._cost == CostModel.from_hf_config(moe, DeviceSpec.cpu())
    assert args._cost.layer_params == CostModel.from_hf_config({**moe, "intermediate_size": 2 * 64 + 128}).layer_params

    dense = {k: v for k, v in moe.items() if k != "moe_intermediate_size"}  # neither width
    (files / "no-mlp.json").write_text(json.dumps(dense))
    with pytest.raises(ValueError, match="has no intermediate_size") as planner:
        CostModel.from_hf_config(dense)
    with pytest.raises(SystemExit) as command:
        cli.load_model_config(str(files / "no-mlp.json"))
    assert str(command.value) == f"--model-config {files / 'no-mlp.json'}: {planner.value}"
