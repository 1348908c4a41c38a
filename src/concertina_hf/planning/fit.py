"""Fitting the cost model to measurements: the only least-squares code of the project.

- :func:`nonneg_lstsq`: least squares with non-negative coefficients (active set: drop the
  negative coefficients and solve again); :func:`through_origin`: the one-coefficient fit
  ``y = k * x``. Every fit below uses one of them, and so does the collectives' latency and
  bandwidth fit (:func:`concertina_hf.runtime.ulysses.fit_all_to_all`).
- :func:`fit_profile`: decoder-layer time coefficients (and activation bytes per token) from
  profiled :class:`~concertina_hf.planning.coefficients.ProfileSample` s.
- :func:`fit_activation_bytes`: the per-token and per-context-token bytes of
  chunks measured without recompute (the profiler's byte fit).
- :func:`fit_linear_layer`: a linear-attention layer's time per token, per slice and per token
  of the scan's padding (``lin_alpha_tok``, ``lin_beta_segment``, ``lin_pad_time_per_token``) from
  chunks timed on such layers alone;
  :func:`fit_linear_bytes`: its saved bytes per token, per token of each slice's padding to
  the scan chunk and per slice.
- :class:`ActionSample` / :func:`action_samples`: a chunk's measured forward and backward on a
  stage, paired from a step's measured actions.
- :func:`refit_cost_model`: the online refit (time coefficients from measured actions, every
  term the profiler fits, none below a floor; activation bytes raised when a stage measured
  more than predicted); :func:`bounded_refit` keeps it only when it predicts held-out steps
  better than the current model (:func:`prediction_error`).

The measurements come from :mod:`concertina_hf.runtime.profiler` (chunks run on the device) and
from the executor's timed actions (:class:`~concertina_hf.training.callbacks.StepStatsCallback`). Each fit is
one ``lstsq`` per active set on a ``samples x features`` matrix (at most 4 features): negligible
next to measuring the samples.

Pure Python and numpy; no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

from .coefficients import ChunkShape, ProfileSample
from .cost import CostModel
from .plan import Plan
from .types import Action, ActionKind, Chunk, StageLayout

__all__ = [
    "FLOOR_FRACTION", "ActionSample", "action_samples", "bounded_refit", "fit_activation_bytes", "fit_linear_bytes",
    "fit_linear_layer", "fit_profile",
    "nonneg_lstsq", "prediction_error", "refit_cost_model", "relative_line", "through_origin",
]

def fit_profile(cost: CostModel, samples: Sequence[ProfileSample]) -> CostModel:
    """``cost`` with ``alpha_attn``, ``alpha_tok``, ``beta``, ``bwd_factor`` (and the activation
    bytes per token when samples carry them) fitted by least squares; other fields are kept.

    Coefficients are constrained non-negative (:func:`nonneg_lstsq`; all 0 when none stays
    positive). ``bwd_factor`` is ``sum(bwd) / sum(fwd)``; the activation bytes per token a fit
    through the origin. Needs at least 3 samples with different shapes.
    """
    import numpy as np

    if len(samples) < 3:
        raise ValueError(f"fitting the cost model needs at least 3 samples, got {len(samples)}")
    rows = []
    for x in samples:
        tok = sum(s for _, s in x.slices)
        pairs = sum((c + s) ** 2 - c * c for c, s in x.slices)
        rows.append([pairs, tok, 1.0])
    feats = np.array(rows, dtype=float)
    fwd = np.array([x.fwd_time_s for x in samples], dtype=float)
    bwd = np.array([x.bwd_time_s for x in samples], dtype=float)
    coef = nonneg_lstsq(feats, fwd)
    if coef is None:
        coef = np.zeros(feats.shape[1])
    total = float(fwd.sum())
    bwd_factor = float(bwd.sum() / total) if total > 0 else cost.bwd_factor
    coef_attn, coef_tok, coef_beta = (float(v) for v in coef)
    changes: dict[str, Any] = dict(
        alpha_attn=coef_attn, alpha_tok=coef_tok, beta=coef_beta, bwd_factor=bwd_factor, source="fitted",
    )
    acts = [(sum(s for _, s in x.slices), x.act_bytes) for x in samples if x.act_bytes > 0]
    if acts:
        changes["act_bytes_per_token"] = through_origin([t for t, _ in acts], [b for _, b in acts])
    return dataclasses.replace(cost, **changes)


def fit_activation_bytes(chunks: Sequence[tuple[ChunkShape, bool]], nbytes: Sequence[float],
                         num_layers: int) -> tuple[float, float]:
    """``(act_bytes_per_token, context_bytes_per_token)`` from the bytes ``nbytes[i]`` that chunk
    ``chunks[i]`` (its shape, and whether it is a non-final slice of a split sequence) keeps on
    ``num_layers`` layers with no recompute.

    Non-negative least squares of ``bytes = layers * (act * T + ctx * context_tokens)`` (``T``
    tokens; the context tokens are the keys a saved layer holds beyond the chunk's own: its
    contexts, plus a split slice's own K/V kept in the store). Both 0 when neither stays positive.
    """
    import numpy as np

    feats = []
    for shape, split in chunks:
        tok = sum(s for _, s in shape)
        ctx = sum(c + (s if split else 0) for c, s in shape if c > 0)
        feats.append([num_layers * tok, num_layers * ctx])
    a = np.array(feats, dtype=float)
    coef = nonneg_lstsq(a, np.array(nbytes, dtype=float))
    if coef is None:
        coef = np.zeros(a.shape[1])
    act, ctx_b = (float(v) for v in coef)
    return act, ctx_b


def relative_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b * x``, both >= 0, fitted on relative errors (each point counts
    alike, whatever its size: a line through measurements from a few to thousands of tokens
    must hold at the small ones too); a line through the origin when the constant would be
    negative. Points with ``y <= 0`` are ignored; ``(0, 0)`` when none is left.

    >>> a, b = relative_line([64, 256, 1024], [2.0 + 0.5 * x for x in (64, 256, 1024)])
    >>> round(a, 6), round(b, 6)
    (2.0, 0.5)
    """
    import numpy as np

    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if y > 0]
    if not pts:
        return 0.0, 0.0
    a_mat = np.array([[1.0 / y, x / y] for x, y in pts])
    coef = nonneg_lstsq(a_mat, np.ones(len(pts)))
    if coef is None:
        return 0.0, 0.0
    return float(coef[0]), float(coef[1])


