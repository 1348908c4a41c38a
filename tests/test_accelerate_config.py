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
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "accelerate"


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
    assert multi.main_process_ip and multi.main_process_port and multi.rdzv_backend == "c10d"
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


@pytest.mark.slow
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
