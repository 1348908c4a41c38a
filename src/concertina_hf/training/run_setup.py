"""What a run plans with, resolved once at construction: :func:`resolve_run` -> :class:`RunSetup`.

Before it, from the arguments and the model: the mesh (:func:`build_topology`: the parallel sizes
resolved from the arguments, handed to the runtime as plain numbers) and this rank's stage of the
model (:func:`pipeline_stage`: a ``PeftModel`` checked and unwrapped here, so the runtime only
sees plain HF models).

From the arguments, the model and the mesh: the cost model (analytic from the config, a JSON
file, a profile of the real layers made once by rank 0 and broadcast, or the one a resumed
checkpoint's layout was made from), the stage layout (decoder layers balanced over the stages by
that cost model, the same on every rank), each stage's memory budget in bytes, and the solver
settings.

Costs: a profile (``concertina_cost_model="profiled"`` without a file) takes a few seconds on rank
0 and one broadcast; with sequence parallelism (``sp > 1``) every rank then times one layer's
all-to-alls on its stage's real sp group for four chunk sizes (a fraction of a second on gloo)
and the fitted latency and bandwidth replace the intra-node fields; everything else is
arithmetic on the config.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
from torch import nn

from .args import ConcertinaTrainingArguments, in_trainer_terms, resolve_parallel_sizes
from .checkpoint import layout_cost_model
from ..integrations.peft import base_model_of, check_peft_model, is_peft_model
from ..runtime.attention.kernels import choose_kernel
from ..runtime.distributed import Topology, launched_world_size
from ..runtime.families import sequence_parallel_refusal as sp_refusal
from ..runtime.stage import PipelineWrapper
from ..planning import CostModel, DeviceSpec, PlanError, StageLayout, partition_layers, stage_budgets
from ..planning.activations import SINKS, SOFTCAPPED_ATTENTION
from ..planning.layouts import count_head_copy
from ..planning.segments import SegmentOptions
from ..runtime.per_layer import layer_heads
from ..runtime.ulysses import check_heads

__all__ = ["RunSetup", "budget_setting", "budget_source", "build_topology", "check_static_memory", "check_trainer_arguments",
           "count_frozen_parameters", "pipeline_stage", "resolve_run"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSetup:
    """Everything a step's plan depends on besides its sequence lengths."""

    #: the cost model the stage layout was made from (and the planner starts from)
    cost_model: CostModel
    layout: StageLayout
    #: per stage, bytes the plan must fit (0: unconstrained)
    budgets: tuple[int, ...]
    device_memory_bytes: int
    strategy: str
    solver: str
    solver_time_limit_s: float
    max_tokens_per_chunk: int | None
    #: where the budgets came from, in words (shown with them in the Gantt chart's memory panel)
    budget_source: str = ""
    #: segment-level training (concertina_segment_*; None: off), recorded in every plan's knobs
    segment: SegmentOptions | None = None
    #: how a stage of sp processes shards each chunk (planning.placement): the effective
    #: concertina_sequence_parallel_mode (ConcertinaTrainingArguments.sequence_parallel_mode)
    sp_mode: str = "ulysses"


def build_topology(args: ConcertinaTrainingArguments, sizes: tuple[int, int, int] | None = None) -> Topology:
    """The ``dp x pp x sp`` mesh of the launched job, with the sizes the arguments ask for (a
    missing one derived: :func:`~concertina_hf.training.args.resolve_parallel_sizes`), or
    ``sizes`` ``(pp, sp, dp)`` when given (``concertina_layout="auto"``'s choice), and
    ``ddp_timeout`` as every group's timeout. Collective: every rank calls it, once."""
    world = launched_world_size(args.world_size)
    sp = args.concertina_sequence_parallel_size if sizes is None else sizes[1]
    pp, dp = resolve_parallel_sizes(world, args.concertina_pipeline_size if sizes is None else sizes[0],
                                    args.concertina_data_parallel_size if sizes is None else sizes[2], sp)
    return Topology.build(pp=pp, dp=dp, sp=sp, timeout=timedelta(seconds=args.ddp_timeout))


