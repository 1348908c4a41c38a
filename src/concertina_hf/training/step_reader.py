"""``StepReader``: an optimizer step's micro-batches as one pipeline step, read one step ahead.

The Trainer's loop asks for ``gradient_accumulation_steps`` micro-batches per optimizer step
(``get_batch_samples``). The reader takes them, splits them into sequences
(:func:`~concertina_hf.training.collator.split_sequences`), submits their lengths to the
:class:`~concertina_hf.training.step_planner.StepPlanner`, and counts the step's label tokens (summed
over the replicas: HF's ``num_items_in_batch``). With look-ahead it then reads the *next*
step's micro-batches too and submits them, so that step is planned while this one runs; the
next call takes them from there. Padded positions (``attention_mask == 0``) are dropped by
:func:`~concertina_hf.training.collator.split_sequences`; when some carry labels (targets ``Trainer`` would
train on) the reader warns once with their count (:func:`~concertina_hf.training.collator.padding_targets`).
Costs: one micro-batch step of data held in memory ahead, one
integer all-reduce over the replicas per step.

Balanced replicas (``concertina_balance_replicas``, dp > 1): every replica reads the whole global
batch of the step (:func:`replica_data_loader` with ``whole_step``), a :class:`ReplicaBalancer`
assigns its sequences to replicas by predicted pipeline time and each replica keeps (and plans)
its own subset; ``num_items_in_batch`` is still the label tokens of the whole global batch, so
the gradients are ``Trainer``'s on one process. Cost: every replica reads and collates the whole
global batch; rank 0 plans each replica's subset a few times (greedy recompute) per step while the
others wait for the broadcast assignment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader
from transformers.trainer_utils import seed_worker

from .args import in_trainer_terms
from .collator import padding_targets, padding_warning, split_sequences
from ..runtime.distributed import Topology
from ..planning import PlanError, balance_replicas
from .step_planner import StepPlanner, Ticket

__all__ = ["ReplicaBalancer", "Step", "StepReader", "replica_balancer", "replica_data_loader"]

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
                 vocab_size: int | None = None, balancer: "ReplicaBalancer | None" = None) -> None:
        """``batches_ahead``: micro-batches to read ahead after each step (the step after it;
        0: no look-ahead). ``vocab_size``: token ids must be below it (checked as read).
        ``balancer``: the batches are the whole global batch; this replica keeps the sequences
        the balancer assigns it."""
        self.planner, self.topology, self.batches_ahead = planner, topology, batches_ahead
        self.balancer = balancer
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
        if self.balancer is not None:
            mine = self.balancer.assign([int(s.numel()) for s in seqs])
            seqs, labels = [seqs[i] for i in mine], [labels[i] for i in mine]
        return Step(batches, seqs, labels, self.planner.submit([int(s.numel()) for s in seqs]))

    def tokens_over_replicas(self, n: int) -> int:
        """``n`` input tokens of this replica's micro-batch summed over the replicas (Trainer's
        ``num_input_tokens_seen``); with a balancer the micro-batch is already the global one."""
        return n if self.balancer is not None else int(self.topology.all_reduce_replicas(n))


def replica_data_loader(dataset: Any, collate_fn: Callable, batch_size: int, args: Any, accelerator: Any,
                        topology: Topology, sampler: Any = None, seed_workers: bool = False,
                        whole_step: bool = False) -> DataLoader:
    """The Trainer's ``DataLoader`` settings, sharded over the data-parallel replicas only: every
    pipeline rank of a replica reads the same batches in the same order (workers seeded by
    replica with ``seed_workers``, not by process). ``whole_step`` (balanced replicas): not
    sharded; every rank reads micro-batches of ``batch_size x dp`` rows, the rows all replicas'
    micro-batches would hold (the same step's sequences, the same number of batches)."""
    from accelerate.data_loader import prepare_data_loader

    shards, index = topology.data_parallel_size, topology.replica
    if whole_step:
        batch_size = batch_size if accelerator.split_batches else batch_size * shards
        shards, index = 1, 0

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
            params["worker_init_fn"] = _WorkerInit(args.dataloader_num_workers, index)
    acc = accelerator
    return prepare_data_loader(
        DataLoader(dataset, **params), device=args.device, num_processes=shards, process_index=index,
        split_batches=acc.split_batches, put_on_device=True,
        rng_types=list(acc.rng_types or []),
        dispatch_batches=False,  # every pipeline rank reads its replica's shard itself
        even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
        data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
    )


class ReplicaBalancer:
    """Which of a step's sequences this replica runs: :func:`~concertina_hf.planning.balance_replicas`
    on global rank 0 (the planner is pure and deterministic, but one maker is the simplest way to
    have every rank agree even if cost models drift apart), broadcast to every rank; an error there
    reaches every rank."""

    def __init__(self, planner: StepPlanner, topology: Topology) -> None:
        self.planner, self.topology = planner, topology
        #: the last step's split (rank 0 only), for logs and tests
        self.last_split = None

    def split(self, seq_lens: list[int]) -> tuple[tuple[int, ...], ...]:
        """Every replica's indices into ``seq_lens`` (pure: the planner's balanced split)."""
        dp, setup = self.topology.data_parallel_size, self.planner.setup
        if len(seq_lens) < dp:
            raise ValueError(
                f"a step holds {len(seq_lens)} sequences for concertina_data_parallel_size={dp} replicas: "
                "every replica needs one; set concertina_balance_replicas=False (accelerate's count split "
                "repeats sequences to fill replicas) or use a larger batch / dataloader_drop_last=True")
        self.last_split = balance_replicas(
            seq_lens, dp, self.planner.cost_model, setup.layout, setup.budgets, strategy=setup.strategy,
            solver="greedy", max_tokens_per_chunk=setup.max_tokens_per_chunk)
        return self.last_split.assignment

    def assign(self, seq_lens: list[int]) -> tuple[int, ...]:
        """This replica's indices into ``seq_lens`` (collective over every rank of the job)."""
        payload: Any = None
        if self.topology.rank == 0:
            try:
                payload = [list(a) for a in self.split(seq_lens)]
            except Exception as e:  # every rank must learn about it, or the others wait forever
                payload = f"{type(e).__name__}: {in_trainer_terms(e) if isinstance(e, PlanError) else e}"
        payload = self.topology.broadcast_from_rank0(payload)
        if isinstance(payload, str):
            raise RuntimeError(f"assigning a step's sequences to replicas failed on rank 0: {payload} "
                               "(concertina_balance_replicas=False splits them by count instead)")
        return tuple(payload[self.topology.replica])


def replica_balancer(args: Any, planner: StepPlanner, topology: Topology) -> ReplicaBalancer | None:
    """The balancer a run uses (``None``: one replica, or ``concertina_balance_replicas=False``)."""
    if topology.data_parallel_size == 1 or not args.concertina_balance_replicas:
        return None
    if not args.average_tokens_across_devices:
        raise ValueError(
            "concertina_balance_replicas=True needs average_tokens_across_devices=True: replicas run "
            "different numbers of tokens, so only a loss normalised over the whole global batch equals "
            "Trainer's; set average_tokens_across_devices=True or concertina_balance_replicas=False")
    return ReplicaBalancer(planner, topology)


class _WorkerInit:
    """Picklable ``worker_init_fn`` seeding data-loader workers by replica."""

    def __init__(self, num_workers: int, replica: int) -> None:
        self.num_workers, self.replica = num_workers, replica

    def __call__(self, worker_id: int) -> None:
        seed_worker(worker_id, self.num_workers, self.replica)
