"""configs/accelerate/*.yaml: valid accelerate configs; the CPU one really starts two ranks in one job.

The trap this guards against: ``accelerate launch --cpu --num_processes 2`` (and a MULTI_CPU
config) goes through accelerate's simple launcher, which starts ONE process; and under torchrun
without ``use_cpu`` every CPU rank builds ``TrainingArguments`` with ``world_size == 1`` and
trains alone. Neither raises.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from _helpers import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "accelerate"
LAUNCH = ROOT / "tests" / "_recipe_launch.py"  # the recipe, plus per-rank facts and a group check


def _load(name: str):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(CONFIGS / name))


def _launcher_decision(argv: list[str]):
    """What ``accelerate launch`` would do with these arguments (nothing is started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv + ["script.py"]))
    return args


def test_every_config_loads_and_uses_the_torchrun_launcher():
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert {"cpu_2proc.yaml", "gpu8_pp8.yaml", "gpu8_pp4_dp2.yaml", "multinode.yaml"} <= set(names)
    for name in names:
        cfg = _load(name)
        # ConcertinaTrainer does its own pipeline/data parallelism: no FSDP / DeepSpeed wrapping
        assert cfg.distributed_type.value == "MULTI_GPU", name
        assert not cfg.fsdp_config and not cfg.deepspeed_config, name
    cpu = _load("cpu_2proc.yaml")
    assert cpu.num_processes == 2 and cpu.use_cpu and cpu.num_machines == 1
    assert _load("gpu8_pp8.yaml").num_processes == 8 and not _load("gpu8_pp8.yaml").use_cpu
    assert _load("gpu8_pp4_dp2.yaml").num_processes == 8
    multi = _load("multinode.yaml")
    assert multi.num_machines > 1 and multi.num_processes % multi.num_machines == 0
    assert multi.main_process_ip and multi.main_process_port and multi.machine_rank == 0
    text = (CONFIGS / "multinode.yaml").read_text()
    assert "machine_rank" in text and "NCCL_SOCKET_IFNAME" in text  # the knobs are explained


def test_cpu_config_takes_the_multi_process_path_unlike_the_cpu_flag():
    ours = _launcher_decision(["--config_file", str(CONFIGS / "cpu_2proc.yaml")])
    assert ours.multi_gpu and not ours.cpu and ours.num_processes == 2  # torchrun with 2 ranks
    trap = _launcher_decision(["--cpu", "--num_processes", "2"])
    assert not trap.multi_gpu and trap.cpu  # accelerate's simple launcher: a single process


WORLD_PROBE = r'''
import json, os, sys
import torch, torch.distributed as dist
from concertina_hf import ConcertinaTrainingArguments
args = ConcertinaTrainingArguments(output_dir=sys.argv[1], report_to=[])
_ = args.device
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump({"env_world": int(os.environ["WORLD_SIZE"]), "args_world": args.world_size,
               "dist_world": dist.get_world_size(), "use_cpu": args.use_cpu, "sum": float(t.item()),
               "parallel_mode": str(args.parallel_mode)}, fh)
dist.barrier()
dist.destroy_process_group()
'''


