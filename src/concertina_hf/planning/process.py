"""Planning in a process of its own: :class:`PlanningProcess` (``python -m concertina_hf.planning.process``).

Planning is pure Python. Run in a thread of a training process (the background planning of
:class:`~concertina_hf.training.step_planner.StepPlanner`) it holds the GIL most of the time, and the
training thread, which releases the GIL inside every torch call, must win it back on each
return: up to the interpreter's switch interval (5 ms) every time. On this project's 10M Llama on
CPU a step ran 2.7-4.5x slower while a planning thread ran beside it, so every millisecond of
background planning cost the step several. A process shares no GIL: the planning competes
for a core at most.

:class:`PlanningProcess` starts ``sys.executable -m concertina_hf.planning.process`` (fork and exec:
nothing of the caller's state, torch or process groups, is inherited; this package comes from the
same directory as the caller's) and runs :func:`plan_checked` there, one call at a time: requests
and results pickled over the child's stdin / stdout, exceptions raised again in the caller. The
child starts on the first call (about a second: it imports only ``concertina_hf.planning``) and
ends when :meth:`PlanningProcess.close` closes its stdin, or with the caller. No torch here.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO, Sequence

from .plan import Plan
from .simulate import simulate
from .strategies import plan_step

__all__ = ["PlanningProcess", "PlanningProcessError", "plan_checked"]


class PlanningProcessError(RuntimeError):
    """The planning process could not start or ended (not an error of the planning itself)."""


def plan_checked(seq_lens: Sequence[int], cost, layout, budgets, strategy: str, **kwargs: Any) -> Plan:
    """:func:`~.strategies.plan_step`, its prediction filled in (simulated if the strategy left it
    out) and validated: a plan ready to broadcast and run."""
    plan = plan_step(list(seq_lens), cost, layout, budgets, strategy, **kwargs)
    if plan.predicted is None:
        plan = plan.with_predicted(simulate(plan, cost).stats())
    return plan.validate()


def _send(fh: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(struct.pack("<Q", len(data)) + data)
    fh.flush()


def _recv(fh: BinaryIO) -> Any:
    head = fh.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    data = fh.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


class PlanningProcess:
    """A child process that plans (see the module docstring). Thread-safe: calls are serialized."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        #: CPU seconds the child spent on the last call
        self.last_cpu_s = 0.0

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        root = str(pathlib.Path(__file__).resolve().parents[2])  # the directory holding concertina_hf
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        return subprocess.Popen([sys.executable, "-m", "concertina_hf.planning.process"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)

    def plan(self, seq_lens: Sequence[int], cost, layout, budgets, strategy: str, **kwargs: Any) -> Plan:
        """:func:`plan_checked` in the child; its exceptions are raised here."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                try:
                    self._proc = self._start()
                except OSError as e:
                    raise PlanningProcessError(f"the planning process did not start: {e}") from e
            proc = self._proc
            try:
                _send(proc.stdin, ((list(seq_lens), cost, layout, budgets, strategy), kwargs))
                ok, value, self.last_cpu_s = _recv(proc.stdout)
            except (EOFError, BrokenPipeError) as e:
                code = proc.poll()
                self._proc = None
                raise PlanningProcessError(f"the planning process (pid {proc.pid}) ended"
                                   f"{'' if code is None else f' with exit code {code}'}; see its stderr") from e
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the child (after the call it is running, if any)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()


def _serve() -> None:
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing printed while planning may corrupt the channel
    while True:
        try:
            args, kwargs = _recv(inp)
        except EOFError:
            return
        c0 = time.process_time()
        try:
            result: tuple = (True, plan_checked(*args, **kwargs))
        except Exception as e:  # raised again in the caller
            result = (False, e)
        cpu = time.process_time() - c0
        try:
            _send(out, (*result, cpu))
        except Exception as e:  # an exception that does not pickle
            _send(out, (False, RuntimeError(f"{type(result[1]).__name__}: {result[1]} ({e})"), cpu))


if __name__ == "__main__":
    _serve()
