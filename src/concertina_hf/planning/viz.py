"""Pictures of a plan: the pipeline schedule as a Gantt chart and each stage's memory over time.

:func:`plot_gantt` draws, top to bottom:

1. the *planned* schedule from the simulator (``sim.action_times``): one row per stage, one bar
   per action, colored by chunk kind (packed / split / hybrid), forwards light and backwards
   dark, the recompute part of a backward hatched (exactly, when the cost model is given; else
   the whole backward of a chunk with recompute is hatched), the all-to-alls of a stage of
   several GPUs (Ulysses, ``sp > 1``; from the cost model) dotted at the end of each bar, chunk
   indices on bars wide enough to hold them;
2. the *measured* schedule, when given (actual start / end per action, e.g. from the runtime's
   timers), on the same time axis so gaps between plan and reality show (on its own axis when
   the measured step is more than twice as long or short as planned: the title gives the ratio);
3. every stage's memory over time (``sim.memory_timeline``, a step function) in a unit that
   fits the data (KiB, MiB or GiB), with its budget as a dashed line labelled with its value
   and, when given, where it came from; a budget far above the data (the CPU's ``auto`` budget)
   is named in the legend and the panel scales to the data instead of flattening it.

The legend shows the chunk kinds present with their count, and the forward (light), backward
(dark) and recompute (hatched) shades drawn in the color of the plan's most common kind, as the
bars are.

matplotlib is an optional dependency (``pip install concertina_hf[viz]``); it is imported only
here, through its object API with the Agg canvas, so the global backend is left alone. Drawing
costs one ``broken_barh`` call per (stage, color), so plans with thousands of actions draw in
about a second.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

from .plan import Plan
from .sharding import chunk_mode
from .types import Action, ActionKind, ChunkKind

__all__ = ["KIND_COLORS", "describe_parallelism", "plot_gantt"]

KIND_COLORS = {ChunkKind.PACKED: "#4C72B0", ChunkKind.SPLIT: "#DD8452", ChunkKind.HYBRID: "#55A868"}
#: the suffix of a chunk's label for its sharding mode inside a stage (Ulysses: none)
_MODE_MARKS = {"whole-doc": "w", "per-doc": "d", "mixed": "m"}
_STAGE_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
_GIB = float(2**30)


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "drawing plans needs matplotlib; install it with `pip install concertina_hf[viz]`"
        ) from e
    return Figure, FigureCanvasAgg, Patch


def _normalize_measured(
    measured: Sequence[tuple[Any, float, float]] | Mapping[int, Sequence[Any]] | None,
) -> list[tuple[Action, float, float]]:
    """Measured actions as ``(Action, start, end)`` with times relative to the earliest start.

    Accepts a flat list of ``(action, start, end)`` or ``{stage: [(action, start, end), ...]}``;
    an action may be an :class:`Action` or its string form ``"1F3"``.
    """
    if measured is None:
        return []
    rows: Iterable[Any]
    if isinstance(measured, Mapping):
        rows = [r for stage in sorted(measured) for r in measured[stage]]
    else:
        rows = measured
    out = []
    for r in rows:
        a, t0, t1 = r
        a = a if isinstance(a, Action) else Action.parse(str(a))
        out.append((a, float(t0), float(t1)))
    if not out:
        return []
    base = min(t0 for _, t0, _ in out)
    return [(a, t0 - base, t1 - base) for a, t0, t1 in out]


def describe_parallelism(plan: Plan, pp: int | None = None, sp: int = 1) -> str:
    """What runs ``plan``, for titles: ``pp P x sp S`` (``pp`` default: the plan's stages) for a
    pipeline plan; for a plan that records its own layout (the ``sp-only`` baseline's knobs
    ``sp``, ``data_parallel``, ``zero3``: one stage of every layer) its Ulysses groups, e.g.
    ``1 stage: 2 Ulysses groups of sp 2 (data parallel, ZeRO-3) on 4 GPUs``."""
    u = plan.knob("sp")
    if u is None:
        pp = plan.num_stages if pp is None else pp
        return f"pp {pp}" + (f" x sp {sp}" if sp > 1 else "")
    groups = int(plan.knob("data_parallel", 1))
    extra = [w for w, on in (("data parallel", groups > 1), ("ZeRO-3", bool(plan.knob("zero3")))) if on]
    return (f"1 stage: {groups} Ulysses group{'s' if groups > 1 else ''} of sp {int(u)}"
            + (f" ({', '.join(extra)})" if extra else "") + f" on {groups * int(u)} GPUs")


def _draw_schedule(ax, plan: Plan, times: Sequence[tuple[Action, float, float]], cost, span: float, label: str):
    p = plan.num_stages
    lanes = int(plan.knob("data_parallel", 1))
    # a plan of rounds (sp-only: groups of GPUs run a round's micro-batches at once): one row per group of GPUs
    row = {c: k for g in plan.groups for k, c in enumerate(g)} if lanes > 1 else None
    # group bars by (stage, color, alpha, hatch) so each group is one broken_barh call
    groups: dict[tuple[int, str, float, str | None], list[tuple[float, float]]] = {}
    texts = []
    for a, t0, t1 in times:
        chunk = plan.chunks[a.chunk]
        color = KIND_COLORS[chunk.kind]
        dur = max(t1 - t0, 0.0)
        y = row[a.chunk] if row is not None else a.stage
        r = plan.recompute[a.stage][a.chunk] if plan.recompute else 0
        comm = 0.0
        if cost is not None and getattr(cost, "sp", 1) > 1:
            comm = min(dur, cost.comm_time(plan.layout, a.stage, chunk, a.kind is ActionKind.BACKWARD, r))
        if comm > 0:  # drawn at the end of the bar: one bar per action still
            groups.setdefault((y, color, 0.95 if a.kind is ActionKind.BACKWARD else 0.45, "...."),
                              []).append((t1 - comm, comm))
            dur -= comm
        if a.kind is ActionKind.FORWARD:
            groups.setdefault((y, color, 0.45, None), []).append((t0, dur))
        else:
            rec = 0.0
            if r:
                # exact recompute share from the cost model; without it hatch the whole bar
                rec = min(dur, cost.recompute_time(chunk, r)) if cost is not None else dur
            if rec > 0:
                groups.setdefault((y, color, 0.95, "////"), []).append((t0, rec))
            if dur - rec > 0:
                groups.setdefault((y, color, 0.95, None), []).append((t0 + rec, dur - rec))
        # a placed chunk's mode inside the stage (.sharding): w(hole-doc), d (per-doc), m(ixed)
        name = f"{a.chunk}{_MODE_MARKS.get(chunk_mode(chunk), '')}"
        if span > 0 and dur / span > 0.012 * max(1, len(name)):
            texts.append((t0 + dur / 2, y, name))
    for (stage, color, alpha, hatch), bars in groups.items():
        ax.broken_barh(bars, (stage - 0.4, 0.8), facecolors=color, alpha=alpha, hatch=hatch,
                       edgecolor="white", linewidth=0.3)
    for x, y, s in texts:
        ax.text(x, y, s, ha="center", va="center", fontsize=6, color="black")
    names = [f"GPUs {k}" for k in range(lanes)] if row is not None else [f"stage {s}" for s in range(p)]
    p = len(names)
    ax.set_yticks(range(p))
    ax.set_yticklabels(names)
    ax.set_ylim(p - 0.5, -0.5)  # stage 0 on top, as in pipeline diagrams
    ax.set_xlim(0, span if span > 0 else 1)
    ax.set_ylabel(label)
    ax.grid(axis="x", alpha=0.3)


def plot_gantt(
    plan: Plan,
    sim: Any,
    path: str | os.PathLike,
    measured: Sequence[tuple[Any, float, float]] | Mapping[int, Sequence[Any]] | None = None,
    title: str | None = None,
    *,
    cost: Any = None,
    budget_source: str | None = None,
    dpi: int = 130,
) -> str:
    """Draw ``plan`` as simulated by ``sim`` (a :class:`~concertina_hf.planning.simulate.SimResult`)
    into ``path`` (format from the suffix, e.g. ``.png``, ``.svg``, ``.pdf``); return the path.

    ``measured``: actual ``(action, start_s, end_s)`` of a run, flat or per stage; drawn under
    the plan on the same time axis (times are shifted so the earliest start is 0). ``cost``:
    the :class:`~concertina_hf.planning.cost.CostModel` the plan was simulated with, to hatch
    the exact recompute part of each backward. ``budget_source``: where the memory budget came
    from (e.g. ``"auto: 0.9 x 80 GiB"``), shown with it.
    """
    Figure, FigureCanvasAgg, Patch = _matplotlib()
    if cost is not None and hasattr(cost, "for_plan"):
        cost = cost.for_plan(plan)  # a plan on its own layout (the sp-only baseline)
    p = max(plan.num_stages, int(plan.knob("data_parallel", 1)))  # schedule rows
    planned = [(a, t0, t1) for a, (t0, t1) in sim.action_times.items()]
    meas = _normalize_measured(measured)
    measured_step = max([t1 for _, _, t1 in meas] + [0.0])
    span = max(sim.step_time_s, measured_step)
    # a measured step more than twice as long (or short) as planned gets its own time axis, so
    # neither schedule (nor the predicted memory under the plan) is squeezed into a corner
    separate = bool(meas) and min(sim.step_time_s, measured_step) > 0 and \
        max(sim.step_time_s, measured_step) > 2 * min(sim.step_time_s, measured_step)
    planned_span = sim.step_time_s if separate else span

    n_rows = 3 if meas else 2
    heights = [max(1.6, 0.45 * p + 0.6)] * (n_rows - 1) + [2.4]
    fig = Figure(figsize=(13, sum(heights) + 1.4), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_rows, 1, sharex=not separate, gridspec_kw={"height_ratios": heights})
    _draw_schedule(axes[0], plan, planned, cost, planned_span, "planned")
    if meas:
        _draw_schedule(axes[1], plan, meas, cost, measured_step if separate else span, "measured")
        axes[1].set_title(
            f"measured step {measured_step:.3g} s vs planned {sim.step_time_s:.3g} s "
            f"({(measured_step / sim.step_time_s - 1) * 100 if sim.step_time_s > 0 else 0:+.1f}%)"
            + (", on its own time axis" if separate else ""),
            fontsize=9, loc="left",
        )
    if separate:
        axes[1].set_xlabel("measured time (s)", fontsize=8)
    span = planned_span  # the memory panel is the plan's prediction: the planned time axis

    mem_ax = axes[-1]
    budgets = list(plan.memory_budget_bytes)
    peak = max([b for points in sim.memory_timeline for _, b in points] + [1])
    unit, scale = _memory_unit(peak)
    for s, points in enumerate(sim.memory_timeline):
        color = _STAGE_COLORS[s % len(_STAGE_COLORS)]
        xs = [t for t, _ in points] + [span]
        ys = [b / scale for _, b in points]
        ys.append(ys[-1] if ys else 0.0)
        mem_ax.step(xs, ys, where="post", color=color, linewidth=1.0, label=f"stage {s}")
    top = peak * 1.15
    shown = [b for b in budgets if b > 0]
    if shown:
        # a budget within 3x of the data is drawn; one far above it would flatten the curves to the
        # axis (the CPU's 'auto' budget): the panel keeps the data's scale and the legend names it
        drawn = [b for b in shown if b <= 3 * peak]
        if drawn:
            top = max(top, max(drawn) * 1.08)
        same = len(set(shown)) == 1
        value = " / ".join(_fmt_bytes(b) for b in (shown[:1] if same else shown))
        where = f" ({budget_source})" if budget_source else ""
        off = "" if len(drawn) == len(shown) else ", above this panel"
        label = f"budget {value}{'' if same else ' per stage'}{where}{off}"
        for s, b in enumerate(budgets):
            if 0 < b <= 3 * peak and (s == 0 or not same):
                mem_ax.axhline(b / scale, color="black" if same else _STAGE_COLORS[s % len(_STAGE_COLORS)],
                               linestyle="--", linewidth=0.9)
        mem_ax.plot([], [], color="black", linestyle="--", linewidth=0.9, label=label)
    mem_ax.set_ylabel(f"memory ({unit})")
    mem_ax.set_xlabel("planned time (s)" if separate else "time (s)")
    mem_ax.set_xlim(0, span if span > 0 else 1)
    mem_ax.set_ylim(0, top / scale)
    mem_ax.grid(alpha=0.3)
    mem_ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncol=p + 1, frameon=False)  # above the curves

    counts = plan.chunk_counts()
    present = [k for k in ChunkKind if counts.get(k.value, 0)]
    handles = [Patch(facecolor=KIND_COLORS[k], alpha=0.95, label=f"{k.value} ({counts[k.value]})") for k in present]
    shade = KIND_COLORS[max(present, key=lambda k: counts[k.value])] if present else "grey"
    handles += [
        Patch(facecolor=shade, alpha=0.45, label="forward (light)"),
        Patch(facecolor=shade, alpha=0.95, label="backward (dark)"),
        Patch(facecolor=shade, alpha=0.95, edgecolor="white", hatch="////",
              label="recompute (hatched)" if cost is not None else "backward with recompute (hatched)"),
    ]
    if cost is not None and getattr(cost, "sp", 1) > 1:
        placed = [c for c in plan.chunks if c.placement]
        what = "all-to-all / K/V all-gather" if placed else "all-to-all"
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="....", label=f"{what} (sp={cost.sp})"))
        if placed:
            handles.append(Patch(facecolor="white", edgecolor="white",
                                 label="chunk N: Ulysses, Nw whole-doc, Nd per-doc, Nm mixed"))
    # above the chart, so it never hides the first bars
    axes[0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7,
                   ncol=len(handles), frameon=False)
    head = title or (f"{plan.strategy}: {plan.num_chunks} chunks, "
                     f"{describe_parallelism(plan, sp=int(getattr(cost, 'sp', 1) or 1))}")
    fig.suptitle(
        f"{head}\npredicted step {sim.step_time_s:.3g} s, bubble {sim.bubble_fraction:.1%}, "
        f"recompute {sim.recompute_fraction:.1%}, peak memory "
        + " / ".join(_fmt_bytes(b) for b in sim.peak_memory_bytes),
        fontsize=10,
    )
    fig.tight_layout()
    out = os.fspath(path)
    fig.savefig(out)
    return out


def _memory_unit(peak_bytes: float) -> tuple[str, float]:
    """The unit (KiB, MiB, GiB) in which ``peak_bytes`` reads as a number from 1 to 1024."""
    for unit, scale in (("GiB", _GIB), ("MiB", float(2**20))):
        if peak_bytes >= scale:
            return unit, scale
    return "KiB", 1024.0


def _fmt_bytes(b: float) -> str:
    unit, scale = _memory_unit(b)
    return f"{b / scale:.3g} {unit}"
