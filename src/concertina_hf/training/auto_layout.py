"""``concertina_layout="auto"``: the trainer picks pipeline x sequence-parallel x data-parallel
sizes at construction from the world size, the model, the memory budget and the data's lengths.

:func:`choose_layout` runs on every rank before any process group of the mesh exists, on the
same inputs, so every rank computes the same choice (the planner is pure and deterministic); the
trainer then checks it against rank 0's (:meth:`LayoutChoice.check_same_everywhere`) and refuses
a mismatch. What it takes:

- **lengths**: a deterministic sample of the training data, :data:`SAMPLE_STEPS` optimizer steps
  of ``per_device_train_batch_size x gradient_accumulation_steps x world size`` sequences each
  (:func:`sample_steps`): with ``train_sampling_strategy="sequential"`` or an iterable (streaming)
  dataset the first rows in the data's order (an iterable dataset is read for these rows only,
  never scanned), otherwise the first rows of a permutation seeded by ``data_seed`` (else ``seed``):
  the same length distribution as the sampler's first steps, not necessarily its very rows. Each
  step's rows go through the run's collator and
  :func:`~concertina_hf.training.collator.split_sequences`, so truncation, padding removal and
  packed documents count as the run will see them.
- **model and budget**: the cost model the run starts from (:func:`~.run_setup.initial_cost_model`:
  analytic from the config, or ``concertina_cost_model_path``; a ``profiled`` run without a file is
  chosen on the analytic model, the profile needs the mesh), per-GPU memory from
  ``concertina_memory_budget`` (one size; a per-stage list needs ``concertina_pipeline_size``).
- **ranking**: :func:`~concertina_hf.planning.layouts.rank_layouts` on every sampled step, greedy
  recompute; a layout's score is its summed simulated step time over the steps (infeasible on one:
  out). Sizes set explicitly win: ``concertina_pipeline_size`` / ``concertina_data_parallel_size``
  when not ``None`` and ``concertina_sequence_parallel_size`` when not 1 are fixed, the rest chosen;
  segment-level training fixes ``sp=1``. The layouts are costed with the state as the runtime
  holds it (``concertina_shard_optimizer``; ``concertina_shard_parameters``: ZeRO-3 at ``pp=1``,
  ``pp > 1`` refused, the reason in the table) and ``concertina_sequence_parallel_mode`` as it
  runs (:attr:`~.args.ConcertinaTrainingArguments.sequence_parallel_mode`: ``auto`` is Ulysses
  under an analytic cost model), which the chosen line names.

The choice never changes the model trained: a step takes ``per_device_train_batch_size x
gradient_accumulation_steps x world size`` sequences, ``Trainer``'s global batch with this many
processes, whatever ``dp`` is: each replica's data loader reads micro-batches of
``per_device_train_batch_size x pp x sp`` rows (:attr:`LayoutChoice.replica_batch_factor`), so the
``dp`` replicas' micro-batches are exactly the ``world size`` processes' micro-batches of ``Trainer``.
No remainder arises (``world = dp x pp x sp``); the end of the data is handled as ``Trainer``
handles it (a short last step, ``dataloader_drop_last``).

A checkpoint named by ``resume_from_checkpoint`` in the arguments keeps its recorded sizes
(``concertina.json``) instead of choosing again; one written by another number of processes is
refused with both layouts. Cost: ``SAMPLE_STEPS`` rankings of every layout of the world size
(milliseconds to a second for a few GPUs; pruned by lower bounds at scale).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..planning import PlanError
from ..planning.layouts import Layout, rank_layouts
from ..runtime.param_sharding import TIED_EMBEDDINGS_REFUSAL
from .args import ConcertinaTrainingArguments
from .manifest import PLAN_META_NAME
from .collator import split_sequences
from .run_setup import budget_setting, count_frozen_parameters, device_memory_bytes, initial_cost_model, ties_embeddings

__all__ = ["LAYOUT_MODES", "SAMPLE_STEPS", "LayoutChoice", "choose_layout", "recorded_layout", "sample_steps"]

logger = logging.getLogger(__name__)

#: concertina_layout: the sizes as given (``manual``) or chosen from the data (``auto``)
LAYOUT_MODES = ("manual", "auto")
#: optimizer steps of the training data whose lengths the choice is made on
SAMPLE_STEPS = 8


@dataclass(frozen=True)
class LayoutChoice:
    """The sizes ``concertina_layout="auto"`` runs and why (``table``: per layout, its summed step
    time over the sampled steps, or why not; best first)."""

    pp: int
    sp: int
    dp: int
    #: "auto" (chosen from the data) or "checkpoint" (the resumed checkpoint's recorded sizes)
    source: str
    table: tuple = field(default=(), compare=False)
    steps_sampled: int = 0
    #: how a stage of ``sp > 1`` shards each chunk (``ulysses`` / ``auto`` / ``context``: the
    #: effective ``concertina_sequence_parallel_mode``, ``args.sequence_parallel_mode``); None at ``sp = 1``
    sp_mode: str | None = None

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.pp, self.sp, self.dp

    @property
    def replica_batch_factor(self) -> int:
        """Rows a replica's micro-batch holds per ``per_device_train_batch_size`` (``pp x sp``):
        the ``dp`` replicas then read ``world size`` processes' micro-batches."""
        return self.pp * self.sp

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "auto", "source": self.source, "pipeline_size": self.pp, "sequence_parallel_size": self.sp,
                "data_parallel_size": self.dp, "sequence_parallel_mode": self.sp_mode,
                "steps_sampled": self.steps_sampled, "table": list(self.table)}

    def check_same_everywhere(self, topology: Any) -> None:
        """Refuse a choice that differs from rank 0's (collective)."""
        theirs = topology.broadcast_from_rank0(self.sizes)
        if tuple(theirs) != self.sizes:
            raise RuntimeError(
                f"concertina_layout='auto' chose pp={self.pp} x sp={self.sp} x dp={self.dp} on rank {topology.rank} "
                f"but pp={theirs[0]} x sp={theirs[1]} x dp={theirs[2]} on rank 0: the ranks see different data or "
                "settings; give every rank the same dataset and arguments, or set the sizes explicitly")

    def table_text(self) -> str:
        """The ranked table, one line per layout (logged by rank 0)."""
        mode = f", sequence-parallel mode {self.sp_mode}" if self.sp > 1 and self.sp_mode else ""
        lines = [f"concertina_layout='auto' chose pp={self.pp} x sp={self.sp} x dp={self.dp}{mode} ({self.source}; "
                 f"{self.steps_sampled} sampled steps); layouts by summed simulated step time:"]
        for row in self.table:
            t = row.get("step_time_s")
            what = f"{t:.4g} s  x{row['ratio']:.3f}" if t is not None else row.get("reason", "")
            lines.append(f"  {row['layout']:<20} {what}")
        return "\n".join(lines)


