"""Training arguments: ``TrainingArguments`` plus flat ``concertina_*`` fields.

Every field carries its help text in ``metadata["help"]``, so ``HfArgumentParser`` turns them
into ``--concertina_*`` command-line flags. Invalid values and combinations fail when the
arguments are built, with a message naming the field to change; checks that need the process
group (pipeline size times data-parallel size equals the world size) run when the world size
is already known from the launcher's ``WORLD_SIZE``, and again in :class:`ConcertinaTrainer`.

Layout of ranks: ``world_size = data_parallel_size * pipeline_size * sequence_parallel_size``;
the ranks of one stage are consecutive and those of one pipeline replica too
(``rank = (replica * pipeline_size + stage) * sequence_parallel_size + sp_rank``), so a stage's
Ulysses all-to-alls stay within one node and a pipeline's point-to-point traffic between
neighbouring devices.

One CPU trap is handled here: ``accelerate launch`` starts CPU processes through torchrun
without telling ``TrainingArguments`` to use the CPU, and ``TrainingArguments`` then treats
each rank as a lone process (``world_size == 1``) although the process group spans them all.
When the launcher says ``WORLD_SIZE > 1`` and no GPU is visible, ``use_cpu`` is switched on.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

# the plan strategies of concertina_hf.planning.plan_step: the adaptive method and its baselines
from ..planning import PIPELINE_STRATEGIES, SOLVERS, STRATEGIES, PlanError, stage_budgets
from ..planning.placement import SP_MODES
from ..planning.segments import SegmentOptions, parse_heads

__all__ = [
    "COST_MODEL_SOURCES",
    "ConcertinaTrainingArguments",
    "DEFAULTS_NOT_TAKEN",
    "NONFINITE_MODES",
    "PLANNER_FIELDS",
    "SOLVERS",
    "STRATEGIES",
    "in_trainer_terms",
    "parse_memory_budget",
    "resolve_parallel_sizes",
]

logger = logging.getLogger(__name__)


def _option(default, help: str):
    """A dataclass field with its ``--help`` text (``HfArgumentParser`` reads ``metadata["help"]``)."""
    return field(default=default, metadata={"help": help})

COST_MODEL_SOURCES = ("analytic", "profiled", "online")
#: the field of these arguments setting each planner setting a planner error names (``PlanError.remedies``)
PLANNER_FIELDS = {
    "memory_budget": "concertina_memory_budget", "max_tokens_per_chunk": "concertina_max_tokens_per_chunk",
    "pipeline_size": "concertina_pipeline_size", "sequence_parallel_size": "concertina_sequence_parallel_size",
    "strategy": "concertina_strategy", "solver": "concertina_solver",
    "sequence_parallel_mode": "concertina_sequence_parallel_mode",
}
#: the cost-model sources whose collective times are measured on the stage's own group: with them,
#: concertina_sequence_parallel_mode='auto' lets the planner choose whole-doc / per-doc per chunk
#: (the analytic model guesses those times; its choice against Ulysses-only, measured on CPU:
#: benchmarks/results/flashcp_measured.md)
MEASURED_COST_MODELS = ("profiled", "online")
#: concertina_nonfinite: stop every rank, or drop the step (see concertina_hf.training.step_guard)
NONFINITE_MODES = ("raise", "skip")
#: The fields whose default, or value as ``__post_init__`` resolves it, is not the base class's:
#: ``ConcertinaTrainingArguments`` against ``TrainingArguments``, and
#: :class:`~concertina_hf.integrations.trl.ConcertinaSFTConfig` against TRL's ``SFTConfig``. Every
#: other field they share takes the base's default and resolves as the base resolves it
#: (``tests/training/test_argument_defaults.py`` compares them on the installed releases).
DEFAULTS_NOT_TAKEN = {
    "gradient_checkpointing": (
        "the planner decides per chunk and per stage which layers recompute their activations, so HF's "
        "checkpointing of every layer is never applied: the default is TrainingArguments' (off; SFTConfig's is on), "
        "and True is accepted and resolved to False with a warning"),
    "activation_checkpointing": "the newer name of gradient_checkpointing (transformers >= 5.2x): the same reason",
}


_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def _parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size in bytes: {text!r} (examples: 40GiB, 500MB, 1073741824)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"a memory budget must be positive, got {text!r}")
    return int(value)


def parse_memory_budget(text: str | int | None) -> str | tuple[int, ...] | None:
    """``"auto"`` -> ``"auto"``; ``"none"`` / ``"0"`` / ``None`` -> ``None`` (unconstrained);
    ``"40GiB"`` -> ``(42949672960,)`` (every stage); ``"20GiB,30GiB"`` -> one per stage.

    >>> parse_memory_budget("1.5KiB,2k")
    (1536, 2000)
    """
    if text is None:
        return None
    if isinstance(text, int):
        return None if text == 0 else (_parse_bytes(str(text)),)
    t = str(text).strip().lower()
    if t == "auto":
        return "auto"
    if t in ("none", "0", ""):
        return None
    return tuple(_parse_bytes(part) for part in t.split(","))


def resolve_parallel_sizes(world_size: int, pipeline_size: int | None, data_parallel_size: int | None,
                           sequence_parallel_size: int = 1) -> tuple[int, int]:
    """``(pipeline_size, data_parallel_size)`` for ``world_size`` ranks, each stage spanning
    ``sequence_parallel_size`` of them; a missing size is derived from the other (pipeline over
    all stages when neither is given)."""
    sp = sequence_parallel_size
    if world_size % sp:
        raise ValueError(
            f"concertina_sequence_parallel_size={sp} does not divide the number of processes {world_size}; set "
            "it to a divisor (the processes are data_parallel x pipeline x sequence_parallel)"
        )
    world_size //= sp  # stages from here on
    if pipeline_size is None and data_parallel_size is None:
        pipeline_size, data_parallel_size = world_size, 1
    elif pipeline_size is None:
        if world_size % data_parallel_size:
            raise ValueError(
                f"concertina_data_parallel_size={data_parallel_size} does not divide the world size "
                f"{world_size}; set concertina_data_parallel_size to a divisor of it"
            )
        pipeline_size = world_size // data_parallel_size
    elif data_parallel_size is None:
        if world_size % pipeline_size:
            raise ValueError(
                f"concertina_pipeline_size={pipeline_size} does not divide the world size {world_size}; "
                "set concertina_pipeline_size to a divisor of it"
            )
        data_parallel_size = world_size // pipeline_size
    if pipeline_size * data_parallel_size != world_size:
        raise ValueError(
            f"concertina_pipeline_size={pipeline_size} x concertina_data_parallel_size={data_parallel_size} "
            f"x concertina_sequence_parallel_size={sp} = {pipeline_size * data_parallel_size * sp} processes, "
            f"but {world_size * sp} were launched; set concertina_pipeline_size / concertina_data_parallel_size / "
            "concertina_sequence_parallel_size so that their product is the number of processes (accelerate "
            "launch --num_processes)"
        )
    return pipeline_size, data_parallel_size


@dataclass
class ConcertinaTrainingArguments(TrainingArguments):
    """``TrainingArguments`` for :class:`concertina_hf.ConcertinaTrainer`.

    Batch semantics are the Trainer's: an optimizer step consumes ``per_device_train_batch_size
    x gradient_accumulation_steps`` sequences per pipeline replica, so ``x
    concertina_data_parallel_size`` in all; with ``concertina_layout="auto"`` ``x`` the number of
    processes in all (``Trainer``'s global batch at that many processes, whatever layout is chosen:
    each replica reads ``pipeline_size x sequence_parallel_size`` processes' micro-batches). All the step's sequences of a replica are planned
    and run as one pipeline step (gradient accumulation is a batch size, not a loop).

    Precision as in ``Trainer``: ``bf16=True`` (or ``mixed_precision: bf16`` in the accelerate
    config) keeps float32 master weights and runs the forward under bfloat16 autocast; a model
    loaded in bfloat16 trains in bfloat16. fp16 (which needs a loss scale shared by all stages)
    is refused.
    """

    concertina_pipeline_size: int | None = _option(
        None,
        "Pipeline stages per replica (processes per pipeline). None: the number of processes "
        "divided by concertina_data_parallel_size.",
    )
    concertina_data_parallel_size: int | None = _option(
        None,
        "Data-parallel pipeline replicas; each sees its own share of every step's sequences and "
        "gradients are all-reduced across replicas. None: the number of processes divided by "
        "concertina_pipeline_size (1 when neither is set).",
    )
    concertina_layout: str = _option(
        "manual",
        "'manual': the sizes as given. 'auto': pipeline, sequence- and data-parallel sizes chosen at "
        "construction from the number of processes, the model, the memory budget and the lengths of the "
        "training data's first 8 steps (concertina_hf.training.auto_layout); concertina_pipeline_size / "
        "concertina_data_parallel_size when set and concertina_sequence_parallel_size when not 1 are kept. A "
        "step then takes per_device_train_batch_size x gradient_accumulation_steps x number of processes "
        "sequences (Trainer's global batch at this many processes), shared over the chosen replicas. A checkpoint "
        "given as resume_from_checkpoint keeps its recorded layout.",
    )
    concertina_sequence_parallel_size: int = _option(
        1,
        "Processes per pipeline stage, sharing each chunk's tokens by Ulysses sequence parallelism "
        "(all-to-all of the attention heads). Must divide num_attention_heads; K/V heads are split "
        "when sp divides num_key_value_heads, replicated when num_key_value_heads divides sp.",
    )
    concertina_shard_optimizer: bool = _option(
        False,
        "Shard each stage's optimizer state (Adam moments) over the stage's data-parallel x "
        "sequence-parallel ranks with torch's ZeroRedundancyOptimizer (ZeRO-1: gradients are still "
        "all-reduced whole, clipping uses the exact global norm, each rank steps its share of the "
        "parameters and broadcasts them). Checkpoints hold each stage's state written by every rank, "
        "its own share, with torch.distributed.checkpoint (optimizer.stage{s}-of-{p}.dcp/), read back "
        "at any dp x sp of the same pipeline size. No effect with one rank per stage.",
    )
    concertina_shard_parameters: bool = _option(
        False,
        "ZeRO-3: shard each stage's parameters, gradients and optimizer state over the stage's "
        "data-parallel x sequence-parallel ranks with torch's FSDP2 (fully_shard per decoder layer, "
        "and the embedding / final norm / LM head as one more unit): each layer gathered for its "
        "forward and again for its backward, freed after each, its gradients reduce-scattered after "
        "every chunk's backward, the optimizer stepping on the shards. save_model writes full HF "
        "weights; checkpoints hold the optimizer state with torch.distributed.checkpoint. Implies a "
        "sharded optimizer state (concertina_shard_optimizer adds nothing). No effect with one rank "
        "per stage.",
    )
    concertina_memory_budget: str = _option(
        "auto",
        "Memory per pipeline stage the plan must fit (static + activations): 'auto' (device "
        "memory x concertina_memory_fraction), 'none' (unconstrained), a size ('40GiB', '500MB', "
        "bytes), or a comma-separated list with one size per stage.",
    )
    concertina_memory_fraction: float = _option(
        0.85,
        "With concertina_memory_budget='auto': share of the device's memory a stage may plan for "
        "(the rest is left to the allocator's fragmentation and communication buffers).",
    )
    concertina_sequence_parallel_mode: str = _option(
        "auto",
        "How a stage of several processes shards each chunk: 'auto' (the planner chooses per chunk the "
        "cheapest of Ulysses, whole-doc: each sequence entirely on one process, no attention traffic, "
        "and per-doc: a long sequence cut into 2 x sp zig-zag pieces with its K/V all-gathered), "
        "'ulysses' (every chunk Ulysses), or 'context' (whole-doc and per-doc only, never an "
        "all-to-all; no head-count limit). 'auto' chooses by measured collective times, so it needs "
        "concertina_cost_model='profiled' or 'online'; with 'analytic' it runs Ulysses.",
    )
    concertina_strategy: str = _option(
        "adaptive",
        f"How each step is planned: one of {', '.join(PIPELINE_STRATEGIES)}. 'adaptive' is the method "
        "(workload-balanced chunking plus per-chunk, per-stage recompute); the others are the "
        "baselines (packed: fixed token budget; split: fixed slicing; no-recompute / full-recompute).",
    )
    concertina_max_tokens_per_chunk: int | None = _option(
        None,
        "Upper bound on the tokens of one pipeline chunk; longer sequences are split into "
        "slices. None: no fixed cap, the planner sizes chunks from the memory budget and the "
        "step's balanced time target, within the largest chunk a profiled cost model measured (its "
        "max_chunk_tokens: the profile's chunk sizes reach this cap, or 512 tokens on CPU and 8192 on "
        "CUDA when unset). A cap that would cut a step into more than 2048 chunks "
        "(8192 / pipeline size, if fewer) or a sequence into more than 256 slices is refused when "
        "the step is planned, with the smallest cap that works.",
    )
    concertina_solver: str = _option(
        "ilp",
        "Recompute solver: 'ilp' (PuLP/CBC with a time limit, greedy fallback) or 'greedy'.",
    )
    concertina_solver_time_limit: float = _option(
        1.0,
        "Seconds the ILP solver may spend on one step's plan.",
    )
    concertina_cost_model: str = _option(
        "analytic",
        "Source of the cost model's coefficients: 'analytic' (FLOPs and bytes of the "
        "architecture at the device's rates), 'profiled' (measured on the real layers on this "
        "device at startup by rank 0, a few seconds; or loaded from concertina_cost_model_path), "
        "or 'online' (start analytic or from the file, then refit from measured stage times "
        "every concertina_replan_interval steps; at sequence parallel size > 1 without a file, the "
        "stage's collectives are timed at start-up as 'profiled' times them).",
    )
    concertina_cost_model_path: str | None = _option(
        None,
        "JSON file of a CostModel (CostModel.to_dict(); a 'profiled' run writes one to "
        "<output_dir>/cost_model.json) to start from instead of the analytic model or a new "
        "profile.",
    )
    concertina_replan_interval: int = _option(
        10,
        "With concertina_cost_model='online': refit the cost model from the measured stage "
        "times every N optimizer steps; later plans use the refitted model.",
    )
    concertina_overlap_planning: bool = _option(
        True,
        "Plan the next step in a background thread while the current step runs (the "
        "dataloader reads one step ahead). Pipeline rank 0 plans and broadcasts the plan, so "
        "every stage runs the same one.",
    )
    concertina_balance_replicas: bool = _option(
        True,
        "With concertina_data_parallel_size > 1: every replica reads the whole global batch of a step and "
        "the step's sequences are assigned to replicas by predicted pipeline time "
        "(planning.balance_replicas, made on rank 0 and broadcast), instead of by count (accelerate's "
        "sampler); the loss stays normalised over the whole global batch, so the model equals Trainer's "
        "on one process. Needs average_tokens_across_devices=True. False: the count split.",
    )
    concertina_gantt_steps: int = _option(
        0,
        "Every N optimizer steps write the step's planned and measured Gantt chart to "
        "<output_dir>/gantt/step-<n>.png (and to wandb when it is a tracker). The last step's "
        "chart is written at the end of train() in any case (0: only that one; -1: none). Needs "
        "matplotlib (the viz extra).",
    )
    concertina_nonfinite: str = _option(
        "raise",
        "What a step with a NaN or an infinity (in a stage's activations, the loss or the gradients; checked "
        "once per step over every stage and replica) does: 'raise' stops every rank naming the step, the plan, "
        "the stage and the sequences; 'skip' drops the step (gradients discarded, weights and optimizer state "
        "untouched), logs a warning and counts it in concertina/nonfinite_steps_skipped. A step without any "
        "trainable token is logged with loss NaN ('raise') or dropped ('skip').",
    )
    concertina_self_check: bool = _option(
        True,
        "At construction, before the model is split, run a tiny packed and split probe through the runtime's "
        "own stage computations and compare the loss of each slice and a few gradients with the HF model run on each "
        "sequence alone, and HF's training loss with plain cross-entropy (auxiliary losses); a mismatch refuses "
        "the model, naming its type and what differs.",
    )
    concertina_segment_tokens: int | None = _option(
        None,
        "Segment-level training (opt-in; a different objective from Trainer's): every sequence longer than S "
        "tokens is cut at every multiple of S into segments (one pipeline slice each) that carry K/V to the "
        "later segments of their sequence; sequences up to S tokens are untouched. None (default): ordinary "
        "training, exactly Trainer's model. With only this option set the loss and gradients are still "
        "Trainer's; concertina_segment_gradient and concertina_segment_kv_tail change the objective. "
        "Sequence parallelism 1 only.",
    )
    concertina_segment_gradient: str = _option(
        "full",
        "With concertina_segment_tokens: 'full' (default): every earlier segment's K/V receives gradient from "
        "the later segments that attend to it; 'previous': only the K/V of the immediately preceding segment "
        "does (truncated backpropagation), older K/V are read without gradient (no gradient buffers for them); "
        "'none': every earlier segment's K/V is read without gradient (Transformer-XL), so each segment's "
        "backward runs right after its forward and activation memory stops growing with the sequence.",
    )
    concertina_segment_kv_tail: int | None = _option(
        None,
        "With concertina_segment_tokens: a segment attends to its own tokens (causally) and to at most the W "
        "most recent earlier tokens of its sequence (keys at positions >= segment start - W); K/V no later "
        "segment reaches is dropped. None (default): every earlier token. Inference should follow the same "
        "segment semantics.",
    )
    concertina_segment_global_heads: str | None = _option(
        None,
        "With concertina_segment_tokens and concertina_segment_kv_tail: query heads (comma-separated indices, "
        "e.g. '0,5', the same on every layer) that also read every token before the tail, without gradient "
        "(the paper's head-specific access); the other heads keep the tail. Their K/V heads are kept whole. "
        "None (default): every head keeps the tail.",
    )
    concertina_router_aux_loss: str | None = _option(
        None,
        "MoE models (Mixtral, Qwen2/3-MoE, OLMoE) with output_router_logits=True, whose HF training loss adds the "
        "router's load-balancing loss over the statistics of the whole forward call, which a 1F1B pipeline cannot "
        "compute. None or 'none' (default): such a model is refused. 'per_chunk': each stage adds, per chunk and "
        "per MoE layer, router_aux_loss_coef x num_experts x sum_e f_e x P_e over the chunk's tokens (f_e: their "
        "share routed to expert e among their top-k, P_e: the mean router probability; HF's formula on one layer), "
        "averaged over the model's MoE layers and weighted by the chunk's share of the step's tokens, as "
        "Megatron-Core adds it per micro-batch: a different loss from Trainer's (see "
        "concertina_hf.runtime.router_aux), added whether or not config.output_router_logits is set; training steps "
        "only (the evaluation loss is the cross-entropy). Logged as concertina/router_aux_loss. Sequence parallel "
        "size 1 only.",
    )
    # TRL's SFTConfig has the same field (same type and default: ConcertinaSFTConfig inherits both)
    model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={"help": (
        "With a model given by name (ConcertinaTrainer(model='org/name' or a local directory)): the keyword "
        "arguments of AutoModelForCausalLM.from_pretrained (dtype, attn_implementation, revision, "
        "trust_remote_code; a JSON string is accepted); each rank then reads only its stage's tensors.")})

    def __post_init__(self):
        self._check_concertina_fields()
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _has_accelerator():
            # torchrun-launched CPU ranks: without this TrainingArguments silently runs each rank alone.
            logger.info("WORLD_SIZE > 1 and no GPU visible: setting use_cpu=True so the ranks form one job")
            self.use_cpu = True
        # the alias the user wrote (transformers >= 5.2x resolves gradient_checkpointing* into
        # activation_checkpointing*; older 5.x releases have only gradient_checkpointing*)
        asked = "activation_checkpointing" if getattr(self, "activation_checkpointing", None) else (
            "gradient_checkpointing" if self.gradient_checkpointing else None)
        compile_asked = [f for f in ("torch_compile", "torch_compile_backend", "torch_compile_mode") if getattr(self, f)]
        if compile_asked:  # off before TrainingArguments exports it to accelerate's environment
            _warn_compile_ignored(compile_asked)
            self.torch_compile, self.torch_compile_backend, self.torch_compile_mode = False, None, None
        super().__post_init__()
        if asked:
            self._leave_recompute_to_the_planner(asked)
        if self.fp16 or getattr(self, "mixed_precision", "no") == "fp16":
            raise ValueError(
                "fp16 mixed precision (fp16=True, or mixed_precision: fp16 in the accelerate config) is not supported "
                "by ConcertinaTrainer (a dynamic loss scale would have to be shared by all pipeline stages); use "
                "bf16=True (mixed_precision: bf16) or load the model in bfloat16"
            )

    def _leave_recompute_to_the_planner(self, asked: str) -> None:
        """``activation_checkpointing`` / ``gradient_checkpointing=True`` (set by habit in long-context
        recipes) is accepted: the planner already recomputes layers per chunk and per stage, as many as
        the memory budget needs, so HF's checkpointing of every layer (slower, same result) is switched
        off. Its kwargs have nothing to act on: say so."""
        kwargs = getattr(self, "activation_checkpointing_kwargs", None) or self.gradient_checkpointing_kwargs or {}
        unused = f"; {asked}_kwargs {dict(kwargs)} are not used (the runtime recomputes with " \
                 "torch.utils.checkpoint(use_reentrant=False) per chunk)" if kwargs else ""
        logger.warning(
            f"{asked}=True: ConcertinaTrainer's planner decides per chunk and per stage how many layers recompute "
            "their activations (to fit concertina_memory_budget), so HF's checkpointing of every layer is not applied "
            f"(concertina_strategy='full-recompute' recomputes every layer){unused}"
        )
        self.gradient_checkpointing, self.gradient_checkpointing_kwargs = False, None
        if hasattr(self, "activation_checkpointing"):  # transformers releases with the new name
            self.activation_checkpointing, self.activation_checkpointing_kwargs = False, None

    def _check_concertina_fields(self) -> None:
        for name in ("concertina_pipeline_size", "concertina_data_parallel_size", "concertina_max_tokens_per_chunk",
                     "concertina_sequence_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        world = os.environ.get("WORLD_SIZE")
        if world is not None:  # launched: check the sizes before any process group is set up
            resolve_parallel_sizes(int(world), self.concertina_pipeline_size, self.concertina_data_parallel_size,
                                   self.concertina_sequence_parallel_size)
        if self.concertina_layout not in ("manual", "auto"):
            raise ValueError(f"concertina_layout={self.concertina_layout!r}: choose 'manual' (the sizes as given) or "
                             "'auto' (chosen from the model, the memory budget and the data's lengths)")
        if self.concertina_strategy not in PIPELINE_STRATEGIES:
            why = (" is a baseline on another layout that `concertina plan` simulates, not one the trainer runs"
                   if self.concertina_strategy in STRATEGIES else "")
            raise ValueError(f"concertina_strategy={self.concertina_strategy!r}{why}: choose one of "
                             f"{', '.join(PIPELINE_STRATEGIES)}")
        if self.concertina_solver not in SOLVERS:
            raise ValueError(f"concertina_solver={self.concertina_solver!r}: choose one of {', '.join(SOLVERS)}")
        if self.concertina_sequence_parallel_mode not in SP_MODES:
            raise ValueError(f"concertina_sequence_parallel_mode={self.concertina_sequence_parallel_mode!r}: choose "
                             f"one of {', '.join(SP_MODES)}")
        if not self.concertina_solver_time_limit > 0:
            raise ValueError(f"concertina_solver_time_limit must be positive, got {self.concertina_solver_time_limit}")
        if self.concertina_cost_model not in COST_MODEL_SOURCES:
            raise ValueError(
                f"concertina_cost_model={self.concertina_cost_model!r}: choose one of {', '.join(COST_MODEL_SOURCES)}"
            )
        if self.concertina_cost_model_path and not os.path.isfile(self.concertina_cost_model_path):
            raise ValueError(f"concertina_cost_model_path={self.concertina_cost_model_path!r} is not a file")
        if self.concertina_replan_interval < 0:
            raise ValueError(f"concertina_replan_interval must be >= 0, got {self.concertina_replan_interval}")
        if self.concertina_cost_model == "online" and self.concertina_replan_interval == 0:
            raise ValueError(
                "concertina_cost_model='online' refits every concertina_replan_interval steps; set "
                "concertina_replan_interval to a positive number of steps"
            )
        if self.concertina_nonfinite not in NONFINITE_MODES:
            raise ValueError(
                f"concertina_nonfinite={self.concertina_nonfinite!r}: choose one of {', '.join(NONFINITE_MODES)}"
            )
        if self.concertina_gantt_steps < -1:
            raise ValueError(f"concertina_gantt_steps must be -1 (no chart), 0 (the last step's) or a positive "
                             f"number of steps, got {self.concertina_gantt_steps}")
        self._check_segment_fields()
        self._check_router_aux_loss()
        if not 0 < self.concertina_memory_fraction <= 1:
            raise ValueError(f"concertina_memory_fraction must be in (0, 1], got {self.concertina_memory_fraction}")
        try:
            budget = parse_memory_budget(self.concertina_memory_budget)
        except ValueError as e:
            raise ValueError(f"concertina_memory_budget={self.concertina_memory_budget!r}: {e}") from None
        if isinstance(budget, tuple) and self.concertina_pipeline_size is not None:
            try:
                stage_budgets(budget, self.concertina_pipeline_size)
            except PlanError as e:
                raise in_trainer_terms(e) from None

    def _check_router_aux_loss(self) -> None:
        value = self.concertina_router_aux_loss
        if isinstance(value, str) and value.strip().lower() in ("none", ""):
            value = self.concertina_router_aux_loss = None
        if value is None:
            return
        from ..runtime.router_aux import ROUTER_AUX_LOSS_MODES

        if value not in ROUTER_AUX_LOSS_MODES:
            raise ValueError(f"concertina_router_aux_loss={value!r}: choose None (no router auxiliary loss: a model "
                             "with output_router_logits=True is refused) or one of "
                             f"{', '.join(map(repr, ROUTER_AUX_LOSS_MODES))}")
        if self.concertina_sequence_parallel_size > 1:
            raise ValueError(f"concertina_router_aux_loss={value!r} runs with concertina_sequence_parallel_size=1 only "
                             f"(got {self.concertina_sequence_parallel_size}): each rank of a stage would see its share "
                             "of a chunk's tokens, not the chunk's router statistics")

    def _check_segment_fields(self) -> None:
        tokens, tail = self.concertina_segment_tokens, self.concertina_segment_kv_tail
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
            raise ValueError(f"concertina_segment_tokens must be a positive number of tokens or None, got {tokens!r}")
        if self.concertina_segment_gradient not in ("full", "previous", "none"):
            raise ValueError(f"concertina_segment_gradient={self.concertina_segment_gradient!r}: choose 'full', "
                             "'previous' or 'none'")
        if tail is not None and (not isinstance(tail, int) or isinstance(tail, bool) or tail < 0):
            raise ValueError(f"concertina_segment_kv_tail must be a number of tokens >= 0 or None, got {tail!r}")
        heads = self.concertina_segment_global_heads
        if heads is not None:
            try:
                parsed = parse_heads(heads)
            except PlanError:
                parsed = None
            if not parsed or any(not isinstance(h, int) or isinstance(h, bool) or h < 0 for h in parsed):
                raise ValueError(f"concertina_segment_global_heads={heads!r}: give query-head indices >= 0, "
                                 "comma-separated ('0,5') or as a list")
            if tokens is not None and tail is None:
                raise ValueError("concertina_segment_global_heads needs concertina_segment_kv_tail (without a tail "
                                 "every head already reads every earlier token)")
        if tokens is None:
            for name, value, default in (("concertina_segment_gradient", self.concertina_segment_gradient, "full"),
                                         ("concertina_segment_kv_tail", tail, None),
                                         ("concertina_segment_global_heads", heads, None)):
                if value != default:
                    raise ValueError(f"{name}={value!r} needs concertina_segment_tokens (the segment length); "
                                     "set it or leave the option at its default")
            return
        if self.concertina_sequence_parallel_size > 1:
            raise ValueError(
                f"concertina_segment_tokens={tokens} runs with concertina_sequence_parallel_size=1 only (got "
                f"{self.concertina_sequence_parallel_size}): Ulysses does not carry the segment K/V tail or the "
                "detached older K/V")

    @property
    def segment_options(self) -> SegmentOptions | None:
        """The segment-level training options as the planner takes them (``None``: off)."""
        if self.concertina_segment_tokens is None:
            return None
        return SegmentOptions(self.concertina_segment_tokens, self.concertina_segment_gradient,
                              self.concertina_segment_kv_tail, parse_heads(self.concertina_segment_global_heads))

    @property
    def sequence_parallel_mode(self) -> str:
        """The mode the planner gets: ``concertina_sequence_parallel_mode``, with ``'auto'`` as
        ``'ulysses'`` under a cost model whose collective times are not measured
        (:data:`MEASURED_COST_MODELS`)."""
        mode = self.concertina_sequence_parallel_mode
        return "ulysses" if mode == "auto" and self.concertina_cost_model not in MEASURED_COST_MODELS else mode

    @property
    def memory_budget(self) -> str | tuple[int, ...] | None:
        """The parsed ``concertina_memory_budget`` (see :func:`parse_memory_budget`)."""
        return parse_memory_budget(self.concertina_memory_budget)


def in_trainer_terms(error: PlanError) -> PlanError:
    """``error`` (the planner's) worded with these arguments' fields: ``raise
    concertina_max_tokens_per_chunk to at least 16 tokens`` (:data:`PLANNER_FIELDS`)."""
    return error.with_message(error.worded(PLANNER_FIELDS))


_COMPILE_WARNED = False


def _warn_compile_ignored(fields: list[str]) -> None:
    """Once per process: ``torch_compile`` is not applied, and why."""
    global _COMPILE_WARNED
    if _COMPILE_WARNED:
        return
    _COMPILE_WARNED = True
    logger.warning(
        f"{'/'.join(fields)} is ignored by ConcertinaTrainer: the model is not compiled. The pipeline runs each "
        "stage's decoder layers on chunks whose token count changes every step, and attention goes through the "
        "'concertina' backend's Python K/V store shared by a sequence's slices, so a compiled graph would break "
        "at every layer's attention and recompile for new chunk shapes (measured on CPU: 25 graphs and 18 graph "
        "breaks in 8 steps, 13x slower with compilation and 1.09x slower after it; benchmarks/studies/compile_cpu.py). "
        "Remove torch_compile (and "
        "torch_compile_backend / torch_compile_mode) to silence this warning."
    )


def _has_accelerator() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())
