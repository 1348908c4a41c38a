"""Plain, frozen data types of a step plan.

A :class:`Plan` is everything one optimizer step needs, as data: the chunks (variable-size
micro-batches cut from the step's sequences), the stage layout (which decoder layers each
pipeline stage owns), the per-stage action lists (forward / backward of a chunk, in order),
and the recompute decision per (stage, chunk). Every rank of a pipeline executes the same plan;
nothing about shapes is negotiated at run time. :func:`~concertina_hf.planning.lower.lower`
turns it into a :class:`Program`, the same actions with the sends and receives between
neighbouring stages written out, which the simulator dry-runs and the runtime interprets.

All types are frozen dataclasses made of tuples and scalars, so they are hashable, compare by
value and round-trip through JSON (:meth:`Plan.to_json` / :meth:`Plan.from_json`).

Conventions: stages are 0-indexed, ``stage 0`` owns the embedding, the last stage owns the
final norm, the LM head and the loss. Chunk ``index`` is its position in the plan's global
forward order (``plan.chunks[i].index == i``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = [
    "Action",
    "ActionKind",
    "Chunk",
    "ChunkKind",
    "Plan",
    "PlanError",
    "PlanStats",
    "Program",
    "Remedy",
    "SETTINGS",
    "Slice",
    "StageLayout",
]


#: the planner's names of the settings a :class:`Remedy` changes (each front end has its own:
#: ``concertina_memory_budget`` for the trainer, ``--memory-gb`` for ``concertina plan``)
SETTINGS = ("memory_budget", "max_tokens_per_chunk", "pipeline_size", "sequence_parallel_size", "strategy", "solver",
            "sequence_parallel_mode")


@dataclass(frozen=True, slots=True)
class Remedy:
    """One change of a planner setting that would help, named by the planner (:data:`SETTINGS`).

    ``change``: ``"raise"`` (``limit``: the smallest value that works, when known), ``"lower"``
    (``limit``: the largest) or ``"set"`` (``value``: what to set it to, in words); ``unit`` of
    the limit; ``note``: words after it. :meth:`words` phrases it under a front end's name:

    >>> Remedy("max_tokens_per_chunk", "raise", 16, "tokens").words("--max-tokens-per-chunk")
    'raise --max-tokens-per-chunk to at least 16 tokens'
    """

    setting: str
    change: str
    limit: int | None = None
    unit: str = ""
    value: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.setting not in SETTINGS or self.change not in ("raise", "lower", "set"):
            raise ValueError(f"not a remedy: {self.change!r} of {self.setting!r}")

    def words(self, name: str) -> str:
        """This remedy in words, the setting called ``name``."""
        if self.change == "set":
            text = f"set {name} to {self.value}"
        else:
            text = f"{self.change} {name}"
            if self.limit is not None:
                unit = self.unit[:-1] if self.limit == 1 and self.unit.endswith("s") else self.unit
                bound = "least" if self.change == "raise" else "most"
                text += f" to at {bound} {self.limit}" + (f" {unit}" if unit else "")
        return f"{text} {self.note}" if self.note else text


class PlanError(ValueError):
    """A plan is malformed, or no plan fits the given constraints.

    ``reason``: what is wrong, in the planner's terms (no front end's setting names);
    ``remedies``: the changes of settings that would help (:class:`Remedy`, the most direct
    first), ``others``: further ways out in words (``"train on shorter sequences"``).
    ``str(error)`` is the reason and the remedies under the planner's names; a front end words
    them under its own with :meth:`worded`. ``setting`` and ``limit``: the first remedy's.

    >>> e = PlanError("too many chunks", Remedy("max_tokens_per_chunk", "raise", 16, "tokens"),
    ...               others=("plan fewer tokens per step",))
    >>> str(e)
    'too many chunks; raise max_tokens_per_chunk to at least 16 tokens or plan fewer tokens per step'
    >>> e.worded({"max_tokens_per_chunk": "--max-tokens-per-chunk"})
    'too many chunks; raise --max-tokens-per-chunk to at least 16 tokens or plan fewer tokens per step'
    >>> (e.setting, e.limit)
    ('max_tokens_per_chunk', 16)
    """

    def __init__(self, reason: str, *remedies: Remedy, others: Sequence[str] = ()) -> None:
        self.reason = reason
        self.remedies = tuple(remedies)
        self.others = tuple(others)
        super().__init__(self.worded({}))

    @property
    def setting(self) -> str | None:
        """The planner's name of the setting to change first (:data:`SETTINGS`); ``None``: none."""
        return self.remedies[0].setting if self.remedies else None

    @property
    def limit(self) -> int | None:
        """The smallest (raise) or largest (lower) value of :attr:`setting` that works, if known."""
        return self.remedies[0].limit if self.remedies else None

    def worded(self, names: dict[str, str]) -> str:
        """The message with the settings called by ``names`` (planner name -> a front end's name;
        missing ones keep the planner's)."""
        ways = [r.words(names.get(r.setting, r.setting)) for r in self.remedies] + list(self.others)
        if not ways:
            return self.reason
        text = ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + ("," if len(ways) > 2 else "") + f" or {ways[-1]}"
        return f"{self.reason}; {text}"

    def with_message(self, message: str) -> "PlanError":
        """The same error (type, reason, remedies) whose ``str`` is ``message``: a front end's
        wording of it."""
        new = type(self)(self.reason, *self.remedies, others=self.others)
        new.args = (message,)
        return new


