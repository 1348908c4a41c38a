"""The plan of one step, as plain data, and the program it is lowered to.

A :class:`Plan` is everything one optimizer step needs, as data: the chunks (variable-size
micro-batches cut from the step's sequences), the stage layout (which decoder layers each
pipeline stage owns), the per-stage action lists (forward / backward of a chunk, in order),
and the recompute decision per (stage, chunk). Every rank of a pipeline executes the same plan;
nothing about shapes is negotiated at run time. :meth:`Plan.validate` checks its invariants
(:mod:`.validate`). :func:`~concertina_hf.planning.lower.lower` turns it into a :class:`Program`,
the same actions with the sends and receives between neighbouring stages written out, which the
simulator dry-runs and the runtime interprets.

Both are frozen dataclasses made of tuples and scalars (the vocabulary of :mod:`.types`), so they
are hashable, compare by value and round-trip through JSON (:meth:`Plan.to_json` /
:meth:`Plan.from_json`); :meth:`Plan.fingerprint` hashes what the runtime executes and
:meth:`Plan.grid` / :meth:`Program.grid` print it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from .types import Action, Chunk, ChunkKind, Slice, StageLayout
from .validate import validate_placements, validate_plan

__all__ = ["Plan", "PlanStats", "Program"]


@dataclass(frozen=True, slots=True)
class PlanStats:
    """What the simulator predicts for a plan (see :func:`concertina_hf.planning.simulate`)."""

    step_time_s: float
    bubble_fraction: float
    recompute_fraction: float
    peak_memory_bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one step needs, as plain data.

    ``groups``: chunk indices of each pipeline group, in forward order; groups run back to back.
    ``schedule``: per stage, the ordered compute actions (forward, backward) the stage executes;
    neighbouring stages run the forwards of the chunks in the same order, and the backwards too
    (messages between two ranks match in issue order). Where sends and receives go is not part
    of the plan: :func:`~concertina_hf.planning.lower.lower` derives it.
    ``recompute``: ``recompute[stage][chunk] = r`` means the *first* ``r`` decoder layers of the
    stage (in layer order) recompute their activations in the chunk's backward, the others keep
    theirs (``0 .. layers of the stage``). The runtime, the cost model and the recompute planner
    all rely on it being the first layers: those run backward last, after the saved layers have
    freed their activations, so recomputing them raises the backward's peak only when every
    layer of the stage recomputes.
    ``memory_budget_bytes``: per-stage budget the plan was made for (0 when unconstrained).
    ``knobs``: the strategy's chosen settings, as ``(name, value)`` pairs (e.g. token budget).
    A plan that runs on another layout than the pipeline's records it there (the ``sp-only``
    baseline: ``sp``, ``state_shards``, ``zero3``, ``data_parallel``; see
    :mod:`~concertina_hf.planning.simulate`).
    """

    strategy: str
    seq_lens: tuple[int, ...]
    layout: StageLayout
    chunks: tuple[Chunk, ...]
    groups: tuple[tuple[int, ...], ...]
    schedule: tuple[tuple[Action, ...], ...]
    recompute: tuple[tuple[int, ...], ...]
    memory_budget_bytes: tuple[int, ...] = ()
    knobs: tuple[tuple[str, Any], ...] = ()
    predicted: PlanStats | None = field(default=None, compare=False)

    # ------------------------------------------------------------------ queries
    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def chunk_counts(self) -> dict[str, int]:
        counts = {k.value: 0 for k in ChunkKind}
        for c in self.chunks:
            counts[c.kind.value] += 1
        return counts

    def slices_of(self, seq: int) -> list[tuple[int, Slice]]:
        """``(chunk index, slice)`` of sequence ``seq``, in token order."""
        out = [(c.index, s) for c in self.chunks for s in c.slices if s.seq == seq]
        return sorted(out, key=lambda cs: cs[1].start)

    def knob(self, name: str, default: Any = None) -> Any:
        return dict(self.knobs).get(name, default)

    def with_predicted(self, stats: PlanStats) -> "Plan":
        return dataclasses.replace(self, predicted=stats)

    # ------------------------------------------------------------------ checks
    def validate(self) -> "Plan":
        """This plan, once every structural invariant holds (:func:`~.validate.validate_plan`
        lists them); else :class:`~.types.PlanError` naming the first broken one."""
        validate_plan(self)
        return self

    def validate_placements(self) -> None:
        """The chunks' placements as data (:func:`~.validate.validate_placements`)."""
        validate_placements(self)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "seq_lens": list(self.seq_lens),
            "layout": {"num_layers": self.layout.num_layers, "layer_ranges": [list(r) for r in self.layout.layer_ranges]},
            "chunks": [
                {"index": c.index, "kind": c.kind.value, "slices": [[s.seq, s.start, s.length] for s in c.slices],
                 **({"placement": list(c.placement)} if c.placement else {})}
                for c in self.chunks
            ],
            "groups": [list(g) for g in self.groups],
            "schedule": [[str(a) for a in acts] for acts in self.schedule],
            "recompute": [list(r) for r in self.recompute],
            "memory_budget_bytes": list(self.memory_budget_bytes),
            "knobs": [[k, v] for k, v in self.knobs],
            "predicted": None if self.predicted is None else {
                "step_time_s": self.predicted.step_time_s,
                "bubble_fraction": self.predicted.bubble_fraction,
                "recompute_fraction": self.predicted.recompute_fraction,
                "peak_memory_bytes": list(self.predicted.peak_memory_bytes),
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        pred = d.get("predicted")
        return cls(
            strategy=d["strategy"],
            seq_lens=tuple(d["seq_lens"]),
            layout=StageLayout(d["layout"]["num_layers"], tuple(tuple(r) for r in d["layout"]["layer_ranges"])),
            chunks=tuple(
                Chunk(c["index"], ChunkKind(c["kind"]), tuple(Slice(*s) for s in c["slices"]),
                      tuple(c.get("placement", ())))
                for c in d["chunks"]
            ),
            groups=tuple(tuple(g) for g in d["groups"]),
            schedule=tuple(tuple(Action.parse(a) for a in acts) for acts in d["schedule"]),
            recompute=tuple(tuple(r) for r in d["recompute"]),
            memory_budget_bytes=tuple(d.get("memory_budget_bytes", ())),
            knobs=tuple((k, v) for k, v in d.get("knobs", ())),
            predicted=None if pred is None else PlanStats(
                pred["step_time_s"], pred["bubble_fraction"], pred["recompute_fraction"],
                tuple(pred["peak_memory_bytes"]),
            ),
        )

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def fingerprint(self) -> str:
        """A stable hash of what the runtime executes (predictions excluded)."""
        d = self.to_dict()
        d.pop("predicted")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ display
    def grid(self, mark: Action | None = None) -> str:
        """The schedule as text: one row per stage, one column per step of its action list.

        ``mark`` (e.g. a failing action) is wrapped in ``>...<``. Below the grid, one line per
        chunk: kind, slices as ``seq[start:end]``, and recompute layers per stage.
        """
        cells = [[_cell((a,), (mark,)) for a in acts] for acts in self.schedule]
        return self._render(f"plan {self.strategy} ({self.fingerprint()})", cells)

    def _render(self, title: str, cells: list[list[str]]) -> str:
        width = max((len(c) for row in cells for c in row), default=3)
        lines = [f"{title}: {self.num_chunks} chunks, {self.num_stages} stages"]
        for st, row in enumerate(cells):
            a, b = self.layout.layer_ranges[st]
            lines.append(f"stage {st} [L{a}-{b - 1}] | " + " ".join(c.rjust(width) for c in row))
        for c in self.chunks:
            sl = " ".join(f"{s.seq}[{s.start}:{s.end}]" for s in c.slices)
            rc = "/".join(str(self.recompute[st][c.index]) for st in range(self.num_stages))
            mode = f"  {_placement_words(c.placement)}" if c.placement else ""
            lines.append(f"  chunk {c.index:>3} {c.kind.value:<6} {c.num_tokens:>7} tok  recompute {rc}{mode}  {sl}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Program:
    """A plan lowered for execution (:func:`~concertina_hf.planning.lower.lower`): per stage,
    the steps the runtime interprets in order, with every message written out.

    A step is a tuple of actions: either one compute action (``F``, ``B``), or communication
    actions (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``) started together, as one
    ``batch_isend_irecv`` (sends first, then receives, in the listed order). A step of messages
    is done when its receives have landed and, conservatively (NCCL runs a batch as one group),
    its sends have been received; :func:`~concertina_hf.planning.dry_run.dry_run` checks that
    every step can complete. ``train=False``: forwards only (evaluation). ``silent``: chunks
    whose messages this program leaves out on every stage (one sequence-parallel rank's copy,
    holding no token of them: :func:`~concertina_hf.planning.lower.rank_program`); their compute
    actions run on nothing received.
    """

    plan: Plan
    steps: tuple[tuple[tuple[Action, ...], ...], ...]
    train: bool = True
    silent: frozenset[int] = frozenset()

    def actions(self, stage: int) -> list[Action]:
        """Stage ``stage``'s actions, flat, in program order."""
        return [a for step in self.steps[stage] for a in step]

    def grid(self, mark: Action | Sequence[Action] | None = None) -> str:
        """One row per stage, one column per step (the messages of one batch joined by ``+``),
        and the plan's chunk table; ``mark`` (e.g. a failing action or step) is wrapped in
        ``>...<`` (an example: :func:`~concertina_hf.planning.lower.lower`)."""
        marked = (mark,) if isinstance(mark, Action) else tuple(mark or ())
        cells = [[_cell(step, marked) for step in steps] for steps in self.steps]
        what = "" if self.train else ", forward only"
        return self.plan._render(f"program of plan {self.plan.strategy} ({self.plan.fingerprint()}{what})", cells)


def _placement_words(placement: tuple[int, ...]) -> str:
    """A placed chunk's mode and its slices' places, e.g. ``mixed [d,0,1]`` (``d``: per-doc)."""
    per_doc = sum(1 for w in placement if w == -1)
    mode = "whole-doc" if not per_doc else "per-doc" if per_doc == len(placement) else "mixed"
    return f"{mode} [{','.join('d' if w == -1 else str(w) for w in placement)}]"


def _cell(step: tuple[Action, ...], marked: tuple[Action | None, ...]) -> str:
    return "+".join(f">{a}<" if a in marked else str(a) for a in step)
