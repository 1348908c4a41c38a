"""The vocabulary of a step plan: slices, chunks, stage layouts, actions, the planner's error.

Frozen dataclasses and enums of tuples and scalars, hashable and comparing by value: a
:class:`Slice` of a sequence, a :class:`Chunk` of slices and its :class:`ChunkKind`, the
:class:`StageLayout` (which decoder layers each pipeline stage owns), an :class:`Action` of a
stage on a chunk and its :class:`ActionKind`. :class:`PlanError` is what the planner raises, with
the :class:`Remedy` s that would help. The plan made of them: :mod:`.plan`.

Conventions: stages are 0-indexed, ``stage 0`` owns the embedding, the last stage owns the
final norm, the LM head and the loss. Chunk ``index`` is its position in the plan's global
forward order (``plan.chunks[i].index == i``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "Action",
    "ActionKind",
    "Chunk",
    "ChunkKind",
    "PlanError",
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
