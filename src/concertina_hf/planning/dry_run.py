"""The dry run of a lowered program: can every stage run it to the end?

A program (:func:`~concertina_hf.planning.lower.lower`) lists per stage compute steps and steps
of messages. Its communication is run as the runtime does it: a batch of messages is done once
the peer has posted the send of each of its receives (sends never hold their stage: each
direction between two neighbours is a channel of its own, :mod:`concertina_hf.runtime.p2p`); once
every program has run, the messages from one stage to another must have been received in the
order they were sent (NCCL matches them in issue order, whatever their tags). A message without
a counterpart, a step that can never complete (a deadlock) or messages out of order raise
:class:`~.types.PlanError` naming the actions, before any process group exists.

:func:`dry_run` does only that, with no cost model (and optionally with sends that wait for their
receive, NCCL's rendezvous). :func:`compile_program` and :func:`run_program` are the engine it
shares with the simulator (:mod:`.simulate`), which runs the same program with the cost model's
durations.

Cost: every step is started exactly once; stages are swept alternately top-down and bottom-up,
so a 1F1B program of ``N`` chunks on ``p`` stages needs about ``N`` sweeps of ``p`` stages.
Pure Python; no torch.
"""

from __future__ import annotations

from .plan import Program
from .types import ActionKind, PlanError

__all__ = ["compile_program", "dry_run", "run_program"]

_FWD, _BWD, _MSG = 0, 1, 2  # compiled step codes


def compile_program(program: Program, rendezvous: bool = False):
    """The program's steps as the engine reads them, and where its messages are.

    Returns ``(steps, (sends, receives))``: per stage, ``(_FWD, c)``, ``(_BWD, c)`` or
    ``(_MSG, ops)`` with ``ops = ((peer, peer's step index, chunk, is_recv, action), ...)`` for
    the messages the step waits for (its receives), the peer's step being the one that holds the
    counterpart; with ``rendezvous``, a last step per stage waits for every send's receive; ``sends[s][dst]`` / ``receives[s][src]``:
    stage ``s``'s messages to ``dst`` / from ``src`` as ``{chunk: step}``, in issue order.
    Raises :class:`PlanError` for a malformed program: a message without counterpart or listed
    twice, a compute action before its input's receive, a send before the compute that
    produces it.
    """
    plan = program.plan
    p, last = plan.num_stages, plan.num_stages - 1
    if len(program.steps) != p:
        raise PlanError(f"the program has {len(program.steps)} stages, the plan {p}")
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    SF, RF, SB, RB = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
    # per kind and stage: {chunk: step index}, in program order
    tf, tb, tsf, trf, tsb, trb = ([{} for _ in range(p)] for _ in range(6))
    for s, prog in enumerate(program.steps):
        for k, step in enumerate(prog):
            for a in step:
                kind = a.kind
                if a.stage != s:
                    raise PlanError(f"action {a} listed under stage {s}")
                if kind is F or kind is B:
                    if len(step) > 1:
                        raise PlanError(f"stage {s}: compute action {a} batched with other actions")
                    t = (tf if kind is F else tb)[s]
                else:
                    t = (tsf if kind is SF else trf if kind is RF else tsb if kind is SB else trb)[s]
                if a.chunk in t:
                    raise PlanError(f"{a} appears twice in stage {s}'s program")
                t[a.chunk] = k
    out = []
    for s, prog in enumerate(program.steps):
        rows: list[tuple] = []
        drain: list[tuple] = []
        for k, step in enumerate(prog):
            a = step[0]
            kind = a.kind
            if kind is F or kind is B:
                c = a.chunk
                inbox = (trf if s > 0 else None) if kind is F else (trb if s < last else None)
                if inbox is not None and c not in program.silent and inbox[s].get(c, k) >= k:
                    need = RF if kind is F else RB
                    raise PlanError(f"{a} runs before its input is received ({s}{need.value}{c} earlier on stage {s})")
                rows.append((_FWD if kind is F else _BWD, c))
                continue
            ops = []
            for a in step:
                kind, c, peer = a.kind, a.chunk, a.peer
                other = (trf if kind is SF else tsf if kind is RF else trb if kind is SB else tsb)
                pk = other[peer].get(c) if 0 <= peer < p else None
                if pk is None:
                    raise PlanError(f"{a} has no matching {a.partner} in the program; every send needs the "
                                    "receive of its neighbour and every receive a send")
                if kind is SF or kind is SB:
                    made = tf if kind is SF else tb
                    if made[s].get(c, k) >= k:
                        raise PlanError(f"{a} is sent before {s}{'F' if kind is SF else 'B'}{c} computes it")
                    drain.append((peer, pk, c, False, a))
                else:
                    ops.append((peer, pk, c, True, a))
            rows.append((_MSG, tuple(ops)))
        if rendezvous and drain:  # the step's end waits for every send to be received
            rows.append((_MSG, tuple(drain)))
        out.append(rows)
    sends = [{s + 1: tsf[s], s - 1: tsb[s]} for s in range(p)]
    receives = [{s - 1: trf[s], s + 1: trb[s]} for s in range(p)]
    return out, (sends, receives)


