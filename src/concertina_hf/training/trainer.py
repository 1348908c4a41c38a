"""``ConcertinaTrainer``: the HF ``Trainer`` running each optimizer step as one planned pipeline step.

Swap ``Trainer`` for ``ConcertinaTrainer`` (and ``TrainingArguments`` for
:class:`~concertina_hf.training.args.ConcertinaTrainingArguments`), launch with ``accelerate launch``,
and the model is trained as ``Trainer`` would train it on one device: same sequences per step,
same token-weighted loss, same optimizer, scheduler and clipping, within float tolerance.

The Trainer's loop is kept; this class only overrides its hooks (transformers 5.x) and delegates:
setup to :func:`~concertina_hf.training.run_setup.resolve_run` (cost model, stage layout, budgets), process
groups and collectives to :mod:`~concertina_hf.runtime.distributed` (the ``dp x pp`` mesh; gradients
reduced over replicas without DDP; clipping with the global norm, tied embeddings counted once),
reading a step (and the next one ahead) to :class:`~concertina_hf.training.step_reader.StepReader`, planning to
:class:`~concertina_hf.training.step_planner.StepPlanner`, running the plan to
:class:`~concertina_hf.runtime.PipelineExecutor`, recording and logging to
:class:`~concertina_hf.training.callbacks.StepStatsCallback`, checkpoints (standard HF directories plus
per-stage optimizer shards) to :mod:`~concertina_hf.training.checkpoint`. The data loader is sharded over
the data-parallel replicas only: every pipeline rank of a replica reads the same batches.
``training_step`` runs the whole optimizer step on its first micro-batch and returns 0 for the
others, so the Trainer's loss bookkeeping sums to the step's loss. ``bf16=True`` runs the forwards
under accelerate's autocast and the backwards outside it, as ``Trainer`` does; fp16 is refused.
See ``docs/architecture.md`` for the data flow and the costs per step.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from .args import ConcertinaTrainingArguments
from .auto_layout import choose_layout
from .callbacks import StepStatsCallback, use_compact_console
from .checkpoint import StageCheckpointer
from .collator import LengthAwareCollator
from ..runtime.composite import refuse_other_modalities
from ..runtime.distributed import fails_together, global_grad_norm, launched_world_size, reduce_gradients
from ..runtime.param_sharding import local_tensor, shard_stage
from .evaluation import PipelinePredictor
from ..integrations.peft import base_model_of
from .run_setup import build_topology, check_trainer_arguments, pipeline_stage, resolve_run
from .self_check import probe_layers, self_check
from .stage_loading import composite_text_model, model_source
from .sharded_optimizer import shard_optimizer
from .step_guard import StepGuard
from .step_planner import StepPlanner
from .step_reader import Step, StepReader, replica_balancer, replica_data_loader

__all__ = ["ConcertinaTrainer"]

logger = logging.getLogger(__name__)

#: every public call that may run a collective (and the resume's loading, which ``train`` runs), and
#: what the failure message calls it: each runs inside the job-wide failure guard
#: (:func:`~concertina_hf.runtime.distributed.fails_together`), so a failure on one rank, caught by
#: the user or not, ends every rank instead of leaving them in a collective. The callbacks' collective
#: work runs inside ``train`` / ``evaluate``. Subclasses' overrides are guarded too (``__init_subclass__``).
GUARDED_CALLS = {
    "__init__": "construction", "train": "train", "evaluate": "evaluate", "predict": "predict",
    "save_model": "save_model", "push_to_hub": "push_to_hub", "create_model_card": "create_model_card",
    "end": "end", "_load_from_checkpoint": "resume from checkpoint (weights)",
    "_load_optimizer_and_scheduler": "resume from checkpoint (optimizer and scheduler)",
    "_load_rng_state": "resume from checkpoint (RNG state)", "_load_best_model": "loading the best model",
}


class ConcertinaTrainer(Trainer):
    """``transformers.Trainer`` over an adaptive pipeline (see the module docstring).

    Same constructor as ``Trainer``; ``model`` may also be a Hub name or a local HF directory (as
    for TRL's ``SFTTrainer``, with ``args.model_init_kwargs``): each rank then builds the model on
    the meta device and reads only its stage's tensors (:mod:`~concertina_hf.training.stage_loading`).
    ``args`` must be :class:`ConcertinaTrainingArguments`
    (default: ``ConcertinaTrainingArguments(output_dir="tmp_trainer")``); ``data_collator``
    defaults to :class:`LengthAwareCollator` and may be any collator whose batches
    :func:`split_sequences` understands (``DataCollatorWithFlattening``, padding collators with an
    ``attention_mask``). Not supported: ``model_init`` (hyperparameter search), a ready-made
    optimizer in ``optimizers`` (use ``optimizer_cls_and_kwargs``; the stage only holds part of the
    parameters), ``compute_loss_func``. ``compute_metrics`` / ``preprocess_logits_for_metrics`` work
    as in ``Trainer``; the latter runs on the last stage per slice of a sequence, so it must work
    token by token (see :mod:`~concertina_hf.training.evaluation`).

    After construction: ``self.pipeline`` (the :class:`PipelineWrapper` of this rank's stage),
    ``self.peft_model`` (the ``PeftModel`` given as ``model``, else ``None``),
    ``self.executor``, ``self.topology``, ``self.setup`` (``self.cost_model``, ``self.layout``),
    ``self.planner``, ``self.stats_callback`` (the :class:`StepStatsCallback` recording each step),
    ``self.model`` (the pruned HF model).
    """

    def __init_subclass__(cls, **kwargs):
        """A subclass's own overrides of :data:`GUARDED_CALLS` are guarded too."""
        super().__init_subclass__(**kwargs)
        _guard_calls(cls, own_only=True)

    def __init__(
        self,
        model: nn.Module | str | os.PathLike | None = None,
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
        **kwargs,
    ):
        """Extra keyword arguments go to the next class of the MRO (e.g. ``SFTTrainer``'s
        ``formatting_func`` in :class:`~concertina_hf.integrations.trl.ConcertinaSFTTrainer`)."""
        from ..runtime import PipelineExecutor
        from ..runtime.rng import StageRNG

        args = args if args is not None else ConcertinaTrainingArguments(output_dir="tmp_trainer")
        # a name or a directory: the model on the meta device, each rank reads its stage's tensors
        source = model_source(model, args.model_init_kwargs) if isinstance(model, (str, os.PathLike)) \
            and isinstance(args, ConcertinaTrainingArguments) else None
        model = source.empty_model() if source is not None else model
        #: a composite (multimodal) model: the pipeline trains its language model (a TextView) and
        #: saves the composite's checkpoint (CompositeCheckpoint); None otherwise
        model, self.composite = composite_text_model(model, source)
        check_trainer_arguments(model, args, optimizers, model_init=model_init, compute_loss_func=compute_loss_func)
        _ = args.device  # the process group must exist before the model is split: the stage is the pipeline rank
        #: concertina_layout="auto": the sizes chosen from the model and the data (None: as given)
        self.layout_choice = None
        if args.concertina_layout == "auto":
            collator = data_collator if data_collator is not None else self._default_data_collator()
            self.layout_choice = choose_layout(args, base_model_of(model), launched_world_size(args.world_size),
                                               train_dataset, collator)
        self.topology = build_topology(args, None if self.layout_choice is None else self.layout_choice.sizes)
        if self.layout_choice is not None:
            self.layout_choice.check_same_everywhere(self.topology)
            if self.topology.rank == 0:
                logger.info(self.layout_choice.table_text())
        if self.composite is not None and not (self.topology.writes_stage and self.topology.stage == 0):
            self.composite.drop_carried()  # only stage 0's writer saves the other towers
        # DDP's: rank 0's weights everywhere (loaded by stage, every rank read the same files)
        self.weights_synced = self.topology.sync_weights_from_rank0(model) if source is None else []
        hf_model = base_model_of(model)  # a PeftModel's HF model; self.peft_model keeps the PeftModel
        self.setup = resolve_run(args, hf_model, self.topology)
        self.cost_model, self.layout = self.setup.cost_model, self.setup.layout
        if args.concertina_self_check:  # before the model is split: its numbers against HF's, on rank 0
            # by name: rank 0 probes the embedding, the first layers and the head, read for it alone
            probe = source.prefix_model(probe_layers(model)) if source is not None and self.topology.rank == 0 \
                else model
            self_check(probe, self.topology, args.device, router_aux_loss=args.concertina_router_aux_loss)
            del probe
        # The saved config must name an attention every HF install has, not the runtime's backend.
        self._saved_attn_implementation = getattr(hf_model.config, "_attn_implementation", None) or "sdpa"
        self.pipeline, self.peft_model = pipeline_stage(model, self.layout, self.topology.stage,
                                                        router_aux_loss=args.concertina_router_aux_loss)
        if source is not None:
            source.load_stage(self.pipeline)
        self.pipeline.label_smoothing = args.label_smoothing_factor  # HF's LabelSmoother, in the pipeline's loss
        if args.concertina_shard_parameters:  # ZeRO-3 (FSDP2), before Trainer builds the optimizer over the shards
            shard_stage(self.pipeline, self.topology)
        self.checkpointer = StageCheckpointer(self.pipeline, self.topology, args.concertina_shard_optimizer,
                                              peft_model=self.peft_model,
                                              shard_parameters=self.pipeline.sharded, composite=self.composite)
        if self.layout_choice is not None:
            self.checkpointer.layout_choice = self.layout_choice.to_dict()
        self.planner = StepPlanner(self.setup, self.topology, overlap=args.concertina_overlap_planning)
        ahead = args.gradient_accumulation_steps if args.concertina_overlap_planning else 0
        self.steps = StepReader(self.planner, self.topology, batches_ahead=ahead,
                                vocab_size=getattr(hf_model.config, "vocab_size", None),
                                balancer=replica_balancer(args, self.planner, self.topology))

        self.stats_callback = next((c for c in (callbacks or []) if isinstance(c, StepStatsCallback)), None)
        if self.stats_callback is None:
            self.stats_callback = StepStatsCallback()
            callbacks = list(callbacks or []) + [self.stats_callback]
        super().__init__(
            model=self.pipeline.model, args=args,
            data_collator=self._default_data_collator() if data_collator is None else data_collator,
            train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
            callbacks=callbacks, optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics, **kwargs,
        )
        # each process draws its stage's dropout from its own stream (every rank is seeded alike)
        self.executor = PipelineExecutor(self.pipeline, pp_group=self.topology.pp_group, device=args.device,
                                         rng=StageRNG(args.seed, self.topology.rank, args.device),
                                         sp_group=self.topology.sp_group, channels=self.topology.p2p_channels)
        self.guard = StepGuard(args.concertina_nonfinite, self.topology)
        self.predictor = PipelinePredictor(self.executor, self.planner, self.steps, self.topology)
        self.stats_callback.bind(self)
        use_compact_console(self.callback_handler)

    # ------------------------------------------------------------------ data
    def _default_data_collator(self):
        """The collator when none is given (``None``: the next class of the MRO picks its own)."""
        return LengthAwareCollator()

    def _set_signature_columns_if_needed(self):
        """Trainer's columns plus ``seq_lengths``, the document lengths of packed rows (TRL's
        ``pack_dataset``): without them the collator could not keep packed documents apart."""
        super()._set_signature_columns_if_needed()
        if "seq_lengths" not in self._signature_columns:
            self._signature_columns = list(self._signature_columns) + ["seq_lengths"]
        if self.composite is not None:  # kept, so that a batch with them is refused (not trained as text)
            self._signature_columns = list(dict.fromkeys([*self._signature_columns, *self.composite.other_inputs]))

    def _get_dataloader(self, dataset, description: str, batch_size: int, sampler_fn=None, is_training: bool = False,
                        dataloader_key: str | None = None) -> DataLoader:
        """The Trainer's data loader, sharded over data-parallel replicas only (never over stages)."""
        # a datasets.Dataset exists only once `datasets` is imported: no import (the package may be absent)
        datasets = sys.modules.get("datasets")
        data_collator = self.data_collator
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            data_collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        if self.composite is not None:
            data_collator = _TextOnlyCollator(data_collator, self.composite.other_inputs, self.composite.model_type)
        if is_training and self.layout_choice is not None:  # Trainer's global batch at this many processes
            batch_size *= self.layout_choice.replica_batch_factor
        sampler = None
        if sampler_fn is not None and not isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = sampler_fn(dataset)
        return replica_data_loader(dataset, data_collator, batch_size, self.args, self.accelerator, self.topology,
                                   sampler=sampler, seed_workers=is_training,
                                   whole_step=is_training and self.steps.balancer is not None)

    # ------------------------------------------------------------------ one pipeline step per optimizer step
    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        step = self.steps.read(epoch_iterator, num_batches)
        if step is None:
            return [], None
        num_items = step.num_items_total if self.args.average_tokens_across_devices else step.num_items_local
        return step.batches, torch.tensor(num_items, device=device)

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Run the whole optimizer step's pipeline on its first micro-batch; 0 for the others."""
        step = self.steps.current
        if step is None or not step.batches or inputs is not step.batches[0]:
            return torch.zeros((), device=self.args.device)
        self.steps.current = None
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        plan = self.planner.plan(step.ticket)
        norm = step.num_items_total if self.args.average_tokens_across_devices else step.num_items_local
        # accelerate's autocast (bf16=True / mixed_precision), which Trainer puts around the model's
        # forward: the executor runs forwards under it and backwards outside it, like Trainer
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            result = self.executor.run_step(plan, step.input_ids, step.labels, num_items_in_batch=max(1, norm),
                                            router_aux_tokens=self._router_aux_tokens(plan),
                                            train=True, measure_memory=self.stats_callback.wants_memory(self.state))
        # non-finite values or no target: raise on every rank, or drop the step (grads discarded)
        if not self.guard.check(self.state.global_step + 1, plan, result, self._stage_params(),
                                step.num_items_total, self.pipeline.is_last):
            # sharded: FSDP2 reduce-scattered them over sp after each backward; the replicas' here
            reduce_gradients(self._stage_params(), self.topology, average=not self.args.average_tokens_across_devices,
                             shards=self.pipeline.sharded)
            # after the replicas' reduction: both copies of tied embeddings then get the same bits
            self.executor.sync_tied_gradients()
        result.router_aux_loss = self._router_aux_over_replicas(result)
        self.stats_callback.record(plan, result)
        loss = self.guard.step_loss(self._global_loss(result, step), step.num_items_total)
        return torch.tensor(loss, dtype=torch.float32, device=self.args.device)

    def _router_aux_tokens(self, plan) -> int | None:
        """The tokens the router term's chunk shares are taken of (``concertina_router_aux_loss``):
        the step's over the replicas when the loss is normalised over them, else the replica's;
        ``None`` without the term."""
        if self.pipeline.router_aux is None:
            return None
        tokens = sum(plan.seq_lens)
        if self.args.average_tokens_across_devices:
            tokens = int(self.topology.all_reduce_replicas(tokens))
        return tokens

    def _router_aux_over_replicas(self, result) -> float | None:
        """This stage's share of the step's router term over the replicas: summed (each replica's
        chunks carry their share of the whole step), or averaged as the gradients are without
        ``average_tokens_across_devices``."""
        value = result.router_aux_loss
        if value is None or self.topology.data_parallel_size == 1:
            return value
        total = float(self.topology.all_reduce_replicas(value, dtype=torch.float64))
        return total if self.args.average_tokens_across_devices else total / self.topology.data_parallel_size

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise NotImplementedError("ConcertinaTrainer computes the loss inside the pipeline "
                                  "(PipelineExecutor.run_step); compute_loss is not used")

    def _global_loss(self, result, step: Step) -> float:
        """The step's loss over all replicas (the value Trainer logs), identical on every rank;
        with per-replica normalization Trainer's logged value is the mean over processes."""
        if self.topology.data_parallel_size == 1 or not self.args.average_tokens_across_devices:
            return float(result.loss)
        total = self.topology.all_reduce_replicas(float(result.loss_sum), dtype=torch.float64)
        return float(total) / max(1, step.num_items_total)

    def get_total_train_batch_size(self, args) -> int:
        """Sequences per optimizer step over all replicas (the pipeline ranks of a replica share theirs;
        ``concertina_layout="auto"``: a replica reads ``pp x sp`` processes' share, so the step is
        ``Trainer``'s at this many processes)."""
        factor = 1 if self.layout_choice is None else self.layout_choice.replica_batch_factor
        return self._train_batch_size * factor * args.gradient_accumulation_steps * self.topology.data_parallel_size

    def _stage_params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _clip_grad_norm(self, model):
        """Clip to ``max_grad_norm`` with the norm over all stages (``clip_grad_norm_``'s formula)."""
        total = self._get_grad_norm(model)
        params = [p for p in self._stage_params() if p.grad is not None]
        if params and self.pipeline.sharded:  # clip_grads_with_norm_'s factor on each rank's shards
            coef = torch.clamp(self.args.max_grad_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_([local_tensor(p.grad) for p in params], coef.to(params[0].device))
        elif params:
            torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, total)
        return total

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is not None:
            return grad_norm
        if self.guard.dropped:  # a dropped step has no gradient
            return torch.tensor(float("nan"), device=self.args.device)
        copy = self.pipeline.tied_weight if self.pipeline.is_last else None  # counted on the first stage
        grads = [local_tensor(p.grad) for p in self._stage_params() if p.grad is not None and p is not copy]
        return global_grad_norm(grads, self.topology, self.args.device, sharded=self.pipeline.sharded)

    def _track_num_input_tokens(self, inputs):
        if self.args.include_num_input_tokens_seen == "no":
            return
        if "attention_mask" in inputs and self.args.include_num_input_tokens_seen == "non_padding":
            n = int(inputs["attention_mask"].sum())
        else:
            n = int(inputs["input_ids"].numel())
        self.state.num_input_tokens_seen += self.steps.tokens_over_replicas(n)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with the step's plan statistics (StepStatsCallback) in the loss entry and
        ``train_tokens_per_second`` (tokens trained over all replicas / ``train_runtime``) at the end."""
        if "loss" in logs:
            logs.update(self.stats_callback.pop_pending_logs())
            self.guard.amend_logs(logs)
        if "train_samples_per_second" in logs and logs.get("train_runtime"):  # the end of train()
            tokens = self.topology.all_reduce_replicas(self.stats_callback.tokens_trained)
            logs["train_tokens_per_second"] = round(tokens / logs["train_runtime"], 3)
        super().log(logs, start_time)

    # ------------------------------------------------------------------ setup of the training loop
    def create_optimizer(self, model=None):
        """Trainer's optimizer over the stage's parameters; ``concertina_shard_optimizer``: sharded
        over the stage's ``dp x sp`` ranks (:func:`~concertina_hf.training.sharded_optimizer.shard_optimizer`)."""
        optimizer = super().create_optimizer(model)
        if self.args.concertina_shard_optimizer and not self.pipeline.sharded:  # sharded parameters: state too
            self.optimizer = optimizer = shard_optimizer(optimizer, self.topology)
        return optimizer

    def _move_model_to_device(self, model, device):
        """Trainer's move, except onto the CPU of a model already there: ``.to("cpu:0")`` (the
        device of distributed CPU runs) would copy every tensor of the stage (the peak memory twice)."""
        if torch.device(device).type == "cpu" and all(t.device.type == "cpu" for t in model.state_dict().values()):
            return
        super()._move_model_to_device(model, device)

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
        self.steps.reset()
        return self.model, train_dataloader

    # ------------------------------------------------------------------ evaluation
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self.gather_function = self._gather_over_replicas
        # applied per slice on the last stage (PipelinePredictor), not to the batch's logits by the loop
        preprocess, self.preprocess_logits_for_metrics = self.preprocess_logits_for_metrics, None
        self.predictor.preprocess = preprocess
        try:
            return super().evaluation_loop(dataloader, description, prediction_loss_only=prediction_loss_only,
                                           ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self.preprocess_logits_for_metrics, self.predictor.preprocess = preprocess, None

    def _gather_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """``gather_for_metrics`` over the data-parallel group only (stages hold the same values),
        the last batch cut to the dataset's remainder as accelerate does (also with one replica)."""
        tensor = self.topology.all_gather_replicas(tensor)
        gs = self.accelerator.gradient_state
        return tensor[: gs.remainder] if gs.end_of_dataloader and gs.remainder > 0 else tensor

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Trainer's ``(loss, logits or preprocessed logits, labels)`` of the batch through the pipeline."""
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            return self.predictor.step(inputs, self.label_names, prediction_loss_only, self.args.device)

    def end(self) -> None:
        """Finish the trackers and destroy the process group, once every rank got here (call it
        last: a gloo group left alive can abort the interpreter's shutdown). Raises, after the
        teardown, when another rank failed in a guarded call (its message): a script that caught
        a failure on one rank and went on to ``end()`` does not end as a success elsewhere."""
        self.planner.close()
        failures = self.topology.failures_of_other_ranks()  # also the barrier: every rank got here
        if hasattr(Trainer, "end"):  # not in transformers 5.17 (checked): there, what Trainer.end does
            super().end()
        else:
            self.accelerator.end_training()
        if failures:
            raise RuntimeError(f"rank {self.topology.rank}: the job failed: {failures[0]}")

    # ------------------------------------------------------------------ saving and loading
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train`` resuming only from a verified checkpoint: ``True`` takes the newest
        ``checkpoint-N`` of ``output_dir`` whose manifest verifies (a warning names each newer one
        skipped and why); a path that does not verify is refused, naming the file."""
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = self.checkpointer.latest_verified(self.args.output_dir)
        elif isinstance(resume_from_checkpoint, str):
            self.checkpointer.verified(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval)

    def _save_checkpoint(self, model, trial) -> None:
        """``Trainer._save_checkpoint`` made atomic: every rank writes into ``tmp-checkpoint-N``, then
        the checkpointer seals it (barrier, manifest, rename): a ``checkpoint-N`` is complete."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        staging = self.checkpointer.begin_checkpoint(final)
        if not self.args.save_only_model:  # first: the shard's hash then overlaps the model's save
            self._save_optimizer_and_scheduler(staging)
            self._save_scaler(staging)
            self._save_rng_state(staging)
        self.save_model(staging, _internal_call=True)
        if (self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
                and self.state.best_global_step):
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if best == final or os.path.exists(best):
                self.state.best_model_checkpoint = best
        if self.args.should_save:
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                name = type(cb).__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
            self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
        self.checkpointer.seal_checkpoint(staging, final, global_step=self.state.global_step, layout=self.layout,
                                          save_only_model=self.args.save_only_model)
        if self.args.push_to_hub:
            self._push_from_checkpoint(final)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        self.checkpointer.save_stage_rng(output_dir, self.executor.rng.state_dict())

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:  # Trainer would go on without it
            self.checkpointer.check_rng_state(checkpoint, self.args.world_size, self.args.process_index)
            self.executor.rng.load_state_dict(self.checkpointer.load_stage_rng(checkpoint))
        super()._load_rng_state(checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a standard HF model directory of the full model, each stage its own shard (collective)."""
        if _internal_call and output_dir is None and self.__dict__.pop("_saved_for_push", False):
            return  # Trainer.push_to_hub's own save: done first by push_to_hub below
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.checkpointer.save_model(
            output_dir, layout=self.layout, model=self.model, is_main=self.args.should_save,
            attn_implementation=self._saved_attn_implementation, processing_class=self.processing_class,
            extra_files={"training_args.bin": self.args}, planning_cost=self.planner.cost_model,
            layout_cost=self.cost_model)
        self.topology.barrier()  # the directory is complete when save_model returns, on every rank
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """``Trainer.push_to_hub`` with its collective part first: every rank saves the model into
        ``output_dir``, then the main process creates the repository, writes the model card and
        uploads (``Trainer`` creates the repository on the main process before the save: a Hub
        error there would leave the other ranks in the collective save)."""
        self.save_model(_internal_call=True)
        self._saved_for_push = True  # Trainer.push_to_hub's save_model(_internal_call=True) is skipped
        try:
            return super().push_to_hub(commit_message=commit_message, blocking=blocking, token=token,
                                       revision=revision, private=private, **kwargs)
        finally:
            self.__dict__.pop("_saved_for_push", None)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.checkpointer.save_optimizer(output_dir, self.optimizer, self.lr_scheduler, self.args.should_save, self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self.checkpointer.load_optimizer(checkpoint, self.optimizer, self.lr_scheduler, self.args.device,
                                             self.model)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """This stage's weights from the full checkpoint; the planner continues with the cost model
        the checkpoint was planning with. The stage layout must be the checkpoint's."""
        cost = self.checkpointer.check_layout(resume_from_checkpoint, self.layout)
        if cost is not None:
            self.planner.set_cost_model(cost)
        self.checkpointer.load_stage_weights(self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        logger.info(f"Loading best model from {self.state.best_model_checkpoint} (score: {self.state.best_metric}).")
        self.checkpointer.verified(self.state.best_model_checkpoint)
        self.checkpointer.load_stage_weights(self.model, self.state.best_model_checkpoint)


class _TextOnlyCollator:
    """A composite model's collator: rows and batches that carry another modality are refused
    (:func:`~concertina_hf.runtime.composite.refuse_other_modalities`)."""

    def __init__(self, collator: Callable, names: tuple[str, ...], model_type: str) -> None:
        self.collator, self.names, self.model_type = collator, names, model_type

    def __call__(self, features):
        for row in features:
            if isinstance(row, dict):
                refuse_other_modalities(row, self.names, self.model_type)
        batch = self.collator(features)
        if isinstance(batch, dict):
            refuse_other_modalities(batch, self.names, self.model_type)
        return batch


def _guard_calls(cls: type, own_only: bool = False) -> None:
    """Wrap ``cls``'s :data:`GUARDED_CALLS` (``own_only``: those it defines itself) in the failure guard."""
    for name, what in GUARDED_CALLS.items():
        fn = cls.__dict__.get(name)
        if fn is None and not own_only and hasattr(cls, name):
            fn = _next_in_mro(cls, name)  # not a copy of the inherited one: a subclass's MRO may differ
        if fn is None or getattr(fn, "fails_together", None) is not None:
            continue
        setattr(cls, name, fails_together(what if name != "__init__" else f"{cls.__name__} construction")(fn))


def _next_in_mro(cls: type, name: str) -> Callable:
    """A method of ``cls`` calling the next class's ``name`` in the object's MRO."""
    def call(self, *args, **kwargs):
        return getattr(super(cls, self), name)(*args, **kwargs)

    call.__name__, call.__qualname__ = name, f"{cls.__name__}.{name}"
    call.__doc__, call.__wrapped__ = getattr(cls, name).__doc__, getattr(cls, name)  # help() and the signature
    return call


_guard_calls(ConcertinaTrainer)