def pipeline_stage(model: nn.Module, layout: StageLayout, stage: int,
                   router_aux_loss: str | None = None) -> tuple[PipelineWrapper, nn.Module | None]:
    """Stage ``stage`` of ``model`` (pruned in place) and the ``PeftModel`` that ``model`` is
    (``None`` for a plain HF model). A ``PeftModel`` is refused first where the pipeline cannot
    run or save it like ``Trainer`` + PEFT (:func:`~concertina_hf.integrations.peft.check_peft_model`);
    the wrapper prunes the HF model inside it (adapter layers in place) and the ``PeftModel`` is
    what saving the adapter needs (:class:`~concertina_hf.training.checkpoint.StageCheckpointer`).
    ``router_aux_loss``: ``concertina_router_aux_loss`` (:class:`PipelineWrapper`)."""
    peft_model = None
    if is_peft_model(model):
        check_peft_model(model, layout.num_stages)
        peft_model, model = model, base_model_of(model)
    return PipelineWrapper(model, layout, stage, router_aux_loss), peft_model


def resolve_run(args: ConcertinaTrainingArguments, model: nn.Module, topology: Topology) -> RunSetup:
    """The run's :class:`RunSetup` (collective when rank 0 profiles: call it on every rank)."""
    # before the cost model reads a config it may not understand
    check_model_family(model, args.concertina_router_aux_loss)
    why = sp_refusal(base_model_of(model).config, topology.sequence_parallel_size, args.sequence_parallel_mode)
    if why is not None:  # the mixers and attention masks that run at sp = 1 only, or under Ulysses only
        raise ValueError(why)
    device_memory = device_memory_bytes(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cost = layout_cost_model(args.resume_from_checkpoint)
    if cost is None:  # not resuming: a resumed run keeps its checkpoint's stage layout
        dtype_bytes = next(model.parameters()).element_size()
        cost = initial_cost_model(args, model.config, args.device, dtype_bytes, device_memory)
        if args.concertina_cost_model == "profiled" and not args.concertina_cost_model_path:
            cost = _profile_on_rank0(model, args, cost, topology)
        # the stage's collectives, timed on its group: an online refit takes them from the model
        # (it cannot tell them from compute), so an online run times them at the start too
        if (args.concertina_cost_model in ("profiled", "online") and not args.concertina_cost_model_path
                and topology.sequence_parallel_size > 1):
            cost = _profile_collectives(args, cost, topology)
        cost = count_frozen_parameters(cost, model)
    if topology.pipeline_size > 1 and ties_embeddings(model):
        cost = count_head_copy(cost)
    sp = topology.sequence_parallel_size
    # optimizer state over the stage's dp x sp ranks (concertina_shard_optimizer), else whole on each;
    # concertina_shard_parameters: weights and gradients too, gathered per layer (zero3)
    zero3 = args.concertina_shard_parameters and sp > 1
    if zero3 and topology.pipeline_size > 1:
        raise ValueError(f"concertina_shard_parameters=True runs at concertina_pipeline_size=1 only (got "
                         f"{topology.pipeline_size}): set concertina_pipeline_size=1 or "
                         "concertina_shard_parameters=False (concertina_shard_optimizer=True shards the optimizer "
                         "state at any pipeline size)")
    shards = sp if zero3 else sp * topology.data_parallel_size if args.concertina_shard_optimizer else 1
    sp_mode = args.sequence_parallel_mode
    if sp > 1 and sp_mode == "ulysses":  # whole-doc / per-doc have no head-count rule
        for heads, kv in layer_heads(model.config) or [(int(model.config.num_attention_heads), int(
                getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads))]:
            check_heads(heads, kv, sp)  # a per-layer config's every layer (runtime/per_layer.py)
    segment = args.segment_options
    if segment is not None and segment.global_heads:
        heads = int(model.config.num_attention_heads)
        if max(segment.global_heads) >= heads:
            raise ValueError(f"concertina_segment_global_heads {list(segment.global_heads)}: the model has {heads} "
                             f"query heads (indices 0..{heads - 1}): set concertina_segment_global_heads to indices "
                             "below that")
    if sp > 1 or shards > 1:  # per GPU: compute and activations over sp
        cost = cost.with_parallel(sp=sp, state_shards=shards, zero3=zero3, ulysses=sp_mode == "ulysses")
    try:
        layout = partition_layers(cost, topology.pipeline_size)
    except PlanError as e:
        raise in_trainer_terms(e) from None
    budgets = memory_budgets(args, device_memory, layout.num_stages)
    check_static_memory(cost, layout, budgets)
    return RunSetup(
        cost_model=cost, layout=layout, budgets=budgets,
        device_memory_bytes=device_memory, strategy=args.concertina_strategy, solver=args.concertina_solver,
        solver_time_limit_s=args.concertina_solver_time_limit,
        max_tokens_per_chunk=args.concertina_max_tokens_per_chunk,
        budget_source=budget_source(args, device_memory, args.device),
        segment=segment,
        sp_mode=sp_mode,
    )


def check_trainer_arguments(model: nn.Module | None, args, optimizers: tuple, **unsupported) -> None:
    """Refuse what ``ConcertinaTrainer`` cannot honour, naming the argument (before any group exists)."""
    if not isinstance(args, ConcertinaTrainingArguments):
        raise TypeError(
            f"ConcertinaTrainer needs ConcertinaTrainingArguments, got {type(args).__name__}; build the "
            "arguments with concertina_hf.ConcertinaTrainingArguments(...) (same fields plus concertina_*)"
        )
    for name, value in unsupported.items():
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
    check_model_family(model, args.concertina_router_aux_loss)
    if args.train_sampling_strategy == "batch_rebalance":
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' balances tokens across all processes, but pipeline ranks "
            "must read the same batches; use 'random' (the planner balances the pipeline's chunks)"
        )


