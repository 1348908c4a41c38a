"""configs/accelerate/*.yaml: valid accelerate configs, what ``accelerate launch`` makes of them
(nothing is started here; the launches: ``tests/launch/test_accelerate_launch.py``).

The trap this guards against: ``accelerate launch --cpu --num_processes 2`` (and a MULTI_CPU
config) goes through accelerate's simple launcher, which starts ONE process. It does not raise.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    assert multi.main_process_ip and multi.main_process_port and multi.machine_rank == 0
    text = (CONFIGS / "multinode.yaml").read_text()
    assert "machine_rank" in text and "NCCL_SOCKET_IFNAME" in text  # the knobs are explained


def test_cpu_config_takes_the_multi_process_path_unlike_the_cpu_flag():
    ours = _launcher_decision(["--config_file", str(CONFIGS / "cpu_2proc.yaml")])
    assert ours.multi_gpu and not ours.cpu and ours.num_processes == 2  # torchrun with 2 ranks
    trap = _launcher_decision(["--cpu", "--num_processes", "2"])
    assert not trap.multi_gpu and trap.cpu  # accelerate's simple launcher: a single process


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
