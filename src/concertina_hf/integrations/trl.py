"""TRL's ``SFTTrainer`` on the pipeline: :class:`ConcertinaSFTTrainer` and :class:`ConcertinaSFTConfig`.

``ConcertinaSFTTrainer`` is ``class ConcertinaSFTTrainer(ConcertinaTrainer, SFTTrainer)``: TRL's
constructor prepares the datasets as it always does (formatting, chat templates, tokenizing,
completion-only / assistant-only labels, truncation, packing with ``bfd`` / ``wrapped``) and
builds its collator (``padding_free`` flattens each batch with document boundaries in
``cu_seq_lens_q``); :class:`~concertina_hf.training.trainer.ConcertinaTrainer` runs every optimizer step as
one planned pipeline step. Every document of a padding-free batch is a sequence of its own for the
planner (packed documents never attend to each other, as in ``SFTTrainer`` with padding-free
attention), and the loss is TRL's ``nll``: the summed token cross-entropy over the labels that are
not ``-100`` divided by the step's label count, i.e. ``Trainer``'s token-weighted loss.

``peft_config`` wraps the model with PEFT before it is split over the stages (the adapter is
initialised after ``set_seed(args.seed)``, as ``SFTTrainer`` does), so LoRA on SFT data trains and
saves as in :mod:`concertina_hf.integrations.peft`.

Refused, naming the setting (each would train something else than ``SFTTrainer`` does):
``loss_type="dft"``, ``label_smoothing_factor > 0``, ``compute_loss_func``,
``activation_offloading``, ``use_liger_kernel``, and a mixture-of-experts router auxiliary loss
unless ``concertina_router_aux_loss='per_chunk'``: the stages then add it per chunk and per layer
(:mod:`concertina_hf.runtime.router_aux`, a different loss from ``SFTTrainer``'s) with TRL's
coefficient (``router_aux_loss_coef``, else the model config's), and ``router_aux_loss_coef=0.0``
turns it off as in TRL.
Not reproduced: TRL's extra training metrics (``entropy``, ``mean_token_accuracy``,
``num_tokens``) are not logged; the loss, learning rate and gradient norm are.

Import it from here (``from concertina_hf.integrations.trl import ConcertinaSFTTrainer``) or as
``concertina_hf.ConcertinaSFTTrainer``; ``trl`` is imported only then (extra ``[trl]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from transformers import TrainingArguments, set_seed
from trl import SFTConfig, SFTTrainer

from ..training.args import DEFAULTS_NOT_TAKEN, ConcertinaTrainingArguments
from ..training.trainer import ConcertinaTrainer

__all__ = ["ConcertinaSFTConfig", "ConcertinaSFTTrainer"]


_TRAINING_ARGUMENTS_FIELDS = {f.name: f for f in fields(TrainingArguments)}


@dataclass
class ConcertinaSFTConfig(SFTConfig, ConcertinaTrainingArguments):
    """``SFTConfig`` (``packing``, ``packing_strategy``, ``padding_free``, ``max_length``,
    ``completion_only_loss``, ``dataset_text_field``, ...) plus the ``concertina_*`` fields of
    :class:`~concertina_hf.training.args.ConcertinaTrainingArguments`.

    Every field shared with ``SFTConfig`` has ``SFTConfig``'s default and resolves as TRL resolves
    it (``SFTConfig`` comes first among the bases: a dataclass takes each field from the last base
    of its MRO that declares it, here ``SFTConfig``), so a TRL script trains the same with only
    the swap: ``bf16`` unset is ``not fp16`` (bfloat16 autocast, on CPU too: set ``use_cpu`` outside
    a launcher, as for ``SFTConfig``), ``learning_rate=2e-5``, ``logging_steps=10``, ... The
    exceptions are :data:`~concertina_hf.training.args.DEFAULTS_NOT_TAKEN`:
    ``gradient_checkpointing`` defaults to ``TrainingArguments``' (off), the planner's recompute
    replaces it."""

    gradient_checkpointing: bool | None = field(  # DEFAULTS_NOT_TAKEN: TrainingArguments' default, not SFTConfig's
        default=_TRAINING_ARGUMENTS_FIELDS["gradient_checkpointing"].default,
        metadata={**_TRAINING_ARGUMENTS_FIELDS["gradient_checkpointing"].metadata,
                  "help": f"{_TRAINING_ARGUMENTS_FIELDS['gradient_checkpointing'].metadata.get('help', '')} Off by "
                          f"default here, unlike SFTConfig: {DEFAULTS_NOT_TAKEN['gradient_checkpointing']}."})


def _check_sft_args(args: ConcertinaSFTConfig) -> None:
    if args.loss_type != "nll":
        raise NotImplementedError(
            f"ConcertinaSFTTrainer computes the 'nll' loss inside the pipeline; loss_type={args.loss_type!r} is not "
            "supported, set loss_type='nll'")
    if args.label_smoothing_factor > 0:
        raise NotImplementedError(
            f"label_smoothing_factor={args.label_smoothing_factor}: the pipeline's loss has no label smoothing; set "
            "label_smoothing_factor=0")
    if args.activation_offloading:
        raise NotImplementedError(
            "activation_offloading=True is not supported: the planner decides recompute per chunk and stage to fit "
            "concertina_memory_budget; set activation_offloading=False")
    if args.use_liger_kernel:
        raise NotImplementedError(
            "use_liger_kernel=True is not supported: the pipeline runs the model's own layers; set "
            "use_liger_kernel=False")


class ConcertinaSFTTrainer(ConcertinaTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` (dataset preparation, collator) over an adaptive pipeline (see the
    module docstring). Same constructor as ``SFTTrainer`` except ``quantization_config``, with the
    arguments after ``args`` given by keyword; ``args`` must be :class:`ConcertinaSFTConfig`;
    ``model`` a model, or a Hub name or local directory (with ``args.model_init_kwargs``) that
    each rank reads by stage (:mod:`~concertina_hf.training.stage_loading`); with ``peft_config``
    a name is loaded whole with ``AutoModelForCausalLM.from_pretrained`` (the adapters are
    initialised on the whole model)."""

    def __init__(self, model: Any, args: ConcertinaSFTConfig | None = None, *, peft_config: Any = None, **kwargs: Any):
        """``peft_config`` wraps ``model`` here; every other keyword (``data_collator``,
        ``train_dataset``, ``processing_class``, ``compute_metrics``, ``callbacks``, ``optimizers``,
        ``formatting_func``, ...) goes to :class:`~concertina_hf.training.trainer.ConcertinaTrainer`,
        which checks it and hands what it does not take to ``SFTTrainer``."""
        if args is None:
            args = ConcertinaSFTConfig(output_dir="tmp_trainer")
        if not isinstance(args, ConcertinaSFTConfig):
            raise TypeError(
                f"ConcertinaSFTTrainer needs ConcertinaSFTConfig, got {type(args).__name__}; build the arguments with "
                "concertina_hf.integrations.trl.ConcertinaSFTConfig(...) (SFTConfig's fields plus concertina_*)")
        _check_sft_args(args)
        if isinstance(model, str) and peft_config is not None:  # adapters are initialised on the whole model
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, **dict(args.model_init_kwargs or {}))
        if peft_config is not None:  # before the model is split: every stage gets its adapters
            from peft import get_peft_model

            set_seed(args.seed)
            model = get_peft_model(model, peft_config)
        super().__init__(model=model, args=args, **kwargs)
        if self.aux_loss_enabled and self.pipeline.router_aux is None:
            raise NotImplementedError(
                f"the model adds a router auxiliary loss (router_aux_loss_coef={self.router_aux_loss_coef}) over the "
                "statistics of the whole forward call, which a 1F1B pipeline cannot compute; set "
                "concertina_router_aux_loss='per_chunk' to add it per chunk and per layer (a different loss from "
                "SFTTrainer's: concertina_hf.runtime.router_aux), or router_aux_loss_coef=0.0")
        if self.pipeline.router_aux is not None:  # TRL's coefficient; none when TRL turned the loss off
            self.pipeline.router_aux = (replace(self.pipeline.router_aux, coef=float(self.router_aux_loss_coef))
                                        if self.aux_loss_enabled else None)

    def _default_data_collator(self):
        return None  # SFTTrainer builds its own (padding-free when asked), which the pipeline understands
