"""Point-to-point transfers between neighbouring pipeline stages, safe under NCCL's semantics.

Shapes and dtypes are never negotiated: both sides derive ``[1, chunk.num_tokens, hidden]`` from
the plan and the dtype from the parameters and the autocast state
(:meth:`~concertina_hf.runtime.executor.PipelineExecutor.wire_dtype`).

**Channels.** On NCCL a send larger than NCCL's internal buffers completes only once the peer has
posted the matching receive, and one communicator runs its operations in issue order, so a send
waiting for its receive holds back every later operation of that communicator. With one
communicator per neighbour pair (both directions), 1F1B over split sequences deadlocks: stage
``s`` queues the forward of the chunk after a chain ahead of the receive of the chain's first
backward, while stage ``s + 1`` receives that forward only after sending the chain's backwards.
So every neighbour pair has two *channels*, one process group each
(:func:`~concertina_hf.runtime.distributed.p2p_channels`): activations (``s -> s + 1``) and
gradients (``s + 1 -> s``). A channel carries one direction, both ends issue its messages in the
same chunk order (``Plan.validate``: neighbouring stages order chunks alike), and a stage waits
only for its receives: a send never blocks its stage, it holds back only later sends of its own
channel, which the peer receives in that order. A stage thus waits exactly as under gloo's eager
sends, which is what :func:`~concertina_hf.planning.dry_run.dry_run` checks for every plan
(``rendezvous=True`` adds NCCL's rendezvous; on these channels it only requires that every send
is received by the end of the step, when :meth:`StageComm.drain` waits for them). Each message is
its own ``isend`` / ``irecv`` (no ``batch_isend_irecv`` across channels); tags (``2 * chunk`` for
activations, ``2 * chunk + 1`` for gradients) let gloo match them and are ignored by NCCL.

Send buffers are kept alive until the send is known to be complete, at the latest until
:meth:`StageComm.drain` at the step's end. NCCL reports completion (``Work.is_completed``);
gloo's send work does not before ``wait()`` (measured: still not completed after the peer's
receive returned), so the executor tells :meth:`StageComm.release` which sends the peer has posted
the receive of (a message from the peer that it sent in the same or a later batch than that
receive has arrived): waiting on those returns at once, and their buffers go.

**Rendezvous emulation (tests).** Gloo sends eagerly, so a CPU run cannot show a deadlock that
NCCL would have. With ``CONCERTINA_EMULATE_NCCL=direction`` (the channels above) or ``=pair``
(one channel per neighbour pair for both directions, each exchange's messages one NCCL group, as
a single communicator per pair with ``batch_isend_irecv`` would run them) every channel end is a
FIFO run by a thread of its own: an exchange's operations on a channel are posted together once
every earlier one of that end has completed, a send completes once its receive is posted (a
handshake through the job's store), and the receive posted ``k``-th must be the send posted
``k``-th (NCCL matches in order, whatever the tags). ``CONCERTINA_EMULATE_NCCL_TIMEOUT_S`` (default 60)
bounds each wait: a stuck step fails naming the actions and peers it waited for.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["TIED_GRAD_TAG", "EMULATE_ENV", "StageComm", "activation_tag", "gradient_tag"]

# the gradient of tied embeddings between the first and the last stage (after a step, so it never
# meets an activation or gradient message; kept far above their tags anyway)
TIED_GRAD_TAG = 2**30
#: the environment variable that turns the rendezvous emulation on (tests; module docstring)
EMULATE_ENV = "CONCERTINA_EMULATE_NCCL"


def activation_tag(chunk: int) -> int:
    return 2 * chunk


def gradient_tag(chunk: int) -> int:
    return 2 * chunk + 1


class StageComm:
    """P2P of one stage with its neighbours: ``group`` is the pipeline (group rank == stage),
    ``channels`` maps a neighbour pair ``s`` (stages ``s`` and ``s + 1``) to its activation and
    gradient process groups (:func:`~concertina_hf.runtime.distributed.p2p_channels`)."""

    def __init__(self, group: dist.ProcessGroup | None, stage: int, num_stages: int,
                 channels: dict[int, tuple[Any, Any]]) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.stage = stage
        self.num_stages = num_stages
        self._ranks = [dist.get_global_rank(self.group, s) for s in range(num_stages)]
        missing = [s for s in (stage - 1, stage) if 0 <= s < num_stages - 1 and s not in channels]
        if missing:
            raise ValueError(f"stage {stage}: no P2P channels for the neighbour pair(s) {missing}")
        self.channels = channels
        self._in_flight: list[tuple[Any, torch.Tensor, object]] = []  # (work, buffer, key)
        # gloo's send works report completion only once waited for (module docstring)
        self.needs_release = dist.get_backend(self.group) == "gloo"
        mode = os.environ.get(EMULATE_ENV, "")
        if mode not in ("", "direction", "pair"):
            raise ValueError(f"{EMULATE_ENV}={mode!r}: use 'direction' or 'pair'")
        self._emulated = _Emulation(self, mode) if mode else None

    def rank_of(self, stage: int) -> int:
        """The global rank running ``stage`` of this pipeline."""
        return self._ranks[stage]

    def channel(self, peer: int, sending: bool) -> tuple[Any, str]:
        """The process group and the name of the channel of a message to or from ``peer``."""
        forward = (peer > self.stage) == sending  # activations flow up the stages
        pair = min(peer, self.stage)
        return self.channels[pair][0 if forward else 1], f"{pair}{'F' if forward else 'B'}"

    def send_op(self, tensor: torch.Tensor, to_stage: int, tag: int) -> dist.P2POp:
        return dist.P2POp(dist.isend, tensor.contiguous(), self._ranks[to_stage], self.channel(to_stage, True)[0], tag)

    def recv_op(self, buffer: torch.Tensor, from_stage: int, tag: int) -> dist.P2POp:
        return dist.P2POp(dist.irecv, buffer, self._ranks[from_stage], self.channel(from_stage, False)[0], tag)

    def exchange(self, sends: list[dist.P2POp], recvs: list[dist.P2POp], keys: list | None = None) -> None:
        """Start ``sends`` and ``recvs``, each on its channel; return once the receives have
        landed (the sends go on in the background). ``keys``: one per send, what
        :meth:`release` is asked about."""
        if self._emulated is not None:
            works = self._emulated.start(sends + recvs)
        else:
            works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in sends + recvs]
        keys = keys if keys is not None else [None] * len(sends)
        for op, w, k in zip(sends, works, keys):
            self._in_flight.append((w, op.tensor, k))
        for w in works[len(sends):]:
            w.wait()
        self._in_flight = [e for e in self._in_flight if not e[0].is_completed()]

    def release(self, received: Callable[[object], bool]) -> None:
        """Wait for (and drop the buffers of) the sends in flight whose key ``received(key)``
        says the peer has posted the receive of: they complete without the peer doing anything
        more, so waiting never blocks on it."""
        keep = []
        for w, t, k in self._in_flight:
            if k is not None and received(k):
                w.wait()
            else:
                keep.append((w, t, k))
        self._in_flight = keep

    def drain(self) -> None:
        """Wait for every send started so far."""
        for w, *_ in self._in_flight:
            w.wait()
        self._in_flight.clear()

    def swap(self, tensor: torch.Tensor, other: int, tag: int) -> torch.Tensor:
        """Send ``tensor`` to stage ``other`` and return what it sends back (both call this): one
        batch of a send and a receive on the pipeline group on each side, complements of each
        other, so NCCL runs them together."""
        theirs = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self._ranks[other], self.group, tag),
                                        dist.P2POp(dist.irecv, theirs, self._ranks[other], self.group, tag)])
        for w in works:
            w.wait()
        return theirs

    def broadcast_from(self, tensor: torch.Tensor, stage: int) -> None:
        dist.broadcast(tensor, src=self._ranks[stage], group=self.group)


# ------------------------------------------------------------------ rendezvous emulation (tests)
_EMULATIONS = itertools.count()


class _Work:
    """An emulated operation's completion, waited for like a ``dist.Work``."""

    def __init__(self, label: str, timeout_s: float, settle: Callable[[], None]) -> None:
        self.label, self.timeout_s, self.settle = label, timeout_s, settle
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        if not self.done.wait(self.timeout_s) or self.error is not None:
            self.settle()  # no channel thread is left inside gloo when the caller gives up
        if not self.done.is_set():
            raise RuntimeError(f"emulated NCCL: {self.label} did not complete within {self.timeout_s:.0f} s "
                               "(a send completes only once its receive is posted; a channel runs in issue order)")
        if self.error is not None:
            raise RuntimeError(f"emulated NCCL: {self.label} failed: {self.error}") from self.error
        return True


