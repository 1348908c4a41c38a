"""``ConcertinaTrainer``: the HF ``Trainer`` running each optimizer step as one planned pipeline step.

Swap ``Trainer`` for ``ConcertinaTrainer`` (and ``TrainingArguments`` for
:class:`~concertina_hf.args.ConcertinaTrainingArguments`), launch with ``accelerate launch``,
and the model is trained as ``Trainer`` would train it on one device: same sequences per step,
same token-weighted loss, same optimizer, scheduler and clipping, within float tolerance.

How a step runs (the Trainer's loop is kept; these are its override points in transformers 5.x):

1. **Data.** ``_get_dataloader`` builds the Trainer's ``DataLoader`` and shards it over the
   *data-parallel replicas only* (accelerate's ``prepare_data_loader`` with the replica count and
   index): every pipeline rank of a replica reads the same batches in the same order.
2. **One pipeline step per optimizer step.** ``get_batch_samples`` takes the step's
   ``gradient_accumulation_steps`` micro-batches, splits them into sequences
   (:func:`~concertina_hf.collator.split_sequences`: the step's ``per_device_train_batch_size x
   gradient_accumulation_steps`` sequences) and counts the label tokens (all-reduced over the
   replicas, HF's ``num_items_in_batch``). It also reads the *next* step's micro-batches ahead and
   hands their lengths to the :class:`~concertina_hf.callbacks.ReplanCallback`, which plans that
   step in a background thread while this one runs. ``training_step`` runs the whole step on its
   first micro-batch (``PipelineExecutor.run_step``: gradients of this stage's parameters
   accumulate, equal to the gradient of ``sum CE / num_items``) and returns 0 for the others, so
   the Trainer's loss bookkeeping sums to the step's loss.
3. **Replicas.** No DDP: after the step, each stage all-reduces its gradients with the same stage
   of the other replicas (one flat buffer per dtype). Tied input/output embeddings split over
   stages (the embedding on the first, a copy in the LM head on the last) then sum their two
   gradients (``PipelineExecutor.sync_tied_gradients``), so both copies take the same step and
   stay equal. Clipping uses the global norm: squared norms all-reduced over the pipeline, the
   tied weight counted once. The logged loss is the global value on every rank.
4. **Optimizer and scheduler** are the Trainer's, built over the stage's parameters (original HF
   names, so weight-decay groups are the same).
5. **Evaluation** runs through the pipeline (``train=False``), one planned step per eval batch.
6. **Checkpoints** are standard HF model directories: the full state dict is gathered to the
   main process (``PipelineWrapper.full_state_dict``) and written by ``save_pretrained``, so
   ``AutoModelForCausalLM.from_pretrained`` loads them without this package (tied embeddings are
   written once, as HF does, and the last stage's copy is loaded from them). Each stage writes
   its own optimizer state shard (``optimizer.stage{s}-of-{p}.pt``); resuming loads the stage's
   weights from the full checkpoint and its own shard. ``concertina.json`` and
   ``layout_cost_model.json`` record the stage layout and the cost models: a resumed run must
   split the layers the same way (with ``resume_from_checkpoint`` in the arguments the trainer
   takes the layout from the checkpoint at construction; a profiled cost model is not
   reproducible otherwise).
7. **Precision.** ``bf16=True`` (or an accelerate config's ``mixed_precision: bf16``) runs the
   pipeline's forwards (training and evaluation) under accelerate's autocast, as ``Trainer`` runs
   the model's forward, and its backwards outside it; weights, gradients and optimizer state keep
   the model's dtype (float32 master weights for a float32 model). fp16 is refused.

Ranks: ``rank = replica * pipeline_size + stage``. Costs per step beyond the pipeline itself: a
plan broadcast and a statistics gather over the pipeline group (a few KB), one gradient
all-reduce over each data-parallel group, one scalar all-reduce for the norm; with tied embeddings
over several stages, one ``vocab x hidden`` gradient exchange between the first and the last stage
(and that copy's weight, gradient and optimizer state on the last stage, which the trainer adds to
the cost model's static memory of the last stage).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import seed_worker

from .args import ConcertinaTrainingArguments, resolve_parallel_sizes
from .callbacks import ReplanCallback
from .collator import LengthAwareCollator, split_sequences

__all__ = ["ConcertinaTrainer", "Topology"]

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "scheduler.pt"
# gradient all-reduce bucket: 32M elements (128 MB of float32) of extra memory at most
_BUCKET_ELEMENTS = 32 * 2**20
PLAN_META_NAME = "concertina.json"
LAYOUT_COST_NAME = "layout_cost_model.json"


def _optimizer_name(stage: int, num_stages: int) -> str:
    return f"optimizer.stage{stage}-of-{num_stages}.pt"


@dataclass
class Topology:
    """Where this rank sits: ``rank = replica * pipeline_size + stage``.

    ``pp_group``: the ranks of this rank's pipeline, in stage order; ``dp_group``: the ranks
    holding the same stage in every replica. Both ``None`` when there is a single process.
    """

    world_size: int
    rank: int
    pipeline_size: int
    data_parallel_size: int
    stage: int
    replica: int
    pp_group: Any = None
    dp_group: Any = None
    pp_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()

    @classmethod
    def build(cls, args: ConcertinaTrainingArguments) -> "Topology":
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        if launched != world or args.world_size != world:
            raise RuntimeError(
                f"the launcher started {launched} processes but they do not form one job (process group of "
                f"{world}, TrainingArguments.world_size={args.world_size}); each rank would train alone. On CPU "
                "pass use_cpu=True (ConcertinaTrainingArguments does this when no GPU is visible) or launch with "
                "configs/accelerate/cpu_2proc.yaml"
            )
        pp, dp = resolve_parallel_sizes(world, args.concertina_pipeline_size, args.concertina_data_parallel_size)
        rank = dist.get_rank() if initialized else 0
        replica, stage = divmod(rank, pp)
        topo = cls(world, rank, pp, dp, stage, replica)
        if initialized:
            # Every rank creates every group, in the same order (torch.distributed requires it).
            for r in range(dp):
                ranks = tuple(r * pp + s for s in range(pp))
                g = dist.new_group(list(ranks))
                if r == replica:
                    topo.pp_group, topo.pp_ranks = g, ranks
            for s in range(pp):
                ranks = tuple(r * pp + s for r in range(dp))
                g = dist.new_group(list(ranks))
                if s == stage:
                    topo.dp_group, topo.dp_ranks = g, ranks
        else:
            topo.pp_ranks = topo.dp_ranks = (0,)
        return topo

    @property
    def is_planner(self) -> bool:
        """Pipeline rank 0 of each replica plans its replica's steps and gathers statistics."""
        return self.stage == 0


