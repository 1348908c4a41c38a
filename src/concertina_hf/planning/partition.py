"""Split the decoder layers over pipeline stages so that stages take equal time.

Stage ``s`` owning layers ``[a, b)`` costs, for a representative chunk of ``tokens_hint``
tokens at context 0 (forward plus backward, no recompute)::

    (b - a) * layer_time  +  [s == 0] * embedding_time  +  [s == p - 1] * (head + loss)_time

With layers of several kinds (:attr:`~.cost.CostModel.layer_kinds`: attention and linear
attention) or attention layers of several shapes (:attr:`~.cost.CostModel.layer_scales`: per-layer
configs, Gemma 4's full layers of twice the head size) or sliding-window layers
(:attr:`~.cost.CostModel.windowed_layers`) ``(b - a) * layer_time`` is the sum of the stage's own
layers' times, each at its kind's, shape's and window's. Layers that share K/V
(:attr:`~.cost.CostModel.kv_share_spans`, Gemma 4's ``num_kv_shared_layers``) stay on one stage: no
boundary falls inside a span.

The layout minimizing the slowest stage comes from an exact dynamic program over split points,
``best[k][j]`` = the smallest possible maximum stage time when the first ``k`` stages own the
first ``j`` layers. A stage's candidate starts are scanned from the right and the scan stops
once the stage alone is slower than the best found, so a step costs about the layers of one
stage: ``O(L^2)`` in all, a few ms for 128 layers on 64 stages in pure Python. Among
optimal layouts the one giving later stages as many layers as possible is taken: in 1F1B the
early stages hold the most chunks in flight, so moving a layer toward the end saves memory
where it is scarcest at no cost in time.
"""

from __future__ import annotations

import dataclasses

from .cost import CostModel
from .types import Chunk, ChunkKind, PlanError, Remedy, Slice, StageLayout

__all__ = ["partition_layers", "stage_times"]


def _unit_times(cost: CostModel, tokens_hint: int) -> tuple[float, float, float]:
    """(one decoder layer, embedding, head + loss), forward plus backward, in seconds."""
    chunk = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, tokens_hint),))
    one = StageLayout(1, ((0, 1),))  # a single stage owning one layer, the embedding and the head
    bare = StageLayout(3, ((0, 1), (1, 2), (2, 3)))  # the middle stage has neither
    layer = cost.fwd_time(bare, 1, chunk) + cost.bwd_time(bare, 1, chunk)
    embed_only = StageLayout(2, ((0, 1), (1, 2)))
    embed = cost.fwd_time(embed_only, 0, chunk) + cost.bwd_time(embed_only, 0, chunk) - layer
    head = cost.fwd_time(embed_only, 1, chunk) + cost.bwd_time(embed_only, 1, chunk) - layer
    # sanity: a one-stage model owns all three (keeps this in step with the cost model)
    total_one = cost.fwd_time(one, 0, chunk) + cost.bwd_time(one, 0, chunk)
    if abs(total_one - (layer + embed + head)) > 1e-9 * max(1.0, total_one):
        raise PlanError("cost model's stage time is not additive over layers, embedding and head")
    return layer, max(0.0, embed), max(0.0, head)


def stage_times(cost: CostModel, layout: StageLayout, tokens_hint: int = 4096) -> tuple[float, ...]:
    """Forward + backward time of each stage of ``layout`` on a ``tokens_hint``-token chunk."""
    chunk = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, tokens_hint),))
    return tuple(cost.fwd_time(layout, s, chunk) + cost.bwd_time(layout, s, chunk) for s in range(layout.num_stages))


