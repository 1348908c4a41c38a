"""``ReplanCallback``: plans every step, refits the cost model, logs what the plans did.

Planning service (used by :class:`~concertina_hf.trainer.ConcertinaTrainer`):

- :meth:`ReplanCallback.submit` takes a step's sequence lengths. On the *planner* (pipeline
  rank 0 of each replica) it starts :func:`~concertina_hf.planning.plan_step` in a background
  thread (one worker, so plans are made in submission order); the trainer submits step ``k+1``
  before running step ``k``, so planning (pure Python, a few ms to the ILP's time limit) hides
  behind the step's compute. Other ranks only remember the lengths.
- :meth:`ReplanCallback.plan` waits for that plan on the planner and broadcasts it as JSON over
  the pipeline group: every stage runs the very same plan even if the ILP hit its time limit at
  a different point (a failed plan is broadcast as an error, so no rank waits forever).
- :meth:`ReplanCallback.record` gathers each stage's measured action times, wall time and
  activation peak to the planner; from them it derives the step's statistics and, with
  ``concertina_cost_model="online"``, time samples of every (stage, chunk). Every
  ``concertina_replan_interval`` steps the cost model is refitted by least squares on the latest
  samples (:func:`refit_cost_model`: decoder-layer coefficients and the embedding / head rate
  together, then the backward factor; activation bytes raised if a stage measured more than
  predicted) and used by the plans submitted after that.

Per step, at the Trainer's logging cadence, its statistics join the step's entry of the Trainer's
``self.log`` (so they reach every ``report_to`` tracker in the same row as the loss), under
``concertina/``: chunks by kind, pipeline groups, predicted and
measured step time and bubble fraction, recompute layers (total and per stage), predicted and
measured activation peak per stage, planning time (and how long the step waited for its plan),
cost-model refits. Every ``concertina_gantt_steps`` steps it writes the step's planned and
measured Gantt chart to ``<output_dir>/gantt/step-<n>.png`` (and to wandb as an image when
wandb is a tracker). Costs per step: one JSON broadcast and one small gather on the pipeline
group; a refit is a least-squares fit over at most ``max_samples`` samples.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

from transformers import TrainerCallback

from .planning import (
    Action,
    CostModel,
    DeviceSpec,
    Plan,
    StageLayout,
    partition_layers,
    plan_step,
    simulate,
)
from .planning.fit import ActionSample, action_samples, refit_cost_model

__all__ = ["ReplanCallback", "StepStats"]

logger = logging.getLogger(__name__)


@dataclass
class _Ticket:
    seq_lens: tuple[int, ...]
    future: Future | None = None
    plan: Plan | None = None
    error: str | None = None
    plan_time_s: float = 0.0


@dataclass
class StepStats:
    """What one step's plan predicted and what the stages measured (planner rank only)."""

    step: int
    plan: Plan
    plan_time_s: float
    plan_wait_s: float
    measured_step_time_s: float
    measured_bubble_fraction: float
    peak_activation_bytes: tuple[int, ...]
    action_times: list[tuple[Action, float, float]] = field(default_factory=list)

    def as_logs(self) -> dict[str, float]:
        plan = self.plan
        logs: dict[str, float] = {}
        for kind, n in plan.chunk_counts().items():
            logs[f"concertina/chunks_{kind}"] = float(n)
        logs["concertina/chunks"] = float(plan.num_chunks)
        logs["concertina/groups"] = float(len(plan.groups))
        logs["concertina/sequences"] = float(len(plan.seq_lens))
        logs["concertina/tokens"] = float(sum(plan.seq_lens))
        logs["concertina/longest_sequence"] = float(max(plan.seq_lens))
        if plan.predicted is not None:
            logs["concertina/predicted_step_time_s"] = plan.predicted.step_time_s
            logs["concertina/predicted_bubble_fraction"] = plan.predicted.bubble_fraction
            for s, b in enumerate(plan.predicted.peak_memory_bytes):
                logs[f"concertina/predicted_peak_memory_stage{s}_bytes"] = float(b)
        logs["concertina/measured_step_time_s"] = self.measured_step_time_s
        logs["concertina/measured_bubble_fraction"] = self.measured_bubble_fraction
        logs["concertina/recompute_layers"] = float(sum(sum(r) for r in plan.recompute))
        for s, row in enumerate(plan.recompute):
            logs[f"concertina/recompute_layers_stage{s}"] = float(sum(row))
        for s, b in enumerate(self.peak_activation_bytes):
            logs[f"concertina/peak_activation_stage{s}_bytes"] = float(b)
        logs["concertina/planning_time_s"] = self.plan_time_s
        logs["concertina/plan_wait_s"] = self.plan_wait_s
        return logs


