"""``StepPlanner``: plans each optimizer step of one replica, ahead of time, the same on every stage.

- :meth:`StepPlanner.submit` takes a step's sequence lengths. On the *planner* (pipeline rank 0
  of each replica) it starts :func:`~concertina_hf.planning.plan_step` in a background thread
  (one worker, so plans are made in submission order); the trainer submits step ``k+1`` before
  running step ``k``, so planning (pure Python, a few ms to the ILP's time limit) hides behind
  the step's compute. Other ranks only remember the lengths.
- :meth:`StepPlanner.plan` waits for that plan on the planner and broadcasts it as JSON over the
  pipeline group: every stage runs the very same plan even if the ILP hit its time limit at a
  different point (a failed plan is broadcast as an error, so no rank waits forever).
- :meth:`StepPlanner.set_cost_model`: plans submitted afterwards use the new cost model (the
  online refit of :class:`~concertina_hf.callbacks.ReplanCallback`).

Costs per step: one JSON broadcast of the plan (a few KB) over the pipeline group.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from .distributed import Topology
from .planning import CostModel, Plan, plan_step, simulate
from .run_setup import RunSetup

__all__ = ["StepPlanner", "Ticket"]


@dataclass
class Ticket:
    """A step submitted for planning: its lengths, and (on the planner) the plan in the making."""

    seq_lens: tuple[int, ...]
    future: Future | None = None
    plan: Plan | None = None
    error: str | None = None
    plan_time_s: float = 0.0


class StepPlanner:
    """Plans the steps of this rank's replica (see the module docstring); ``overlap``: plan in a
    background thread on the planner rank."""

    def __init__(self, setup: RunSetup, topology: Topology, overlap: bool = True) -> None:
        self.setup = setup
        self.layout = setup.layout
        self.topology = topology
        self.overlap = overlap
        self._cost_model = setup.cost_model
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        #: planning time of the last plan handed out, and how long the step waited for it
        self.last_plan_time_s = 0.0
        self.last_wait_s = 0.0

    @property
    def cost_model(self) -> CostModel:
        with self._lock:
            return self._cost_model

    def set_cost_model(self, cost: CostModel) -> None:
        """Plans submitted from now on use ``cost``."""
        with self._lock:
            self._cost_model = cost

    def make_plan(self, seq_lens: Sequence[int], cost: CostModel | None = None) -> Plan:
        """Plan one step now, in this thread (pure; the same on every rank given the same inputs)."""
        setup = self.setup
        cost = cost or self.cost_model
        try:
            plan = plan_step(list(seq_lens), cost, self.layout, setup.budgets, setup.strategy,
                             max_tokens_per_chunk=setup.max_tokens_per_chunk, solver=setup.solver,
                             time_limit_s=setup.solver_time_limit_s)
        except Exception as e:
            msg = (f"{e} [planning a step of {len(seq_lens)} sequences, longest {max(seq_lens, default=0)} tokens; "
                   "see concertina_memory_budget, concertina_max_tokens_per_chunk, concertina_strategy]")
            try:
                wrapped = type(e)(msg)
            except Exception:  # an exception type that does not take one message
                wrapped = RuntimeError(msg)
            raise wrapped from e
        if plan.predicted is None:
            plan = plan.with_predicted(simulate(plan, cost).stats())
        return plan.validate()

    def _timed_plan(self, seq_lens: tuple[int, ...], cost: CostModel) -> tuple[Plan, float]:
        t0 = time.perf_counter()
        plan = self.make_plan(seq_lens, cost)
        return plan, time.perf_counter() - t0

    def submit(self, seq_lens: Sequence[int], background: bool = True) -> Ticket:
        """Start planning a step (in the background thread on the planner when overlap is on)."""
        ticket = Ticket(tuple(int(n) for n in seq_lens))
        if self.topology.is_planner and background and self.overlap and ticket.seq_lens:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="concertina-plan")
            ticket.future = self._pool.submit(self._timed_plan, ticket.seq_lens, self.cost_model)
        return ticket

    def plan(self, ticket: Ticket) -> Plan:
        """The ticket's plan on every rank of the pipeline (collective over the pipeline group)."""
        wait0 = time.perf_counter()
        payload: str | None = None
        if self.topology.is_planner:
            try:
                if ticket.future is not None:
                    plan, ticket.plan_time_s = ticket.future.result()
                else:
                    plan, ticket.plan_time_s = self._timed_plan(ticket.seq_lens, self.cost_model)
                ticket.plan = plan
                payload = plan.to_json()
            except Exception as e:  # every stage must learn about it, or the others wait forever
                ticket.error = f"{type(e).__name__}: {e}"
                payload = json.dumps({"error": ticket.error})
        payload = self.topology.broadcast_in_pipeline(payload)
        self.last_wait_s = time.perf_counter() - wait0
        data = json.loads(payload)
        if "error" in data:
            raise RuntimeError(f"planning failed on pipeline rank 0: {data['error']}")
        plan = ticket.plan if ticket.plan is not None else Plan.from_dict(data)
        if plan.seq_lens != ticket.seq_lens:
            raise RuntimeError(
                f"pipeline ranks disagree on the step's sequences ({len(plan.seq_lens)} vs {len(ticket.seq_lens)}): "
                "every rank of a pipeline must read the same batches (do not shard data over stages)"
            )
        self.last_plan_time_s = ticket.plan_time_s
        return plan

    def close(self) -> None:
        """Stop the planning thread (after the plan it is making, if any); a later submit starts
        a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
