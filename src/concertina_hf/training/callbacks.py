"""``StepStatsCallback``: records what each step's plan did, refits the cost model, logs and draws it.

The planning itself is the trainer's (:class:`~concertina_hf.training.step_planner.StepPlanner`); this
callback keeps what a ``TrainerCallback`` is for:

- :meth:`StepStatsCallback.record` gathers each stage's measured action times, wall time and
  activation peak to the planner rank; from them it derives the step's :class:`StepStats` and,
  with ``concertina_cost_model="online"``, time samples of every (stage, chunk). Every
  ``concertina_replan_interval`` steps it refits the cost model by least squares on the latest
  samples, the newest steps held out (:func:`~concertina_hf.planning.fit.bounded_refit`: no
  coefficient below a fraction of the start model's, kept only when it predicts the held-out
  steps better than the current model), and hands it to the planner, guarded, for the plans
  submitted after that (a plan that jumps falls back: :mod:`~concertina_hf.training.step_planner`).
- Per step, at the Trainer's logging cadence, the statistics join the step's entry of the
  Trainer's ``self.log`` (so they reach every ``report_to`` tracker in the same row as the loss),
  under ``concertina/``: chunks by kind, pipeline groups, predicted and measured step time and
  bubble fraction, recompute layers (total and per stage), predicted and measured activation
  peak per stage, planning time (and how long the step waited for its plan), where each stage's
  step time went (``concertina/compute_s_stage<s>``, ``comm_wait_s_stage<s>``, ``other_s_stage<s>``:
  :attr:`~concertina_hf.runtime.executor.StepResult.breakdown`), cost-model refits (accepted,
  rejected, undone by a fallback), and with ``concertina_router_aux_loss`` the router
  load-balancing term added to the step's loss (``concertina/router_aux_loss``: summed over the
  stages, ``coef`` included; the logged ``loss`` is the cross-entropy without it).
- At the end of ``train()`` it writes the last step's planned and measured Gantt chart to
  ``<output_dir>/gantt/step-<n>.png`` (and every ``concertina_gantt_steps`` steps when that is
  positive; -1 draws none), logs its path, and sends it to wandb as an image when wandb is a
  tracker.

Costs per step: one small gather on the pipeline group; a refit is a least-squares fit over at
most ``max_samples`` samples and a prediction of the held-out ones.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..planning import Action, CostModel, Plan, simulate
from ..planning.fit import ActionSample, action_samples, bounded_refit

__all__ = ["StepStatsCallback", "StepStats", "console_logs", "use_compact_console"]

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one step's plan predicted and what the stages measured (planner rank only)."""

    step: int
    plan: Plan
    plan_time_s: float
    plan_wait_s: float
    measured_step_time_s: float
    measured_bubble_fraction: float
    #: per stage; ``None`` where the step was run without measuring it (:meth:`StepStatsCallback.wants_memory`)
    peak_activation_bytes: tuple[int | None, ...]
    action_times: list[tuple[Action, float, float]] = field(default_factory=list)
    #: per stage: seconds of compute, communication waits and the rest (``StepResult.breakdown``)
    breakdown: tuple[dict[str, float], ...] = ()
    #: the router load-balancing term of the step, summed over the stages (None: no such term)
    router_aux_loss: float | None = None

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
            if b is not None:
                logs[f"concertina/peak_activation_stage{s}_bytes"] = float(b)
        logs["concertina/planning_time_s"] = self.plan_time_s
        logs["concertina/plan_wait_s"] = self.plan_wait_s
        for s, parts in enumerate(self.breakdown):
            for part, seconds in parts.items():
                logs[f"concertina/{part}_s_stage{s}"] = float(seconds)
        if self.router_aux_loss is not None:
            logs["concertina/router_aux_loss"] = self.router_aux_loss
        return logs


