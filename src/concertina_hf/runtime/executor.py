"""A faithful interpreter of a :class:`~concertina_hf.planning.plan.Plan` on one pipeline stage.

:meth:`PipelineExecutor.run_step` lowers the plan (:func:`~concertina_hf.planning.lower.lower`,
once per plan; the program is dry-run first, so a communication deadlock is refused before any
message is sent) and walks this stage's program in order, deciding nothing:

- ``F c``: take chunk ``c``'s hidden states received from the previous stage (stage 0: embed
  the chunk's tokens), run the stage's decoder layers with the first ``plan.recompute[stage][c]``
  of them checkpointed, and keep the result for its send (the last stage instead applies the
  final norm, the LM head and a float32 summed cross-entropy divided by ``num_items_in_batch``);
- ``B c``: take the gradient of the chunk's output received from the next stage (the last stage
  starts from its loss) and run ``torch.autograd.backward`` on the output *and* on the K/V that
  chunk's non-final slices stored, with the gradients later slices accumulated on the leaf
  aliases of that K/V (see :mod:`.attention`); keep the input gradient for its send; free the
  chunk's K/V. Received hidden states always require grad, so with frozen parameters (PEFT) the
  gradient still reaches every adapter and the previous stage; on stage 0 the tensors that
  depend on nothing trainable (a frozen embedding's output, the K/V of frozen projections
  before the first adapter) are left out of the backward;
- a batch of ``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``: one
  :meth:`~concertina_hf.runtime.p2p.StageComm.exchange` (shapes from the plan, the dtype from
  :meth:`PipelineExecutor.wire_dtype`), each message on its channel (activations and gradients
  of a neighbour pair on process groups of their own, so NCCL's rendezvous never holds a stage
  back: :mod:`.p2p`), returning once its receives have landed.

Gradients accumulate into ``.grad`` of the stage's parameters (never zeroed here) and equal
those of the HF model on one device over the same sequences with the same ``num_items_in_batch``
(token-weighted loss), whatever the chunking, schedule and recompute.

Mixed precision: ``run_step`` follows the caller's autocast (``torch.autocast``, which
``ConcertinaTrainer`` enters as accelerate does for ``Trainer``): forward actions run under it,
backward actions outside it (as HF's ``loss.backward()``; a checkpointed layer's replay restores
the forward's autocast state itself), and the attention casts query, key and value to the autocast
dtype (:mod:`.attention`), so stored K/V have one dtype. Messages between stages use
:meth:`PipelineExecutor.wire_dtype`, derived from the parameters' dtype and the autocast dtype on
both sides (float32 for float32 weights under bfloat16 autocast), never negotiated.

Sequence parallelism (``sp_group``, :mod:`.ulysses`): each rank of the stage runs its share of
every chunk's tokens (padded to a multiple of the group size) and the attention exchanges heads
for tokens with the group; received messages are ``[1, ceil(tokens / sp), hidden]``, the loss is
summed over the group, and each rank's gradients cover its tokens only until
:func:`~concertina_hf.runtime.distributed.reduce_gradients` sums them over the stage's ranks. A
placed chunk (:mod:`.context_parallel`) gives each rank its pieces instead: messages of
:func:`~concertina_hf.planning.sharding.rank_tokens` tokens, none at all for a chunk the rank
holds no token of (its program is :func:`~concertina_hf.planning.lower.rank_program`'s; it runs
the chunk on a pad token).

Tied input/output embeddings over several stages: each copy gets its own share of the gradient
here; :meth:`PipelineExecutor.sync_tied_gradients` sums them once per optimizer step.

The MoE router's load-balancing term (a wrapper with
:attr:`~concertina_hf.runtime.stage.PipelineWrapper.router_aux`, ``concertina_router_aux_loss``;
:mod:`.router_aux`): each training forward of chunk ``c`` computes this stage's layers' term over
the chunk's tokens, times ``tokens(c) / router_aux_tokens`` (the step's tokens by default), and
the chunk's backward runs it together with the output (the last stage adds it to the chunk's
loss), so each router's gradient comes from its own stage; :attr:`StepResult.router_aux_loss`
is this stage's share of the step's term. Sequence parallelism 1 only (a chunk's statistics
would be split over the stage's ranks).

Forwards draw dropout from the stage's own random stream (:class:`~concertina_hf.runtime.rng.StageRNG`,
swapped in around each forward action). Each action's result (a forward's output or chunk loss, a
backward's input gradient) is summed into a float32 scalar; the step reads them once at the end
and lists the actions whose sum was not finite in :attr:`StepResult.nonfinite` (the trainer's
:mod:`~concertina_hf.training.step_guard` decides what a non-finite step does).

Per step costs beyond compute: one P2P message per chunk and direction between neighbouring
stages (``[1, tokens, hidden]`` in :meth:`PipelineExecutor.wire_dtype`), and one 2-float
broadcast of the loss; lowering and dry-running a new plan take a few ms of CPU; one reduction
per action (the finiteness sums) and one device synchronization to read them. Measuring the
activation peak (``measure_memory``, on by default) costs on CPU one Python call per tensor
autograd saves (:class:`~concertina_hf.runtime.memory.SavedTensorMeter`'s hooks: 1.1% / 3.7% /
6.6% of a step of chunks of 1024 / 256 / 64 tokens on a 10M-parameter Llama,
``benchmarks/studies/runtime_overhead.py``);
a step run with ``measure_memory=False`` installs no hook, counts nothing and reports
``peak_activation_bytes=None``, its computation unchanged (the hooks return every saved tensor
as is). ``ConcertinaTrainer`` measures only the steps whose figure is used
(:meth:`~concertina_hf.training.callbacks.StepStatsCallback.wants_memory`).
Failures inside an action are logged with the program grid, the failing action marked, and
raised naming the stage, its rank and the action; a receive that times out (the process group's
timeout, ``ddp_timeout``) names the stage and rank it waited for.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..planning.lower import lower, rank_program
from ..planning.plan import Plan, Program
from ..planning.segments import check_segment_plan
from ..planning.sharding import earlier_slices, plan_placement_refusal, rank_tokens
from ..planning.dry_run import dry_run
from ..planning.types import Action, ActionKind, PlanError
from .attention import ChunkAttentionContext, KVStore, SliceSpec, autocast_dtype
from .memory import SavedTensorMeter
from .param_sharding import local_tensor
from .distributed import group_timeout, p2p_channels
from .p2p import TIED_GRAD_TAG, StageComm, activation_tag, gradient_tag
from .rng import StageRNG
from .stage import PipelineWrapper
from .context_parallel import EMPTY_RANK_TOKENS, ContextParallelContext
from .families import sequence_parallel_refusal as sp_refusal
from .ulysses import SequenceParallel

__all__ = ["PipelineExecutor", "StepResult"]

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one :meth:`PipelineExecutor.run_step` did on this stage.

    ``loss`` = ``loss_sum / num_items`` (the same on every pipeline rank); ``action_times``:
    ``(action, start, end)`` of the compute of each action of this stage, in seconds since the
    step started (communication waits before an action are outside its span);
    ``peak_activation_bytes``: measured peak of activation memory on this stage
    (:class:`~concertina_hf.runtime.memory.SavedTensorMeter`; ``None`` for a step run with
    ``measure_memory=False``); ``nonfinite``: the actions of this
    stage whose result held a NaN or an infinity (``"F3"``: the output, or on the last stage the
    loss, of chunk 3's forward; ``"B3"``: the gradient chunk 3's backward sends on), in the order
    they ran (empty when every value was finite).

    ``breakdown``: where this stage's ``wall_time_s`` went, in seconds: ``compute`` (the sum of
    the ``action_times`` spans), ``comm_wait`` (inside the message exchanges, the final drain of
    the sends and the loss broadcast: waiting for a neighbour, or for the transfer) and ``other``
    (the rest: Python between actions, buffer allocation, the finiteness check, the end of the
    step), so that ``compute + comm_wait + other == wall_time_s``. On CPU the three are disjoint
    spans of one clock; on CUDA ``compute`` is device time from events while the others are host
    time, so the parts may overlap and ``other`` is clipped at 0.
    """

    loss: float
    loss_sum: float
    num_items: int
    action_times: list[tuple[Action, float, float]] = field(default_factory=list)
    peak_activation_bytes: int | None = 0
    wall_time_s: float = 0.0
    nonfinite: list[str] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)
    #: this stage's share of the step's router load-balancing term (``coef`` and the chunks' token
    #: weights included; the step's term is the sum over stages); ``None`` without one
    router_aux_loss: float | None = None


