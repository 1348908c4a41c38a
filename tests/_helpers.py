"""Helpers shared by the tests: the import path, ports, and starting the ranks of a launch.

conftest.py imports this module, which puts ``tests/`` and its tier folders on ``sys.path``: the
test files are not packages; shared models, data and references live in ``tests/_models.py`` and
the workers of the launches beside their tests.

One way to start a multi-process job: :func:`start_ranks` (and :func:`run_ranks`, which waits and
fails the test with the ranks' stderr) runs a module-level function on ``world`` processes with
the rank in the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ... as
torchrun sets them), each in a session of its own, its stderr and stdout in files. The processes
are forked from a fork server that imported torch, transformers and the package once
(``tests/_preload.py``): a rank starts in ~0.1 s instead of ~5 CPU-seconds of imports. Inside a
worker, :func:`gloo_rank` joins the group, runs the checks and writes the rank's report.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import sys
import time

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


#: the fork server's modules (imported once; see the module docstring)
PRELOAD = ["_preload"]


def _fork_context():
    """The ``forkserver`` context, its server started (once per test process) with the workers'
    environment and :data:`PRELOAD` imported."""
    import multiprocessing
    import multiprocessing.forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.update(worker_env())  # what the server imports under (one thread, offline)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx


def _rank_main(env: dict[str, str], logs: str, fn, args: tuple, fresh: bool) -> None:
    """A rank's process: its own session (so the rank and its children can be killed together),
    stdout and stderr to ``<logs>/stdout-rank<r>.txt`` and ``stderr-rank<r>.txt``, the rank's
    environment, one thread, then ``fn(*args)``, and the exit of a script: an exception's traceback
    on stderr and status 1, the ``atexit`` handlers run. A forked rank then ends at once; a fresh
    interpreter (``spawn``) shuts down as a script's does, which takes seconds."""
    os.setsid()
    rank = env["RANK"]
    for fd, name in ((1, "stdout"), (2, "stderr")):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        log = os.open(os.path.join(logs, f"{name}-rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, fd)
        os.close(log)
    os.environ.clear()
    os.environ.update(env)
    import atexit
    import traceback

    import torch

    torch.set_num_threads(1)
    code = 0
    try:
        fn(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    if fresh:
        raise SystemExit(code)  # the interpreter's own shutdown, atexit handlers included
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Ranks:
    """The processes of one launch (:func:`start_ranks`)."""

    def __init__(self, procs: list, logs: pathlib.Path, what: str) -> None:
        self.procs, self.logs, self.what = procs, logs, what
        self.started = time.time()
        #: when each rank was first seen ended (:meth:`poll`), ``time.time()``
        self.ended: list[float | None] = [None] * len(procs)

    def poll(self) -> bool:
        """Note the ranks that ended since the last call (:attr:`ended`); whether all have."""
        now = time.time()
        for rank, p in enumerate(self.procs):
            if self.ended[rank] is None and p.exitcode is not None:
                self.ended[rank] = now
        return None not in self.ended

    @property
    def codes(self) -> list[int | None]:
        """Each rank's exit code (``None`` while it runs; ``-9`` when killed)."""
        return [p.exitcode for p in self.procs]

    def stderr(self, rank: int) -> str:
        path = self.logs / f"stderr-rank{rank}.txt"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        """End every rank still running, with the processes it started."""
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the rank's session: it and its children
                except ProcessLookupError:  # not yet its own session
                    p.kill()
        for p in self.procs:
            p.join()

    def wait(self, timeout: float, grace: float | None = None) -> list[int | None]:
        """Wait for every rank, at most ``timeout`` seconds, then kill those left. With ``grace``,
        once a rank failed the others get ``grace`` seconds more (torchrun's behaviour: a failed
        job is not left waiting for its collectives' timeouts). The exit codes."""
        deadline = time.monotonic() + timeout
        while not self.poll() and time.monotonic() < deadline:
            if grace is not None and any(c not in (0, None) for c in self.codes):
                deadline = min(deadline, time.monotonic() + grace)
                grace = None
            time.sleep(0.05)
        self.kill()
        return self.codes

    def check(self, timeout: float = 1500) -> "Ranks":
        """:meth:`wait`, then fail the test with every rank's stderr unless each exited 0."""
        codes = self.wait(timeout, grace=30)
        if codes != [0] * len(codes):
            tails = "\n".join(f"--- rank {r} (exit {c}):\n{self.stderr(r)[-6000:]}" for r, c in enumerate(codes))
            raise AssertionError(f"{self.what}: ranks failed (exit codes {codes}):\n{tails}")
        return self


def start_ranks(world: int, fn, *args, logs, env: dict[str, str] | None = None, fresh: bool = False) -> Ranks:
    """``fn(*args)`` on ``world`` processes (``fn`` a module-level function: the rank imports its
    module), with the rank in the environment as torchrun sets it, :func:`worker_env` and ``env``
    on top; each rank's stdout and stderr in ``logs`` (created). Returns at once. The ranks are
    forked from the fork server; ``fresh``: new interpreters instead, each paying its imports, for
    a test of what peers see while a failing rank's interpreter shuts down (a forked rank's
    exit skips that shutdown)."""
    import multiprocessing

    logs = pathlib.Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    ctx, port = multiprocessing.get_context("spawn") if fresh else _fork_context(), free_port()
    procs = []
    for rank in range(world):
        rank_env = worker_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              **(env or {}))
        proc = ctx.Process(target=_rank_main, args=(rank_env, str(logs), fn, args, fresh), name=f"rank{rank}")
        proc.start()
        procs.append(proc)
    what = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}{tuple(map(str, args))}"
    return Ranks(procs, logs, what)


def run_ranks(world: int, fn, *args, logs, env: dict[str, str] | None = None, timeout: float = 1500) -> Ranks:
    """:func:`start_ranks`, waiting for the ranks; fails the test with their stderr unless every
    rank exits 0 (``timeout`` only ends a hung launch)."""
    return start_ranks(world, fn, *args, logs=logs, env=env).check(timeout)


def fork_pool(processes: int):
    """A ``multiprocessing`` pool of processes forked from the fork server (its imports already
    done), for CPU-bound cases of one test spread over the machine's cores; a context manager."""
    return _fork_context().Pool(processes)


def reports(outdir, world: int, name: str = "rank{r}.json") -> list[dict]:
    """The JSON report each rank wrote to ``<outdir>/<name>``."""
    import json

    return [json.loads((pathlib.Path(outdir) / name.format(r=r)).read_text()) for r in range(world)]


def gloo_rank(outdir, run, timeout_s: float = 180, **fields) -> None:
    """Inside a rank of :func:`start_ranks`: join the gloo group, ``run(report)`` with ``report =
    {"rank", "failures", "cases", **fields}`` (a crash becomes a failure), write it to
    ``<outdir>/rank<r>.json``, then wait for the others and leave the group."""
    import json
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
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
