"""Helpers shared by the tests: the import path, ports, and starting the ranks of a launch.

conftest.py imports this module, which puts ``tests/`` and its tier folders on ``sys.path``: the
test files are not packages, and none imports another: what several share (models, data,
references) lives in ``tests/_models.py`` and its ``tests/_*.py`` siblings, the workers of the
launches beside their tests.

One way to start a multi-process job: :func:`start_ranks` (and :func:`run_ranks`, which waits and
fails the test with the ranks' stderr) runs a module-level function on ``world`` processes with
the rank in the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ... as
torchrun sets them), each in a session of its own, its stderr and stdout in files. The processes
are forked from a fork server that imported torch, transformers and the package once
(``tests/_preload.py``): a rank starts in ~0.1 s instead of ~5 CPU-seconds of imports. Inside a
worker, :func:`gloo_rank` joins the group, runs the checks and writes the rank's report.

A launch test declares its jobs in a module table ``LAUNCHES`` (name -> :class:`Launch`, or
:class:`Command` for a launcher or a benchmark script) and reads each through the ``launched``
fixture: the session starts them in the background from its start (:class:`Launches`,
conftest.py). Jobs whose subject is time (a fault's exits, a fitted link) or that need the test
process first start in the test itself.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
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


def worker_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a worker process: ``base`` (default: this process's environment now),
    one thread, no Hub, no wandb, no tokenizer threads, the test path on ``PYTHONPATH``, and
    without ``ACCELERATE_USE_CPU`` (the trainer's arguments must turn CPU on by themselves);
    ``extra`` on top."""
    base = dict(os.environ if base is None else base)
    path = os.pathsep.join(PATHS + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(base, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=path, **extra)
    env.pop("ACCELERATE_USE_CPU", None)
    return env


#: the fork server's modules (imported once; see the module docstring)
PRELOAD = ["_preload"]


_FORK_SERVER = threading.Lock()
_fork_server_started = False


def _fork_context():
    """The ``forkserver`` context, its server started (once per test process, from whichever
    thread asks first) with the workers' environment and :data:`PRELOAD` imported."""
    import multiprocessing
    import multiprocessing.forkserver

    global _fork_server_started
    ctx = multiprocessing.get_context("forkserver")
    with _FORK_SERVER:
        if not _fork_server_started:
            ctx.set_forkserver_preload(PRELOAD)
            saved = dict(os.environ)
            os.environ.update(worker_env())  # what the server imports under (one thread, offline)
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
            _fork_server_started = True
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

    def __init__(self, procs: list, logs: pathlib.Path, what: str, stderr_name: str = "stderr-rank{r}.txt") -> None:
        self.procs, self.logs, self.what, self.stderr_name = procs, logs, what, stderr_name
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
        path = self.logs / self.stderr_name.format(r=rank)
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


def start_ranks(world: int, fn, *args, logs, env: dict[str, str] | None = None, fresh: bool = False,
                base_env: dict[str, str] | None = None) -> Ranks:
    """``fn(*args)`` on ``world`` processes (``fn`` a module-level function: the rank imports its
    module), with the rank in the environment as torchrun sets it, :func:`worker_env` and ``env``
    on top; each rank's stdout and stderr in ``logs`` (created). Returns at once. The ranks are
    forked from the fork server; ``fresh``: new interpreters instead, each paying its imports, for
    a test of what peers see while a failing rank's interpreter shuts down (a forked rank's
    exit skips that shutdown). ``base_env``: the environment the ranks' starts from (default:
    this process's now)."""
    import multiprocessing

    logs = pathlib.Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    ctx, port = multiprocessing.get_context("spawn") if fresh else _fork_context(), free_port()
    procs = []
    for rank in range(world):
        rank_env = worker_env(base_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
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


class Launch:
    """One multi-process job of a launch test, a row of its module's ``LAUNCHES`` table (name ->
    :class:`Launch`): ``fn(out, *args)`` on ``world`` ranks (:func:`start_ranks`, ``env`` on top),
    ``out`` a folder of its own. ``check``: every rank must exit 0 (else the test that reads it
    fails with their stderr); without it the test reads the exit codes itself.

    The table shows which jobs a module launches, and lets the session start them early: the
    launches of the selected tests run one after another in the background from the start of the
    session (:class:`Launches`), beside the one-process tiers, which use one core of the machine's
    two; a test waits for its own (starting it at once if the background has not reached it)."""

    def __init__(self, world: int, fn, *args, env: dict[str, str] | None = None, check: bool = True,
                 timeout: float = 1500) -> None:
        self.world, self.fn, self.args, self.env, self.check, self.timeout = world, fn, args, env or {}, check, timeout

    def start(self, out: pathlib.Path, base_env: dict[str, str]) -> "Ranks":
        return start_ranks(self.world, self.fn, str(out), *self.args, logs=out / "logs", env=self.env,
                           base_env=base_env)


class Command(Launch):
    """A job that is one command rather than ranks of a function (a launcher, a benchmark script):
    ``argv`` in a process of its own session, in ``cwd``, with ``env`` on top of the environment
    and ``unset`` taken out (``{out}`` in any of them: the job's folder); its stdout and stderr
    together in ``<out>/output.txt``. Read as one rank: ``codes`` and ``stderr`` of one entry."""

    def __init__(self, *argv: str, env: dict[str, str] | None = None, unset: tuple[str, ...] = (), cwd=None,
                 check: bool = False, timeout: float = 1500) -> None:
        super().__init__(1, None, env=env, check=check, timeout=timeout)
        self.argv, self.unset, self.cwd = argv, unset, cwd

    def start(self, out: pathlib.Path, base_env: dict[str, str]) -> "Ranks":
        out.mkdir(parents=True, exist_ok=True)
        def place(text) -> str:
            return str(text).replace("{out}", str(out))

        env = {k: place(v) for k, v in dict(base_env, **self.env).items() if k not in self.unset}
        argv = [place(a) for a in self.argv]
        with open(out / "output.txt", "w") as log:
            proc = subprocess.Popen(argv, env=env, cwd=None if self.cwd is None else place(self.cwd), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return Ranks([_Process(proc)], out, " ".join(argv), stderr_name="output.txt")


class _Process:
    """A ``subprocess.Popen`` seen as a ``multiprocessing`` process (:class:`Ranks` reads these)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.pid = proc, proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def join(self) -> None:
        self.proc.wait()


class Launched:
    """A finished :class:`Launch`: its folder, each rank's exit code and stderr."""

    def __init__(self, out: pathlib.Path, codes: list[int | None], stderr: list[str]) -> None:
        self.out, self.codes, self.stderr = out, codes, stderr


class Launches:
    """The session's launches by ``module::name``: :meth:`prefetch` runs them one after another in a
    background thread, :meth:`get` waits for one (running it in the calling thread if nobody has
    started it). Nothing of torch runs in this process for them: the ranks are forked processes."""

    def __init__(self, root) -> None:
        import threading

        self.root = pathlib.Path(root)
        #: the environment every job starts from: this process's at the session's start, not a
        #: test's (a test's monkeypatched variable must not reach a job started meanwhile)
        self.environ = dict(os.environ)
        self._table: dict[str, Launch] = {}
        self._state: dict[str, object] = {}  # key -> threading.Event (running) | Launched | str (failure)
        self._lock = threading.Lock()
        self._running: list[Ranks] = []
        self._closed = False

    def declare(self, module: str, table: dict[str, Launch]) -> list[str]:
        keys = [f"{module}::{name}" for name in table]
        self._table.update(zip(keys, table.values()))
        return keys

    def prefetch(self, keys: list[str]) -> None:
        """Run ``keys`` one after another in a daemon thread (each unless a test took it first)."""
        import threading

        if keys:
            _fork_context()  # the fork server starts here, in the main thread
            threading.Thread(target=lambda: [self._run(k) for k in keys if not self._closed], daemon=True,
                             name="launches").start()

    def get(self, key: str) -> Launched:
        """The finished launch ``key`` (fails the test with the ranks' stderr if it must succeed
        and did not)."""
        self._run(key)
        state = self._state[key]
        if hasattr(state, "wait"):
            state.wait()
            state = self._state[key]
        if isinstance(state, str):
            raise AssertionError(state)
        return state

    def close(self) -> None:
        """End the launches still running (the session is over)."""
        self._closed = True
        for ranks in list(self._running):
            ranks.kill()

    def _run(self, key: str) -> None:
        import threading

        with self._lock:
            if key in self._state:
                return
            done = self._state[key] = threading.Event()
        launch = self._table[key]
        out = self.root / key.replace("::", "-").replace("/", "-")
        try:
            ranks = launch.start(out, self.environ)
            self._running.append(ranks)
            try:
                codes = ranks.wait(launch.timeout, grace=30 if launch.check else None)
            finally:
                self._running.remove(ranks)
            stderr = [ranks.stderr(r) for r in range(launch.world)]
            if launch.check and codes != [0] * launch.world:
                tails = "\n".join(f"--- rank {r} (exit {c}):\n{stderr[r][-6000:]}" for r, c in enumerate(codes))
                self._state[key] = f"launch {key} ({ranks.what}): ranks failed (exit codes {codes}):\n{tails}"
            else:
                self._state[key] = Launched(out, codes, stderr)
        except BaseException as exc:  # noqa: BLE001 (reported to the test that reads it)
            self._state[key] = f"launch {key} did not run: {type(exc).__name__}: {exc}"
        finally:
            done.set()


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