class _Clock:
    """Wall clock on CPU; CUDA events on GPU (read once at the end of the step)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        if self.cuda:
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e0.record()

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter() - self.t0

    def seconds(self, mark) -> float:
        if self.cuda:
            return self.e0.elapsed_time(mark) / 1e3
        return mark


class PipelineExecutor:
    """Runs plans on this process's stage (see the module docstring).

    ``pp_group``: the pipeline ranks in stage order (group rank == stage); ``None``: the default
    group (rank == stage), or no process group at all for a single stage. ``device``: where
    activations live (default: the device of the stage's parameters). ``rng``: the stage's own
    random stream its forwards draw dropout from (:class:`~concertina_hf.runtime.rng.StageRNG`;
    default: seed 0, stream ``stage``). ``sp_group``: the ranks sharing this stage by Ulysses
    sequence parallelism (:mod:`.ulysses`; ``None`` or one rank: none); ``pp_group`` then links
    this rank to the same sequence-parallel rank of every stage. ``measure_memory``: whether
    :meth:`run_step` measures the activation peak when its own ``measure_memory`` is ``None``
    (see the module docstring for what it costs). ``channels``: this rank's P2P channels
    (:func:`~concertina_hf.runtime.distributed.p2p_channels`); ``None``: made here, which needs
    ``pp_group`` to span the job (with several pipelines every rank makes every pipeline's
    channels, in one collective call).
    """

    def __init__(self, wrapper: PipelineWrapper, pp_group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, rng: StageRNG | None = None,
                 sp_group: dist.ProcessGroup | None = None, measure_memory: bool = True,
                 channels: dict[int, tuple[Any, Any]] | None = None) -> None:
        self.wrapper = wrapper
        self.measure_memory = measure_memory
        self.layout = wrapper.layout
        self.stage = wrapper.stage
        self.num_stages = wrapper.layout.num_stages
        self.device = torch.device(device) if device is not None else wrapper.device
        self.comm: StageComm | None = None
        self.sp: SequenceParallel | None = None
        self._ulysses_refusal: str | None = None  # why Ulysses cannot split the heads (placed chunks still run)
        if sp_group is not None and dist.get_world_size(sp_group) > 1:
            if wrapper.router_aux is not None:
                raise ValueError(
                    "concertina_router_aux_loss='per_chunk' runs with sequence parallel size 1 only (each rank of a "
                    f"stage of {dist.get_world_size(sp_group)} would see its share of a chunk's tokens, not the "
                    "chunk's router statistics); set concertina_sequence_parallel_size=1 (with "
                    "concertina_layout='auto': concertina_pipeline_size x concertina_data_parallel_size = the "
                    "number of processes), or concertina_router_aux_loss=None")
            why = sp_refusal(wrapper.config, dist.get_world_size(sp_group))  # the mixers' and masks' (families.py)
            if why is not None:
                raise ValueError(why)
            self.sp = SequenceParallel(sp_group)
            try:
                self.sp.check_model(wrapper.config)
            except ValueError as exc:
                self._ulysses_refusal = str(exc)
        if self.num_stages > 1:
            if not dist.is_initialized():
                raise RuntimeError(
                    f"a {self.num_stages}-stage pipeline needs torch.distributed initialized "
                    "(or use a layout with one stage)"
                )
            group = pp_group if pp_group is not None else dist.group.WORLD
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            if size != self.num_stages:
                raise ValueError(f"the pipeline group has {size} ranks but the layout has {self.num_stages} stages")
            if rank != self.stage:
                raise ValueError(f"this process is rank {rank} of the pipeline group but wraps stage {self.stage}")
            if channels is None:
                if size != dist.get_world_size():
                    raise ValueError("a pipeline group smaller than the job needs its P2P channels passed in "
                                     "(channels=distributed.p2p_channels(every pipeline's ranks))")
                channels = p2p_channels([list(range(size))], timeout=group_timeout(group))
            self.comm = StageComm(group, self.stage, self.num_stages, channels)
            if dist.get_backend(group) == "nccl":
                # batched NCCL P2P must not be the first operation on a fresh communicator
                dist.barrier(group=group)
        self._checked_plan: Plan | None = None
        self._programs: dict[bool, Program] = {}  # of the checked plan, for training and evaluation
        self.rng = rng if rng is not None else StageRNG(0, self.stage, self.device)
        # a sharded parameter (concertina_shard_parameters): this rank's shard
        excluded = [local_tensor(p) for p in wrapper.parameters()] + [b for b in wrapper.buffers()]
        self.meter = SavedTensorMeter(exclude=excluded, device=self.device)

    def wire_dtype(self, amp: torch.dtype | None = None) -> torch.dtype:
        """The dtype of the hidden states and their gradients between stages, derived on both
        sides without a handshake: the parameters' dtype, promoted with the autocast dtype
        ``amp`` (``None``: autocast off).

        The residual stream of a decoder starts as the embedding's output (parameter dtype) and
        adds the outputs of matmuls (autocast dtype under autocast), so it is the promotion of the
        two: float32 for float32 weights under bfloat16 autocast, bfloat16 for bfloat16 weights.
        A stage output of another dtype is cast to this one before it is sent (lossless when
        it is narrower).
        """
        base = self.wrapper.dtype
        return base if amp is None else torch.promote_types(base, amp)

    def sync_tied_gradients(self) -> None:
        """Sum the gradients of the two copies of tied input/output embeddings (first and last
        stage, see :class:`~concertina_hf.runtime.stage.PipelineWrapper`), so that both copies
        take the same optimizer step.

        Call it once per optimizer step, after the step's last :meth:`run_step` (and after any
        data-parallel reduction) and before clipping: ``run_step`` leaves each copy with its own
        share, and summing twice would double count. Every pipeline rank may call it; only the
        first and the last stage exchange their gradient (one ``vocab x hidden`` message each
        way), and each adds the other's to its own, so the two sums are equal bit for bit.
        """
        weight = self.wrapper.tied_weight
        if weight is None or self.comm is None or not weight.requires_grad:  # frozen: same on both stages
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        other = self.num_stages - 1 if self.stage == 0 else 0
        # returns once the send is done too: it reads weight.grad, which the sum below overwrites
        weight.grad.add_(self.comm.swap(weight.grad, other, TIED_GRAD_TAG))

    # ------------------------------------------------------------------ checks
    def _check(self, plan: Plan, input_ids: Sequence[torch.Tensor], labels: Sequence[torch.Tensor] | None) -> None:
        if plan is not self._checked_plan:
            self._check_plan(plan)
            self._checked_plan = plan
            self._programs = {}
        if len(input_ids) != len(plan.seq_lens):
            raise ValueError(f"the plan covers {len(plan.seq_lens)} sequences, got {len(input_ids)} input_ids")
        for i, (ids, n) in enumerate(zip(input_ids, plan.seq_lens)):
            if ids.dim() != 1 or ids.shape[0] != n:
                raise ValueError(f"input_ids[{i}] has shape {tuple(ids.shape)}, the plan says [{n}]")
        if labels is not None:
            if len(labels) != len(input_ids):
                raise ValueError(f"{len(labels)} labels for {len(input_ids)} sequences")
            for i, (lab, ids) in enumerate(zip(labels, input_ids)):
                if lab.shape != ids.shape:
                    raise ValueError(f"labels[{i}] has shape {tuple(lab.shape)}, input_ids[{i}] {tuple(ids.shape)}")

    def _check_plan(self, plan: Plan) -> None:
        plan.validate()
        if plan.layout != self.layout:
            raise PlanError(
                f"the plan was made for stage layout {plan.layout.layer_ranges} but this pipeline runs "
                f"{self.layout.layer_ranges}; plan with the wrapper's layout"
            )
        if check_segment_plan(plan) is not None and self.sp is not None:
            raise PlanError("segment-level training (plan knob segment_tokens) runs with sequence parallelism 1 "
                            "only: neither Ulysses nor the whole-doc / per-doc placements carry the segment K/V "
                            "tail or the detached older K/V")
        if self.sp is not None:
            why = plan_placement_refusal(plan, self.sp.size)
            if why is not None:
                raise PlanError(f"the plan's whole-doc / per-doc placements cannot run on this stage's "
                                f"{self.sp.size} sequence-parallel ranks: {why}")
            if self.wrapper.family.linear_attention and any(c.placement for c in plan.chunks):
                raise PlanError("whole-doc / per-doc placed chunks are not implemented for linear-attention (Gated "
                                "DeltaNet) layers (a placed chunk would need the recurrent state passed between the "
                                "stage's ranks); set concertina_sequence_parallel_mode='ulysses'")
            if self._ulysses_refusal is not None and any(not c.placement for c in plan.chunks):
                raise PlanError(f"{self._ulysses_refusal}; or plan every chunk whole-doc / per-doc "
                                "(concertina_sequence_parallel_mode='context'), which has no head-count rule")

    def _program(self, plan: Plan, train: bool) -> Program:
        """The checked plan lowered (this sequence-parallel rank's copy: without the messages of
        the placed chunks it holds no token of, :func:`~concertina_hf.planning.lower.rank_program`),
        and dry-run once (every rank checks the whole program)."""
        program = self._programs.get(train)
        if program is None:
            program = lower(plan, train=train)
            if self.sp is not None:
                program = rank_program(program, self.sp.size, self.sp.rank)
            program = self._programs[train] = program
            dry_run(program)
        return program

    # ------------------------------------------------------------------ step
    def run_step(self, plan: Plan, input_ids: Sequence[torch.Tensor], labels: Sequence[torch.Tensor] | None = None,
                 num_items_in_batch: int | None = None, train: bool = True,
                 on_logits: Callable[[Sequence[SliceSpec], torch.Tensor], None] | None = None,
                 measure_memory: bool | None = None, router_aux_tokens: int | None = None) -> StepResult:
        """Execute this stage's part of ``plan`` (see the module docstring).

        ``router_aux_tokens``: with the wrapper's router term, the token count a chunk's share is
        taken of (``None``: the plan's tokens; the trainer passes the step's over the replicas when
        the loss is normalised over them).

        ``measure_memory``: measure this step's activation peak (``None``: the executor's
        :attr:`measure_memory`); without it ``StepResult.peak_activation_bytes`` is ``None`` and
        the step installs no saved-tensor hook (the same computation, cheaper on CPU).

        ``on_logits(slices, logits)``: called on the last stage after each chunk's forward with the
        chunk's slices and its detached ``[1, tokens, vocab]`` logits (``slices[i].offset`` is where
        slice ``i`` starts in them), so a caller keeps what it needs of them chunk by chunk. With
        sequence parallelism the ranks' token shards are gathered over the stage's ``sp`` group
        first (every rank of the last stage gets the whole chunk's logits, in token order), unless
        the hook has a true ``takes_sp_shards``: then it gets ``(slices, local logits [1, t,
        vocab], sp)`` (this rank's tokens ``[sp.rank * t, (sp.rank + 1) * t)`` of the chunk, padded)
        and gathers what it keeps itself (collectively over ``sp.group``)."""
        self._check(plan, input_ids, labels)
        if labels is None:
            labels = input_ids
        if num_items_in_batch is None:
            num_items_in_batch = int(sum(int((lab[1:] != -100).sum()) for lab in labels))
        divisor = float(max(num_items_in_batch, 1))
        dev, st = self.device, self.stage
        # The caller's autocast state (Trainer: accelerator.autocast()) is the forward's; backward
        # actions run outside autocast, like HF's loss.backward() (checkpoint replays restore the
        # forward's state themselves).
        amp = autocast_dtype(dev.type)
        wire_dtype = self.wire_dtype(amp)
        metered = self.measure_memory if measure_memory is None else bool(measure_memory)
        meter = self.meter if metered else _NO_METER
        step = _Step(self, plan, input_ids, labels, divisor, train, on_logits, meter, router_aux_tokens)
        program = self._program(plan, train)
        msg_steps = _message_steps(program) if self.comm is not None and self.comm.needs_release else None
        self._release_horizon: dict[int, int] = {}  # peer stage -> its latest step known posted
        self.meter.release_all()  # what a failed step left held
        meter.reset()
        clock = _Clock(dev)
        times: list[tuple[Action, object, object]] = []
        comm_s = 0.0  # host time inside exchanges, the drain and the loss broadcast
        received: dict[tuple[ActionKind, int], torch.Tensor] = {}  # (RECV_F / RECV_B, chunk) -> message
        to_send: dict[tuple[ActionKind, int], torch.Tensor] = {}  # (SEND_F / SEND_B, chunk) -> message
        with meter, torch.set_grad_enabled(train):
            for actions in program.steps[st]:
                action = actions[0]
                t_wait = time.perf_counter()
                try:
                    if action.kind.is_compute:
                        c = action.chunk
                        fwd = action.kind is ActionKind.FORWARD
                        buf = received.pop((ActionKind.RECV_F if fwd else ActionKind.RECV_B, c), None)
                        # a placed chunk this sp rank holds no token of: run on a pad token
                        # (.context_parallel), zeros in, nothing out (rank_program: no message)
                        empty = c in program.silent
                        if empty and (st > 0 if fwd else st < self.num_stages - 1):
                            width = self.wrapper.in_width if fwd else self.wrapper.out_width
                            buf = torch.zeros((1, EMPTY_RANK_TOKENS, width), dtype=wire_dtype, device=dev)
                        t_start = clock.mark()
                        if fwd:
                            out = step.forward(c, buf)
                        elif amp is None:
                            out = step.backward(c, buf)
                        else:
                            with torch.autocast(dev.type, enabled=False):
                                out = step.backward(c, buf)
                        if out is not None and not empty:
                            to_send[(ActionKind.SEND_F if fwd else ActionKind.SEND_B, c)] = out
                        times.append((action, t_start, clock.mark()))
                    else:
                        self._exchange(plan, actions, received, to_send, wire_dtype, msg_steps)
                        comm_s += time.perf_counter() - t_wait
                except Exception as exc:
                    logger.error("%s failed in %s:\n%s", self._where(), _label(actions), program.grid(mark=actions))
                    raise RuntimeError(self._failure(actions, time.perf_counter() - t_wait, exc)) from exc
            if self.comm is not None:
                t_wait = time.perf_counter()
                try:
                    self.comm.drain()
                    comm_s += time.perf_counter() - t_wait
                except Exception as exc:
                    raise RuntimeError(f"{self._where()} failed after {time.perf_counter() - t_wait:.1f} s "
                                       f"waiting for the step's sends to complete: {exc}") from exc
        if to_send:
            raise RuntimeError(f"pipeline stage {st}: the program never sends {[f'{st}{k.value}{c}' for k, c in to_send]}")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # the events of the action clock must have completed
        peak = meter.peak_bytes
        meter.release_all()
        nonfinite = step.nonfinite_actions()
        loss_sum = step.loss_sum
        if self.sp is not None:  # each sequence-parallel rank holds the loss of its own tokens
            loss_sum = self.sp.all_reduce_sum(loss_sum)
        if self.comm is not None:
            # the loss lives on the last stage; every rank reports it
            t = torch.stack([loss_sum, torch.tensor(float(num_items_in_batch), device=dev)])
            t_wait, last = time.perf_counter(), self.num_stages - 1
            try:
                self.comm.broadcast_from(t, last)
                comm_s += time.perf_counter() - t_wait
            except Exception as exc:
                raise RuntimeError(f"{self._where()} failed after {time.perf_counter() - t_wait:.1f} s waiting for "
                                   f"the step's loss from stage {last} (rank {self.comm.rank_of(last)}): {exc}") from exc
            loss_sum = t[0]
        loss_sum_f = float(loss_sum)
        action_times = [(a, clock.seconds(s), clock.seconds(e)) for a, s, e in times]
        wall = time.perf_counter() - clock.t0
        compute_s = sum(e - s for _, s, e in action_times)
        return StepResult(
            loss=loss_sum_f / divisor,
            loss_sum=loss_sum_f,
            num_items=int(num_items_in_batch),
            action_times=action_times,
            peak_activation_bytes=None if peak is None else int(peak),
            wall_time_s=wall,
            nonfinite=nonfinite,
            breakdown={"compute": compute_s, "comm_wait": comm_s,
                       "other": max(0.0, wall - compute_s - comm_s) if clock.cuda else wall - compute_s - comm_s},
            router_aux_loss=float(step.aux_sum) if step.aux_tokens is not None else None,
        )

    def _where(self) -> str:
        rank = self.comm.rank_of(self.stage) if self.comm is not None else 0
        return f"pipeline stage {self.stage} (rank {rank})"

    def _failure(self, actions: Sequence[Action], seconds: float, exc: Exception) -> str:
        """What failed, for every rank's log: the stage and rank, the action, and for a batch of
        messages the receives it was waiting for and from whom (a timeout names the stalled peer)."""
        recvs = [a for a in actions if a.kind.is_recv]
        if not recvs or self.comm is None:
            rank = self.comm.rank_of(self.stage) if self.comm is not None else 0
            return f"pipeline stage {self.stage}, action {_label(actions)} (rank {rank}): {exc}"
        peers = sorted({a.peer for a in recvs})
        sources = ", ".join(f"stage {p} (rank {self.comm.rank_of(p)})" for p in peers)
        return (f"{self._where()} failed after {seconds:.1f} s in {_label(actions)} waiting for "
                f"{'+'.join(map(str, recvs))} from {sources}: {exc}")

    def _exchange(self, plan: Plan, actions: Sequence[Action], received: dict, to_send: dict,
                  wire_dtype: torch.dtype, msg_steps: dict | None = None) -> None:
        """One batch of messages: sends of what a compute action left in ``to_send``, receives
        into fresh ``[1, tokens, hidden]`` buffers left in ``received``. With ``msg_steps``
        (:func:`_message_steps`; gloo), the sends whose receive the peer has posted by now are
        waited for and dropped (:meth:`StageComm.release`): their buffers (a stage output, an
        input gradient) are not kept until the step's end."""
        sends, recvs, keys = [], [], []
        for a in actions:
            c = a.chunk
            tag = activation_tag(c) if a.kind in (ActionKind.SEND_F, ActionKind.RECV_F) else gradient_tag(c)
            if a.kind.is_send:
                sends.append(self.comm.send_op(to_send.pop((a.kind, c)).to(wire_dtype), a.peer, tag))
                if msg_steps is not None:  # the peer's step that posts this message's receive
                    keys.append((a.peer, msg_steps.get((a.peer, _MATCH[a.kind], c), -1)))
            else:
                # this rank's tokens of the chunk: all, Ulysses' even share, or its placed pieces
                tokens = plan.chunks[c].num_tokens if self.sp is None else rank_tokens(plan.chunks[c], self.sp.size,
                                                                                       self.sp.rank)
                # the hidden states (and Gemma 4's per-layer inputs: PipelineWrapper.in_width / out_width)
                shape = (1, tokens, self.wrapper.in_width if a.kind is ActionKind.RECV_F else self.wrapper.out_width)
                buf = received[(a.kind, c)] = torch.empty(shape, dtype=wire_dtype, device=self.device)
                recvs.append(self.comm.recv_op(buf, a.peer, tag))
        self.comm.exchange(sends, recvs, keys if msg_steps is not None else None)
        if msg_steps is None or not recvs:
            return
        # a message that arrived was sent in the peer's step j: the peer has posted every
        # receive of its steps up to j
        horizon = self._release_horizon
        for a in actions:
            if not a.kind.is_send:
                j = msg_steps.get((a.peer, _MATCH[a.kind], a.chunk), -1)
                horizon[a.peer] = max(horizon.get(a.peer, -1), j)
        self.comm.release(lambda k: k[1] <= horizon.get(k[0], -1))


class _NoMeter:
    """The meter of a step run with ``measure_memory=False``: installs no hook, counts nothing."""

    peak_bytes = None

    def __enter__(self) -> "_NoMeter":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def reset(self) -> None:
        pass

    def hold(self, tag, *tensors) -> None:
        pass

    def release(self, tag) -> None:
        pass

    def release_all(self) -> None:
        pass


_NO_METER = _NoMeter()

_MATCH = {ActionKind.SEND_F: ActionKind.RECV_F, ActionKind.RECV_F: ActionKind.SEND_F,
          ActionKind.SEND_B: ActionKind.RECV_B, ActionKind.RECV_B: ActionKind.SEND_B}


def _message_steps(program: Program) -> dict[tuple[int, ActionKind, int], int]:
    """``(stage, message kind, chunk) -> index of the stage's program step`` that posts it."""
    return {(st, a.kind, a.chunk): j for st, steps in enumerate(program.steps)
            for j, step in enumerate(steps) for a in step if not a.kind.is_compute}


def _label(actions: Sequence[Action]) -> str:
    return "+".join(map(str, actions))


class _Step:
    """The state of one step on one stage, and the two computations of an action.

    ``forward`` / ``backward`` take the received message (``None`` where there is none) and
    return the tensor to send on (``None`` where nothing is sent).
    """

    def __init__(self, ex: PipelineExecutor, plan: Plan, input_ids: Sequence[torch.Tensor],
                 labels: Sequence[torch.Tensor], divisor: float, train: bool,
                 on_logits: Callable[[Sequence[SliceSpec], torch.Tensor], None] | None = None,
                 meter: "SavedTensorMeter | _NoMeter | None" = None, router_aux_tokens: int | None = None) -> None:
        self.w = w = ex.wrapper
        self.on_logits = on_logits
        self.meter = ex.meter if meter is None else meter
        self.plan = plan
        self.train = train
        self.divisor = divisor
        self.device = dev = ex.device
        self.recompute = plan.recompute[ex.stage]
        self.sp = ex.sp  # Ulysses: this rank's share of each chunk's tokens, padded (.ulysses)
        self.slices = [
            [SliceSpec(s.seq, s.start, s.length, off, s.end == plan.seq_lens[s.seq])
             for s, off in zip(c.slices, _offsets([s.length for s in c.slices]))]
            for c in plan.chunks
        ]
        self.ids = [t.to(dev) for t in input_ids] if w.is_first else None
        self.labels = [t.to(dev) for t in labels] if w.is_last else None
        seg = check_segment_plan(plan)  # segment-level training: the objective is in the plan's knobs
        self.store = KVStore() if seg is None else KVStore(seg.gradient, seg.kv_tail, seg.global_heads)
        self.backwarded: set[tuple[int, int]] = set()  # (seq, start) of slices run backward
        self.inputs: dict[int, torch.Tensor] = {}  # received activations, for their gradient
        self.outputs: dict[int, torch.Tensor] = {}  # stage outputs (last stage: loss), for backward
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        # the router load-balancing term (training only): the token count chunk shares are taken of,
        # this stage's sum, and each chunk's term until its backward (the last stage adds it to the loss)
        self.aux_tokens = None if w.router_aux is None or not train else float(
            max(1, router_aux_tokens if router_aux_tokens is not None else sum(plan.seq_lens)))
        self.aux_sum = torch.zeros((), dtype=torch.float32, device=dev)
        self.aux: dict[int, torch.Tensor] = {}
        self.rng = ex.rng
        # (action label, float32 sum of what it produced): a NaN or an infinity anywhere makes the
        # sum non-finite; read once at the end of the step (no synchronization per action)
        self.sums: list[tuple[str, torch.Tensor]] = []

    def nonfinite_actions(self) -> list[str]:
        """The actions whose result was not finite, in the order they ran (one device sync)."""
        if not self.sums:
            return []
        ok = torch.isfinite(torch.stack([t for _, t in self.sums])).tolist()
        return [label for (label, _), good in zip(self.sums, ok) if not good]

    def forward(self, c: int, received: torch.Tensor | None) -> torch.Tensor | None:
        with self.rng.active():  # the stage's own dropout stream (see .rng)
            return self._forward(c, received)

    def _forward(self, c: int, received: torch.Tensor | None) -> torch.Tensor | None:
        w, meter, train, slices = self.w, self.meter, self.train, self.slices[c]
        placed = self.sp is not None and bool(self.plan.chunks[c].placement)
        if placed:  # whole-doc / per-doc: this rank's pieces of the chunk (.context_parallel)
            chunk = self.plan.chunks[c]
            ctx = ContextParallelContext(chunk, slices, self.store, self.device, train, self.sp,
                                         earlier_slices(self.plan, chunk))
        else:
            ctx = ChunkAttentionContext(slices, self.store, self.device, requires_grad=train)
            if self.sp is not None:
                ctx = self.sp.context(ctx)
        local = ctx.pieces if placed else slices  # (position, length) of this rank's tokens
        if w.is_first:
            ids = torch.cat([self.ids[s.seq][s.start:s.start + s.length] for s in local]
                            or [self.ids[0][:EMPTY_RANK_TOKENS]])  # an empty rank's pad token (.context_parallel)
            x = w.embed(ids if self.sp is None or placed else self.sp.shard(ids, 0))
        else:
            x = received.requires_grad_(train)
            if train:
                self.inputs[c] = x
                meter.hold(("in", c), x)
        routers: list[torch.Tensor] | None = [] if self.aux_tokens is not None else None
        y = w.run_layers(x, ctx, self.recompute[c] if train else 0, router_logits=routers)
        aux = None
        if routers:  # this stage's MoE layers on the chunk, weighted by its token share of the step
            aux = w.router_aux_loss(routers) * (self.plan.chunks[c].num_tokens / self.aux_tokens)
            self.aux_sum += aux.detach()
        del routers
        for s in slices:
            if not s.final:
                meter.hold(("kv", s.seq, s.start), *[t for e in self.store.entries(s.seq, s.start) for t in (e.k, e.v)])
        if not train:
            for s in slices:
                if s.final and s.start > 0:  # the sequence's last slice: its K/V has served
                    self.store.free_seq(s.seq)
                    for _, earlier in self.plan.slices_of(s.seq):
                        meter.release(("kv", s.seq, earlier.start))
                elif self.store.kv_tail is not None and s.start > 0:  # K/V no later slice's tail reaches
                    reach = s.start + s.length - self.store.kv_tail
                    self.store.drop_before(s.seq, reach)
                    for _, earlier in self.plan.slices_of(s.seq):
                        if earlier.end <= reach:
                            meter.release(("kv", s.seq, earlier.start))
        if w.is_last:
            targets = torch.cat([_targets(self.labels[s.seq], s) for s in local]
                                or [self.labels[0].new_full((EMPTY_RANK_TOKENS,), -100)])  # the pad has no target
            if self.sp is not None and not placed:
                targets = self.sp.shard(targets, -100)
            if self.on_logits is None:
                chunk_loss = w.head_loss_sum(y, targets)
            else:  # the same loss, the logits handed to the caller on the way
                logits = w.head_logits(y)
                chunk_loss = w.loss_sum(logits, targets)
                logits = logits.detach()
                if self.sp is None:
                    self.on_logits(slices, logits)
                elif placed:  # every sp rank: the whole chunk's logits, the pieces put back in token order
                    self.on_logits(slices, ctx.gather_tokens(logits))
                elif getattr(self.on_logits, "takes_sp_shards", False):  # the hook gathers what it keeps
                    self.on_logits(slices, logits, self.sp)
                else:  # every sp rank: the whole chunk's logits, in token order
                    self.on_logits(slices, self.sp.gather_tokens(logits, sum(s.length for s in slices)))
                del logits
            self.loss_sum += chunk_loss.detach()
            self.sums.append((f"F{c}", chunk_loss.detach().float()))
            if train:
                self.outputs[c] = chunk_loss / self.divisor if aux is None else chunk_loss / self.divisor + aux
            return None
        if train:
            self.outputs[c] = y
            meter.hold(("out", c), y)
            if aux is not None:
                self.aux[c] = aux
        self.sums.append((f"F{c}", y.detach().sum(dtype=torch.float32)))
        return y.detach()

    def backward(self, c: int, received: torch.Tensor | None) -> torch.Tensor | None:
        w, meter, store, slices = self.w, self.meter, self.store, self.slices[c]
        out = self.outputs.pop(c)
        # the chunk's output, and the K/V of its non-final slices with what later slices sent them
        tensors, grads = [out], [None if received is None else received.to(out.dtype)]
        if received is not None:
            meter.hold(("grad", c), received)
        aux = self.aux.pop(c, None)
        if aux is not None:  # this stage's router term of the chunk, into its own layers' routers
            tensors.append(aux)
            grads.append(torch.ones_like(aux))
        del aux
        for s in slices:
            if s.final:
                continue
            for e in store.entries(s.seq, s.start):
                for t, leaf in ((e.k, e.k_leaf), (e.v, e.v_leaf)):
                    if leaf.grad is not None:
                        tensors.append(t)
                        grads.append(leaf.grad)
        # With frozen parameters (PEFT: a frozen embedding, adapters only in some layers) a tensor
        # of stage 0 may not depend on anything trainable: its gradient has nowhere to go. Later
        # stages' inputs always require grad, so their gradient still reaches the previous stage.
        keep = [i for i, t in enumerate(tensors) if t.requires_grad]
        if keep:
            torch.autograd.backward([tensors[i] for i in keep], [grads[i] for i in keep])
        del tensors, grads, out
        if store.gradient == "none":  # segment-level training: free the K/V every reader has run backward with
            self._free_read_kv(slices)
        for s in slices:
            if not s.final and store.gradient != "none":  # every later slice has run backward: this K/V is done
                store.free_slice(s.seq, s.start)
                meter.release(("kv", s.seq, s.start))
                meter.release(("kvgrad", s.seq, s.start))
        meter.release(("out", c))
        # what this backward accumulated on earlier slices' K/V lives until their own backward
        for s in slices:
            for earlier, e in store.entries_before(s.seq, s.start):
                meter.hold(("kvgrad", s.seq, earlier), e.k_leaf.grad, e.v_leaf.grad)
        result = None
        if not w.is_first:
            x = self.inputs.pop(c)
            result = x.grad
            meter.release(("in", c))
            if result is not None:
                self.sums.append((f"B{c}", result.sum(dtype=torch.float32)))
        meter.release(("grad", c))
        return result

    def _free_read_kv(self, slices: Sequence[SliceSpec]) -> None:
        """Segment gradient ``"none"``: slices backward in any order, so a slice's (detached) K/V
        is freed once every slice that reads it (itself and the later ones its K/V tail reaches:
        their forward, and the replay of checkpointed layers in their backward) has run backward;
        the global heads' share of it once every slice of the sequence has."""
        done = self.backwarded
        tail = self.store.kv_tail
        for s in slices:
            done.add((s.seq, s.start))
            chain = [sl for _, sl in self.plan.slices_of(s.seq)]
            if all((s.seq, r.start) in done for r in chain):  # the global heads' K/V too
                self.store.free_seq(s.seq)
            for j, e in enumerate(chain[:-1]):
                readers = [r for r in chain[j:] if r is e or tail is None or r.start - tail < e.end]
                if all((s.seq, r.start) in done for r in readers):
                    self.store.retire(s.seq, e.start)
                    self.meter.release(("kv", s.seq, e.start))


def _offsets(lengths: Sequence[int]) -> list[int]:
    out, t = [], 0
    for n in lengths:
        out.append(t)
        t += n
    return out


def _targets(labels: torch.Tensor, s: SliceSpec) -> torch.Tensor:
    """Target of token ``t`` is ``labels[t + 1]`` of the same sequence; -100 after its last token."""
    tgt = labels[s.start + 1:s.start + s.length + 1]
    if tgt.shape[0] < s.length:
        tgt = torch.cat([tgt, tgt.new_full((s.length - tgt.shape[0],), -100)])
    return tgt
