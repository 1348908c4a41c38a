"""``StepGuard``: every rank agrees, once per optimizer step, whether the step's values are finite.

A NaN or an infinity produced on one stage flows on: through the later stages' forwards into the
loss, back through every stage's gradients, into the weights with the optimizer step, and from
there into every later step. ``Trainer`` on one process hides it too: with
``logging_nan_inf_filter`` (on by default) the logged loss of a NaN step is replaced by the mean of
the previous ones. :meth:`StepGuard.check` runs after each step's pipeline, before the gradients
are reduced over the replicas: each rank looks at what it computed (the executor's list of actions
whose result was not finite, :attr:`~concertina_hf.runtime.executor.StepResult.nonfinite`; the
loss on the last stage; the 2-norm of its stage's gradients) and the job exchanges one number per
rank (:meth:`~concertina_hf.runtime.distributed.Topology.numbers_of_every_rank`), so every rank reaches
the same verdict. Only when something is wrong does it gather the details, to name where the
values first went non-finite: the earliest stage whose forward produced one (forwards run from
stage 0 to the last), else the latest stage whose backward did, else the stages whose parameter
gradients did.

``concertina_nonfinite``:

- ``"raise"`` (default): every rank raises :class:`NonFiniteStepError` naming the step, the plan's
  fingerprint, the stage (and rank) and action where the values first went non-finite and the
  sequences of that chunk; ``ConcertinaTrainer.train`` ends every rank with it.
- ``"skip"``: the step is dropped on every rank: gradients discarded (every parameter's ``.grad``
  is ``None``, so the optimizer leaves weights and state untouched), a warning, and the count in
  the logs (``concertina/nonfinite_steps_skipped``). The learning-rate schedule still advances.

A step without any trainable token (every label ``-100``, summed over the replicas) has no loss:
``Trainer`` would divide by zero and train NaN into the weights. Here it warns; with ``"raise"``
the step runs (zero gradients) and its loss is logged as NaN, with ``"skip"`` it is dropped like a
non-finite step (``concertina/steps_without_targets`` counts both).

Logging: ``concertina/loss`` is the mean of the steps' losses since the last log entry, NaN when
one of them was not finite or had no target; the Trainer's ``loss`` is set to NaN for such an entry
too (``logging_nan_inf_filter`` would show the other steps' mean, or 0.0), and to
``concertina/loss`` when the Trainer's own running sum stayed NaN after a skipped step
(``logging_nan_inf_filter=False``). A logged loss is thus NaN exactly when its steps were.

Cost per step: one pass over the stage's gradients (their 2-norm), one all-reduce of
``world_size`` floats, and the executor's one reduction per chunk and action.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .args import NONFINITE_MODES
from ..runtime.distributed import Topology
from ..runtime.param_sharding import local_tensor
from ..planning import Plan

__all__ = ["NONFINITE_MODES", "NonFiniteStepError", "StepGuard"]

logger = logging.getLogger(__name__)

_FORWARD, _BACKWARD, _GRADS, _LOSS = 1, 2, 4, 8


class NonFiniteStepError(FloatingPointError):
    """A step produced NaN or infinite values (``concertina_nonfinite="raise"``)."""


@dataclass
class _RankReport:
    rank: int
    stage: int
    replica: int
    code: int
    actions: list[str]


class StepGuard:
    """The per-step verdict on non-finite values and empty steps (see the module docstring)."""

    def __init__(self, mode: str, topology: Topology) -> None:
        if mode not in NONFINITE_MODES:
            raise ValueError(f"concertina_nonfinite={mode!r}: choose one of {', '.join(NONFINITE_MODES)}")
        self.mode, self.topology = mode, topology
        #: non-finite steps dropped, and steps without a trainable token, since construction
        self.nonfinite_skipped = 0
        self.without_targets = 0
        #: the last checked step was dropped (its gradients are gone; its grad norm is NaN)
        self.dropped = False
        self._window = (0.0, 0)  # sum and number of the steps' losses since the last log entry

    # ------------------------------------------------------------------ the verdict
    def check(self, step: int, plan: Plan, result: Any, params: Sequence[torch.nn.Parameter],
              num_items_total: int, is_last_stage: bool) -> bool:
        """Collective over the job: True when the step is dropped (its gradients are discarded
        here); raises :class:`NonFiniteStepError` on every rank with ``"raise"``. ``step``: the
        optimizer step's number (1-based); ``result``: this stage's
        :class:`~concertina_hf.runtime.executor.StepResult`."""
        code = 0
        if any(a.startswith("F") for a in result.nonfinite):
            code |= _FORWARD
        if any(a.startswith("B") for a in result.nonfinite):
            code |= _BACKWARD
        if is_last_stage and not math.isfinite(float(result.loss_sum)):
            code |= _LOSS
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]  # a rank's own shards
        if grads and not bool(torch.isfinite(torch.nn.utils.get_total_norm(grads, 2.0))):
            code |= _GRADS
        codes = self.topology.numbers_of_every_rank(code)
        self.dropped = False
        if any(codes):
            t = self.topology
            reports = t.objects_of_every_rank(_RankReport(t.rank, t.stage, t.replica, code, list(result.nonfinite)))
            message = _describe(step, plan, reports)
            if self.mode == "raise":
                raise NonFiniteStepError(message + "; set concertina_nonfinite='skip' to drop such steps and go on")
            self.nonfinite_skipped += 1
            if self.topology.rank == 0:
                logger.warning(f"{message}: step dropped (concertina_nonfinite='skip'; "
                               f"{self.nonfinite_skipped} dropped so far)")
            self._drop(params)
        elif num_items_total == 0:
            self.without_targets += 1
            skip = self.mode == "skip"
            if self.topology.rank == 0:
                logger.warning(
                    f"step {step} has no trainable token (every label is -100 on every replica): its loss is "
                    + ("undefined, the step is dropped (concertina_nonfinite='skip')" if skip else
                       "logged as NaN and the optimizer steps with zero gradients (Trainer would divide by zero "
                       "and train NaN into the weights; concertina_nonfinite='skip' drops such steps)"))
            if skip:
                self._drop(params)
        return self.dropped

    def _drop(self, params: Sequence[torch.nn.Parameter]) -> None:
        for p in params:
            p.grad = None
        self.dropped = True

    def step_loss(self, loss: float, num_items_total: int) -> float:
        """The loss the step reports (NaN for a step without target), kept for the log entry."""
        value = float("nan") if num_items_total == 0 else float(loss)
        total, n = self._window
        self._window = (total + value, n + 1)  # a NaN stays NaN until the next log entry
        return value

    # ------------------------------------------------------------------ logs
    def amend_logs(self, logs: dict[str, float]) -> None:
        """Add ``concertina/loss`` and the counters to a training log entry (one with ``loss``) and
        show the Trainer's ``loss`` as NaN when one of its steps was (see the module docstring)."""
        (total, n), self._window = self._window, (0.0, 0)
        if not n:
            return
        mean = total / n  # NaN when one step's loss was
        logs["concertina/loss"] = mean
        logs["concertina/nonfinite_steps_skipped"] = float(self.nonfinite_skipped)
        logs["concertina/steps_without_targets"] = float(self.without_targets)
        loss = logs.get("loss")
        if not math.isfinite(mean) or (loss is not None and not math.isfinite(loss)):
            logs["loss"] = mean


