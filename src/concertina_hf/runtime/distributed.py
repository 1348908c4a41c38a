"""Where a rank sits, and every collective the trainer runs: the one module that owns process groups.

Ranks form a :class:`~torch.distributed.device_mesh.DeviceMesh` with named dimensions, outermost
first: ``("dp", "pp", "sp")``, ``rank = (replica * pipeline_size + stage) * sp_size + sp_rank``:
the ``sp`` ranks of one stage (Ulysses sequence parallelism, :mod:`.ulysses`: the GPUs of
one node) are consecutive, then the stages of one pipeline, then the replicas. A ``pp`` group
links the same ``sp`` rank of every stage of a replica (its point-to-point traffic); the
gradients of a stage are reduced over its ``dp x sp`` ranks (:attr:`Topology.grad_group`, one
extra group per stage when both sizes exceed 1). Callers ask for a group by name
(:meth:`Topology.group`). Nothing else in the package creates a process group.

Collectives (all no-ops with one process, each a few lines over ``torch.distributed``):

- :func:`reduce_gradients`: each stage's gradients summed over its ``sp`` ranks and summed (or
  averaged) over the replicas, in flat buckets of at most :data:`BUCKET_ELEMENTS` per dtype
  (bounded extra memory, few calls);
- :func:`global_grad_norm`: the 2-norm over every stage's gradients (squared norms summed over
  the pipeline), the quantity ``clip_grad_norm_`` would compute on the whole model;
- :meth:`Topology.all_reduce_replicas`, :meth:`Topology.all_gather_replicas`: counts, losses and
  evaluation values over the replicas;
- :meth:`Topology.broadcast_in_pipeline`, :meth:`Topology.gather_in_pipeline`,
  :meth:`Topology.broadcast_from_rank0`: small Python objects (plans, statistics, cost models);
- :meth:`Topology.sync_weights_from_rank0`: at construction, rank 0's weights wherever a
  process's differ (what ``DistributedDataParallel`` does for ``Trainer``; a checksum compare
  when they are the same);
- :meth:`Topology.numbers_of_every_rank`, :meth:`Topology.objects_of_every_rank`: a number (one
  all-reduce of ``world_size`` floats) or an object of every rank of the job, on every rank (the
  step's verdict on non-finite values, which all ranks must reach together).

Collectives run on :attr:`Topology.comm_device`: the device itself with NCCL, the CPU otherwise.

Timeouts: every group of the mesh is created with the run's ``ddp_timeout``
(:attr:`Topology.timeout`), and the default group (which ``TrainingArguments`` leaves at torch's
30 minutes on CPU) is set to it too, so a stalled or dead peer makes each waiting rank raise
within ``ddp_timeout`` seconds instead of hanging the job.

Failing together: an exception that leaves :meth:`Topology.failing_together` (the trainer wraps
every public call that may run a collective in it, through :func:`fails_together`) sets an abort flag in the job's rendezvous store
with its message; a daemon thread on every rank polls the flag every :data:`ABORT_POLL_S`
seconds and ends its process with status 1 after printing that message, so no rank waits for a
peer that gave up, even when the user catches the exception on the failing rank (that rank ends
too, :data:`ABORT_GRACE_S` seconds later, if it has not exited by itself). The cost: one store
lookup per rank every :data:`ABORT_POLL_S` seconds. A refusal that every rank raises alike, at the
same point (a verdict broadcast from rank 0, marked with :func:`on_every_rank`), raises no flag: no
rank is left waiting, so a user who catches it on every rank may go on.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ABORT_GRACE_S", "ABORT_POLL_S", "BUCKET_ELEMENTS", "MESH_DIMS", "Topology", "fails_together",
           "global_grad_norm", "launched_world_size", "on_every_rank", "reduce_gradients"]

logger = logging.getLogger(__name__)

# outermost first; a new dimension goes innermost (after "pp") and is built in Topology.build
MESH_DIMS = ("dp", "pp", "sp")
# gradient all-reduce bucket: 32M elements (128 MB of float32) of extra memory at most
BUCKET_ELEMENTS = 32 * 2**20
# how often each rank looks for another rank's abort flag, and how long a rank whose own failure
# was caught (by the user) may go on before it ends too
ABORT_POLL_S = 0.5
ABORT_GRACE_S = 5.0
_ABORT_KEY = "concertina/abort"


@dataclass
class Topology:
    """This rank's place in the ``dp x pp x sp`` mesh
    (``rank = (replica * pipeline_size + stage) * sequence_parallel_size + sp_rank``).

    ``mesh``: the :class:`DeviceMesh` (``None`` with a single process); ``pp_group`` / ``pp_ranks``:
    the ranks of this rank's pipeline in stage order (same ``sp_rank``); ``dp_group`` /
    ``dp_ranks``: the ranks holding the same stage and ``sp_rank`` in every replica; ``sp_group``
    / ``sp_ranks``: the ranks sharing this stage's chunks (Ulysses); ``grad_group``: the ``dp x
    sp`` ranks of this stage, over which its gradients are reduced; ``p2p_channels``: this
    rank's point-to-point channels to its neighbour stages (:func:`p2p_channels`); ``timeout``:
    how long any receive or collective waits for a peer (``ddp_timeout``).
    """

    world_size: int
    rank: int
    pipeline_size: int
    data_parallel_size: int
    stage: int
    replica: int
    mesh: Any = None
    pp_group: Any = None
    dp_group: Any = None
    pp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)
    timeout: timedelta = timedelta(minutes=30)
    sequence_parallel_size: int = 1
    sp_rank: int = 0
    sp_group: Any = None
    sp_ranks: tuple[int, ...] = (0,)
    grad_group: Any = None
    p2p_channels: Any = None

    @classmethod
    def build(cls, *, pp: int, dp: int = 1, sp: int = 1, timeout: timedelta = timedelta(minutes=30)) -> "Topology":
        """The ``dp x pp x sp`` mesh of the launched job (collective: every rank calls it, once).

        The sizes are plain numbers that the caller resolved (the trainer, from its arguments);
        their product must be the number of processes. ``timeout``: how long any receive or
        collective waits for a peer."""
        world = launched_world_size()
        if dp * pp * sp != world:
            raise ValueError(f"a mesh of dp={dp} x pp={pp} x sp={sp} = {dp * pp * sp} processes, but {world} were "
                             "launched")
        initialized = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if initialized else 0
        (replica, stage), sp_rank = divmod(rank // sp, pp), rank % sp
        topo = cls(world, rank, pp, dp, stage, replica, timeout=timeout, sequence_parallel_size=sp, sp_rank=sp_rank)
        if initialized:
            topo.mesh = _mesh_with_timeout((dp, pp, sp), topo.timeout)
            _AbortWatch.start(rank)
            topo.pp_group, topo.dp_group, topo.sp_group = topo.group("pp"), topo.group("dp"), topo.group("sp")
            topo.pp_ranks = tuple(int(r) for r in topo.mesh["pp"].mesh.tolist())
            topo.dp_ranks = tuple(int(r) for r in topo.mesh["dp"].mesh.tolist())
            topo.sp_ranks = tuple(int(r) for r in topo.mesh["sp"].mesh.tolist())
            topo.grad_group = _stage_groups(dp, pp, sp, topo) if dp > 1 and sp > 1 else (
                topo.sp_group if sp > 1 else topo.dp_group)
            if pp > 1:  # every pipeline: one lane per replica and sequence-parallel rank
                lanes = [[(d * pp + s) * sp + r for s in range(pp)] for d in range(dp) for r in range(sp)]
                topo.p2p_channels = p2p_channels(lanes, topo.timeout)
        return topo

    @property
    def grad_ranks(self) -> tuple[int, ...]:
        """The ``dp x sp`` ranks holding this stage (its gradients are reduced over them)."""
        sp, pp = self.sequence_parallel_size, self.pipeline_size
        return tuple((d * pp + self.stage) * sp + s for d in range(self.data_parallel_size) for s in range(sp))

    def group(self, dim: str) -> Any:
        """The process group of this rank along a named mesh dimension (``None`` without a mesh)."""
        return None if self.mesh is None else self.mesh.get_group(dim)

    @property
    def is_planner(self) -> bool:
        """Pipeline rank 0 of each replica (its sequence-parallel rank 0) plans its replica's
        steps and gathers statistics."""
        return self.stage == 0 and self.sp_rank == 0

    @property
    def writes_stage(self) -> bool:
        """This rank writes its stage's files (weights gathered, optimizer shard): replica 0,
        sequence-parallel rank 0 (the other ranks of the stage hold the same state)."""
        return self.replica == 0 and self.sp_rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where collectives' tensors live: the current CUDA device with NCCL, the CPU otherwise."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ over the replicas
    def all_reduce_replicas(self, value: float | int, dtype: torch.dtype = torch.long) -> float | int:
        """The sum of a number over the replicas (the number itself with one replica)."""
        if self.data_parallel_size == 1:
            return value
        t = torch.tensor([value], dtype=dtype, device=self.comm_device)
        with self.waiting(f"a sum over the replicas (ranks {list(self.dp_ranks)})"):
            dist.all_reduce(t, group=self.dp_group)
        return t.item()

    def all_gather_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """The replicas' tensors concatenated along dim 0, in replica order."""
        if self.data_parallel_size == 1:
            return tensor
        src = tensor.detach().to(self.comm_device).contiguous()
        parts = [torch.empty_like(src) for _ in range(self.data_parallel_size)]
        with self.waiting(f"a gather over the replicas (ranks {list(self.dp_ranks)})"):
            dist.all_gather(parts, src, group=self.dp_group)
        return torch.cat(parts).to(tensor.device)

    # ------------------------------------------------------------------ objects in the pipeline
    def broadcast_in_pipeline(self, obj: Any, src_stage: int = 0, same_on_sp_ranks: bool = False) -> Any:
        """``obj`` of pipeline stage ``src_stage`` on every rank of the pipeline; with sequence
        parallelism that stage's ``sp`` rank 0's, on every rank of the replica (first over the
        stage's ``sp`` group, then over each ``pp`` group; ``same_on_sp_ranks``: every sp rank of
        that stage holds it already, so each sends its own down its ``pp`` group)."""
        if self.sequence_parallel_size > 1 and self.stage == src_stage and not same_on_sp_ranks:
            box = [obj]
            with self.waiting(f"an object from sequence-parallel rank 0 of stage {src_stage} "
                               f"(rank {self.sp_ranks[0]})"):
                dist.broadcast_object_list(box, src=self.sp_ranks[0], group=self.sp_group)
            obj = box[0]
        if self.pipeline_size == 1:
            return obj
        box = [obj]
        src = self.pp_ranks[src_stage]
        with self.waiting(f"an object from pipeline stage {src_stage} (rank {src})"):
            dist.broadcast_object_list(box, src=src, group=self.pp_group)
        return box[0]

    def gather_in_pipeline(self, obj: Any) -> list[Any] | None:
        """Every stage's ``obj`` in stage order on pipeline rank 0; ``None`` elsewhere."""
        if self.pipeline_size == 1:
            return [obj]
        out = [None] * self.pipeline_size if self.stage == 0 else None
        with self.waiting(f"a gather of every stage's object (pipeline ranks {list(self.pp_ranks)})"):
            dist.gather_object(obj, out, dst=self.pp_ranks[0], group=self.pp_group)
        return out

    def broadcast_from_rank0(self, obj: Any) -> Any:
        """``obj`` of global rank 0 on every rank of the job."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with self.waiting("an object from rank 0"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def numbers_of_every_rank(self, value: float) -> list[float]:
        """Every rank's ``value``, in rank order, on every rank of the job (one all-reduce)."""
        if self.world_size == 1:
            return [float(value)]
        t = torch.zeros(self.world_size, dtype=torch.float64, device=self.comm_device)
        t[self.rank] = float(value)
        with self.waiting("a number from every rank"):
            dist.all_reduce(t)
        return t.tolist()

    def objects_of_every_rank(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank of the job."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.waiting("an object from every rank"):
            dist.all_gather_object(out, obj)
        return out

    def sync_weights_from_rank0(self, model: nn.Module) -> list[str]:
        """Every process's ``model`` (before it is split) with global rank 0's weights and
        buffers, as ``DistributedDataParallel`` makes them at construction for ``Trainer``: the
        ``sp`` ranks of a stage and the replicas must hold the same weights (their gradients are
        summed), and the stages together rank 0's model. A checksum of each state tensor (float64
        sum and sum of squares of at most 4096 evenly strided elements) is compared over the job
        (one MIN and one MAX all-reduce); only when one differs (a model built from an unseeded
        random initialization, a different checkpoint) are those tensors broadcast from rank 0,
        with one warning naming them. Returns their names (the same list on every rank);
        collective."""
        if self.world_size == 1:
            return []
        named = [(n, t) for n, t in model.state_dict().items()
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"]  # not a module's extra state
        sums = []
        for _, t in named:
            x = t.detach().reshape(-1)
            x = x[::max(1, x.numel() // 4096)].double()
            sums.append(torch.stack([x.sum(), (x * x).sum()]) if x.numel() else torch.zeros(2, dtype=torch.float64))
        lo = torch.nan_to_num(torch.stack(sums)).to(self.comm_device) if sums else torch.zeros(0, 2, dtype=torch.float64)
        hi = lo.clone()
        with self.waiting("the weights' checksums of every rank"):
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        differ = [i for i in range(len(named)) if not torch.equal(lo[i], hi[i])]
        with torch.no_grad(), self.waiting("rank 0's weights"):
            for i in differ:
                t = named[i][1]
                buf = t.detach().to(self.comm_device).contiguous()
                dist.broadcast(buf, src=0)
                t.copy_(buf.to(t.device))
        names = [named[i][0] for i in differ]
        if names and self.rank == 0:
            logger.warning(
                "concertina: the model's weights differ between processes (%d tensors, e.g. %s): every process "
                "now holds rank 0's, as DistributedDataParallel makes them for Trainer (build the model "
                "identically on every process, e.g. from_pretrained or set_seed before from_config, to skip this)",
                len(names), ", ".join(names[:3]))
        return names

    def shard_mesh(self) -> Any:
        """A 1-D :class:`DeviceMesh` over this stage's ``sp`` ranks (one replica's), on
        :attr:`sp_group` (no new process group), for FSDP2's parameter sharding
        (:mod:`~concertina_hf.runtime.param_sharding`); ``None`` at ``sp = 1``."""
        if self.sp_group is None or self.sequence_parallel_size == 1:
            return None
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.sp_group, self.comm_device.type, mesh_dim_names=("shard",))

    def barrier(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            with self.waiting("every rank at a barrier"):
                dist.barrier()

    @contextmanager
    def failing_together(self, what: str):
        """Run a collective phase (``what``: "train", "save_model", ...); an exception leaving it
        ends every rank of the job with its message (see the module docstring), then propagates."""
        try:
            yield
        except Exception as exc:
            watch = _AbortWatch.current
            if watch is not None and self.world_size > 1 and not getattr(exc, "on_every_rank", False):
                watch.raise_flag(f"rank {self.rank} (pipeline stage {self.stage}, replica {self.replica}) failed in "
                                 f"{what}: {type(exc).__name__}: {exc}")
            raise

    def failures_of_other_ranks(self) -> list[str]:
        """The failures other ranks raised in :meth:`failing_together`, none when this rank failed
        too (it has its own exception). Collective: it replaces a barrier, so a rank that reaches
        the end of the job before its abort watch saw a peer's failure still learns of it."""
        watch = _AbortWatch.current
        mine = watch.message if watch is not None and watch.raised_at is not None else None
        others = [m for r, m in enumerate(self.objects_of_every_rank(mine)) if m and r != self.rank]
        return [] if mine else others

    @contextmanager
    def waiting(self, what: str):
        """Re-raise a failed collective (a peer's timeout, a closed connection) naming this rank
        and what it waited for."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as exc:
            raise RuntimeError(f"rank {self.rank} (pipeline stage {self.stage}, replica {self.replica}) failed after "
                               f"{time.perf_counter() - t0:.1f} s waiting for {what}: {exc}") from exc


def fails_together(what: str) -> Callable[[Callable], Callable]:
    """Decorator of a method whose object holds (or will hold) its :class:`Topology` as ``topology``:
    the call runs inside :meth:`Topology.failing_together` (``what`` names the call in the
    message); before the object has its topology (early in a constructor), inside this process's
    abort watch alone, naming the rank. The exception itself propagates unchanged. Nested guarded
    calls: the innermost failure is the one reported. ``guarded.fails_together`` is ``what``."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def guarded(self, *args, **kwargs):
            topology = getattr(self, "topology", None)
            guard = topology.failing_together(what) if isinstance(topology, Topology) else _failing_alone(what)
            with guard:
                return fn(self, *args, **kwargs)

        guarded.fails_together = what
        return guarded

    return wrap


@contextmanager
def _failing_alone(what: str):
    """:meth:`Topology.failing_together` for a process that has no topology yet (or none at all)."""
    try:
        yield
    except Exception as exc:
        watch = _AbortWatch.current
        if watch is not None and not getattr(exc, "on_every_rank", False) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            watch.raise_flag(f"rank {watch.rank} failed in {what}: {type(exc).__name__}: {exc}")
        raise


def on_every_rank(exc: Exception) -> Exception:
    """``exc``, marked as raised alike by every rank at the same point (a verdict broadcast from
    rank 0): leaving :meth:`Topology.failing_together` it raises no abort flag."""
    exc.on_every_rank = True
    return exc


def launched_world_size(expected: int | None = None) -> int:
    """The number of processes of the launched job. Raises when the launcher's count
    (``WORLD_SIZE``), the process group's size and ``expected`` (the arguments' ``world_size``,
    where the caller has one) disagree: each rank would train alone."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    if launched != world or expected not in (None, world):
        told = "" if expected is None else f", TrainingArguments.world_size={expected}"
        raise RuntimeError(
            f"the launcher started {launched} processes but they do not form one job (process group of "
            f"{world}{told}); each rank would train alone. On CPU "
            "pass use_cpu=True (ConcertinaTrainingArguments does this when no GPU is visible) or launch with "
            "configs/accelerate/cpu_2proc.yaml"
        )
    return world


class _AbortWatch:
    """This process's watch of the job's abort flag (one per process, like the default group)."""

    current: "_AbortWatch | None" = None

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        self.raised_at: float | None = None
        self.message = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="concertina-abort-watch", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # before the interpreter freezes daemon threads

    @classmethod
    def start(cls, rank: int) -> None:
        get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        store = get_store() if get_store is not None else None
        if store is None or (cls.current is not None and cls.current.store is store):
            return
        if cls.current is not None:
            cls.current.stop()
        cls.current = cls(store, rank)

    def raise_flag(self, message: str) -> None:
        if self.raised_at is not None:
            return
        self.message, self.raised_at = message, time.monotonic()
        try:
            if not self.store.check([_ABORT_KEY]):  # the first failure is the one to report
                self.store.set(_ABORT_KEY, message)
        except Exception:  # the store is gone: the peers find out through their timeouts
            pass

    def stop(self) -> None:
        """End the watch. A rank that raised the flag first stays until its peers have polled it
        twice: its exit may close the store they read it from (it hosts the rendezvous store)."""
        if self.raised_at is not None and not self._stop.is_set():
            time.sleep(max(0.0, self.raised_at + 2 * ABORT_POLL_S - time.monotonic()))
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * ABORT_POLL_S)

    def _run(self) -> None:
        store_alive = True
        while not self._stop.wait(ABORT_POLL_S):
            if self.raised_at is not None:
                # this rank failed: its exception ends it the ordinary way, unless someone caught it
                if time.monotonic() - self.raised_at >= ABORT_GRACE_S:
                    self._end(self.message)
                continue
            if not store_alive:
                continue
            try:
                if not self.store.check([_ABORT_KEY]):
                    continue
                message = self.store.get(_ABORT_KEY).decode(errors="replace")
            except Exception:  # the store closed: the job ended (or its host died: timeouts apply)
                store_alive = False
                continue
            self._end(message)

    def _end(self, message: str) -> None:
        if self._stop.is_set():
            return
        sys.stderr.write(f"[rank {self.rank}] concertina: ending this rank, the job failed: {message}\n")
        sys.stderr.flush()
        os._exit(1)


def _mesh_with_timeout(shape: tuple[int, ...], timeout: timedelta) -> Any:
    """The ``MESH_DIMS`` mesh, every group of it (and the default group) waiting at most ``timeout``.

    Each dimension gets backend options carrying the timeout, which also stops DeviceMesh from
    reusing the default group for a dimension spanning the world (a gloo default group's
    point-to-point receives ignore a timeout set after its creation). Torch without
    ``backend_override`` (< 2.7): the groups' timeouts are set after creation.
    """
    from torch.distributed.device_mesh import init_device_mesh

    nccl = dist.get_backend() == "nccl"
    _set_group_timeout(None, timeout)
    if "backend_override" in inspect.signature(init_device_mesh).parameters:
        override = {}
        for name in MESH_DIMS:
            opts = dist.ProcessGroupNCCL.Options() if nccl else dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            override[name] = opts
        return init_device_mesh("cuda" if nccl else "cpu", shape, mesh_dim_names=MESH_DIMS, backend_override=override)
    mesh = init_device_mesh("cuda" if nccl else "cpu", shape, mesh_dim_names=MESH_DIMS)
    for name in MESH_DIMS:
        _set_group_timeout(mesh.get_group(name), timeout)
    return mesh


def _stage_groups(dp: int, pp: int, sp: int, topo: Topology) -> Any:
    """One group per stage over its ``dp x sp`` ranks (every rank creates every group, in stage
    order, as ``new_group`` requires); returns this rank's."""
    mine = None
    for stage in range(pp):
        ranks = [(d * pp + stage) * sp + s for d in range(dp) for s in range(sp)]
        group = dist.new_group(ranks, timeout=topo.timeout)
        if stage == topo.stage:
            mine = group
    return mine


def _set_group_timeout(group: Any, timeout: timedelta) -> None:
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.3
    if set_timeout is not None:
        set_timeout(timeout, group)


def group_timeout(group: Any) -> timedelta | None:
    """The timeout ``group`` was made with (``None`` where torch does not tell)."""
    try:
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        return group._get_backend(device).options._timeout
    except Exception:
        return None


def p2p_channels(lanes: Sequence[Sequence[int]], timeout: timedelta | None = None) -> dict[int, tuple[Any, Any]]:
    """This rank's P2P channels: for each neighbour pair ``s`` of its pipeline (stages ``s`` and
    ``s + 1``), two process groups of those two ranks, one for activations and one for gradients
    (:mod:`.p2p` says why NCCL needs them apart). ``lanes``: every pipeline's global ranks in
    stage order. Collective: every rank of the job calls it with the same lanes.

    Each channel carries one message here, lower stage to higher, in one order on every rank: a
    fresh NCCL communicator is set up by its first operation, which waits for the peer's first,
    so no message of a step waits for that."""
    me = dist.get_rank()
    mine: dict[int, tuple[Any, Any]] = {}
    for lane in lanes:
        for s in range(len(lane) - 1):
            pair = [int(lane[s]), int(lane[s + 1])]
            groups = (dist.new_group(pair, timeout=timeout), dist.new_group(pair, timeout=timeout))
            if me in pair:
                mine[s] = groups
    for s in sorted(mine):
        for group in mine[s]:
            ranks = dist.get_process_group_ranks(group)
            nccl = dist.get_backend(group) == "nccl"
            x = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
            if me == ranks[0]:
                dist.send(x, ranks[1], group=group)
            else:
                dist.recv(x, ranks[0], group=group)
    return mine


def reduce_gradients(params: Sequence[nn.Parameter], topology: Topology, average: bool,
                     shards: bool = False) -> None:
    """Sum each stage's gradients over its sequence-parallel ranks (each holds its tokens' share)
    and sum (``average=False``: token-averaged loss) or average them over the replicas, in one
    all-reduce over the stage's ``dp x sp`` ranks per flat bucket of at most
    :data:`BUCKET_ELEMENTS` elements per dtype. A missing gradient counts as zeros (another rank
    may have one). ``shards``: the gradients are this rank's shards, already summed over its
    ``sp`` ranks (``concertina_shard_parameters``): reduced over the replicas only."""
    if topology.data_parallel_size * (1 if shards else topology.sequence_parallel_size) == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad.to_local() if shards and hasattr(p.grad, "to_local") else p.grad
        by_dtype.setdefault(g.dtype, []).append(g)
    group = topology.dp_group if shards else topology.grad_group
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads + [None]:
            if g is not None and (size + g.numel() <= BUCKET_ELEMENTS or not bucket):
                bucket.append(g)
                size += g.numel()
                continue
            _all_reduce_bucket(bucket, topology, average, group)
            bucket, size = ([g], g.numel()) if g is not None else ([], 0)


def _all_reduce_bucket(grads: list[torch.Tensor], topology: Topology, average: bool, group: Any) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads]).to(topology.comm_device)
    with topology.waiting(f"the gradients of the stage's ranks {list(dist.get_process_group_ranks(group))}"):
        dist.all_reduce(flat, group=group)
    if average:
        flat /= topology.data_parallel_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def global_grad_norm(grads: Sequence[torch.Tensor], topology: Topology, device: torch.device,
                     sharded: bool = False) -> torch.Tensor:
    """2-norm over the gradients of all stages: this stage's squared norm summed over the
    pipeline (the caller leaves out a copy it must not count twice, e.g. a tied weight's).
    ``sharded``: ``grads`` are this rank's shards of the stage's gradients
    (``concertina_shard_parameters``), their squared norms summed over the stage's ``sp`` ranks first."""
    local = torch.nn.utils.get_total_norm(list(grads), 2.0) if grads else torch.zeros(())
    sq = local.float().reshape(1) ** 2
    if sharded and topology.sp_group is not None and topology.sequence_parallel_size > 1:
        sq = sq.to(topology.comm_device)
        with topology.waiting(f"the gradient norms of the stage's ranks {list(topology.sp_ranks)}"):
            dist.all_reduce(sq, group=topology.sp_group)
    if topology.pipeline_size > 1:
        sq = sq.to(topology.comm_device)
        with topology.waiting(f"the gradient norms of every stage (pipeline ranks {list(topology.pp_ranks)})"):
            dist.all_reduce(sq, group=topology.pp_group)
    return sq.reshape(()).sqrt().to(device)