@dataclass(frozen=True, slots=True, order=True)
class Slice:
    """A contiguous token range ``[start, start + length)`` of sequence ``seq``.

    Its context (tokens of the same sequence before it, whose K/V it attends to) is ``start``.
    """

    seq: int
    start: int
    length: int

    @property
    def context(self) -> int:
        return self.start

    @property
    def end(self) -> int:
        return self.start + self.length


class ChunkKind(str, enum.Enum):
    PACKED = "packed"  # whole short sequences, each with context 0
    SPLIT = "split"  # exactly one non-final slice of a long sequence
    HYBRID = "hybrid"  # the final slice of a split sequence plus whole short sequences

    @staticmethod
    def of(slices: Sequence[Slice], seq_lens: Sequence[int]) -> ChunkKind:
        """The kind :meth:`Plan.validate` expects of a chunk holding ``slices``: packed when each is
        a whole sequence, hybrid when its split slice ends its sequence, split otherwise."""
        split = [s for s in slices if s.length != seq_lens[s.seq]]
        if not split:
            return ChunkKind.PACKED
        return ChunkKind.HYBRID if split[0].end == seq_lens[split[0].seq] else ChunkKind.SPLIT


@dataclass(frozen=True, slots=True)
class Chunk:
    """The unit that flows through the pipeline: a padding-free concatenation of slices."""

    index: int
    kind: ChunkKind
    slices: tuple[Slice, ...]
    #: Where the chunk's tokens live on the ``sp`` ranks of a stage (:mod:`.sharding`): empty for
    #: Ulysses (the default), else one entry per slice: a rank ``0 .. sp-1`` (whole-doc: the slice
    #: entirely on that rank) or :data:`~.sharding.PER_DOC` (``-1``: cut into ``2 sp`` zig-zag pieces).
    placement: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.slices)

    @property
    def split_seq(self) -> int | None:
        """The split sequence this chunk carries a slice of (``None`` for a packed chunk).

        By convention a hybrid chunk lists its tail slice first.
        """
        return None if self.kind is ChunkKind.PACKED else self.slices[0].seq


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Contiguous decoder-layer ranges ``[start, end)`` per pipeline stage."""

    num_layers: int
    layer_ranges: tuple[tuple[int, int], ...]

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    def num_stage_layers(self, stage: int) -> int:
        a, b = self.layer_ranges[stage]
        return b - a

    def has_embedding(self, stage: int) -> bool:
        return stage == 0

    def has_head(self, stage: int) -> bool:
        return stage == self.num_stages - 1

    @classmethod
    def even(cls, num_layers: int, num_stages: int) -> "StageLayout":
        """Layers spread as evenly as possible, earlier stages taking the remainder."""
        if not 1 <= num_stages <= num_layers:
            raise PlanError(
                f"cannot place {num_layers} decoder layers on {num_stages} pipeline stages; "
                "set the pipeline size between 1 and the number of layers"
            )
        base, extra = divmod(num_layers, num_stages)
        ranges, start = [], 0
        for s in range(num_stages):
            n = base + (1 if s < extra else 0)
            ranges.append((start, start + n))
            start += n
        return cls(num_layers, tuple(ranges))


class ActionKind(str, enum.Enum):
    """What an action does. A plan's schedule holds the compute kinds only; the communication
    kinds (names as in torch pipelining) appear in a lowered :class:`Program`."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"  # the forward's output (hidden states) to the next stage
    RECV_F = "RECV_F"  # the forward's input from the previous stage
    SEND_B = "SEND_B"  # the backward's input gradient to the previous stage
    RECV_B = "RECV_B"  # the gradient of the forward's output from the next stage

    def __init__(self, value: str) -> None:
        # plain attributes, not properties: the simulator reads them per action
        self.is_compute = value in ("F", "B")
        self.is_send = value.startswith("SEND")
        self.is_recv = value.startswith("RECV")