class ReplanCallback(TrainerCallback):
    """Plans each step of a :class:`ConcertinaTrainer`, refits the cost model, logs plan statistics.

    The settings come from the trainer's :class:`ConcertinaTrainingArguments` (``concertina_*``
    fields); ``ConcertinaTrainer`` adds one of these when ``callbacks`` holds none, and binds it.
    ``max_samples``: the newest per-layer time samples kept for refits.
    """

    def __init__(self, max_samples: int = 2048) -> None:
        self.max_samples = max_samples
        self.trainer = None
        self.cost_model: CostModel | None = None
        self.layout: StageLayout | None = None
        self.memory_budget: int | tuple[int, ...] = 0
        self.refits = 0
        self.last: StepStats | None = None
        self.history: list[StepStats] = []  # planner rank only; kept short (see record)
        self._samples: list[ActionSample] = []
        self._memory_ratio = 1.0  # largest measured / predicted activation peak seen since the last refit
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._steps_recorded = 0

    # ------------------------------------------------------------------ setup
    @staticmethod
    def initial_cost_model(args, config, device, dtype_bytes: int, device_memory_bytes: int) -> CostModel:
        """The cost model a run starts from: analytic from the config at the device's rates, or
        the JSON file ``concertina_cost_model_path`` (``profiled``, and ``online`` when given)."""
        if args.concertina_cost_model_path:
            with open(args.concertina_cost_model_path) as fh:
                cost = CostModel.from_dict(json.load(fh))
            if cost.num_layers != int(config.num_hidden_layers):
                raise ValueError(
                    f"concertina_cost_model_path describes {cost.num_layers} layers but the model has "
                    f"{config.num_hidden_layers}; profile this model or drop concertina_cost_model_path"
                )
            return cost
        base = DeviceSpec() if getattr(device, "type", str(device)) == "cuda" else DeviceSpec.cpu()
        spec = DeviceSpec(flops=base.flops, mem_bandwidth=base.mem_bandwidth, kernel_overhead_s=base.kernel_overhead_s,
                          p2p_bandwidth=base.p2p_bandwidth, p2p_latency_s=base.p2p_latency_s,
                          memory_bytes=int(device_memory_bytes))
        return CostModel.from_hf_config(config, spec, dtype_bytes=dtype_bytes)

    @staticmethod
    def profiled_cost_model(model, args, base: CostModel, device, pipeline_size: int) -> CostModel:
        """Profile the real decoder layers, head and embedding on ``device``
        (:func:`concertina_hf.runtime.profiler.profile_cost_model`), as many layers as a stage
        holds, chunk shapes up to ``concertina_max_tokens_per_chunk`` (at least 32; the profiler's
        device default without a cap); ``base`` keeps the rest."""
        import torch

        from .runtime.profiler import profile_cost_model

        layers = -(-int(model.config.num_hidden_layers) // max(1, pipeline_size))
        cap = args.concertina_max_tokens_per_chunk
        # the profiler needs at least 32 tokens to make distinct shapes; None: its device default
        # profile in the precision the run trains in (bf16 autocast halves activations and K/V)
        amp = torch.bfloat16 if args.bf16 else None
        return profile_cost_model(model, base=base, device=device, num_layers=layers,
                                  max_tokens=None if cap is None else max(32, cap), autocast_dtype=amp)

    @staticmethod
    def layout_for(cost: CostModel, pipeline_size: int) -> StageLayout:
        """Decoder layers over stages, balanced by the cost model (deterministic on every rank)."""
        return partition_layers(cost, pipeline_size)

    def bind(self, trainer) -> None:
        """Attach to a :class:`ConcertinaTrainer` (called by its constructor)."""
        args = trainer.args
        self.trainer = trainer
        self.args = args
        self.topology = trainer.topology
        self.cost_model = trainer.cost_model
        self.layout = trainer.layout
        budget = args.memory_budget
        if budget == "auto":
            self.memory_budget = int(trainer._device_memory * args.concertina_memory_fraction)
        elif budget is None:
            self.memory_budget = 0
        else:
            self.memory_budget = budget[0] if len(budget) == 1 else tuple(budget)
            if isinstance(self.memory_budget, tuple) and len(self.memory_budget) != self.layout.num_stages:
                raise ValueError(
                    f"concertina_memory_budget lists {len(self.memory_budget)} sizes for "
                    f"{self.layout.num_stages} pipeline stages; give one size, or one per stage"
                )
        if self.topology.is_planner and args.concertina_overlap_planning and self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="concertina-plan")

    # ------------------------------------------------------------------ planning
    def make_plan(self, seq_lens: Sequence[int], cost: CostModel | None = None) -> Plan:
        """Plan one step now, in this thread (pure; the same on every rank given the same inputs)."""
        args = self.args
        cost = cost or self.cost_model
        try:
            plan = plan_step(list(seq_lens), cost, self.layout, self.memory_budget, args.concertina_strategy,
                             max_tokens_per_chunk=args.concertina_max_tokens_per_chunk, solver=args.concertina_solver,
                             time_limit_s=args.concertina_solver_time_limit)
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

    def submit(self, seq_lens: Sequence[int], background: bool = True) -> _Ticket:
        """Start planning a step (background thread on the planner when overlap is on)."""
        ticket = _Ticket(tuple(int(n) for n in seq_lens))
        if self.topology.is_planner and background and self._pool is not None and ticket.seq_lens:
            ticket.future = self._pool.submit(self._timed_plan, ticket.seq_lens, self.cost_model)
        return ticket

    def plan(self, ticket: _Ticket) -> Plan:
        """The ticket's plan on every rank of the pipeline (collective over the pipeline group)."""
        import torch.distributed as dist

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
        if self.topology.pipeline_size > 1:
            obj = [payload]
            dist.broadcast_object_list(obj, src=self.topology.pp_ranks[0], group=self.topology.pp_group)
            payload = obj[0]
        self._plan_wait_s = time.perf_counter() - wait0
        data = json.loads(payload)
        if "error" in data:
            raise RuntimeError(f"planning failed on pipeline rank 0: {data['error']}")
        plan = ticket.plan if ticket.plan is not None else Plan.from_dict(data)
        if plan.seq_lens != ticket.seq_lens:
            raise RuntimeError(
                f"pipeline ranks disagree on the step's sequences ({len(plan.seq_lens)} vs {len(ticket.seq_lens)}): "
                "every rank of a pipeline must read the same batches (do not shard data over stages)"
            )
        self._plan_time_s = ticket.plan_time_s
        return plan

    # ------------------------------------------------------------------ measurements
    def record(self, plan: Plan, result) -> StepStats | None:
        """Gather the stages' measurements to the planner; statistics and (online) refits there.
        Collective over the pipeline group."""
        import torch.distributed as dist

        mine = {
            "stage": self.topology.stage,
            "actions": [(str(a), float(t0), float(t1)) for a, t0, t1 in result.action_times],
            "peak": int(result.peak_activation_bytes),
            "wall": float(result.wall_time_s),
        }
        if self.topology.pipeline_size > 1:
            gathered = [None] * self.topology.pipeline_size if self.topology.is_planner else None
            dist.gather_object(mine, gathered, dst=self.topology.pp_ranks[0], group=self.topology.pp_group)
        else:
            gathered = [mine]
        self._steps_recorded += 1
        if not self.topology.is_planner:
            return None
        per_stage = sorted(gathered, key=lambda m: m["stage"])
        actions = [(Action.parse(a), t0, t1) for m in per_stage for a, t0, t1 in m["actions"]]
        wall = max(m["wall"] for m in per_stage)
        busy = sum(t1 - t0 for _, t0, t1 in actions)
        p = plan.num_stages
        stats = StepStats(
            step=self._steps_recorded,
            plan=plan,
            plan_time_s=getattr(self, "_plan_time_s", 0.0),
            plan_wait_s=getattr(self, "_plan_wait_s", 0.0),
            measured_step_time_s=wall,
            measured_bubble_fraction=max(0.0, 1.0 - busy / (p * wall)) if wall > 0 else 0.0,
            peak_activation_bytes=tuple(m["peak"] for m in per_stage),
            action_times=actions,
        )
        self.last = stats
        self.history = (self.history + [stats])[-8:]
        if self.args.concertina_cost_model == "online":
            self._samples = (self._samples + action_samples(plan, actions))[-self.max_samples:]
            if plan.predicted is not None:
                for st, measured in enumerate(stats.peak_activation_bytes):
                    predicted = plan.predicted.peak_memory_bytes[st] - self.cost_model.static_memory(plan.layout, st)
                    if predicted > 0:
                        self._memory_ratio = max(self._memory_ratio, measured / predicted)
            if self._steps_recorded % self.args.concertina_replan_interval == 0:
                self.refit()
        return stats

    def refit(self) -> bool:
        """Refit the cost model on the kept samples (:func:`refit_cost_model`); raise the activation
        memory coefficients when a stage measured more than predicted. False if the samples cannot
        determine the time coefficients."""
        new = refit_cost_model(self.cost_model, self.layout, self._samples, memory_scale=self._memory_ratio)
        if new is None:
            return False
        with self._lock:
            self.cost_model = new
        self._memory_ratio = 1.0
        self.refits += 1
        return True

    # ------------------------------------------------------------------ TrainerCallback hooks
    def on_step_end(self, args, state, control, **kwargs):
        stats = self.last
        if self.trainer is None or stats is None or not self.topology.is_planner:
            return
        if control.should_log:
            # merged into the Trainer's own log entry of this step (ConcertinaTrainer.log): calling
            # trainer.log here would reset control.should_log and drop the step's loss entry
            logs = stats.as_logs()
            logs["concertina/cost_model_refits"] = float(self.refits)
            self._pending_logs = logs
        n = args.concertina_gantt_steps
        if n and state.global_step % n == 0 and state.is_world_process_zero:
            self.write_gantt(stats, os.path.join(args.output_dir, "gantt", f"step-{state.global_step}.png"),
                             state.global_step)

    def pop_pending_logs(self) -> dict[str, float]:
        """The statistics waiting for the step's log entry (empty when none)."""
        logs, self._pending_logs = getattr(self, "_pending_logs", None) or {}, None
        return logs

    def write_gantt(self, stats: StepStats, path: str, step: int | None = None) -> str | None:
        """Planned vs measured Gantt chart of a step (matplotlib needed; skipped with a warning)."""
        try:
            from .viz import plot_gantt

            os.makedirs(os.path.dirname(path), exist_ok=True)
            sim = simulate(stats.plan, self.cost_model)
            plot_gantt(stats.plan, sim, path, measured=stats.action_times, cost=self.cost_model,
                       title=f"step {step}: {stats.plan.num_chunks} chunks, predicted "
                             f"{sim.step_time_s:.3f}s, measured {stats.measured_step_time_s:.3f}s")
        except ImportError as e:
            logger.warning("not writing the Gantt chart: %s", e)
            return None
        if "wandb" in (self.args.report_to or []):
            try:
                import wandb

                if wandb.run is not None:
                    wandb.log({"concertina/gantt": wandb.Image(path), "train/global_step": step})
            except ImportError:
                pass
        return path

    def close(self) -> None:
        """Stop the planning thread (after the plan it is making, if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def on_train_end(self, args, state, control, **kwargs):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            if self.topology.is_planner and args.concertina_overlap_planning:
                # a later train() call (e.g. resuming) plans in the background again
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="concertina-plan")