def check_model_family(model: nn.Module, router_aux_loss: str | None = None) -> None:
    """Refuse a model the runtime cannot train as HF does (an other layout, mixers that are not
    attention, the router auxiliary loss without ``concertina_router_aux_loss``, ...), naming its
    model type and the feature: :func:`~concertina_hf.runtime.families.inspect_model`, on the HF
    model inside a ``PeftModel``."""
    from ..runtime.families import UnsupportedModelError, inspect_model

    hf = base_model_of(model)
    inspect_model(hf, router_aux_loss)
    declared, held = getattr(hf.config, "num_hidden_layers", None), len(hf.model.layers)
    if declared is not None and int(declared) != held:  # the stage layout and the cost model count the config's layers
        raise UnsupportedModelError(
            f"model type {hf.config.model_type!r}: config.num_hidden_layers is {declared} but model.model.layers "
            f"holds {held} decoder layers; the stage layout and the cost model count config.num_hidden_layers")


def memory_budgets(args: ConcertinaTrainingArguments, device_memory: int, num_stages: int) -> tuple[int, ...]:
    """``concertina_memory_budget`` in bytes per stage: ``auto`` is the device's memory times
    ``concertina_memory_fraction``; ``none`` is 0 (unconstrained)."""
    try:
        return stage_budgets(budget_setting(args, device_memory), num_stages)
    except PlanError as e:
        raise in_trainer_terms(e) from None


def budget_setting(args: ConcertinaTrainingArguments, device_memory: int) -> int | tuple[int, ...]:
    """``concertina_memory_budget`` resolved to bytes (``auto``: the device's memory times
    ``concertina_memory_fraction``; ``none``: 0), or the sizes per stage as given."""
    budget = args.memory_budget
    if budget == "auto":
        return int(device_memory * args.concertina_memory_fraction)
    return 0 if budget is None else budget