def fit_linear_layer(chunks: Sequence[ChunkShape], seconds: Sequence[float], beta: float,
                     scan_chunk: int = 0) -> tuple[float, float, float]:
    """``(lin_alpha_tok, lin_beta_segment, lin_pad_time_per_token)`` of a linear layer's time
    ``lin_alpha_tok * tokens + lin_beta_segment * slices + lin_pad_time_per_token * padding + beta``
    (:meth:`~.cost.CostModel.linear_layer_time`, ``beta`` the attention layers' constant;
    ``padding``: each slice's tokens up to a multiple of ``scan_chunk``, the chunked scan's; 0
    drops that term), all >= 0, fitted on relative errors (as :func:`relative_line`) to
    ``seconds`` per layer of each chunk shape. Chunks of one slice and of many short ones, of the
    same tokens, separate the terms. ``(0, 0, 0)`` when no time is positive.

    >>> a, b, p = fit_linear_layer([((0, 64),), ((0, 8),) * 8, ((0, 256),)], [1.0 + 64e-3, 8.0 + 64e-3, 1.0 + 256e-3], 0.0)
    >>> round(a, 6), round(b, 6), p
    (0.001, 1.0, 0.0)
    >>> shapes = [((0, 64),), ((0, 16),) * 4, ((0, 8),) * 8, ((0, 100),), ((0, 128),)]
    >>> secs = [1e-3 * sum(s for _, s in x) + 0.1 * len(x) + 1e-4 * sum(-s % 64 for _, s in x) for x in shapes]
    >>> tuple(round(c, 6) for c in fit_linear_layer(shapes, secs, 0.0, 64))
    (0.001, 0.1, 0.0001)
    """
    import numpy as np

    rows = []
    for shp, t in zip(chunks, seconds):
        if t > 0:
            pad = sum(-s % scan_chunk for _, s in shp) if scan_chunk else 0
            rows.append((float(sum(s for _, s in shp)), float(len(shp)), float(pad), float(t)))
    if not rows:
        return 0.0, 0.0, 0.0
    cols = 3 if scan_chunk else 2
    a_mat = np.array([[tok / t, n / t, pad / t][:cols] for tok, n, pad, t in rows])
    coef = nonneg_lstsq(a_mat, np.array([1.0 - beta / t for *_, t in rows]))
    if coef is None:
        return 0.0, 0.0, 0.0
    return float(coef[0]), float(coef[1]), float(coef[2]) if cols == 3 else 0.0


