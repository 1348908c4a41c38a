"""``accelerate launch`` of the recipe (``tests/_recipe_launch.py``: recipes/train_long_context.py
plus per-rank facts and a group check); the configs themselves: ``tests/training/test_accelerate_config.py``.

- ``--config_file configs/accelerate/cpu_2proc.yaml`` (one launch, :func:`cpu_2proc`), two tests
  on it: the config really starts two ranks in one process group (the launcher's, the process
  group's and the arguments' world size 2, CPU turned on by the arguments themselves: under
  torchrun without ``use_cpu`` every CPU rank would build ``TrainingArguments`` with
  ``world_size == 1`` and train alone, raising nothing); and the default recipe (shrunk: 6 steps,
  100 stdlib files, 256 tokens) trains as one 2-stage pipeline, the loss falls, and the saved
  directory, loaded by ``AutoModelForCausalLM.from_pretrained`` alone, gives on the held-out
  documents the same loss as the pipeline's evaluation (so the same logits).
- two launchers, machine ranks 0 and 1, of a 2-machine config made from
  ``multinode_pp4_sp8.yaml``: one job of 4 ranks at pp = 2 x sp = 2, a stage per "machine".
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from _helpers import Command, free_port
from _recipe import heldout_ids, heldout_loss

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "accelerate"
LAUNCH = ROOT / "tests" / "_recipe_launch.py"  # the recipe, plus per-rank facts and a group check
CPU_2PROC_ARGV = ["--max_steps", "6", "--max_files", "100", "--max_length", "256", "--per_device_train_batch_size", "4",
                  "--eval_samples", "4", "--concertina_max_tokens_per_chunk", "128", "--concertina_gantt_steps", "3"]


#: the job (a command, started by the session in the background, read through ``launched``)
LAUNCHES = {"cpu_2proc": Command(
    sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"), str(LAUNCH),
    "--output_dir", "{out}/run", *CPU_2PROC_ARGV, cwd="{out}",
    env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "HF_DATASETS_CACHE": "{out}/cache",
         "TOKENIZERS_PARALLELISM": "false", "CONCERTINA_RANK_INFO_DIR": "{out}"},
    unset=("ACCELERATE_USE_CPU",))}


@pytest.fixture(scope="module")
def cpu_2proc(launched) -> pathlib.Path:
    """The default recipe under ``accelerate launch --config_file cpu_2proc.yaml``, each rank's facts
    in ``<dir>/rank<r>.json``; the folder (the run in ``run``, the datasets cache in ``cache``)."""
    run = launched("cpu_2proc")
    assert run.codes == [0], run.stderr[0][-9000:]
    return run.out


def test_cpu_2proc_starts_two_ranks_sharing_one_process_group(cpu_2proc):
    ranks = [json.loads((cpu_2proc / f"rank{r}.json").read_text()) for r in (0, 1)]
    for info in ranks:
        assert info["env_world"] == info["world_size"] == info["args_world"] == 2, info
        assert info["use_cpu"] and "DISTRIBUTED" in info["parallel_mode"]
        assert info["rank_sum"] == 3.0  # 1 + 2: the all-reduce crossed both ranks


def test_accelerate_launch_cpu_2proc_default_recipe(cpu_2proc, monkeypatch):
    out = cpu_2proc / "run"
    argv = ["--output_dir", str(out), *CPU_2PROC_ARGV]
    info = json.loads((out / "run_info.json").read_text())
    # really two ranks, in one process group, as one 2-stage pipeline
    group_check = json.loads((out / "group_check.json").read_text())
    assert info["world_size"] == 2 and group_check["all_reduce_ones"] == 2.0
    assert info["pipeline_size"] == 2 and info["data_parallel_size"] == 1
    assert len(info["layer_ranges"]) == 2
    losses = info["losses"]
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.3 and all(x < losses[0] for x in losses[2:]), losses
    # a plain HF directory; its held-out loss is the pipeline's eval loss
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "trainer_state.json"):
        assert (out / name).is_file(), name
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cpu_2proc / "cache"))
    assert abs(heldout_loss(out, heldout_ids(argv)) - info["eval_loss"]) < 1e-5
    assert (out / "gantt" / "step-3.png").is_file() and (out / "gantt" / "step-6.png").is_file()


def test_two_node_launch_on_this_machine_trains_one_pipeline(tmp_path):
    """Two ``accelerate launch`` processes, machine ranks 0 and 1, of a 2-machine config made from
    ``multinode_pp4_sp8.yaml`` (2 processes per "machine", gloo on CPU, rendezvous on 127.0.0.1),
    run the recipe at pp = 2 x sp = 2: one job of 4 ranks, each machine one pipeline stage whose
    two ranks share its tokens, the same losses on every rank, both launchers exit 0."""
    import yaml

    cfg = yaml.safe_load((CONFIGS / "multinode_pp4_sp8.yaml").read_text())
    cfg.update(num_machines=2, num_processes=4, use_cpu=True, mixed_precision="no",
               main_process_ip="127.0.0.1", main_process_port=free_port())
    config = tmp_path / "two_nodes.yaml"
    config.write_text(yaml.safe_dump(cfg))
    info_dir = tmp_path / "ranks"
    info_dir.mkdir()
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--max_steps", "2", "--max_files", "24", "--max_length", "128",
            "--per_device_train_batch_size", "4", "--eval_samples", "0", "--concertina_max_tokens_per_chunk", "128",
            "--concertina_pipeline_size", "2", "--concertina_sequence_parallel_size", "2", "--disable_tqdm", "true"]
    procs = []
    for node in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
                   TOKENIZERS_PARALLELISM="false", CONCERTINA_RANK_INFO_DIR=str(info_dir),
                   HF_DATASETS_CACHE=str(tmp_path / f"cache{node}"))  # each "machine" its own cache
        env.pop("ACCELERATE_USE_CPU", None)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--machine_rank", str(node), str(LAUNCH)] + argv
        procs.append(subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{log[-6000:]}"
    ranks = [json.loads((info_dir / f"rank{r}.json").read_text()) for r in range(4)]
    for r, info in enumerate(ranks):
        assert info["rank"] == r and info["world_size"] == 4 and info["all_reduce_ones"] == 4.0, info
        assert info["node"] == r // 2 and info["local_rank"] == r % 2, info  # machine_rank -> ranks 2m, 2m+1
        assert (info["pipeline_size"], info["sequence_parallel_size"]) == (2, 2)
        assert (info["stage"], info["sp_rank"], info["replica"]) == (r // 2, r % 2, 0), info  # a stage per node
    assert ranks[0]["layers"] != ranks[2]["layers"] and ranks[0]["layers"] == ranks[1]["layers"]
    losses = ranks[0]["losses"]
    assert len(losses) == 2 and all(x == x and x > 0 for x in losses), losses
    for info in ranks[1:]:
        assert info["losses"] == losses, (info["rank"], info["losses"], losses)
    assert json.loads((out / "run_info.json").read_text())["world_size"] == 4
    # each stage writes its own shard (stage 1's on node 1; here the nodes share the folder)
    assert (out / "model-00002-of-00002.safetensors").is_file() and (out / "model.safetensors.index.json").is_file()