class _Emulation:
    """The channels of one :class:`StageComm` under NCCL's rules (module docstring): one thread
    per channel end, the posted operations announced in the job's store."""

    def __init__(self, comm: StageComm, mode: str) -> None:
        self.comm, self.mode = comm, mode
        self.store = dist.distributed_c10d._get_default_store()
        self.timeout_s = float(os.environ.get("CONCERTINA_EMULATE_NCCL_TIMEOUT_S", "60"))
        # both ends of a channel build their StageComm in the same order: the same instance number
        self.prefix = f"nccl-emu/{next(_EMULATIONS)}/{'-'.join(map(str, comm._ranks))}"
        self.queues: dict[str, queue.Queue] = {}
        self.counts: dict[tuple[str, bool], int] = {}

    def start(self, ops: list[dist.P2POp]) -> list[_Work]:
        """Queue one batch: the operations of one channel in it are posted together, as one NCCL
        group (``batch_isend_irecv``) would post them."""
        works, items = [], {}
        for op in ops:
            sending = op.op is dist.isend
            peer = self.comm._ranks.index(op.peer)
            group, name = self.comm.channel(peer, sending)
            if self.mode == "pair":  # both directions on the activation channel's group
                group, name = self.comm.channels[min(peer, self.comm.stage)][0], str(min(peer, self.comm.stage))
            # the k-th message of a channel from one end meets the k-th receive of the other
            src = self.comm.stage if sending else peer
            k = self.counts[(name, src)] = self.counts.get((name, src), -1) + 1
            kind = ("SEND" if sending else "RECV") + ("_F" if op.tag % 2 == 0 else "_B")
            work = _Work(f"stage {self.comm.stage} {kind} tag {op.tag} with stage {peer} (channel {name}, "
                         f"message {k})", self.timeout_s, self.settle)
            items.setdefault(name, []).append((op, group, f"{self.prefix}/{name}/{src}/{k}", sending, work))
            works.append(work)
        for name, item in items.items():
            if name not in self.queues:
                self.queues[name] = queue.Queue()
                threading.Thread(target=self._run, args=(self.queues[name],), daemon=True,
                                 name=f"nccl-emu-{name}").start()
            self.queues[name].put(item)
        return works

    def settle(self) -> None:
        """Wait until every channel thread has finished what it was given (each of its waits is
        bounded)."""
        deadline = time.monotonic() + 3 * self.timeout_s
        while any(q.unfinished_tasks for q in self.queues.values()) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _wait_for(self, key: str, label: str) -> None:
        # polled: a blocking store.wait holds the process's store client, so another channel's
        # thread could not announce its receive meanwhile
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: its receive was not posted within {self.timeout_s:.0f} s")
            time.sleep(0.0005)

    def _run_batch(self, item: list) -> BaseException | None:
        """Post a batch's receives, wait for its sends' receives, then run it on gloo. A receive
        once announced is always run, and a send only once its receive is announced, so no gloo
        operation is left waiting when a batch fails (an exiting process would abort)."""
        for op, _, key, sending, _ in item:
            if not sending:
                self.store.set(key, str(op.tag))
        failed, ready = None, []
        for op, group, key, sending, work in item:
            if sending:
                try:
                    self._wait_for(key, work.label)
                    tag = int(self.store.get(key))
                    if tag != op.tag:
                        raise RuntimeError(f"NCCL would deliver the message of tag {op.tag} into the receive "
                                           f"posted for tag {tag} (messages out of order)")
                except BaseException as exc:
                    failed = exc
                    break
                ready.append((op, group))
        ready += [(op, group) for op, group, _, sending, _ in item if not sending]
        works = [(dist.isend if op.op is dist.isend else dist.irecv)(op.tensor, op.peer, group=group, tag=op.tag)
                 for op, group in ready]
        for w in works:
            try:
                w.wait(timedelta(seconds=self.timeout_s))
            except BaseException as exc:
                failed = failed or exc
        return failed

    def _run(self, items: queue.Queue) -> None:
        """One channel end: each batch posted once the one before it completed."""
        failed: BaseException | None = None
        while True:
            item = items.get()
            if failed is None:
                failed = self._run_batch(item)
            for *_, work in item:
                work.error = failed
                work.done.set()
            items.task_done()
