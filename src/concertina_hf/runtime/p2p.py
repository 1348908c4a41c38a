"""Point-to-point transfers between neighbouring pipeline stages.

Shapes and dtypes are never negotiated: both sides derive ``[1, chunk.num_tokens, hidden]`` from
the plan and the dtype from the parameters and the autocast state
(:meth:`~concertina_hf.runtime.executor.PipelineExecutor.wire_dtype`).
Messages carry a tag (``2 * chunk`` for activations, ``2 * chunk + 1`` for gradients,
:data:`TIED_GRAD_TAG` for the gradient of tied embeddings between the first and last stage) so that
gloo matches them even if two stages ordered them differently; NCCL ignores tags and matches in
issue order, which is why ``Plan.validate`` requires neighbouring stages to forward (and backward)
the chunks in the same order and the simulator's dry run checks the order of the messages.

Which messages go together is the lowered program's business
(:func:`~concertina_hf.planning.lower.lower`: the sends produced by one action with the receive
the next action needs); the executor starts each such batch with one :meth:`StageComm.exchange`,
one ``batch_isend_irecv`` (NCCL then runs them as one group, which avoids the classic 1F1B
deadlock where both neighbours first block on a receive from each other). Sends complete in the
background; their buffers are kept alive until they are known to be complete, at the latest until
:meth:`StageComm.drain`. NCCL reports completion (``Work.is_completed``); gloo's send work does
not before ``wait()`` (measured: still not completed after the peer's receive returned), so each
send kept the stage output or input gradient it carries alive until the step's end. The executor
therefore tells :meth:`StageComm.release` which sends the peer has posted the receive of (a message
from the peer that it sent in the same or a later batch than that receive has arrived): waiting on
those returns at once (gloo reads a posted receive in its own thread), and their buffers go.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["TIED_GRAD_TAG", "StageComm", "activation_tag", "gradient_tag"]

# the gradient of tied embeddings between the first and the last stage (after a step, so it never
# meets an activation or gradient message; kept far above their tags anyway)
TIED_GRAD_TAG = 2**30


def activation_tag(chunk: int) -> int:
    return 2 * chunk


def gradient_tag(chunk: int) -> int:
    return 2 * chunk + 1


class StageComm:
    """P2P of one stage with its neighbours in ``group`` (group rank == stage)."""

    def __init__(self, group: dist.ProcessGroup | None, stage: int, num_stages: int) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.stage = stage
        self.num_stages = num_stages
        self._ranks = [dist.get_global_rank(self.group, s) for s in range(num_stages)]
        self._in_flight: list[tuple[dist.Work, torch.Tensor, object]] = []  # (work, buffer, key)
        # gloo's send works report completion only once waited for (module docstring)
        self.needs_release = dist.get_backend(self.group) == "gloo"

    def rank_of(self, stage: int) -> int:
        """The global rank running ``stage`` of this pipeline."""
        return self._ranks[stage]

    def send_op(self, tensor: torch.Tensor, to_stage: int, tag: int) -> dist.P2POp:
        return dist.P2POp(dist.isend, tensor.contiguous(), self._ranks[to_stage], self.group, tag)

    def recv_op(self, buffer: torch.Tensor, from_stage: int, tag: int) -> dist.P2POp:
        return dist.P2POp(dist.irecv, buffer, self._ranks[from_stage], self.group, tag)

    def exchange(self, sends: list[dist.P2POp], recvs: list[dist.P2POp], keys: list | None = None) -> None:
        """Start ``sends`` and ``recvs`` as one batch; return once the receives have landed.
        ``keys``: one per send, what :meth:`release` is asked about."""
        ops = sends + recvs
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        # with coalesced NCCL ops a single work stands for the whole batch
        if len(works) != len(ops):
            for w in works:
                w.wait()
            return
        keys = keys if keys is not None else [None] * len(sends)
        for op, w, k in zip(ops[:len(sends)], works[:len(sends)], keys):
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

    def broadcast_from(self, tensor: torch.Tensor, stage: int) -> None:
        dist.broadcast(tensor, src=self._ranks[stage], group=self.group)
