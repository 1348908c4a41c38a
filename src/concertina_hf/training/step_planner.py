"""``StepPlanner``: plans each optimizer step of one replica, ahead of time, the same on every stage.

- :meth:`StepPlanner.submit` takes a step's sequence lengths. On the *planner* (pipeline rank 0
  of each replica) it starts :func:`~concertina_hf.planning.plan_step` in a background thread
  (one worker, so plans are made in submission order), which runs it in a process of its own
  (:class:`~concertina_hf.planning.process.PlanningProcess`: no GIL shared with training); the trainer submits step ``k+1`` before
  running step ``k``, so planning (pure Python, a few ms to the ILP's time limit) hides behind
  the step's compute. Other ranks only remember the lengths.
- :meth:`StepPlanner.plan` waits for that plan on the planner and broadcasts it as JSON over the
  pipeline group: every stage runs the very same plan even if the ILP hit its time limit at a
  different point (a failed plan is broadcast as an error, so no rank waits forever).
- :meth:`StepPlanner.set_cost_model`: plans submitted afterwards use the new cost model (the
  online refit of :class:`~concertina_hf.training.callbacks.StepStatsCallback`). A refit is set *guarded*:
  the model before it stays as the fallback. When a plan's chunks or predicted time per token
  jump by more than ``jump_factor`` against the previous step's plan, the step is planned with
  the fallback too; if the two plans differ by that factor in chunk count, or the fallback model
  predicts the new plan that much slower than its own, the step runs the fallback's plan, the
  refit is undone and the reason logged (:attr:`StepPlanner.fallbacks`): a bad refit never makes
  a step slower by more than that factor, and only for its first step.

Costs per step: one JSON broadcast of the plan (a few KB) over the pipeline group; a second
plan (in the background thread) only for a step that jumped after a refit.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from ..runtime.distributed import Topology
from ..planning import CostModel, Plan, PlanError, simulate
from ..planning.process import PlanningProcess, PlanningProcessError, plan_checked
from .args import PLANNER_FIELDS
from .run_setup import RunSetup

__all__ = ["JUMP_FACTOR", "StepPlanner", "Ticket", "plan_jump"]

logger = logging.getLogger(__name__)

#: how far a plan's chunks or predicted time per token may move against the previous step's
#: after a refit before the step falls back to the previous cost model
JUMP_FACTOR = 2.0


def plan_jump(previous: Plan, plan: Plan, factor: float = JUMP_FACTOR) -> str | None:
    """Why ``plan`` jumped against ``previous`` (chunks or predicted step time per token moved by
    more than ``factor`` either way), or ``None``."""
    def per_token(p: Plan) -> tuple[float, float]:
        tokens = max(1, sum(p.seq_lens))
        t = p.predicted.step_time_s if p.predicted is not None else 0.0
        return p.num_chunks / tokens, t / tokens

    (c0, t0), (c1, t1) = per_token(previous), per_token(plan)
    if c0 > 0 and c1 > 0 and max(c1 / c0, c0 / c1) > factor:
        return (f"{plan.num_chunks} chunks for {sum(plan.seq_lens)} tokens after {previous.num_chunks} for "
                f"{sum(previous.seq_lens)} in the previous step")
    if t0 > 0 and t1 > 0 and max(t1 / t0, t0 / t1) > factor:
        return (f"predicted {plan.predicted.step_time_s:.3g}s for {sum(plan.seq_lens)} tokens after "
                f"{previous.predicted.step_time_s:.3g}s for {sum(previous.seq_lens)} in the previous step")
    return None


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
    background thread on the planner rank; ``jump_factor``: see the module docstring;
    ``isolate``: the background thread hands the planning itself to a process of its own
    (:class:`~concertina_hf.planning.process.PlanningProcess`), so that it never holds the GIL
    the training thread needs (in the thread itself it slowed CPU steps several times over for
    as long as it ran)."""

    def __init__(self, setup: RunSetup, topology: Topology, overlap: bool = True,
                 jump_factor: float = JUMP_FACTOR, isolate: bool = True) -> None:
        self.setup = setup
        self.layout = setup.layout
        self.topology = topology
        self.overlap = overlap
        self.jump_factor = jump_factor
        self._cost_model = setup.cost_model
        self._fallback: CostModel | None = None  # the model before a guarded refit
        self._previous: Plan | None = None  # the plan made last (plans are made in submission order)
        #: why steps fell back to the previous cost model (planner rank only)
        self.fallbacks: list[str] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.isolate = isolate
        self._process: PlanningProcess | None = None
        #: planning time of the last plan handed out, and how long the step waited for it
        self.last_plan_time_s = 0.0
        self.last_wait_s = 0.0

    @property
    def cost_model(self) -> CostModel:
        with self._lock:
            return self._cost_model

    def set_cost_model(self, cost: CostModel, *, guarded: bool = False) -> None:
        """Plans submitted from now on use ``cost``; ``guarded`` (an online refit): the current
        model stays the fallback of a step whose plan jumps (see the module docstring)."""
        with self._lock:
            self._fallback = self._cost_model if guarded else None
            self._cost_model = cost

    def _models(self) -> tuple[CostModel, CostModel | None]:
        with self._lock:
            return self._cost_model, self._fallback

    def make_plan(self, seq_lens: Sequence[int], cost: CostModel | None = None) -> Plan:
        """Plan one step now (in the planning process once the background thread has started one;
        pure: the same on every rank given the same inputs)."""
        setup = self.setup
        cost = cost or self.cost_model
        args = (list(seq_lens), cost, self.layout, setup.budgets, setup.strategy)
        kwargs = dict(max_tokens_per_chunk=setup.max_tokens_per_chunk, solver=setup.solver,
                      time_limit_s=setup.solver_time_limit_s)
        if setup.segment is not None:  # segment-level training: cut at segments, recorded in the plan
            kwargs["segment"] = setup.segment
        if setup.sp_mode != "ulysses":  # whole-doc / per-doc placements chosen per chunk
            kwargs["sp_mode"] = setup.sp_mode
        try:
            process = self._process
            if process is not None:
                try:
                    return process.plan(*args, **kwargs)
                except PlanningProcessError as e:  # the process, not the planning: plan here from now on
                    logger.warning("concertina: %s; planning in the training process from now on", e)
                    self._process, self.isolate = None, False
                    process.close()
            return plan_checked(*args, **kwargs)
        except Exception as e:
            text = e.worded(PLANNER_FIELDS) if isinstance(e, PlanError) else str(e)
            msg = (f"{text} [planning a step of {len(seq_lens)} sequences, longest {max(seq_lens, default=0)} tokens; "
                   "see concertina_memory_budget, concertina_max_tokens_per_chunk, concertina_strategy]")
            if isinstance(e, PlanError):
                raise e.with_message(msg) from e
            try:
                wrapped = type(e)(msg)
            except Exception:  # an exception type that does not take one message
                wrapped = RuntimeError(msg)
            raise wrapped from e

    def _timed_plan(self, seq_lens: tuple[int, ...], cost: CostModel,
                    fallback: CostModel | None = None) -> tuple[Plan, float]:
        t0 = time.perf_counter()
        plan = self.make_plan(seq_lens, cost)
        if fallback is not None and self._previous is not None:
            plan = self._guard(plan, seq_lens, cost, fallback)
        self._previous = plan
        return plan, time.perf_counter() - t0

    def _guard(self, plan: Plan, seq_lens: tuple[int, ...], cost: CostModel, fallback: CostModel) -> Plan:
        """``plan``, or the fallback model's plan of the same step when ``plan`` jumped because of
        the refit (then the refit is undone)."""
        jump = plan_jump(self._previous, plan, self.jump_factor)
        if jump is None:
            return plan
        try:
            fb = self.make_plan(seq_lens, fallback)
        except Exception:  # the fallback cannot plan this step: keep the new model's plan
            return plan
        f = self.jump_factor
        if max(plan.num_chunks / fb.num_chunks, fb.num_chunks / plan.num_chunks) > f:
            why = f"{plan.num_chunks} chunks where the previous cost model plans {fb.num_chunks}"
        elif (t := simulate(plan, fallback).step_time_s) > f * fb.predicted.step_time_s:
            why = f"the previous cost model predicts the new plan {t:.3g}s against {fb.predicted.step_time_s:.3g}s for its own"
        else:
            return plan  # the step itself is unusual: both models plan it alike
        reason = f"refit undone: {jump}; {why}"
        logger.warning("concertina: a step falls back to the previous cost model (%s)", reason)
        with self._lock:
            if self._cost_model is cost:
                self._cost_model, self._fallback = fallback, None
        self.fallbacks.append(reason)
        return fb

    def submit(self, seq_lens: Sequence[int], background: bool = True) -> Ticket:
        """Start planning a step (in the background thread on the planner when overlap is on)."""
        ticket = Ticket(tuple(int(n) for n in seq_lens))
        if self.topology.is_planner and background and self.overlap and ticket.seq_lens:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="concertina-plan")
            if self.isolate and self._process is None:
                self._process = PlanningProcess()
            ticket.future = self._pool.submit(self._timed_plan, ticket.seq_lens, *self._models())
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
                    plan, ticket.plan_time_s = self._timed_plan(ticket.seq_lens, *self._models())
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
        if self._process is not None:
            self._process.close()
            self._process = None
