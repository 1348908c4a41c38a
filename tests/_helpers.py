"""Helpers shared by the tests: the import path, ports, and starting worker processes.

conftest.py imports this module, which puts ``tests/`` and its tier folders on ``sys.path``: the
test files are not packages, and some take helpers from another folder's test module by name
(``from test_trainer_pipeline import _model``). Workers started as scripts get the same path
through :func:`worker_env` (``PYTHONPATH``); those started by ``mp.spawn`` inherit ``sys.path``.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parent
#: tests/ and every folder of it holding test files (the tiers: planning, runtime, training, ...)
PATHS = [str(TESTS)] + sorted(str(d) for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))


def add_test_paths() -> None:
    """Put :data:`PATHS` on ``sys.path`` (after what is there: nothing installed is shadowed)."""
    for path in PATHS:
        if path not in sys.path:
            sys.path.append(path)


add_test_paths()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker process: one thread, no Hub, no wandb, no tokenizer threads,
    the test path on ``PYTHONPATH``, and without ``ACCELERATE_USE_CPU`` (the trainer's arguments
    must turn CPU on by themselves); ``extra`` on top."""
    path = os.pathsep.join(PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=path, **extra)
    env.pop("ACCELERATE_USE_CPU", None)
    return env


def torchrun(nproc: int, script: str, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """``torchrun`` of ``script args`` on ``nproc`` CPU ranks; fails the test with the workers'
    output if they fail (``timeout`` only ends a hung launch)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} workers failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def start_ranks(world: int, script: str, *args: str, stderr_dir) -> list[tuple[subprocess.Popen, object]]:
    """``world`` plain processes of ``script args`` (no torchrun, which would end the survivors of
    a failed rank itself), the rank in the environment, each in a session of its own and with its
    stderr in ``<stderr_dir>/stderr-rank<r>.txt``; (process, open stderr file) per rank."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = worker_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        err = open(pathlib.Path(stderr_dir) / f"stderr-rank{rank}.txt", "w")
        procs.append((subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env,
                                       stdout=subprocess.DEVNULL, stderr=err, start_new_session=True), err))
    return procs


def gloo_rank(rank: int, world: int, port: int, outdir, run, timeout_s: float = 180, **fields) -> None:
    """One rank of an ``mp.spawn``-ed gloo job: join the group, ``run(report)`` with ``report =
    {"rank", "failures", "cases", **fields}`` (a crash becomes a failure), write it to
    ``<outdir>/rank<r>.json``, then wait for the others and leave the group."""
    import json
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    report: dict = {"rank": rank, "failures": [], "cases": 0, **fields}
    try:
        run(report)
    except Exception:
        report["failures"].append("crash:\n" + traceback.format_exc())
    with open(os.path.join(str(outdir), f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