def budget_source(args: ConcertinaTrainingArguments, device_memory: int, device) -> str:
    """Where :func:`memory_budgets` took the budget from, e.g. ``"auto: 0.9 x 80 GiB of GPU memory"``."""
    if args.memory_budget == "auto":
        where = "GPU memory" if getattr(device, "type", str(device)) == "cuda" else "CPU memory per local process"
        return (f"concertina_memory_budget='auto': {args.concertina_memory_fraction:g} x "
                f"{device_memory / 2**30:.3g} GiB of {where}")
    return f"concertina_memory_budget={args.concertina_memory_budget!r}"


def check_static_memory(cost: CostModel, layout: StageLayout, budgets: tuple[int, ...]) -> None:
    """Refuse, before the first step, a budget that a stage's parameters, gradients and optimizer
    state alone exceed (no plan could fit it)."""
    for stage, budget in enumerate(budgets):
        static = cost.static_memory(layout, stage)
        if budget and static >= budget:
            raise ValueError(
                f"concertina_memory_budget gives pipeline stage {stage} {budget / 2**30:.3g} GiB, but its layers "
                f"{layout.layer_ranges[stage][0]}-{layout.layer_ranges[stage][1] - 1} alone take "
                f"{static / 2**30:.3g} GiB (weights, gradients, optimizer state) before any activation; raise "
                "concertina_memory_budget (or concertina_memory_fraction with 'auto'), or use more pipeline stages "
                "(concertina_pipeline_size)"
            )


def initial_cost_model(args, config, device, dtype_bytes: int, device_memory: int) -> CostModel:
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
    spec = replace(base, memory_bytes=int(device_memory))
    # the activations as the run computes them: bf16 autocast over float32 weights (bf16=True),
    # attention by the kernel the runtime takes on the device
    compute = 2 if args.bf16 and dtype_bytes > 2 else dtype_bytes
    dtype = torch.bfloat16 if compute == 2 else torch.float32
    return CostModel.from_hf_config(config, spec, dtype_bytes=dtype_bytes, compute_dtype_bytes=compute,
                                    attention_kernel=attention_kernel_of(config, device, dtype))


def attention_kernel_of(config, device, dtype: torch.dtype) -> str:
    """The kernel the runtime's attention takes for ``config``'s model on ``device`` in ``dtype``
    (:data:`~concertina_hf.runtime.attention.KERNELS`): what the analytic cost model counts the
    saved tensors of (soft-capped scores and sinks run the eager formula where no kernel takes them)."""
    kind = str(getattr(config, "model_type", "") or "")
    cap = getattr(config, "attn_logit_softcapping", None) if kind in SOFTCAPPED_ATTENTION else None
    return choose_kernel(torch.device(device), dtype, softcap=cap, sink=kind in SINKS)


def _profile_on_rank0(model: nn.Module, args: ConcertinaTrainingArguments, base: CostModel,
                      topology: Topology) -> CostModel:
    """Rank 0 profiles the model before it is split; every rank gets the same cost model (the
    layout and the plans derive from it). The main process keeps it in ``cost_model.json``."""
    from ..runtime.profiler import profile_cost_model
    from ..runtime.router_aux import without_router_logits

    payload = None
    if topology.rank == 0:
        t0 = time.perf_counter()
        if args.bf16 and base.dtype_bytes > 2 and base.source == "analytic":
            # the profiler measures autocast's weight copies itself: the base without its count of them
            base = replace(base, static_bytes_per_param=base.static_bytes_per_param - 2)
        layers = -(-int(model.config.num_hidden_layers) // topology.pipeline_size)  # as many as a stage holds
        cap = args.concertina_max_tokens_per_chunk
        # chunk shapes up to the cap (at least 32 tokens, to make distinct shapes; None: the
        # profiler's device default), in the precision the run trains in (bf16 autocast halves
        # activations and K/V)
        # a model loaded by stage (parameters on the meta device): its first layers, read for the profile
        source = getattr(model, "_concertina_source", None)
        probe = source.prefix_model(layers) if source is not None else model
        try:
            with without_router_logits(probe, args.concertina_router_aux_loss is not None):  # times the layers only
                cost = profile_cost_model(probe, base=base, device=args.device, num_layers=layers,
                                          max_tokens=None if cap is None else max(32, cap),
                                          autocast_dtype=torch.bfloat16 if args.bf16 else None)
        except Exception as exc:  # a layer the profiler's probe cannot run: the analytic model still plans
            raise ValueError(f"concertina_cost_model='profiled': profiling model type "
                             f"{getattr(model.config, 'model_type', '?')!r} failed ({type(exc).__name__}: {exc}); "
                             "set concertina_cost_model='analytic'") from exc
        logger.info("profiled the cost model in %.1fs", time.perf_counter() - t0)
        payload = json.dumps(cost.to_dict())
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "cost_model.json"), "w") as fh:
            fh.write(payload)
    return CostModel.from_dict(json.loads(topology.broadcast_from_rank0(payload)))


