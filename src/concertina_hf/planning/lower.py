"""Lowering: a plan's compute actions become a :class:`~.plan.Program` with explicit messages.

The pass is torch pipelining's ``_add_send_recv`` for this runtime's communication pattern. On
stage ``s`` of ``p``, a forward of chunk ``c`` receives its input from stage ``s - 1``
(``RECV_F``, except on stage 0) and sends its output to ``s + 1`` (``SEND_F``, except on the last
stage); a backward receives the gradient of that output from ``s + 1`` (``RECV_B``, except on
the last stage) and sends its input's gradient to ``s - 1`` (``SEND_B``, except on stage 0). The
sends of one compute action and the receive the next one needs start together, as one batch,
right after it (so two neighbours never both block on a receive from each other, the classic
1F1B deadlock); a stage's last sends form a batch of their own. Nothing else is decided here:
the order of everything follows the plan's schedule, and the runtime interprets the result.

Stages of ``sp`` GPUs: sequence-parallel rank ``r`` of a stage exchanges with rank ``r`` of its
neighbours, so each rank runs its own copy of the program. :func:`rank_program` drops from it the
messages of the placed chunks in which rank ``r`` holds no token (a whole-doc chunk of fewer
sequences than ranks): both ends are rank ``r`` of the same chunk, so both drop the message, and
each channel keeps its order (a subset of a program that runs under NCCL's rendezvous runs too).

Cost: one pass over the schedule, ``O(actions)``.
"""

from __future__ import annotations

from .plan import Plan, Program
from .sharding import rank_tokens
from .types import Action, ActionKind

__all__ = ["lower", "rank_program"]


def lower(plan: Plan, *, train: bool = True) -> Program:
    """The program that runs ``plan`` (see the module docstring); ``train=False``: its forwards
    only, as evaluation runs them. ``plan`` is assumed valid (:meth:`Plan.validate`).

    >>> from concertina_hf.planning import Chunk, ChunkKind, Slice, StageLayout, build_schedule
    >>> chunks = tuple(Chunk(i, ChunkKind.PACKED, (Slice(i, 0, 8),)) for i in range(2))
    >>> plan = Plan("demo", (8, 8), StageLayout.even(4, 2), chunks, ((0, 1),),
    ...             build_schedule(chunks, ((0, 1),), 2), ((0, 0), (2, 2)))
    >>> print(lower(plan).grid().split("\\n", 1)[1])  # doctest: +NORMALIZE_WHITESPACE
    stage 0 [L0-1] | 0F0 0SEND_F0 0F1 0SEND_F1+0RECV_B0 0B0 0RECV_B1 0B1
    stage 1 [L2-3] | 1RECV_F0 1F0 1B0 1SEND_B0+1RECV_F1 1F1 1B1 1SEND_B1
      chunk   0 packed       8 tok  recompute 0/2  0[0:8]
      chunk   1 packed       8 tok  recompute 0/2  1[0:8]
    """
    last = plan.num_stages - 1
    FWD, SEND_F, RECV_F, SEND_B, RECV_B = (ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F,
                                           ActionKind.SEND_B, ActionKind.RECV_B)
    stages = []
    for s, actions in enumerate(plan.schedule):
        steps: list[tuple[Action, ...]] = []
        sends: list[Action] = []  # the previous compute action's output
        for a in actions:
            fwd = a.kind is FWD
            if not (train or fwd):
                continue
            c = a.chunk
            if fwd and s > 0:
                batch = (*sends, Action(s, RECV_F, c))
            elif not fwd and s < last:
                batch = (*sends, Action(s, RECV_B, c))
            else:
                batch = tuple(sends)
            if batch:
                steps.append(batch)
            steps.append((a,))
            if fwd:
                sends = [Action(s, SEND_F, c)] if s < last else []
            else:
                sends = [Action(s, SEND_B, c)] if s > 0 else []
        if sends:
            steps.append(tuple(sends))
        stages.append(tuple(steps))
    return Program(plan, tuple(stages), train)


def rank_program(program: Program, sp: int, rank: int) -> Program:
    """The program sequence-parallel rank ``rank`` of every stage runs (module docstring):
    ``program`` without the messages of the placed chunks of which that rank holds no token,
    and without the batches left empty; ``program`` itself when there are none."""
    empty = {c.index for c in program.plan.chunks if c.placement and rank_tokens(c, sp, rank) == 0}
    if not empty:
        return program
    stages = []
    for steps in program.steps:
        kept = (tuple(a for a in step if a.kind.is_compute or a.chunk not in empty) for step in steps)
        stages.append(tuple(step for step in kept if step))
    return Program(program.plan, tuple(stages), program.train, frozenset(empty))