# communication kind -> (offset of the peer stage, the kind of the peer's matching action)
_PEER = {
    ActionKind.SEND_F: (1, ActionKind.RECV_F),
    ActionKind.RECV_F: (-1, ActionKind.SEND_F),
    ActionKind.SEND_B: (-1, ActionKind.RECV_B),
    ActionKind.RECV_B: (1, ActionKind.SEND_B),
}
_ACTION_RE = re.compile(r"\s*(\d+)([A-Z_]+)(\d+)\s*")


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a stage on a chunk, printed like torch pipelining: ``"1F3"`` (forward of
    chunk 3 on stage 1), ``"1B3"``, and in a lowered :class:`Program` ``"1SEND_F3"`` /
    ``"2RECV_F3"`` (its hidden states to stage 2) and ``"2SEND_B3"`` / ``"1RECV_B3"`` (their
    gradient back)."""

    stage: int
    kind: ActionKind
    chunk: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.chunk}"

    @property
    def peer(self) -> int:
        """The stage at the other end of a send or receive."""
        return self.stage + _PEER[self.kind][0]

    @property
    def partner(self) -> "Action":
        """The peer's action that completes this send or receive (``0SEND_F2`` <-> ``1RECV_F2``)."""
        step, kind = _PEER[self.kind]
        return Action(self.stage + step, kind, self.chunk)

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _ACTION_RE.fullmatch(text)
        try:
            return cls(int(m[1]), ActionKind(m[2]), int(m[3]))
        except (TypeError, ValueError):
            raise PlanError(f"not an action: {text!r}") from None


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
        """Check every structural invariant; raise :class:`PlanError` naming the first broken one.

        Invariants: every token of every sequence lands in exactly one slice, slices of a
        sequence are in chunk order; chunk kinds match their content; no chunk holds slices of
        two split sequences; groups partition the chunks in order and a split sequence stays in
        one group; each stage forwards and backwards every chunk exactly once (compute actions
        only), forward before backward, slices of a sequence forward in order and backward in
        reverse order (any order under the knob ``segment_gradient="none"``); neighbouring stages
        order the forwards (and the backwards) of the chunks the same way; recompute is within each
        stage's layer count.
        """
        p = self.num_stages
        lay = self.layout
        if lay.num_stages < 1 or lay.layer_ranges[0][0] != 0 or lay.layer_ranges[-1][1] != lay.num_layers:
            raise PlanError(f"stage layout {lay.layer_ranges} does not cover {lay.num_layers} layers")
        for (a0, b0), (a1, _) in zip(lay.layer_ranges, lay.layer_ranges[1:]):
            if b0 != a1 or a0 >= b0:
                raise PlanError(f"stage layout {lay.layer_ranges} is not contiguous and non-empty")
        if lay.layer_ranges[-1][0] >= lay.layer_ranges[-1][1]:
            raise PlanError(f"stage layout {lay.layer_ranges} has an empty last stage")
        for i, c in enumerate(self.chunks):
            if c.index != i:
                raise PlanError(f"chunk at position {i} has index {c.index}")
            if not c.slices:
                raise PlanError(f"chunk {i} is empty")
            split = {s.seq for s in c.slices if s.length != self.seq_lens[s.seq]}
            if len(split) > 1:
                raise PlanError(f"chunk {i} holds slices of two split sequences {sorted(split)}")
            if c.kind is ChunkKind.PACKED and split:
                raise PlanError(f"packed chunk {i} holds a slice of split sequence {split.pop()}")
            if c.kind is ChunkKind.SPLIT and (len(c.slices) != 1 or not split):
                raise PlanError(f"split chunk {i} must hold exactly one slice of a split sequence")
            if c.kind is ChunkKind.SPLIT and c.slices[0].end == self.seq_lens[c.slices[0].seq]:
                raise PlanError(f"split chunk {i} holds a final slice (that is a hybrid chunk)")
            if c.kind is ChunkKind.HYBRID:
                if not split:
                    raise PlanError(f"hybrid chunk {i} holds no tail slice")
                tail = c.slices[0]
                if tail.seq not in split:
                    raise PlanError(f"hybrid chunk {i} must list its tail slice first")
                if tail.end != self.seq_lens[tail.seq]:
                    raise PlanError(f"hybrid chunk {i} holds a non-final slice of sequence {tail.seq}")
        # token coverage and slice order
        chunk_group = {}
        for g, members in enumerate(self.groups):
            for ci in members:
                if ci in chunk_group:
                    raise PlanError(f"chunk {ci} is in two pipeline groups")
                chunk_group[ci] = g
        flat = [ci for members in self.groups for ci in members]
        if flat != list(range(self.num_chunks)):
            raise PlanError("pipeline groups must list every chunk once, in forward order")
        by_seq: list[list[tuple[int, Slice]]] = [[] for _ in self.seq_lens]  # slices_of, for all at once
        for c in self.chunks:
            for sl in c.slices:
                if not 0 <= sl.seq < len(by_seq):
                    raise PlanError(f"chunk {c.index} holds a slice of sequence {sl.seq}, not in the step")
                by_seq[sl.seq].append((c.index, sl))
        seq_chunks: list[list[int]] = []
        for seq, n in enumerate(self.seq_lens):
            parts = sorted(by_seq[seq], key=lambda cs: cs[1].start)
            pos = 0
            for ci, s in parts:
                if s.start != pos:
                    raise PlanError(f"sequence {seq}: tokens [{pos}, {s.start}) are missing or repeated")
                pos = s.end
                if s.length <= 0:
                    raise PlanError(f"sequence {seq}: empty slice in chunk {ci}")
            if pos != n:
                raise PlanError(f"sequence {seq}: covers {pos} of {n} tokens")
            chunk_ids = [ci for ci, _ in parts]
            seq_chunks.append(chunk_ids)
            if chunk_ids != sorted(chunk_ids) or len(set(chunk_ids)) != len(chunk_ids):
                raise PlanError(f"sequence {seq}: slices are not in increasing chunk order")
            if len({chunk_group[ci] for ci in chunk_ids}) > 1:
                raise PlanError(f"sequence {seq} is split across pipeline groups")
        # schedule
        if len(self.schedule) != p:
            raise PlanError(f"schedule has {len(self.schedule)} stages, layout has {p}")
        # position of each (sequence, chunk) in the sequence's chain of chunks
        chain_pos = {(seq, ci): k for seq, chain in enumerate(seq_chunks) for k, ci in enumerate(chain)}
        # segment-level training with gradient "none": no gradient crosses a slice boundary
        chained = self.knob("segment_gradient") != "none"
        for st, actions in enumerate(self.schedule):
            fdone: set[int] = set()
            bdone: set[int] = set()
            for a in actions:
                if a.stage != st:
                    raise PlanError(f"action {a} listed under stage {st}")
                if not a.kind.is_compute:
                    raise PlanError(f"action {a} in the schedule: a plan lists forwards and backwards only "
                                    "(lower(plan) adds the sends and receives)")
                if not 0 <= a.chunk < self.num_chunks:
                    raise PlanError(f"action {a} names a chunk that does not exist")
                done = fdone if a.kind is ActionKind.FORWARD else bdone
                if a.chunk in done:
                    raise PlanError(f"action {a} appears twice")
                if a.kind is ActionKind.BACKWARD and a.chunk not in fdone:
                    raise PlanError(f"action {a} runs before its forward")
                for s in self.chunks[a.chunk].slices:
                    chain = seq_chunks[s.seq]
                    k = chain_pos[(s.seq, a.chunk)]
                    if a.kind is ActionKind.FORWARD and k > 0 and chain[k - 1] not in fdone:
                        raise PlanError(f"action {a}: earlier slice (chunk {chain[k-1]}) not forwarded yet")
                    if (a.kind is ActionKind.BACKWARD and k + 1 < len(chain) and chain[k + 1] not in bdone
                            and chained):
                        raise PlanError(f"action {a}: later slice (chunk {chain[k+1]}) not backwarded yet")
                done.add(a.chunk)
            if len(fdone) != self.num_chunks or len(bdone) != self.num_chunks:
                raise PlanError(f"stage {st} does not run every chunk forward and backward once")
        # a stage's messages to its neighbour match in issue order (NCCL ignores tags)
        for st in range(p - 1):
            for kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                a = [x.chunk for x in self.schedule[st] if x.kind is kind]
                b = [x.chunk for x in self.schedule[st + 1] if x.kind is kind]
                if a != b:
                    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                    raise PlanError(
                        f"stages {st} and {st + 1} run the {kind.name.lower()} passes of the chunks in different "
                        f"orders: at position {i} chunk {a[i]} on stage {st} but chunk {b[i]} on stage {st + 1} "
                        f"({a} vs {b}); their messages would not match"
                    )
        if len(self.recompute) != p or any(len(r) != self.num_chunks for r in self.recompute):
            raise PlanError("recompute must be [stage][chunk]")
        for st, row in enumerate(self.recompute):
            n = lay.num_stage_layers(st)
            for ci, r in enumerate(row):
                if not 0 <= r <= n:
                    raise PlanError(f"recompute[{st}][{ci}] = {r} outside 0..{n}")
        if self.memory_budget_bytes and len(self.memory_budget_bytes) != p:
            raise PlanError("memory_budget_bytes must have one entry per stage")
        if any(c.placement for c in self.chunks):
            self.validate_placements()
        lanes = int(self.knob("data_parallel", 1))
        if lanes > 1:  # the groups are rounds run at once on `lanes` groups of GPUs (simulate.py)
            if p != 1:
                raise PlanError(f"knob data_parallel={lanes} needs a plan of one stage, not {p}")
            wide = next((g for g in self.groups if len(g) > lanes), None)
            if wide is not None:
                raise PlanError(f"a round of {len(wide)} chunks {list(wide)} on data_parallel={lanes} groups of GPUs")
        return self

    def validate_placements(self) -> None:
        """Placements as data (:mod:`.sharding`; the ranks against ``sp``:
        :func:`~.sharding.plan_placement_refusal`): one entry per slice, each a rank or ``-1``
        (per-doc); a split sequence's slices all Ulysses or all placed, each per-doc slice after
        per-doc ones only, a whole-doc slice after per-doc ones or ones on its own rank (the K/V
        carried from slice to slice must be where the next one attends)."""
        where: dict[int, list[tuple[int, int | None]]] = {}
        for c in self.chunks:
            if c.placement and len(c.placement) != len(c.slices):
                raise PlanError(f"chunk {c.index}: {len(c.placement)} placements for {len(c.slices)} slices")
            if any(w < -1 for w in c.placement):
                raise PlanError(f"chunk {c.index}: placement {list(c.placement)} holds an entry below -1 (per-doc)")
            for i, sl in enumerate(c.slices):
                if sl.length != self.seq_lens[sl.seq]:
                    where.setdefault(sl.seq, []).append((sl.start, c.placement[i] if c.placement else None))
        for seq, items in sorted(where.items()):
            items.sort()
            if len({w is None for _, w in items}) > 1:
                raise PlanError(f"sequence {seq} has slices run by Ulysses and slices placed whole-doc / per-doc; "
                                "their carried K/V are laid out differently (heads vs tokens)")
            for (_, before), (start, w) in zip(items, items[1:]):
                if w is None or w == before or before == -1:
                    continue
                raise PlanError(f"sequence {seq}: the slice at token {start} is placed "
                                f"{'per-doc' if w == -1 else f'on rank {w}'} but the earlier slice's K/V live on "
                                f"rank {before} only")

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