def fit_linear_bytes(chunks: Sequence[ChunkShape], nbytes: Sequence[float], scan_chunk: int) -> tuple[float, float, float]:
    """``(per_token, per_pad_token, per_slice)`` >= 0 of a linear layer's saved bytes ``per_token *
    tokens + per_pad_token * padding + per_slice * slices`` (``padding``: each slice's tokens up
    to a multiple of ``scan_chunk``, the scan's padding; 0 drops that term), least squares on
    relative errors over ``nbytes`` per layer of each chunk shape.

    >>> fit_linear_bytes([((0, 64),), ((0, 8),) * 8, ((0, 100),), ((0, 30),) * 3], [6410.0, 7376.0, 10066.0, 9234.0], 64)
    (100.0, 2.0, 10.0)
    """
    import numpy as np

    rows = []
    for shp, y in zip(chunks, nbytes):
        if y > 0:
            pad = sum(-s % scan_chunk for _, s in shp) if scan_chunk else 0
            rows.append(([float(sum(s for _, s in shp)), float(pad), float(len(shp))], float(y)))
    if not rows:
        return 0.0, 0.0, 0.0
    coef = nonneg_lstsq(np.array([[v / y for v in x] for x, y in rows]), np.ones(len(rows)))
    if coef is None:
        return 0.0, 0.0, 0.0
    return tuple(round(float(c), 9) for c in coef)