def test_cpu_2proc_starts_two_ranks_sharing_one_process_group(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(WORLD_PROBE)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    env.pop("ACCELERATE_USE_CPU", None)
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
         str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for info in ranks:
        assert info["env_world"] == info["dist_world"] == info["args_world"] == 2, info
        assert info["use_cpu"] and "DISTRIBUTED" in info["parallel_mode"]
        assert info["sum"] == 3.0  # 1 + 2: the all-reduce crossed both ranks


# ------------------------------------------------------------ sizes in the headers, multi-node
SIZE_FLAG = re.compile(r"--concertina_(pipeline|data_parallel|sequence_parallel)_size\s+(\d+)")


def _header_sizes(name: str) -> dict[str, int]:
    """The ``--concertina_*_size`` flags of the launch command in a config's header comment."""
    header = "\n".join(line for line in (CONFIGS / name).read_text().splitlines() if line.startswith("#"))
    return {kind: int(n) for kind, n in SIZE_FLAG.findall(header)}


@pytest.mark.parametrize("name, dp, pp, sp", [
    ("cpu_2proc.yaml", 1, 2, 1),
    ("gpu8_pp8.yaml", 1, 8, 1),
    ("gpu8_pp4_dp2.yaml", 2, 4, 1),
    ("gpu8_pp2_sp4.yaml", 1, 2, 4),
    ("gpu8_sp8.yaml", 1, 1, 8),
    ("multinode.yaml", 4, 8, 1),
    ("multinode_pp4_sp8.yaml", 1, 4, 8),
])
def test_num_processes_is_dp_x_pp_x_sp_of_the_documented_flags(name, dp, pp, sp):
    from concertina_hf.training.args import resolve_parallel_sizes

    cfg, flags = _load(name), _header_sizes(name)
    got_sp = flags.get("sequence_parallel", 1)
    # the sizes the trainer derives from the header's flags and the config's process count
    got_pp, got_dp = resolve_parallel_sizes(cfg.num_processes, flags.get("pipeline"), flags.get("data_parallel"),
                                            got_sp)
    assert (got_dp, got_pp, got_sp) == (dp, pp, sp), (name, flags)
    assert cfg.num_processes == dp * pp * sp
    # an sp group (consecutive ranks) stays inside one machine: the all-to-alls never cross the network
    per_machine = cfg.num_processes // cfg.num_machines
    assert cfg.num_processes % cfg.num_machines == 0 and per_machine % sp == 0, name
    if sp > 1:  # the file says how the sizes reach the trainer, since accelerate configs do not carry them
        text = (CONFIGS / name).read_text()
        assert "ConcertinaTrainingArguments(" in text and "concertina_sequence_parallel_size=" in text, name


def test_the_paper_layout_puts_one_stage_on_each_machine():
    cfg = _load("multinode_pp4_sp8.yaml")
    assert (cfg.num_machines, cfg.num_processes) == (4, 32)
    flags = _header_sizes("multinode_pp4_sp8.yaml")
    per_machine, sp = cfg.num_processes // cfg.num_machines, flags["sequence_parallel"]
    # rank = (replica * pp + stage) * sp + sp_rank; machine m runs ranks m*8 .. m*8+7
    for rank in range(cfg.num_processes):
        stage = (rank // sp) % flags["pipeline"]
        assert stage == rank // per_machine
    text = (CONFIGS / "multinode_pp4_sp8.yaml").read_text()
    for knob in ("machine_rank", "main_process_ip", "main_process_port", "--rdzv_backend c10d", "--rdzv_conf",
                 "NCCL_SOCKET_IFNAME"):
        assert knob in text, knob


@pytest.mark.parametrize("name", ["multinode.yaml", "multinode_pp4_sp8.yaml"])
def test_multinode_configs_rendezvous_at_machine_0_with_the_machine_rank(name):
    """What ``accelerate launch`` makes of them on machine 2: torchrun on 8 local ranks of 4 nodes,
    node rank 2, rendezvous endpoint machine 0's ip:port. accelerate keeps its command-line
    defaults over the file's ``rdzv_backend`` / ``same_network`` keys (static rendezvous), which
    the files say; c10d is ``--rdzv_backend c10d``."""
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = _launcher_decision(["--config_file", str(CONFIGS / name), "--machine_rank", "2"])
    assert args.multi_gpu and args.num_machines == 4 and args.machine_rank == 2
    assert args.rdzv_backend == "static" and not args.same_network
    prepare_multi_gpu_env(args)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("4", "8", 2)
    assert args.rdzv_endpoint == "10.0.0.1:29500"
    c10d = _launcher_decision(["--config_file", str(CONFIGS / name), "--machine_rank", "2", "--rdzv_backend", "c10d"])
    assert c10d.rdzv_backend == "c10d"


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
