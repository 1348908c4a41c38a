"""Segment-level training (opt-in, ``docs/segments.md``): the options as plan knobs, and the cuts they force.

A plan made with ``segment_tokens=S`` cuts every sequence longer than ``S`` at every multiple of
``S``: its slices *are* its segments (``S`` tokens each, the last the remainder); sequences of at
most ``S`` tokens are untouched. The options travel in ``plan.knobs`` (``segment_tokens``,
``segment_gradient``, ``segment_kv_tail``, and ``segment_global_heads`` when set) so that the executor and the simulator read the same
objective from the one object every rank receives; :func:`segment_options` reads them back and
:func:`check_segment_plan` refuses a plan whose split slices are not the segments.

Semantics (what the runtime computes, and the plain-HF reference in the tests): segment ``k`` of a
sequence attends causally to its own tokens and to the earlier tokens at positions ``>= start_k -
W`` (``W = segment_kv_tail``, unbounded when ``None``); under ``segment_gradient="previous"`` only
the K/V of segment ``k - 1`` receive gradient from segment ``k``, older K/V are read detached; under
``"none"`` every earlier segment's K/V is read detached (Transformer-XL's truncation: no gradient
crosses a segment boundary), so a segment's backward needs no later segment's and runs right after
its forward (textbook 1F1B over segments: a stage holds a few segments' activations whatever the
sequence length, plus the K/V tail). The
*global heads* (query heads, the same on every layer; they need a tail W) also read every earlier key
before ``start_k - W``, detached (no gradient reaches those K/V): their K/V is kept whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .plan import Plan
from .types import PlanError

__all__ = ["SEGMENT_GRADIENTS", "SegmentOptions", "check_segment_plan", "parse_heads", "segment_cuts",
           "segment_options"]

SEGMENT_GRADIENTS = ("full", "previous", "none")


@dataclass(frozen=True, slots=True)
class SegmentOptions:
    """``tokens``: segment length S; ``gradient``: ``"full"`` or ``"previous"``; ``kv_tail``: W or
    ``None``; ``global_heads``: query heads that also read every key before the tail, detached."""

    tokens: int
    gradient: str = "full"
    kv_tail: int | None = None
    global_heads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 1:
            raise PlanError(f"segment_tokens must be a positive number of tokens (got {self.tokens!r})")
        if self.gradient not in SEGMENT_GRADIENTS:
            raise PlanError(f"segment_gradient must be one of {SEGMENT_GRADIENTS} (got {self.gradient!r})")
        if self.kv_tail is not None and (not isinstance(self.kv_tail, int) or self.kv_tail < 0):
            raise PlanError(f"segment_kv_tail must be None or a number of tokens >= 0 (got {self.kv_tail!r})")
        heads = tuple(self.global_heads)
        if any(not isinstance(h, int) or isinstance(h, bool) or h < 0 for h in heads) or len(set(heads)) < len(heads):
            raise PlanError(f"segment_global_heads must be distinct query-head indices >= 0 (got {heads!r})")
        if heads and self.kv_tail is None:
            raise PlanError("segment_global_heads needs a K/V tail (segment_kv_tail): without one every head "
                            "already reads every earlier token")
        object.__setattr__(self, "global_heads", tuple(sorted(heads)))

    @property
    def chained(self) -> bool:
        """Whether a slice's backward waits for the later slices' (they send its K/V gradient);
        not under ``gradient="none"``."""
        return self.gradient != "none"

    def knobs(self) -> tuple[tuple[str, Any], ...]:
        knobs = (("segment_tokens", self.tokens), ("segment_gradient", self.gradient),
                 ("segment_kv_tail", self.kv_tail))
        # a string, so that the knob survives the plan's JSON round trip as it is
        heads = ",".join(map(str, self.global_heads))
        return knobs + ((("segment_global_heads", heads),) if heads else ())


def segment_options(plan: Plan) -> SegmentOptions | None:
    """The segment options a plan was made with (``None``: ordinary training)."""
    tokens = plan.knob("segment_tokens")
    if tokens is None:
        return None
    return SegmentOptions(int(tokens), plan.knob("segment_gradient", "full"), plan.knob("segment_kv_tail"),
                          parse_heads(plan.knob("segment_global_heads")))


def parse_heads(heads: Any) -> tuple[int, ...]:
    """Global heads as given (``"0,3"``, a sequence of ints, ``None``) -> a tuple of ints."""
    if heads is None or heads == "":
        return ()
    if isinstance(heads, str):
        try:
            return tuple(int(h) for h in heads.replace(" ", "").split(","))
        except ValueError:
            raise PlanError(f"segment_global_heads must be comma-separated query-head indices (got {heads!r})") from None
    return tuple(heads)


def segment_cuts(length: int, tokens: int) -> list[int]:
    """Slice lengths of a sequence of ``length`` tokens cut into segments of ``tokens``."""
    full, rest = divmod(length, tokens)
    return [tokens] * full + ([rest] if rest else [])


def check_segment_plan(plan: Plan) -> SegmentOptions | None:
    """:func:`segment_options`, after checking that every sequence longer than S is cut exactly into
    its segments (a slice per segment). Raises :class:`PlanError` naming the first offending slice."""
    opts = segment_options(plan)
    if opts is None:
        return None
    for seq, n in enumerate(plan.seq_lens):
        slices = [s for _, s in plan.slices_of(seq)]
        got = [s.length for s in slices]
        want = segment_cuts(n, opts.tokens) if n > opts.tokens else ([n] if n else [])
        if got != want:
            raise PlanError(
                f"segment-level training with segment_tokens={opts.tokens}: sequence {seq} ({n} tokens) is "
                f"cut into slices of {got} tokens, not its segments {want}; plan with segment_tokens set")
    return opts