def recorded_layout(checkpoint: Any) -> tuple[int, int, int] | None:
    """``(pp, sp, dp)`` recorded in a checkpoint's ``concertina.json`` (``None``: not a
    concertina checkpoint, or one that did not record them)."""
    if not isinstance(checkpoint, str) or not os.path.isfile(os.path.join(checkpoint, PLAN_META_NAME)):
        return None
    with open(os.path.join(checkpoint, PLAN_META_NAME)) as fh:
        meta = json.load(fh)
    sizes = (meta.get("pipeline_size"), meta.get("sequence_parallel_size"), meta.get("data_parallel_size"))
    return None if None in sizes else tuple(int(n) for n in sizes)


def sample_steps(dataset: Any, collator: Callable | None, rows_per_step: int, args: ConcertinaTrainingArguments,
                 steps: int = SAMPLE_STEPS) -> list[list[int]]:
    """The sequence lengths of the first ``steps`` optimizer steps of ``rows_per_step`` rows (see
    the module docstring for which rows); fewer steps when the data is shorter."""
    want = steps * rows_per_step
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        rows = list(itertools.islice(iter(dataset), want))
    else:
        n = len(dataset)
        if args.train_sampling_strategy == "sequential":
            order = range(min(n, want))
        else:
            gen = torch.Generator().manual_seed(int(args.data_seed if args.data_seed is not None else args.seed))
            order = torch.randperm(n, generator=gen)[:want].tolist()
        rows = [dataset[int(i)] for i in order]
    out = []
    for start in range(0, len(rows), rows_per_step):
        lens = _lengths(rows[start:start + rows_per_step], collator)
        if lens:
            out.append(lens)
    return out


