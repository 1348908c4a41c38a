"""Fitting the cost model to measurements: the only least-squares code of the project.

- :func:`nonneg_lstsq`: least squares with non-negative coefficients (active set: drop the
  negative coefficients and solve again). Every fit below and in
  :meth:`~concertina_hf.planning.cost.CostModel.fit` and the profiler uses it.
- :class:`ActionSample` / :func:`action_samples`: a chunk's measured forward and backward on a
  stage, paired from a step's measured actions.
- :func:`refit_cost_model`: the online refit (time coefficients from measured actions; activation
  bytes raised when a stage measured more than predicted).

Pure Python and numpy; no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from .cost import CostModel
from .types import Action, ActionKind, Chunk, Plan, StageLayout

__all__ = ["ActionSample", "action_samples", "nonneg_lstsq", "refit_cost_model"]


@dataclass(frozen=True)
class ActionSample:
    """The measured forward and backward time of one chunk on one stage."""

    stage: int
    chunk: Chunk
    recompute: int
    fwd_s: float
    bwd_s: float


def action_samples(plan: Plan, actions: Sequence[tuple[Action, float, float]]) -> list[ActionSample]:
    """Pair each chunk's measured forward and backward on each stage (chunks missing one are skipped)."""
    fwd: dict[tuple[int, int], float] = {}
    bwd: dict[tuple[int, int], float] = {}
    for a, t0, t1 in actions:
        (fwd if a.kind is ActionKind.FORWARD else bwd)[(a.stage, a.chunk)] = t1 - t0
    return [ActionSample(s, plan.chunks[c], plan.recompute[s][c], tf, bwd[(s, c)])
            for (s, c), tf in sorted(fwd.items()) if (s, c) in bwd]


def refit_cost_model(cost: CostModel, layout: StageLayout, samples: Sequence[ActionSample],
                     memory_scale: float = 1.0) -> CostModel | None:
    """Least-squares time coefficients from measured actions; ``None`` when underdetermined.

    A forward of a chunk (slices ``s_i`` at contexts ``C_i``, ``T`` tokens) on a stage of ``n``
    layers is modelled as ``n * (alpha_attn * P + alpha_tok * T + beta) + k * (e * [first] + h *
    [last]) * T`` with ``P = sum((C+s)^2 - C^2)`` and the analytic embedding / head rates ``e``,
    ``h`` scaled by one fitted factor ``k`` (the head of a large vocabulary is a big share of the
    last stage, so it must be fitted too). Coefficients are kept non-negative. The backward factor
    is then ``sum(t_bwd - r * layer_fwd) / sum(t_fwd)`` over the samples. With
    ``memory_scale > 1`` the activation byte coefficients are multiplied by it (never lowered: the
    runtime's meter sees saved tensors only, not allocator slack). Cost: one ``lstsq`` on a
    ``len(samples) x 4`` matrix.
    """
    import numpy as np

    if len({(x.stage, x.chunk.slices) for x in samples}) < 4:
        return None
    e0, h0 = cost.embed_time_per_token, cost.head_time_per_token
    if e0 + h0 <= 0:
        e0 = h0 = 1e-9
    rows, y = [], []
    for x in samples:
        n = layout.num_stage_layers(x.stage)
        pairs = sum((sl.context + sl.length) ** 2 - sl.context ** 2 for sl in x.chunk.slices)
        tok = x.chunk.num_tokens
        extra = (e0 if layout.has_embedding(x.stage) else 0.0) + (h0 if layout.has_head(x.stage) else 0.0)
        rows.append([n * pairs, n * tok, n, extra * tok])
        y.append(x.fwd_s)
    coef = nonneg_lstsq(np.array(rows, dtype=float), np.array(y, dtype=float))
    if coef is None or not np.isfinite(coef).all() or coef[:3].sum() <= 0:
        return None
    a, b, beta, k = (float(v) for v in coef)
    new = dataclasses.replace(cost, alpha_attn=a, alpha_tok=b, beta=beta, embed_time_per_token=e0 * k,
                              head_time_per_token=h0 * k, source="online")
    fwd_pred = sum(new.fwd_time(layout, x.stage, x.chunk) for x in samples)
    bwd_rest = sum(max(0.0, x.bwd_s - x.recompute * new.layer_fwd_time(x.chunk.slices)) for x in samples)
    if fwd_pred <= 0 or bwd_rest <= 0:
        return None
    changes: dict[str, Any] = {"bwd_factor": bwd_rest / fwd_pred}
    if memory_scale > 1.0:
        for name in ("act_bytes_per_token", "ckpt_bytes_per_token", "kv_bytes_per_token", "logits_bytes_per_token"):
            changes[name] = getattr(new, name) * memory_scale
    return dataclasses.replace(new, **changes)


def nonneg_lstsq(a, y):
    """Least squares with coefficients >= 0 (active set by dropping the negative ones and
    solving again); ``None`` when no coefficient stays positive."""
    import numpy as np

    active = list(range(a.shape[1]))
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            out = np.zeros(a.shape[1])
            out[active] = sol
            return out
        active = [i for i, v in zip(active, sol) if v > 0]
    return None
