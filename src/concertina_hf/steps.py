"""``StepReader``: an optimizer step's micro-batches as one pipeline step, read one step ahead.

The Trainer's loop asks for ``gradient_accumulation_steps`` micro-batches per optimizer step
(``get_batch_samples``). The reader takes them, splits them into sequences
(:func:`~concertina_hf.collator.split_sequences`), submits their lengths to the
:class:`~concertina_hf.step_planner.StepPlanner`, and counts the step's label tokens (summed
over the replicas: HF's ``num_items_in_batch``). With look-ahead it then reads the *next*
step's micro-batches too and submits them, so that step is planned while this one runs; the
next call takes them from there. Padded positions (``attention_mask == 0``) are dropped by
:func:`~concertina_hf.collator.split_sequences`; when some carry labels (targets ``Trainer`` would
train on) the reader warns once with their count (:func:`~concertina_hf.collator.padding_targets`).
Costs: one micro-batch step of data held in memory ahead, one
integer all-reduce over the replicas per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader
from transformers.trainer_utils import seed_worker

from .collator import padding_targets, padding_warning, split_sequences
from .distributed import Topology
from .step_planner import StepPlanner, Ticket

__all__ = ["Step", "StepReader", "replica_data_loader"]

logger = logging.getLogger(__name__)


@dataclass
class Step:
    """One optimizer step of one replica: its micro-batches, sequences and plan ticket."""

    batches: list
    input_ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    ticket: Ticket
    num_items_local: int = 0
    num_items_total: int = 0


class StepReader:
    """Reads optimizer steps from the Trainer's epoch iterator (see the module docstring)."""

    def __init__(self, planner: StepPlanner, topology: Topology, batches_ahead: int,
                 vocab_size: int | None = None) -> None:
        """``batches_ahead``: micro-batches to read ahead after each step (the step after it;
        0: no look-ahead). ``vocab_size``: token ids must be below it (checked as read)."""
        self.planner, self.topology, self.batches_ahead = planner, topology, batches_ahead
        self.vocab_size = vocab_size
        #: the step ``read`` returned last, until the trainer runs it
        self.current: Step | None = None
        self._ahead: tuple[Any, list, Step | None] | None = None  # (iterator, batches, their step)
        self._warned_padding = False

    def reset(self) -> None:
        """Forget what was read ahead (a new training loop starts)."""
        self._ahead = None

    def read(self, epoch_iterator: Iterator, num_batches: int) -> Step | None:
        """The next step's ``num_batches`` micro-batches (fewer at the end of the data; ``None``
        when there are none); reads the step after it ahead when look-ahead is on."""
        batches, step = self._take(epoch_iterator, num_batches)
        if not batches:
            self.current = None
            return None
        if step is None:
            step = self._new_step(batches)
        local = sum(int((y[1:] != -100).sum()) for y in step.labels)
        step.num_items_local, step.num_items_total = local, int(self.topology.all_reduce_replicas(local))
        self.current = step
        if self.batches_ahead:
            ahead: list = []
            for _ in range(self.batches_ahead):
                try:
                    ahead.append(next(epoch_iterator))
                except StopIteration:
                    break
            if ahead:
                self._ahead = (epoch_iterator, ahead, self._new_step(ahead))
        return step

    def check_token_ids(self, seqs: list[torch.Tensor], batch_index: int) -> None:
        """Token ids outside the embedding fail here, naming the sequence, rather than as an index
        error inside the first stage (and a closed connection on the others)."""
        if self.vocab_size is None:
            return
        for j, s in enumerate(seqs):
            if s.numel() and (int(s.max()) >= self.vocab_size or int(s.min()) < 0):
                bad = int(s.max()) if int(s.max()) >= self.vocab_size else int(s.min())
                raise ValueError(
                    f"sequence {j} of micro-batch {batch_index} holds token id {bad}, outside the model's "
                    f"vocabulary of {self.vocab_size} (config.vocab_size): tokenize with the model's own tokenizer "
                    "(or resize the embeddings) before training"
                )

    def _take(self, epoch_iterator: Iterator, num_batches: int) -> tuple[list, Step | None]:
        """The micro-batches read ahead for this iterator first, then fresh ones."""
        batches: list = []
        step = None
        if self._ahead is not None and self._ahead[0] is epoch_iterator:
            _, batches, step = self._ahead
            if len(batches) > num_batches:  # the loop asked for fewer: keep the rest for later
                self._ahead = (epoch_iterator, batches[num_batches:], None)
                batches, step = batches[:num_batches], None
            else:
                self._ahead = None
        else:
            self._ahead = None
        while len(batches) < num_batches:
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if step is not None and len(step.batches) != len(batches):
            step = None
        return batches, step

    def _new_step(self, batches: list) -> Step:
        seqs: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        for i, b in enumerate(batches):
            if not self._warned_padding and isinstance(b, Mapping):
                lost = padding_targets(b)
                if lost:
                    self._warned_padding = True
                    logger.warning(padding_warning(lost, f"micro-batch {i} of a step"))
            x, y = split_sequences(b)
            self.check_token_ids(x, i)
            seqs += x
            labels += y
        return Step(batches, seqs, labels, self.planner.submit([int(s.numel()) for s in seqs]))


def replica_data_loader(dataset: Any, collate_fn: Callable, batch_size: int, args: Any, accelerator: Any,
                        topology: Topology, sampler: Any = None, seed_workers: bool = False) -> DataLoader:
    """The Trainer's ``DataLoader`` settings, sharded over the data-parallel replicas only: every
    pipeline rank of a replica reads the same batches in the same order (workers seeded by
    replica with ``seed_workers``, not by process)."""
    from accelerate.data_loader import prepare_data_loader

    params: dict[str, Any] = {
        "batch_size": batch_size, "collate_fn": collate_fn, "num_workers": args.dataloader_num_workers,
        # pinned memory only helps copies to an accelerator (torch warns about it on the CPU)
        "pin_memory": args.dataloader_pin_memory and args.device.type != "cpu",
        "persistent_workers": args.dataloader_persistent_workers,
        "multiprocessing_context": args.dataloader_multiprocessing_context,
        "prefetch_factor": args.dataloader_prefetch_factor,
    }
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        if sampler is not None:
            params["sampler"] = sampler
        params["drop_last"] = args.dataloader_drop_last
        if seed_workers:
            params["worker_init_fn"] = _WorkerInit(args.dataloader_num_workers, topology.replica)
    acc = accelerator
    return prepare_data_loader(
        DataLoader(dataset, **params), device=args.device, num_processes=topology.data_parallel_size,
        process_index=topology.replica, split_batches=acc.split_batches, put_on_device=True,
        rng_types=list(acc.rng_types or []),
        dispatch_batches=False,  # every pipeline rank reads its replica's shard itself
        even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
        data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
    )


class _WorkerInit:
    """Picklable ``worker_init_fn`` seeding data-loader workers by replica."""

    def __init__(self, num_workers: int, replica: int) -> None:
        self.num_workers, self.replica = num_workers, replica

    def __call__(self, worker_id: int) -> None:
        seed_worker(worker_id, self.num_workers, self.replica)