def _lengths(rows: list, collator: Callable | None) -> list[int]:
    if collator is not None:
        try:
            return [int(s.numel()) for s in split_sequences(collator(rows))[0] if s.numel()]
        except Exception:  # a collator needing columns the raw rows lack: count the rows themselves
            pass
    lens = []
    for row in rows:
        if not isinstance(row, Mapping) or "input_ids" not in row:
            raise ValueError("concertina_layout='auto' reads the training rows' input_ids to sample their lengths; "
                             "this dataset's rows have none: set concertina_layout='manual' with the sizes")
        if row.get("seq_lengths") is not None:
            lens += [int(n) for n in row["seq_lengths"]]
        elif row.get("attention_mask") is not None:
            lens.append(int(sum(int(m) for m in row["attention_mask"])))
        else:
            lens.append(len(row["input_ids"]))
    return [n for n in lens if n > 0]


def _fixed_sizes(args: ConcertinaTrainingArguments) -> dict[str, int]:
    fixed = {}
    if args.concertina_pipeline_size is not None:
        fixed["pp"] = args.concertina_pipeline_size
    if args.concertina_data_parallel_size is not None:
        fixed["dp"] = args.concertina_data_parallel_size
    if args.concertina_sequence_parallel_size != 1 or args.concertina_segment_tokens is not None:
        fixed["sp"] = args.concertina_sequence_parallel_size
    return fixed