def _device_memory_bytes(device: torch.device, local_world_size: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        total = 16 * 2**30
    return int(total // max(1, local_world_size))


class ConcertinaTrainer(Trainer):
    """``transformers.Trainer`` over an adaptive pipeline (see the module docstring).

    Same constructor as ``Trainer``. ``args`` must be :class:`ConcertinaTrainingArguments`
    (default: ``ConcertinaTrainingArguments(output_dir="tmp_trainer")``); ``data_collator``
    defaults to :class:`LengthAwareCollator` and may be any collator whose batches
    :func:`split_sequences` understands (``DataCollatorWithFlattening``, padding collators with an
    ``attention_mask``). Not supported: ``model_init`` (hyperparameter search), a ready-made
    optimizer in ``optimizers`` (use ``optimizer_cls_and_kwargs``; the stage only holds part of the
    parameters), ``compute_loss_func`` and ``compute_metrics`` / ``preprocess_logits_for_metrics``
    (logits stay on the last stage; evaluation reports the loss).

    After construction: ``self.pipeline`` (the :class:`PipelineWrapper` of this rank's stage),
    ``self.executor``, ``self.topology``, ``self.layout``, ``self.replan`` (the planning callback),
    ``self.model`` (the pruned HF model).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: ConcertinaTrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init: Callable | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        optimizer_cls_and_kwargs: tuple | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
    ):
        from .runtime import PipelineExecutor, PipelineWrapper

        if args is None:
            args = ConcertinaTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, ConcertinaTrainingArguments):
            raise TypeError(
                f"ConcertinaTrainer needs ConcertinaTrainingArguments, got {type(args).__name__}; build the "
                "arguments with concertina_hf.ConcertinaTrainingArguments(...) (same fields plus concertina_*)"
            )
        for name, value in (("model_init", model_init), ("compute_loss_func", compute_loss_func),
                            ("compute_metrics", compute_metrics),
                            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics)):
            if value is not None:
                raise NotImplementedError(
                    f"ConcertinaTrainer does not support {name}: the pipeline computes the causal-LM loss on the "
                    "last stage and logits never leave it; remove the argument"
                )
        if optimizers[0] is not None:
            raise ValueError(
                "a ready-made optimizer cannot be used: each pipeline rank owns only its stage's parameters. Pass "
                "optimizer_cls_and_kwargs=(cls, kwargs) instead (or set args.optim)"
            )
        if model is None:
            raise ValueError("ConcertinaTrainer needs a model (an HF causal LM)")
        if args.train_sampling_strategy == "batch_rebalance":
            raise ValueError(
                "train_sampling_strategy='batch_rebalance' balances tokens across all processes, but pipeline ranks "
                "must read the same batches; use 'random' (the planner balances the pipeline's chunks)"
            )
        # The process group must exist before the model is split: the stage is the pipeline rank.
        _ = args.device
        self.topology = Topology.build(args)

        dtype_bytes = next(model.parameters()).element_size()
        self._device_memory = _device_memory_bytes(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        resume_layout = _checkpoint_layout_cost(args.resume_from_checkpoint)
        if resume_layout is not None:
            # resuming: the stage layout must be the checkpoint's, so start from its cost model
            self.cost_model = resume_layout
        else:
            self.cost_model = ReplanCallback.initial_cost_model(args, model.config, args.device, dtype_bytes,
                                                                self._device_memory)
            if args.concertina_cost_model == "profiled" and not args.concertina_cost_model_path:
                self.cost_model = self._profile_once(model, args)
        if self.topology.pipeline_size > 1 and _ties_embeddings(model):
            self.cost_model = _count_head_copy(self.cost_model)
        self.layout = ReplanCallback.layout_for(self.cost_model, self.topology.pipeline_size)
        # The saved config must name an attention every HF install has, not the runtime's backend.
        self._saved_attn_implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
        self.pipeline = PipelineWrapper(model, self.layout, self.topology.stage)
        stage_model = self.pipeline.model

        if data_collator is None:
            data_collator = LengthAwareCollator()
        replan = next((c for c in (callbacks or []) if isinstance(c, ReplanCallback)), None)
        if replan is None:
            replan = ReplanCallback()
            callbacks = list(callbacks or []) + [replan]
        self.replan = replan
        # per-step state of the pipeline loop (see get_batch_samples / training_step)
        self._current_step: _Step | None = None
        self._lookahead: tuple[Any, list, _Step] | None = None

        super().__init__(
            model=stage_model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
            optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        self.executor = PipelineExecutor(self.pipeline, pp_group=self.topology.pp_group, device=args.device)
        self.replan.bind(self)

    def _profile_once(self, model: nn.Module, args: ConcertinaTrainingArguments):
        """Rank 0 profiles the model before it is split; every rank gets the same cost model (the
        layout and the plans derive from it). The main process keeps it in ``cost_model.json``."""
        from .planning import CostModel

        payload = None
        if self.topology.rank == 0:
            t0 = time.perf_counter()
            cost = ReplanCallback.profiled_cost_model(model, args, self.cost_model, args.device,
                                                      self.topology.pipeline_size)
            logger.info("profiled the cost model in %.1fs", time.perf_counter() - t0)
            payload = json.dumps(cost.to_dict())
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "cost_model.json"), "w") as fh:
                fh.write(payload)
        if self.topology.world_size > 1:
            obj = [payload]
            dist.broadcast_object_list(obj, src=0)
            payload = obj[0]
        return CostModel.from_dict(json.loads(payload))

    # ------------------------------------------------------------------ data
    def _get_dataloader(self, dataset, description: str, batch_size: int, sampler_fn=None, is_training: bool = False,
                        dataloader_key: str | None = None) -> DataLoader:
        """The Trainer's data loader, sharded over data-parallel replicas only (never over stages)."""
        import datasets
        from accelerate.data_loader import prepare_data_loader

        data_collator = self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            data_collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        params: dict[str, Any] = {
            "batch_size": batch_size,
            "collate_fn": data_collator,
            "num_workers": self.args.dataloader_num_workers,
            "pin_memory": self.args.dataloader_pin_memory,
            "persistent_workers": self.args.dataloader_persistent_workers,
            "multiprocessing_context": self.args.dataloader_multiprocessing_context,
            "prefetch_factor": self.args.dataloader_prefetch_factor,
        }
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = sampler_fn(dataset) if sampler_fn is not None else None
            if sampler is not None:
                params["sampler"] = sampler
            params["drop_last"] = self.args.dataloader_drop_last
            if is_training:
                # Seed workers by replica, not by process: the stages of a pipeline must read identical data.
                params["worker_init_fn"] = _WorkerInit(self.args.dataloader_num_workers, self.topology.replica)
        acc = self.accelerator
        return prepare_data_loader(
            DataLoader(dataset, **params),
            device=self.args.device,
            num_processes=self.topology.data_parallel_size,
            process_index=self.topology.replica,
            split_batches=acc.split_batches,
            put_on_device=True,
            rng_types=list(acc.rng_types or []),
            dispatch_batches=False,  # every pipeline rank reads its replica's shard itself
            even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking,
        )

    # ------------------------------------------------------------------ one pipeline step per optimizer step
    def _take_batches(self, epoch_iterator, num_batches: int) -> tuple[list, "_Step | None"]:
        """The step's micro-batches: those read ahead for this iterator first, then fresh ones."""
        batches: list = []
        ahead_step = None
        if self._lookahead is not None and self._lookahead[0] is epoch_iterator:
            _, batches, ahead_step = self._lookahead
            if len(batches) > num_batches:  # the loop asked for fewer: keep the rest for later
                self._lookahead = (epoch_iterator, batches[num_batches:], None)
                batches, ahead_step = batches[:num_batches], None
            else:
                self._lookahead = None
        else:
            self._lookahead = None
        while len(batches) < num_batches:
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if ahead_step is not None and len(ahead_step.batches) != len(batches):
            ahead_step = None
        return batches, ahead_step

    def _new_step(self, batches: list) -> "_Step":
        seqs: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        for b in batches:
            x, y = split_sequences(b)
            seqs += x
            labels += y
        step = _Step(batches=batches, input_ids=seqs, labels=labels)
        step.ticket = self.replan.submit([int(s.numel()) for s in seqs])
        return step

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        batches, step = self._take_batches(epoch_iterator, num_batches)
        if not batches:
            self._current_step = None
            return batches, None
        if step is None:
            step = self._new_step(batches)
        local = sum(int((y[1:] != -100).sum()) for y in step.labels)
        total = local
        if self.topology.data_parallel_size > 1:
            t = torch.tensor([local], dtype=torch.long, device=self._comm_device)
            dist.all_reduce(t, group=self.topology.dp_group)
            total = int(t.item())
        step.num_items_local, step.num_items_total = local, total
        self._current_step = step
        if self.args.concertina_overlap_planning:
            # Read the next step now so its plan is made while this step runs.
            ahead: list = []
            for _ in range(self.args.gradient_accumulation_steps):
                try:
                    ahead.append(next(epoch_iterator))
                except StopIteration:
                    break
            if ahead:
                self._lookahead = (epoch_iterator, ahead, self._new_step(ahead))
        num_items = total if self.args.average_tokens_across_devices else local
        return batches, torch.tensor(num_items, device=device)

    @property
    def _comm_device(self) -> torch.device:
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        return self.args.device if backend == "nccl" else torch.device("cpu")

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Run the whole optimizer step's pipeline on its first micro-batch; 0 for the others."""
        step = self._current_step
        if step is None or not step.batches or inputs is not step.batches[0]:
            return torch.zeros((), device=self.args.device)
        self._current_step = None
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        plan = self.replan.plan(step.ticket)
        norm = step.num_items_total if self.args.average_tokens_across_devices else step.num_items_local
        # accelerate's autocast (bf16=True / mixed_precision), which Trainer puts around the model's
        # forward: the executor runs forwards under it and backwards outside it, like Trainer
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            result = self.executor.run_step(plan, step.input_ids, step.labels,
                                            num_items_in_batch=max(1, norm), train=True)
        self._reduce_gradients()
        # after the replicas' reduction: both copies of tied embeddings then get the same bits
        self.executor.sync_tied_gradients()
        self.replan.record(plan, result)
        return torch.tensor(self._global_loss(result, step), dtype=torch.float32, device=self.args.device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise NotImplementedError(
            "ConcertinaTrainer computes the loss inside the pipeline (PipelineExecutor.run_step); "
            "compute_loss is not used"
        )

    def _global_loss(self, result, step: "_Step") -> float:
        """The step's loss over all replicas (the value Trainer logs), identical on every rank."""
        if self.topology.data_parallel_size == 1:
            return float(result.loss)
        if self.args.average_tokens_across_devices:
            t = torch.tensor([float(result.loss_sum)], dtype=torch.float64, device=self._comm_device)
            dist.all_reduce(t, group=self.topology.dp_group)
            return float(t.item()) / max(1, step.num_items_total)
        # per-replica normalization: Trainer's logged value is the mean over processes
        return float(result.loss)

    def _stage_params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _reduce_gradients(self) -> None:
        """Sum (token-averaged loss) or average (per-replica loss) each stage's gradients over replicas,
        in flat buckets of at most ``_BUCKET_ELEMENTS`` (bounded extra memory, few collectives)."""
        dp = self.topology.data_parallel_size
        if dp == 1:
            return
        params = self._stage_params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            bucket: list[torch.Tensor] = []
            size = 0
            for g in grads + [None]:
                if g is not None and (size + g.numel() <= _BUCKET_ELEMENTS or not bucket):
                    bucket.append(g)
                    size += g.numel()
                    continue
                self._all_reduce_bucket(bucket)
                bucket, size = ([g], g.numel()) if g is not None else ([], 0)

    def _all_reduce_bucket(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self._comm_device)
        dist.all_reduce(flat, group=self.topology.dp_group)
        if not self.args.average_tokens_across_devices:
            flat /= self.topology.data_parallel_size
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    # ------------------------------------------------------------------ clipping with the global norm
    def _global_grad_norm(self) -> torch.Tensor:
        """2-norm of all stages' gradients: this stage's squared norm, summed over the pipeline
        (tied embeddings counted once: on the first stage, not on the last stage's copy)."""
        copy = self.pipeline.tied_weight if self.pipeline.is_last else None
        grads = [p.grad for p in self._stage_params() if p.grad is not None and p is not copy]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
        sq = local.float().reshape(1) ** 2
        if self.topology.pipeline_size > 1:
            sq = sq.to(self._comm_device)
            dist.all_reduce(sq, group=self.topology.pp_group)
        return sq.reshape(()).sqrt().to(self.args.device)

    def _clip_grad_norm(self, model):
        """Clip to ``max_grad_norm`` with the norm over all stages (``clip_grad_norm_``'s formula)."""
        total = self._global_grad_norm()
        params = [p for p in self._stage_params() if p.grad is not None]
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, total)
        return total

    def _get_grad_norm(self, model, grad_norm=None):
        return self._global_grad_norm() if grad_norm is None else grad_norm

    def _track_num_input_tokens(self, inputs):
        if self.args.include_num_input_tokens_seen == "no":
            return
        if "attention_mask" in inputs and self.args.include_num_input_tokens_seen == "non_padding":
            n = int(inputs["attention_mask"].sum())
        else:
            n = int(inputs["input_ids"].numel())
        if self.topology.data_parallel_size > 1:
            t = torch.tensor([n], dtype=torch.long, device=self._comm_device)
            dist.all_reduce(t, group=self.topology.dp_group)
            n = int(t.item())
        self.state.num_input_tokens_seen += n

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with the step's plan statistics (ReplanCallback) in the loss entry."""
        if "loss" in logs:
            logs.update(self.replan.pop_pending_logs())
        super().log(logs, start_time)

    # ------------------------------------------------------------------ setup of the training loop
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return model  # no DDP / DataParallel: replicas reduce gradients themselves

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Optimizer and scheduler over the stage's parameters; no ``accelerator.prepare`` of the model."""
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        self._lookahead = None
        return self.model, train_dataloader

    # ------------------------------------------------------------------ evaluation
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self.gather_function = self._gather_over_replicas
        return super().evaluation_loop(dataloader, description, prediction_loss_only=True, ignore_keys=ignore_keys,
                                       metric_key_prefix=metric_key_prefix)

    def _gather_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """``gather_for_metrics`` over the data-parallel group only (stages hold the same values)."""
        dp = self.topology.data_parallel_size
        if dp > 1:
            src = tensor.detach().to(self._comm_device).contiguous()
            parts = [torch.empty_like(src) for _ in range(dp)]
            dist.all_gather(parts, src, group=self.topology.dp_group)
            tensor = torch.cat(parts).to(tensor.device)
            gs = self.accelerator.gradient_state
            if gs.end_of_dataloader and gs.remainder > 0:
                tensor = tensor[: gs.remainder]
        return tensor

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The batch's mean token loss through the pipeline (forward only); no logits."""
        seqs, labels = split_sequences(inputs)
        ticket = self.replan.submit([int(s.numel()) for s in seqs], background=False)
        plan = self.replan.plan(ticket)
        with torch.no_grad(), self.compute_loss_context_manager(), self.accelerator.autocast():
            result = self.executor.run_step(plan, seqs, labels, train=False)
        return torch.tensor(float(result.loss), device=self.args.device), None, None

    def end(self) -> None:
        """Finish the trackers and destroy the process group, once every rank got here (call it
        last: a gloo group left alive can abort the interpreter's shutdown)."""
        self.replan.close()
        if self.topology.world_size > 1 and dist.is_initialized():
            dist.barrier()
        super().end()

    # ------------------------------------------------------------------ saving and loading
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a standard HF model directory of the FULL model (collective over the pipeline)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = None
        if self.topology.replica == 0:
            state_dict = self.pipeline.full_state_dict(self.topology.pp_group)
        if self.args.should_save:
            self._save_full(output_dir, state_dict)
        if self.topology.world_size > 1:
            dist.barrier()  # the directory is complete when save_model returns, on every rank
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_full(self, output_dir: str, state_dict: dict[str, torch.Tensor]) -> None:
        os.makedirs(output_dir, exist_ok=True)
        logger.info(f"Saving the full model (all {self.topology.pipeline_size} stages) to {output_dir}")
        config = self.model.config
        runtime_attn = config._attn_implementation
        try:
            config._attn_implementation = self._saved_attn_implementation
            self.model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)
        finally:
            config._attn_implementation = runtime_attn
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        with open(os.path.join(output_dir, PLAN_META_NAME), "w") as fh:
            json.dump({"pipeline_size": self.topology.pipeline_size,
                       "data_parallel_size": self.topology.data_parallel_size,
                       "layer_ranges": [list(r) for r in self.layout.layer_ranges],
                       "cost_model": self.replan.cost_model.to_dict()}, fh, indent=1)
        # the cost model the stage layout was made from: concertina_cost_model_path for a rerun
        with open(os.path.join(output_dir, LAYOUT_COST_NAME), "w") as fh:
            json.dump(self.cost_model.to_dict(), fh, indent=1)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Each stage of replica 0 writes its optimizer shard; the main process the scheduler."""
        os.makedirs(output_dir, exist_ok=True)
        if self.topology.replica == 0:
            path = os.path.join(output_dir, _optimizer_name(self.topology.stage, self.topology.pipeline_size))
            torch.save(self.optimizer.state_dict(), path)
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, _optimizer_name(self.topology.stage, self.topology.pipeline_size))
        if not os.path.isfile(path):
            found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(checkpoint, "optimizer*")))
            raise ValueError(
                f"{checkpoint} has no optimizer state for stage {self.topology.stage} of "
                f"{self.topology.pipeline_size} (found: {found or 'none'}); resume with the same "
                "concertina_pipeline_size the checkpoint was written with"
            )
        # "cpu:0" (the CPU device of distributed runs) is not a valid map_location
        where = "cpu" if self.args.device.type == "cpu" else self.args.device
        self.optimizer.load_state_dict(torch.load(path, map_location=where, weights_only=True))
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.lr_scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """This stage's weights from the full checkpoint; the planner continues with the cost model
        the checkpoint was planning with. The stage layout must be the checkpoint's."""
        from .planning import CostModel

        meta_path = os.path.join(resume_from_checkpoint, PLAN_META_NAME)
        if os.path.isfile(meta_path):
            with open(meta_path) as fh:
                meta = json.load(fh)
            ranges = [list(r) for r in self.layout.layer_ranges]
            if meta.get("layer_ranges") != ranges:
                raise ValueError(
                    f"{resume_from_checkpoint} was trained with the decoder layers split {meta.get('layer_ranges')} "
                    f"over the stages, this trainer splits them {ranges}. Build the trainer with "
                    f"resume_from_checkpoint={resume_from_checkpoint!r} in its ConcertinaTrainingArguments (the "
                    "layout is then restored at construction), or with concertina_cost_model_path="
                    f"{os.path.join(resume_from_checkpoint, LAYOUT_COST_NAME)!r}, and the same concertina_pipeline_size"
                )
            if "cost_model" in meta:
                self.replan.cost_model = CostModel.from_dict(meta["cost_model"])
        self._load_stage_weights(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        logger.info(f"Loading best model from {self.state.best_model_checkpoint} (score: {self.state.best_metric}).")
        self._load_stage_weights(self.state.best_model_checkpoint)

    def _load_stage_weights(self, checkpoint_dir: str) -> None:
        """Load this stage's parameters out of a full HF checkpoint (single or sharded safetensors).
        Tied embeddings are stored once (``model.embed_tokens.weight``): the head's copy loads from it."""
        from safetensors import safe_open

        from .runtime.stage import EMBED_WEIGHT, HEAD_WEIGHT

        own = self.model.state_dict()
        index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
        single = os.path.join(checkpoint_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        elif os.path.isfile(single):
            with safe_open(single, framework="pt", device="cpu") as fh:
                weight_map = {k: "model.safetensors" for k in fh.keys()}
        else:
            raise ValueError(f"no model.safetensors (or its index) in {checkpoint_dir}: not a checkpoint to resume from")
        source = {k: k for k in own if k in weight_map}  # stage key -> checkpoint key
        if (self.pipeline.tied_embeddings and HEAD_WEIGHT in own and HEAD_WEIGHT not in weight_map
                and EMBED_WEIGHT in weight_map):
            source[HEAD_WEIGHT] = EMBED_WEIGHT
        files: dict[str, list[str]] = {}
        for k, src in source.items():
            files.setdefault(weight_map[src], []).append(k)
        loaded: dict[str, torch.Tensor] = {}
        for fname, keys in files.items():
            with safe_open(os.path.join(checkpoint_dir, fname), framework="pt", device="cpu") as fh:
                for k in keys:
                    loaded[k] = fh.get_tensor(source[k])
        missing = [k for k, v in own.items() if k not in loaded and not _is_buffer_only(self.model, k)]
        if missing:
            raise ValueError(f"{checkpoint_dir} lacks {len(missing)} parameters of stage {self.topology.stage}, "
                             f"e.g. {missing[:3]}")
        self.model.load_state_dict(loaded, strict=False)


def _checkpoint_layout_cost(checkpoint: str | None):
    """The cost model a checkpoint's stage layout was made from (``None`` if not a concertina one)."""
    from .planning import CostModel

    if not isinstance(checkpoint, str) or not os.path.isfile(os.path.join(checkpoint, LAYOUT_COST_NAME)):
        return None
    with open(os.path.join(checkpoint, LAYOUT_COST_NAME)) as fh:
        return CostModel.from_dict(json.load(fh))


def _ties_embeddings(model: nn.Module) -> bool:
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    return head is not None and head is embed


def _count_head_copy(cost):
    """The cost model with the last stage's copy of tied embeddings in its static memory: the
    analytic and profiled models count the shared weight once, on the embedding's stage, which
    is right for one stage; with several, the last stage holds its own copy (weight, gradient,
    optimizer state)."""
    if cost.head_params >= cost.embed_params:  # already counted (e.g. a checkpoint's layout model)
        return cost
    return replace(cost, head_params=cost.head_params + cost.embed_params)


def _is_buffer_only(model: nn.Module, key: str) -> bool:
    return key not in dict(model.named_parameters())


class _WorkerInit:
    """Picklable ``worker_init_fn`` seeding data-loader workers by replica."""

    def __init__(self, num_workers: int, replica: int) -> None:
        self.num_workers, self.replica = num_workers, replica

    def __call__(self, worker_id: int) -> None:
        seed_worker(worker_id, self.num_workers, self.replica)


@dataclass
class _Step:
    """One optimizer step of one replica: its micro-batches, sequences and plan ticket."""

    batches: list
    input_ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    ticket: Any = None
    num_items_local: int = 0
    num_items_total: int = 0
    extra: dict = field(default_factory=dict)