class StepStatsCallback(TrainerCallback):
    """Records the steps of a :class:`ConcertinaTrainer`, refits its cost model, logs plan statistics.

    The settings come from the trainer's :class:`ConcertinaTrainingArguments` (``concertina_*``
    fields); ``ConcertinaTrainer`` adds one of these when ``callbacks`` holds none, and binds it.
    ``max_samples``: the newest per-layer time samples kept for refits; ``held_out_fraction``: the
    share of the kept steps (the newest, at least one) a refit is checked on instead of fitted to.
    """

    def __init__(self, max_samples: int = 2048, held_out_fraction: float = 0.2) -> None:
        self.max_samples = max_samples
        self.held_out_fraction = held_out_fraction
        self.trainer = None
        self.planner = None
        self.floor_model: CostModel | None = None  # the start model: refits stay above a fraction of it
        self.refits = 0
        self.rejected_refits = 0
        self.last: StepStats | None = None
        self.history: list[StepStats] = []  # planner rank only; kept short (see record)
        self._samples: list[list[ActionSample]] = []  # per recorded step, oldest first
        self._memory_ratio = 1.0  # largest measured / predicted activation peak seen since the last refit
        self._steps_recorded = 0
        self._pending_logs: dict[str, float] | None = None
        #: tokens this replica trained on since the last train() began (every rank counts them)
        self.tokens_trained = 0
        self._drawn_step: int | None = None

    def bind(self, trainer) -> None:
        """Attach to a :class:`ConcertinaTrainer` (called by its constructor)."""
        self.trainer = trainer
        self.args = trainer.args
        self.topology = trainer.topology
        self.planner = trainer.planner
        self.floor_model = trainer.planner.cost_model

    @property
    def cost_model(self) -> CostModel:
        """The cost model the next plans are made with (the planner's)."""
        return self.planner.cost_model

    @property
    def layout(self):
        return self.planner.layout

    # ------------------------------------------------------------------ measurements
    def wants_memory(self, state) -> bool:
        """Whether the step the Trainer runs next (``state.global_step + 1``) needs its measured
        activation peak: every step with the ``online`` cost model (the refit's memory check takes
        the largest measured / predicted ratio of every step), otherwise the steps whose statistics
        are logged (``logging_first_step``, every ``logging_steps``-th step, every step under
        ``logging_strategy="epoch"``, none under ``"no"``). Measuring costs a Python call per saved tensor on CPU
        (:class:`~concertina_hf.runtime.memory.SavedTensorMeter`); a step logged for another
        reason (a callback setting ``should_log``) logs no ``peak_activation`` figure."""
        args = self.args
        if args.concertina_cost_model == "online":
            return True
        step = state.global_step + 1
        if step == 1 and args.logging_first_step:
            return True
        strategy = str(getattr(args.logging_strategy, "value", args.logging_strategy))
        if strategy != "steps":
            return strategy != "no"  # "epoch": whichever step ends the epoch
        every = getattr(state, "logging_steps", None) or args.logging_steps
        return bool(every) and step % every == 0

    def record(self, plan: Plan, result) -> StepStats | None:
        """Gather the stages' measurements to the planner; statistics and (online) refits there.
        Collective over the pipeline group."""
        mine = {
            "stage": self.topology.stage,
            "actions": [(str(a), float(t0), float(t1)) for a, t0, t1 in result.action_times],
            "peak": None if result.peak_activation_bytes is None else int(result.peak_activation_bytes),
            "wall": float(result.wall_time_s),
            "breakdown": {k: float(v) for k, v in getattr(result, "breakdown", {}).items()},
            "router_aux": getattr(result, "router_aux_loss", None),
        }
        gathered = self.topology.gather_in_pipeline(mine)
        self._steps_recorded += 1
        self.tokens_trained += sum(plan.seq_lens)
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
            plan_time_s=self.planner.last_plan_time_s,
            plan_wait_s=self.planner.last_wait_s,
            measured_step_time_s=wall,
            measured_bubble_fraction=max(0.0, 1.0 - busy / (p * wall)) if wall > 0 else 0.0,
            peak_activation_bytes=tuple(m["peak"] for m in per_stage),
            action_times=actions,
            breakdown=tuple(m["breakdown"] for m in per_stage),
            router_aux_loss=None if all(m["router_aux"] is None for m in per_stage)
            else sum(m["router_aux"] or 0.0 for m in per_stage),
        )
        self.last = stats
        self.history = (self.history + [stats])[-8:]
        if self.args.concertina_cost_model == "online":
            self._samples.append(action_samples(plan, actions))
            while len(self._samples) > 1 and sum(map(len, self._samples)) > self.max_samples:
                self._samples.pop(0)
            if plan.predicted is not None:
                for st, measured in enumerate(stats.peak_activation_bytes):
                    if measured is None:
                        continue
                    predicted = plan.predicted.peak_memory_bytes[st] - self.cost_model.static_memory(plan.layout, st)
                    if predicted > 0:
                        self._memory_ratio = max(self._memory_ratio, measured / predicted)
            if self._steps_recorded % self.args.concertina_replan_interval == 0:
                self.refit()
        return stats

    def refit(self) -> bool:
        """Refit the cost model on the kept samples but the newest steps' and check it on those
        (:func:`bounded_refit`); raise the activation memory coefficients when a stage measured more
        than predicted. False (the reason logged) when the refit is rejected."""
        held = max(1, int(len(self._samples) * self.held_out_fraction))
        fit = [x for step in self._samples[:-held] for x in step]
        held_out = [x for step in self._samples[-held:] for x in step]
        new, why = bounded_refit(self.cost_model, self.layout, fit, held_out, floors=self.floor_model,
                                 memory_scale=self._memory_ratio)
        if new is None:
            self.rejected_refits += 1
            logger.info("concertina: cost-model refit rejected (%s)", why)
            return False
        logger.info("concertina: cost model refitted (%s)", why)
        self.planner.set_cost_model(new, guarded=True)
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
            logs["concertina/cost_model_refits_rejected"] = float(self.rejected_refits)
            logs["concertina/cost_model_fallbacks"] = float(len(getattr(self.planner, "fallbacks", ())))
            self._pending_logs = logs
        n = args.concertina_gantt_steps
        if n > 0 and state.global_step % n == 0 and state.is_world_process_zero:
            self._draw(stats, args, state.global_step)

    def _draw(self, stats: StepStats, args, step: int) -> None:
        path = self.write_gantt(stats, os.path.join(args.output_dir, "gantt", f"step-{step}.png"), step)
        if path is not None:
            self._drawn_step = step
            logger.info("concertina: the schedule of step %d is drawn in %s", step, path)

    def on_train_begin(self, args, state, control, **kwargs):
        self.tokens_trained = 0

    def on_train_end(self, args, state, control, **kwargs):
        if self.planner is not None:
            self.planner.close()  # the planning thread; a later train() starts a new one
        stats = self.last
        if (self.trainer is not None and stats is not None and args.concertina_gantt_steps >= 0
                and state.is_world_process_zero and self._drawn_step != state.global_step):
            self._draw(stats, args, state.global_step)  # the last step's chart

    def pop_pending_logs(self) -> dict[str, float]:
        """The statistics waiting for the step's log entry (empty when none)."""
        logs, self._pending_logs = self._pending_logs or {}, None
        return logs

    def write_gantt(self, stats: StepStats, path: str, step: int | None = None) -> str | None:
        """Planned vs measured Gantt chart of a step (matplotlib needed; skipped with a warning)."""
        try:
            from ..planning.viz import plot_gantt

            os.makedirs(os.path.dirname(path), exist_ok=True)
            sim = simulate(stats.plan, self.cost_model)
            source = getattr(getattr(self.trainer, "setup", None), "budget_source", None)
            plot_gantt(stats.plan, sim, path, measured=stats.action_times, cost=self.cost_model, budget_source=source,
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


# ---------------------------------------------------------------------- the console
#: the plan statistics shown on the console, under a short name (all of them go to the trackers)
CONSOLE_KEYS = {"concertina/measured_step_time_s": "step_time_s", "concertina/measured_bubble_fraction": "bubble"}


def console_logs(logs: dict) -> dict:
    """A log entry as the console shows it: the Trainer's own figures (loss, learning rate, grad
    norm, ...) plus the step time and bubble; the other ``concertina/*`` statistics only reach the
    configured trackers."""
    out = {k: v for k, v in logs.items() if not k.startswith("concertina/")}
    out.update({short: logs[k] for k, short in CONSOLE_KEYS.items() if k in logs})
    return out


class _CompactProgress(ProgressCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)


class _CompactPrinter(PrinterCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)


def use_compact_console(callback_handler) -> None:
    """Swap the Trainer's console printers (progress bar or plain prints) for ones showing
    :func:`console_logs` (one short line per logging step instead of ~20 plan statistics)."""
    for old, new in ((ProgressCallback, _CompactProgress), (PrinterCallback, _CompactPrinter)):
        if callback_handler.pop_callback(old) is not None:
            callback_handler.add_callback(new)