def _runtime_refusals(args: ConcertinaTrainingArguments, model: torch.nn.Module, world: int) -> dict[Layout, str]:
    """Layouts the runtime refuses for reasons the planner cannot see (the model's modules):
    ``concertina_shard_parameters=True`` with tied embeddings on one stage (``pp=1``, ``sp > 1``:
    :func:`~concertina_hf.runtime.param_sharding.shard_stage`). ``pp > 1`` under parameter
    sharding is the planner's refusal (``rank_layouts(shard_parameters=True)``). The model's mixers
    and attention masks: every ``sp > 1`` :func:`~concertina_hf.runtime.families.sequence_parallel_refusal`
    refuses (chunked and indexed attention, the recurrent mixers; Gated DeltaNet outside Ulysses or
    with key heads ``sp`` does not divide)."""
    from ..integrations.peft import base_model_of
    from ..runtime.families import sequence_parallel_refusal

    out, config = {}, base_model_of(model).config
    for sp in range(2, world + 1):
        why = sequence_parallel_refusal(config, sp, args.sequence_parallel_mode)
        out.update({Layout(pp, sp, world // (pp * sp)): f"refused: {why}" for pp in range(1, world + 1)
                    if why is not None and world % (pp * sp) == 0})
    if not args.concertina_shard_parameters or not ties_embeddings(model):
        return out
    return {**out, **{Layout(1, sp, world // sp): f"refused: {TIED_EMBEDDINGS_REFUSAL}"
                      for sp in range(2, world + 1) if world % sp == 0}}


def _budget(args: ConcertinaTrainingArguments, device_memory: int) -> int:
    budget = budget_setting(args, device_memory)
    if isinstance(budget, int):
        return budget
    if len(budget) > 1 and args.concertina_pipeline_size is None:
        raise ValueError(f"concertina_memory_budget={args.concertina_memory_budget!r} gives one size per stage, "
                         "but concertina_layout='auto' chooses the number of stages: give one size, or set "
                         "concertina_pipeline_size")
    return min(budget)


def choose_layout(args: ConcertinaTrainingArguments, model: torch.nn.Module, world: int, train_dataset: Any,
                  collator: Callable | None) -> LayoutChoice:
    """The sizes ``concertina_layout="auto"`` runs at ``world`` processes (module docstring).
    Deterministic in its inputs: every rank computes it; no collective."""
    recorded = recorded_layout(args.resume_from_checkpoint)
    if recorded is not None:
        pp, sp, dp = recorded
        if pp * sp * dp != world:
            raise ValueError(
                f"{args.resume_from_checkpoint} was written by {pp * sp * dp} processes (pp={pp} x sp={sp} x dp={dp}), "
                f"this run has {world}: concertina_layout='auto' resumes the checkpoint's recorded layout, and its "
                f"RNG states and optimizer shards are per process; resume with {pp * sp * dp} processes")
        return LayoutChoice(pp, sp, dp, "checkpoint", sp_mode=args.sequence_parallel_mode if sp > 1 else None)
    if train_dataset is None:
        raise ValueError("concertina_layout='auto' chooses the layout from the training data's lengths: pass "
                         "train_dataset, or set concertina_layout='manual' with the sizes")
    rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    steps = sample_steps(train_dataset, collator, rows_per_step, args)
    if not steps:
        raise ValueError("concertina_layout='auto': the training data gave no sequence to sample lengths from")
    device_memory = device_memory_bytes(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cost = initial_cost_model(args, model.config, args.device, next(model.parameters()).element_size(), device_memory)
    cost = count_frozen_parameters(cost, model)
    budget = _budget(args, device_memory)
    fixed = _fixed_sizes(args)
    refusals = _runtime_refusals(args, model, world)
    # the state as run_setup.resolve_run holds it: ZeRO-3 (pp=1 only, pp > 1 refused) or ZeRO-1 or whole
    kwargs = dict(shard_optimizer=args.concertina_shard_optimizer, shard_parameters=args.concertina_shard_parameters,
                  tied_embeddings=ties_embeddings(model),  # the last of several stages holds a copy (run_setup)
                  strategy=args.concertina_strategy, sp_only=False, solver="greedy",
                  max_tokens_per_chunk=args.concertina_max_tokens_per_chunk, sp_mode=args.sequence_parallel_mode)
    if args.segment_options is not None:
        kwargs["segment"] = args.segment_options
    totals: dict[Layout, float | None] = {}
    reasons: dict[Layout, str] = {}
    try:
        per_step = [rank_layouts(lens, cost, world, budget, prune=not fixed, **kwargs) for lens in steps]
        # a layout pruned on a step (its lower bound above that step's best) could still win on the sum:
        # those steps are planned again unpruned for every layout until the best has only real times
        while True:
            _sum(per_step, fixed, totals, reasons, refusals)
            best = _best(totals)
            pruned = [i for i, rows in enumerate(per_step)
                      if best is not None and any(r.layout == best and r.status == "pruned" for r in rows)]
            if not pruned:
                break
            for i in pruned:
                per_step[i] = rank_layouts(steps[i], cost, world, budget, prune=False, **kwargs)
    except PlanError as e:
        raise ValueError(f"concertina_layout='auto' could not rank the layouts of {world} processes: {e}") from None
    if best is None:
        why = "; ".join(f"{lay.name}: {r}" for lay, r in sorted(reasons.items())) or "no layout matches the fixed sizes"
        raise ValueError(f"concertina_layout='auto' found no layout of {world} processes that fits ({why}); raise "
                         "concertina_memory_budget or concertina_max_tokens_per_chunk, or set the sizes")
    top = totals[best]
    table = [{"layout": lay.name, "step_time_s": t, "ratio": t / top}
             for lay, t in sorted(((l, t) for l, t in totals.items() if t is not None), key=lambda x: (x[1], x[0]))]
    table += [{"layout": lay.name, "step_time_s": None, "reason": r} for lay, r in sorted(reasons.items())]
    return LayoutChoice(best.pp, best.sp, best.dp, "auto", tuple(table), len(steps),
                        args.sequence_parallel_mode if best.sp > 1 else None)


def _sum(per_step: list, fixed: dict[str, int], totals: dict, reasons: dict, refusals: dict) -> None:
    totals.clear()
    reasons.clear()
    reasons.update((lay, why) for lay, why in refusals.items()
                   if all(getattr(lay, k) == v for k, v in fixed.items()))
    for rows in per_step:
        for r in rows:
            lay = r.layout
            if r.status == "reference" or any(getattr(lay, k) != v for k, v in fixed.items()):
                continue
            if lay in reasons:  # out on an earlier step (or refused): keep its first reason
                continue
            if r.status == "ok":
                totals[lay] = totals.get(lay, 0.0) + r.step_time_s
            elif r.status == "pruned":
                totals[lay] = totals.get(lay, 0.0) + r.lower_bound_s  # never above its real time
            else:
                reasons[lay] = f"{r.status}: {r.reason}"
                totals.pop(lay, None)


def _best(totals: dict) -> Layout | None:
    ok = [(t, lay.pp, lay.sp, lay) for lay, t in totals.items() if t is not None]
    return min(ok)[-1] if ok else None