def run_program(program: Program, compiled, fdur, bdur, p2p):
    """Run the compiled program (:func:`compile_program`) with these durations: ``fdur[s][c]`` /
    ``bdur[s][c]`` of each compute step, ``p2p[c]`` of each message (the execution model of
    :mod:`.simulate`); ``(fstart, fend, bstart, bend, free_at)``, per stage and chunk. Raises
    :class:`PlanError` on a deadlock or messages out of order."""
    steps, channels = compiled
    p = len(steps)
    n = program.plan.num_chunks
    fend: list[list[float | None]] = [[None] * n for _ in range(p)]
    bend: list[list[float | None]] = [[None] * n for _ in range(p)]
    fstart = [[0.0] * n for _ in range(p)]
    bstart = [[0.0] * n for _ in range(p)]
    posted = [[0.0] * len(st) for st in steps]  # when a stage reached each step: its sends leave then
    free_at = [0.0] * p
    ptr = [0] * p
    remaining = sum(len(st) for st in steps)
    sweep = 0
    while remaining:
        progressed = False
        order = range(p) if sweep % 2 == 0 else range(p - 1, -1, -1)
        sweep += 1
        for s in order:
            st = steps[s]
            k = ptr[s]
            t_free = free_at[s]
            fe, be, post = fend[s], bend[s], posted[s]
            while k < len(st):
                code, x = st[k]
                if code == _MSG:
                    post[k] = t_free
                    ready = t_free
                    for peer, pk, c, is_recv, _ in x:
                        if ptr[peer] < pk:  # the counterpart is not posted yet
                            break
                        if is_recv:
                            arrive = posted[peer][pk] + p2p[c]
                            if arrive > ready:
                                ready = arrive
                    else:
                        t_free = ready
                        k += 1
                        continue
                    break
                if code == _FWD:
                    fstart[s][x] = t_free
                    t_free = t_free + fdur[s][x]
                    fe[x] = t_free
                else:
                    if fe[x] is None:
                        break
                    bstart[s][x] = t_free
                    t_free = t_free + bdur[s][x]
                    be[x] = t_free
                k += 1
            if k != ptr[s]:
                remaining -= k - ptr[s]
                ptr[s] = k
                free_at[s] = t_free
                progressed = True
        if not progressed:
            raise _deadlock(program, steps, ptr, fend, bend)
    _check_order(*channels)
    return fstart, fend, bstart, bend, free_at


def _deadlock(program: Program, steps: list[list[tuple]], ptr, fend, bend) -> PlanError:
    blocked, stuck = [], []
    left = 0
    for s, prog in enumerate(program.steps):
        k = ptr[s]
        if k == len(prog) < len(steps[s]):  # the rendezvous drain: sends nobody receives
            waits = [str(a.partner) for peer, pk, c, _, a in steps[s][k][1] if ptr[peer] < pk]
            blocked.append(f"the end of stage {s}'s step (its sends wait for {', '.join(waits)})")
            continue
        if k >= len(prog):
            continue
        left += sum(len(step) for step in prog[k:])
        step = prog[k]
        if step[0].kind.is_compute:  # a backward before its own forward
            blocked.append(f"{step[0]} (waits for its own forward {s}F{step[0].chunk})")
            continue
        stuck.append(f"{'+'.join(map(str, step))} on stage {s}")
        recvs, sends = [], []
        for peer, pk, c, is_recv, a in steps[s][k][1]:
            if ptr[peer] >= pk:
                continue
            other = a.partner
            if not is_recv:
                sends.append(str(other))
                continue
            made = fend if other.kind is ActionKind.SEND_F else bend
            kind = "F" if other.kind is ActionKind.SEND_F else "B"
            recvs.append(str(other) if made[peer][c] is not None else f"{peer}{kind}{c}")
        if recvs:  # the compute action that needs the message cannot start
            nxt = next((st[0] for st in prog[k + 1:] if st[0].kind.is_compute), step[-1])
            blocked.append(f"{nxt} (waits for {', '.join(recvs)})")
        else:
            blocked.append(f"{'+'.join(map(str, step))} (waits for {', '.join(sends)})")
    return PlanError(
        f"deadlock: {left} actions cannot run; blocked: " + ", ".join(blocked)
        + (f"; stuck messages: {', '.join(stuck)}" if stuck else "")
        + ". Every stage must order its actions so that the chunk a stage waits for is forwarded (or "
        "backwarded) by its neighbour first, and send its messages in the order its neighbour receives them."
    )


def _check_order(sends, receives) -> None:
    """Messages from one stage to another must be received in the order they were sent."""
    for src, out in enumerate(sends):
        for dst, sent in out.items():
            if not sent:
                continue
            got = receives[dst][src]
            if list(sent) != list(got):
                i, (a, b) = next((i, ab) for i, ab in enumerate(zip(sent, got)) if ab[0] != ab[1])
                kind = "F" if dst > src else "B"
                raise PlanError(
                    f"stage {src} sends to stage {dst} in another order than stage {dst} receives: message {i} is "
                    f"{src}SEND_{kind}{a} but {dst}RECV_{kind}{b} on stage {dst}; two ranks match their messages in "
                    "issue order (NCCL ignores tags)"
                )


def dry_run(program: Program, *, rendezvous: bool = False) -> None:
    """Check that ``program`` can run to the end: every message has a counterpart, no step
    waits forever, messages are received in the order they are sent (see the module
    docstring); raise :class:`PlanError` naming the actions otherwise.

    ``rendezvous=True``: NCCL's semantics on the runtime's channels (:mod:`concertina_hf.runtime.p2p`):
    a send completes only once its receive is posted, and each channel (one direction between two
    neighbours, its own communicator) runs in issue order. A stage waits for its receives only,
    so a pending send holds back nothing but later sends of its own channel, which the peer
    receives in the same order (checked below); what is left is the step's end, which waits for
    every send to be received. (With one channel for both directions, 1F1B over a split sequence
    would deadlock: stage ``s`` queues the forward of the chunk after the chain before the
    receive of the chain's first backward, and stage ``s + 1`` receives that forward only after
    sending every backward of the chain.)"""
    n, p = program.plan.num_chunks, len(program.steps)
    zeros = [[0.0] * n for _ in range(p)]
    run_program(program, compile_program(program, rendezvous), zeros, zeros, [0.0] * n)