def through_origin(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope ``k`` of ``y = k * x`` (no intercept); 0 when every ``x`` is 0.

    >>> through_origin([1, 2], [2, 4])
    2.0
    """
    den = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys)) / den if den else 0.0


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


#: the fraction of the floor model's coefficients (the profiled or start model) a refit never
#: goes below: a per-call constant or a per-token rate fitted to 0 on noisy steps makes small
#: chunks look free (measured on CPU: 12 -> 466 chunks a step, 5x slower)
FLOOR_FRACTION = 0.25


def refit_cost_model(cost: CostModel, layout: StageLayout, samples: Sequence[ActionSample],
                     memory_scale: float = 1.0, *, floors: CostModel | None = None,
                     floor_fraction: float = FLOOR_FRACTION) -> CostModel | None:
    """Least-squares time coefficients from measured actions; ``None`` when underdetermined.

    A forward of a chunk (slices ``s_i`` at contexts ``C_i``, ``T`` tokens) on a stage of ``n``
    layers is modelled as ``n * (alpha_attn * P + alpha_tok * T + beta) + k * (E(T) * [first] +
    H(T) * [last])`` with ``P = sum((C+s)^2 - C^2)`` and the start model's embedding / head times
    ``E``, ``H`` (per token, per call, the head's measured points) scaled by one fitted factor
    ``k`` (the head of a large vocabulary is a big share of the last stage, so it must be fitted
    too). The backward factor is then ``sum(t_bwd - r * layer_fwd) / sum(t_fwd)``.

    Every coefficient stays at or above ``floor_fraction`` times its value in ``floors`` (the
    profiled or start model of the run; ``cost`` itself when ``None``; ``floor_fraction=0``: no
    floors): least squares on ``coef = floor + z`` with ``z >= 0``. A refit on noisy steps
    otherwise can set the per-call constant ``beta`` (or ``alpha_tok``) to 0, and small chunks
    look free to the planner. With ``memory_scale > 1`` the activation byte coefficients are multiplied by it
    (never lowered: the runtime's meter sees saved tensors only, not allocator slack). Cost: one
    ``lstsq`` per active set on a ``len(samples) x 4`` matrix.

    A stage of several GPUs (``cost.sp > 1``): the measured times include each layer's
    all-to-alls, whose per-call and per-token parts cannot be told apart from ``beta`` and
    ``alpha_tok`` by a fit; they are taken from ``cost`` (its link fields: analytic, or timed on
    the real group by a profiled run) and subtracted, forward and backward, before the compute
    coefficients are fitted (per GPU, like the model's); a whole-doc / per-doc chunk's are its
    per-doc K/V all-gathers forward and reduce-scatters backward (:meth:`CostModel.comm_time`,
    fitted on the group by a profiled run), its compute the busiest GPU's (the same formula for a
    balanced placement: ``1/sp`` of the pairs and tokens at one GPU's rates). ``zero3`` models (each layer's time the
    larger of its compute and its weight gather) are not refitted (``None``).
    """
    import numpy as np

    if len({(x.stage, x.chunk.slices) for x in samples}) < 4 or cost.zero3:
        return None

    def comm(x: ActionSample, backward: bool = False) -> float:
        """The sample's collectives in one direction (0 at sp = 1): its layers' all-to-alls, or a
        placed chunk's K/V gathers; backward with its recomputed layers' own."""
        return cost.comm_time(layout, x.stage, x.chunk, backward, x.recompute if backward else 0)
    e0, h0 = cost.embed_time_per_token, cost.head_time_per_token
    if e0 + h0 <= 0:
        e0 = h0 = 1e-9
    start = dataclasses.replace(cost, embed_time_per_token=e0, head_time_per_token=h0)

    def ends(x: ActionSample) -> float:  # the start model's embedding and head time of the sample
        tok = x.chunk.num_tokens
        return ((start.embed_time_per_call + e0 * tok if layout.has_embedding(x.stage) else 0.0)
                + (start.head_time(tok) if layout.has_head(x.stage) else 0.0))
    rows, y = [], []
    for x in samples:
        n = layout.num_stage_layers(x.stage)
        sl = x.chunk.slices
        pairs = sum((s.context + s.length) ** 2 - s.context ** 2 for s in sl)
        tok = x.chunk.num_tokens
        rows.append([n * pairs, n * tok, n, ends(x)])
        y.append(x.fwd_s - comm(x))
    a_mat, y_vec = np.array(rows, dtype=float), np.array(y, dtype=float)
    floors = cost if floors is None else floors
    f = floor_fraction
    # k scales the start model's embedding / head rates e0, h0: floor it so neither goes below
    k_lo = max((getattr(floors, name) / base for name, base in
                (("embed_time_per_token", e0), ("head_time_per_token", h0)) if base > 0), default=0.0)
    lo = f * np.array([floors.alpha_attn, floors.alpha_tok, floors.beta, k_lo])
    z = nonneg_lstsq(a_mat, y_vec - a_mat @ lo)
    coef = lo.copy()
    if z is not None:
        coef += z
    if not np.isfinite(coef).all() or coef[:3].sum() <= 0:
        return None
    a, b, beta, k = (float(v) for v in coef)
    new = dataclasses.replace(cost, alpha_attn=a, alpha_tok=b, beta=beta,
                              embed_time_per_token=e0 * k, head_time_per_token=h0 * k,
                              embed_time_per_call=cost.embed_time_per_call * k,
                              head_time_per_call=cost.head_time_per_call * k,
                              head_time_points=tuple((t, v * k) for t, v in cost.head_time_points), source="online")
    # the compute the backward factor multiplies: forward without its all-to-alls; the backward
    # without its own all-to-alls and the recomputed layers' forwards (all-to-alls included)
    fwd_pred = sum(new.fwd_time(layout, x.stage, x.chunk) - comm(x) for x in samples)
    bwd_rest = sum(max(0.0, x.bwd_s - comm(x, True) - x.recompute * new.layer_compute_time(x.chunk.slices))
                   for x in samples)
    if fwd_pred <= 0 or bwd_rest <= 0:
        return None
    bwd_factor = max(bwd_rest / fwd_pred, f * floors.bwd_factor)
    changes: dict[str, Any] = {"bwd_factor": bwd_factor}
    if memory_scale > 1.0:
        for name in ("act_bytes_per_token", "ckpt_bytes_per_token", "kv_bytes_per_token", "logits_bytes_per_token"):
            changes[name] = getattr(new, name) * memory_scale
    return dataclasses.replace(new, **changes)


def prediction_error(cost: CostModel, layout: StageLayout, samples: Sequence[ActionSample]) -> float:
    """Mean ``|log(predicted / measured)|`` of the samples' forward plus backward times (0 when
    none; ``inf`` when a time is not positive): how far ``cost`` is off, either way alike."""
    errs = []
    for x in samples:
        pred = cost.fwd_time(layout, x.stage, x.chunk) + cost.bwd_time(layout, x.stage, x.chunk, x.recompute)
        meas = x.fwd_s + x.bwd_s
        errs.append(abs(math.log(pred / meas)) if pred > 0 and meas > 0 else math.inf)
    return sum(errs) / len(errs) if errs else 0.0


def bounded_refit(cost: CostModel, layout: StageLayout, samples: Sequence[ActionSample],
                  held_out: Sequence[ActionSample], *, floors: CostModel | None = None,
                  memory_scale: float = 1.0) -> tuple[CostModel | None, str]:
    """The online refit with its guards: ``(new model, why)``, the model ``None`` when rejected.

    :func:`refit_cost_model` on ``samples`` with coefficients above the ``floors`` model's (default:
    ``cost``), kept
    only when it predicts ``held_out`` (the latest measured steps, not among ``samples``) better
    than ``cost`` does (:func:`prediction_error`). Without held-out samples there is no
    evidence, and the refit is rejected.
    """
    if cost.zero3:
        return None, "zero3 models (each layer the larger of its compute and its weight gather) are not refitted"
    new = refit_cost_model(cost, layout, samples, memory_scale, floors=floors)
    if new is None:
        return None, f"underdetermined: {len(samples)} samples of too few distinct chunks"
    if not held_out:
        return None, "no held-out samples to check the refit against"
    before, after = prediction_error(cost, layout, held_out), prediction_error(new, layout, held_out)
    if not after < before:
        return None, (f"the refit predicts the {len(held_out)} latest measured actions no better "
                      f"(mean |log error| {after:.3f} vs {before:.3f})")
    return new, f"held-out mean |log error| {before:.3f} -> {after:.3f}"


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