def _profile_collectives(args: ConcertinaTrainingArguments, cost: CostModel, topology: Topology) -> CostModel:
    """The all-to-alls of one decoder layer timed on every stage's real sequence-parallel group
    and fitted into the cost model's intra-node latency and bandwidth (the slowest group's times:
    the same model on every rank), and, unless ``concertina_sequence_parallel_mode="ulysses"``,
    the per-doc K/V all-gather and reduce-scatter likewise (``all_gather_*``,
    ``reduce_scatter_*``); rank 0 rewrites ``cost_model.json``. Collective."""
    from ..runtime.ulysses import default_a2a_token_counts, profile_all_gather, profile_all_to_all

    t0 = time.perf_counter()
    tokens = default_a2a_token_counts(args.concertina_max_tokens_per_chunk, topology.sequence_parallel_size)
    cost = profile_all_to_all(cost, topology.sp_group, tokens, device=topology.comm_device)
    if args.sequence_parallel_mode != "ulysses":
        cost = profile_all_gather(cost, topology.sp_group, tokens, device=topology.comm_device)
    if topology.rank == 0:
        logger.info("profiled the all-to-all in %.1fs: latency %.1f us, bandwidth %.2f GB/s; all-gather %.1f us, "
                    "reduce-scatter %.1f us", time.perf_counter() - t0, cost.intra_node_latency_s * 1e6,
                    cost.intra_node_bandwidth / 1e9, cost.all_gather_latency_s * 1e6,
                    cost.reduce_scatter_latency_s * 1e6)
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "cost_model.json"), "w") as fh:
            fh.write(json.dumps(cost.to_dict()))
    return cost


def device_memory_bytes(device: torch.device, local_world_size: int) -> int:
    """A device's memory; on the CPU the machine's memory shared by the local processes."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        total = 16 * 2**30
    return int(total // max(1, local_world_size))


def ties_embeddings(model: nn.Module) -> bool:
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    return head is not None and head is embed


def count_frozen_parameters(cost: CostModel, model: nn.Module) -> CostModel:
    """The cost model with frozen parameters (a PEFT base model, a frozen embedding) holding only
    their weights: ``static_bytes_per_param`` assumes every parameter has a gradient and optimizer
    state (16 bytes with Adam); a frozen one keeps its ``element_size()`` bytes, plus what the
    model adds above 16 per parameter (autocast copies of the weights, see the profiler). The
    saving is spread over all parameters (one figure per model, not per stage)."""
    total = trainable = 0
    frozen_bytes = 0.0
    for p in model.parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen_bytes += p.numel() * p.element_size()
    if total == 0 or trainable == total:
        return cost
    extra = max(0.0, cost.static_bytes_per_param - 16.0)
    per_param = (frozen_bytes + (total - trainable) * extra + trainable * cost.static_bytes_per_param) / total
    return replace(cost, static_bytes_per_param=min(cost.static_bytes_per_param, per_param))