def partition_layers(cost: CostModel, num_stages: int, num_layers: int | None = None,
                     tokens_hint: int = 4096) -> StageLayout:
    """Contiguous layer ranges minimizing the slowest stage's time (see the module docstring)."""
    L = cost.num_layers if num_layers is None else num_layers
    p = num_stages
    if p < 1:
        raise PlanError(f"pipeline size must be at least 1, got {p}", Remedy("pipeline_size", "raise", 1))
    if p > L:
        raise PlanError(
            f"cannot place {L} decoder layers on {p} pipeline stages (every stage needs at least one layer)",
            Remedy("pipeline_size", "lower", L),
        )
    if tokens_hint < 1:
        raise PlanError(f"tokens_hint must be positive, got {tokens_hint}")
    if cost.layer_kinds or cost.layer_scales or cost.windowed_layers:  # each layer at its kind's, shape's
        # and window's time (the checks of _unit_times on each)
        layer, embed, head = _unit_times(dataclasses.replace(cost, layer_kinds=(), layer_scales=(),
                                                             windowed_layers=()), tokens_hint)
        times: dict[tuple, float] = {}
        prefix = [0.0]
        for i in range(L):
            kind = cost.layer_kinds[i] if i < len(cost.layer_kinds) else "attention"
            shape = cost.layer_scales[i] if i < len(cost.layer_scales) else (1.0,) * 5
            windowed = i in cost.windowed_layers
            if (kind, shape, windowed) not in times:
                one = dataclasses.replace(cost, layer_kinds=(kind,) * 3 if cost.layer_kinds else (),
                                          layer_scales=(shape,) * 3 if cost.layer_scales else (),
                                          windowed_layers=(0, 1, 2) if windowed else ())
                times[kind, shape, windowed] = _unit_times(one, tokens_hint)[0]
            prefix.append(prefix[-1] + times[kind, shape, windowed])
    else:
        layer, embed, head = _unit_times(cost, tokens_hint)
        prefix = None

    def cost_of(k: int, i: int, j: int) -> float:
        """Time of stage k (0-indexed) owning layers [i, j)."""
        t = (j - i) * layer if prefix is None else prefix[j] - prefix[i]
        if k == 0:
            t += embed
        if k == p - 1:
            t += head
        return t

    inf = float("inf")
    spans = cost.kv_share_spans  # layers a stage holds whole (KV sharing): no boundary inside

    def cut_ok(j: int) -> bool:
        """A stage may end after layer ``j - 1``."""
        return not any(a < j <= b for a, b in spans)

    # best[k][j]: min over layouts of the first k stages on the first j layers of the max time
    best = [[inf] * (L + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        # stage k-1 ends at layer j; stages before it need >= 1 layer each, after it too
        for j in range(k, L - (p - k) + 1):
            if k < p and not cut_ok(j):
                continue
            row = best[k - 1]
            m = inf
            # the stage's own time grows as its start i moves left: once it alone reaches the
            # best max so far, no earlier start can do better
            for i in range(j - 1, k - 2, -1):
                c = cost_of(k - 1, i, j)
                if c >= m:
                    break
                v = row[i]
                v = v if v > c else c
                if v < m:
                    m = v
            best[k][j] = m
    target = best[p][L]
    if target == inf:
        raise PlanError(
            f"cannot place {L} decoder layers on {p} pipeline stages keeping layers {spans} on one stage each "
            "(KV sharing: later layers read the K/V of an earlier one, and no K/V passes between stages)",
            Remedy("pipeline_size", "lower", 1 + sum(cut_ok(j) for j in range(1, L))),
        )
    # Reconstruct from the last stage backwards, each stage taking as many layers as the
    # optimum allows (later stages hold fewer chunks in flight in 1F1B).
    tol = 1e-12 * max(1.0, target)
    ranges: list[tuple[int, int]] = []
    end = L
    for k in range(p, 0, -1):
        start = None
        for i in range(k - 1, end):  # smallest start = most layers for this stage
            if cost_of(k - 1, i, end) <= target + tol and best[k - 1][i] <= target + tol:
                start = i
                break
        assert start is not None  # the DP guarantees a feasible split point
        ranges.append((start, end))
        end = start
    ranges.reverse()
    return StageLayout(L, tuple(ranges))