def _sequences(plan: Plan, chunk: int) -> str:
    parts = []
    for s in plan.chunks[chunk].slices:
        n = plan.seq_lens[s.seq]
        whole = s.start == 0 and s.length == n
        parts.append(f"{s.seq} ({n} tokens)" if whole else f"{s.seq} (tokens {s.start}:{s.start + s.length} of {n})")
    return ", ".join(parts)


def _describe(step: int, plan: Plan, reports: list[_RankReport]) -> str:
    """Where the step's values first went non-finite (the same text on every rank)."""
    head = f"non-finite values (NaN or inf) in optimizer step {step} (plan {plan.fingerprint()})"

    def where(r: _RankReport) -> str:
        return f"pipeline stage {r.stage} (rank {r.rank}, replica {r.replica})"

    fwd = [r for r in reports if r.code & _FORWARD]
    bwd = [r for r in reports if r.code & _BACKWARD]
    if fwd:
        r = min(fwd, key=lambda r: (r.stage, r.replica))
        action = next(a for a in r.actions if a.startswith("F"))
        what = "loss" if r.code & _LOSS else "output"
        first = f"first in the {what} of the forward of chunk {action[1:]} on {where(r)}"
    elif bwd:
        r = max(bwd, key=lambda r: (r.stage, -r.replica))
        action = next(a for a in r.actions if a.startswith("B"))
        first = f"first in the input gradient of the backward of chunk {action[1:]} on {where(r)}"
    else:
        r = None
        stages = sorted({x.stage for x in reports if x.code & (_GRADS | _LOSS)})
        return f"{head}: in the parameter gradients of pipeline stage(s) {stages}, every activation finite"
    seqs = f"; chunk {action[1:]} holds sequence(s) {_sequences(plan, int(action[1:]))} of the step"
    grads = sorted({x.stage for x in reports if x.code & _GRADS})
    tail = f"; parameter gradients non-finite on stage(s) {grads}" if grads else ""
    return f"{head}: {first}{seqs}{tail}"
