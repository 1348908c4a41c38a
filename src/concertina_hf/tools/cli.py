"""The ``concertina`` command line.

``concertina plan``: plan one step for a batch of sequence lengths under every requested
strategy and compare the predictions. The lengths come from a file (``--lengths``), from a
dataset tokenized on the fly (``--dataset``, through :func:`concertina_hf.tools.data.load_text_dataset`)
or from a shipped long-tailed distribution (``--distribution``). The model is an HF config (a
Hub name or local path for ``AutoConfig``, a JSON file of config fields, or a preset such as
``llama-13b``), turned into an analytic :class:`~concertina_hf.planning.CostModel` at the
given device's rates (or a fitted cost model from ``--cost-model``). Each strategy's plan is
simulated with the same cost model, so the table compares like for like:

    concertina plan --distribution github --num-seqs 512 --max-len 131072 \\
        --model-config llama-13b --pp 4 --sp 8 --memory-gb 80 --device a800 --strategy all

(``--sp 8``: each stage is 8 GPUs running Ulysses sequence parallelism, with its weights,
gradients and optimizer state sharded as :mod:`concertina_hf.planning.cost_parallel` describes;
``--memory-gb`` is per GPU.)

``--layout auto --gpus N`` chooses the layout instead: every ``pp x sp x dp = N`` split the runtime
can run is planned with ``adaptive`` and ranked (:mod:`concertina_hf.planning.layouts`; layouts a
lower bound shows cannot win are pruned, ``sp-only`` is listed as a reference the trainer cannot
run yet):

    concertina plan --gpus 32 --layout auto --model-config llama-13b --memory-gb 80 \\
        --distribution github --max-len 131072 --num-seqs 512 --json layouts.json

``--device`` takes the presets of :class:`~concertina_hf.planning.DeviceSpec`: ``a800``, ``h100``,
``h200``, ``b200`` (datasheet figures at a stated efficiency) and ``cpu``.

Cost: planning time is the planner's (ILP with a time limit per call, or greedy); the
simulation of a plan takes milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import random
import sys
import time
from typing import Any, Sequence

from ..planning.coefficients import check_model_config
from ..planning.presets import MODEL_PRESETS
from ..planning.types import PlanError

__all__ = ["FLAGS", "build_parser", "load_model_config", "main", "run_plan"]

_GIB = 2**30

#: the flag of this command setting each planner setting its errors name (``PlanError.remedies``)
FLAGS = {"memory_budget": "--memory-gb", "max_tokens_per_chunk": "--max-tokens-per-chunk", "pipeline_size": "--pp",
         "sequence_parallel_size": "--sp", "strategy": "--strategy", "solver": "--solver",
         "sequence_parallel_mode": "--sp-mode"}


# ---------------------------------------------------------------------------------- inputs
def load_model_config(spec: str) -> dict[str, Any]:
    """Config fields of a preset name, a JSON file, or an HF config (``AutoConfig`` name/path)."""
    if spec in MODEL_PRESETS:
        return dict(MODEL_PRESETS[spec])
    p = pathlib.Path(spec)
    if p.is_file():
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise SystemExit(f"--model-config {spec}: not a JSON file ({e})") from None
    else:
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(spec).to_dict()
        except Exception as e:  # noqa: BLE001 - any loading failure gets the same explanation
            raise SystemExit(
                f"--model-config {spec!r}: not a preset ({', '.join(MODEL_PRESETS)}), not a JSON file, "
                f"and AutoConfig could not load it: {type(e).__name__}: {e}"
            ) from None
    # multimodal configs keep the decoder's fields under text_config
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    try:
        check_model_config(cfg)  # the planner's check: what CostModel.from_hf_config reads
    except ValueError as e:
        raise SystemExit(f"--model-config {spec}: {e}") from None
    return cfg


def _device(args):
    """The rates of one GPU (``--device``, ``--tflops``, ``--p2p-gbps``, ``--a2a-gbps``)."""
    from ..planning import DeviceSpec

    dev = DeviceSpec.preset(args.device)
    changes = {}
    if args.tflops is not None:
        changes["flops"] = args.tflops * 1e12
    if args.p2p_gbps is not None:
        changes["p2p_bandwidth"] = args.p2p_gbps * 1e9
    if args.a2a_gbps is not None:
        changes["intra_node_bandwidth"] = args.a2a_gbps * 1e9
    if args.inter_node_gbps is not None:
        changes["inter_node_bandwidth"] = args.inter_node_gbps * 1e9
    if args.gpus_per_node is not None:
        changes["gpus_per_node"] = args.gpus_per_node
    if changes:
        import dataclasses

        dev = dataclasses.replace(dev, **changes)
    return dev


def _lengths(args) -> tuple[list[int], str]:
    """The batch's sequence lengths and a one-line description of where they came from."""
    from . import data

    if args.lengths:
        lens = data.read_lengths(args.lengths)
        src = f"lengths file {args.lengths}"
    elif args.dataset:
        from transformers import AutoTokenizer

        tok_path = args.tokenizer or data.bundled_tokenizer_path()
        tokenizer = AutoTokenizer.from_pretrained(tok_path)
        ds = data.load_text_dataset(args.dataset, config=args.dataset_config, split=args.split,
                                    text_column=args.text_column, data_files=args.data_files, flags="cli")
        ds = data.tokenize_dataset(ds, tokenizer, text_column=args.text_column, max_length=args.max_len, flags="cli")
        lens = [int(x) for x in ds["length"] if int(x) > 0]
        src = f"dataset {args.dataset} ({args.split}, column {args.text_column}, tokenizer {tok_path})"
    else:
        max_len = args.max_len or 65536
        lens = data.sample_lengths(args.distribution, args.num_seqs or 512, max_len, args.seed)
        return lens, f"distribution {args.distribution} (seed {args.seed}, max {max_len} tokens)"
    if args.max_len:
        lens = [min(x, args.max_len) for x in lens]
    if args.num_seqs and args.num_seqs < len(lens):
        # a seeded random batch, like a sampler drawing one global batch from the corpus
        lens = random.Random(args.seed).sample(lens, args.num_seqs)
        src += f", {args.num_seqs} sampled with seed {args.seed}"
    if not lens:
        raise SystemExit(f"no non-empty sequences in {src}")
    return lens, src


def _strategies(values: Sequence[str] | None) -> list[str]:
    from ..planning import STRATEGIES

    out: list[str] = []
    for v in values or ["all"]:
        for name in (x.strip() for x in v.split(",")):
            if not name:
                continue
            names = list(STRATEGIES) if name == "all" else [name]
            for n in names:
                if n not in STRATEGIES:
                    raise SystemExit(f"--strategy {n!r}: choose from {', '.join(STRATEGIES)} or all")
                if n not in out:
                    out.append(n)
    return out


# ---------------------------------------------------------------------------------- planning
def run_plan(args) -> list[dict[str, Any]]:
    """Plan and simulate every strategy; return one JSON-ready record per strategy.

    Each record: ``strategy``, ``fits`` and, when it fits, ``step_time_s``, ``ratio_to_best``,
    ``bubble_fraction``, ``recompute_fraction``, ``recompute_time_s``, ``peak_memory_bytes``
    (per stage), ``memory_budget_bytes``, ``num_chunks`` (by kind and ``total``),
    ``plan_time_s``, ``ideal_step_time_s``, ``plan`` (``Plan.to_dict()``); otherwise ``reason``.
    Also attaches the ``Plan`` and the simulation under the private keys ``_plan`` / ``_sim``.
    """
    from ..planning import CostModel, PlanError, ideal_step_time, plan_step
    from ..planning.sharding import MODES, chunk_mode
    from ..planning.simulate import simulate

    cfg = load_model_config(args.model_config)
    dev = _device(args)
    args.sp_mode = getattr(args, "sp_mode", None) or "auto"
    sp = 1 if args.sp is None else args.sp
    if sp < 1 or args.dp < 1:
        raise SystemExit(f"--sp and --dp must be at least 1, got --sp {sp} --dp {args.dp}")
    if args.cost_model:
        cost = CostModel.from_dict(json.loads(pathlib.Path(args.cost_model).read_text()))
    else:
        cost = CostModel.from_hf_config(cfg, dev)
    if getattr(args, "shard_parameters", False) and args.pp > 1 and sp > 1:  # as the trainer refuses it
        from ..planning.layouts import Layout, shard_parameters_refusal

        raise SystemExit(f"--shard-parameters with --pp {args.pp}: {shard_parameters_refusal(Layout(args.pp, sp, args.dp))}")
    if args.pp > 1 and cfg.get("tie_word_embeddings"):  # the last stage's copy of the embedding, as the trainer holds it
        from ..planning.layouts import count_head_copy

        cost = count_head_copy(cost)
    if sp > 1 or args.dp > 1:
        try:
            zero3 = bool(getattr(args, "shard_parameters", False)) and args.pp == 1 and sp > 1
            cost = cost.with_parallel(sp=sp, state_shards=sp if zero3 else args.dp * sp,
                                      ulysses=args.sp_mode == "ulysses", zero3=zero3)
        except PlanError as e:
            raise SystemExit(f"--sp {sp}: {e.worded(FLAGS)}") from None
    args._sp = sp
    num_layers = int(cfg["num_hidden_layers"])
    if not 1 <= args.pp <= num_layers:
        raise SystemExit(f"--pp {args.pp}: the model has {num_layers} decoder layers; choose --pp between 1 and {num_layers}")
    try:
        from ..planning.partition import partition_layers

        layout = partition_layers(cost, args.pp)
    except ImportError:
        from ..planning import StageLayout

        layout = StageLayout.even(num_layers, args.pp)
    budget = int(args.memory_gb * _GIB) if args.memory_gb is not None else int(dev.memory_bytes)
    try:
        lens, src = _lengths(args)
    except (ValueError, FileNotFoundError) as e:
        # bad input data: a message naming the setting, not a traceback
        raise SystemExit(f"concertina plan: {e}") from None
    args._source = src
    args._lens = lens
    args._layout = layout
    args._budget = budget
    args._cost = cost
    ideal = ideal_step_time(lens, cost, layout)
    records: list[dict[str, Any]] = []
    for strategy in _strategies(args.strategy):
        t0 = time.perf_counter()
        try:
            plan = plan_step(lens, cost, layout, budget, strategy,
                             max_tokens_per_chunk=args.max_tokens_per_chunk,
                             solver=args.solver or "ilp", time_limit_s=args.time_limit,
                             **({"sp_mode": args.sp_mode} if sp > 1 else {}))
        except PlanError as e:  # InfeasiblePlanError too
            records.append({"strategy": strategy, "fits": False, "reason": e.worded(FLAGS),
                            "plan_time_s": time.perf_counter() - t0})
            continue
        plan_s = time.perf_counter() - t0
        sim = simulate(plan, cost)
        over = [s for s, (m, b) in enumerate(zip(sim.peak_memory_bytes, [budget] * plan.num_stages)) if m > b]
        if over:
            # A planner returning an over-budget plan is a bug; report it instead of hiding it.
            records.append({"strategy": strategy, "fits": False, "plan_time_s": plan_s,
                            "reason": f"plan exceeds the memory budget on stages {over} "
                                      f"(peak {[round(sim.peak_memory_bytes[s] / _GIB, 2) for s in over]} GiB)"})
            continue
        counts = plan.chunk_counts()
        counts["total"] = plan.num_chunks
        modes = {m: 0 for m in MODES}
        for c in plan.chunks:
            modes[chunk_mode(c)] += 1
        records.append({
            "strategy": strategy,
            "fits": True,
            "step_time_s": sim.step_time_s,
            "bubble_fraction": sim.bubble_fraction,
            "recompute_fraction": sim.recompute_fraction,
            "recompute_time_s": sim.recompute_time_s,
            "peak_memory_bytes": list(sim.peak_memory_bytes),
            "memory_budget_bytes": [budget] * plan.num_stages,
            "num_chunks": counts,
            "chunk_modes": modes,
            "stage_comm_bytes": sim.stage_comm_bytes,
            "plan_time_s": plan_s,
            "ideal_step_time_s": ideal,
            "plan": plan.with_predicted(sim.stats()).to_dict(),
            "_plan": plan,
            "_sim": sim,
        })
    best = min((r["step_time_s"] for r in records if r["fits"]), default=None)
    for r in records:
        if r["fits"]:
            r["ratio_to_best"] = r["step_time_s"] / best if best else math.nan
    return records


def _gib(b: float) -> str:
    """GiB with 3 significant digits: readable for 640 GiB stages and 0.15 GiB test models."""
    return f"{b / _GIB:.3g}"


def _table(records: list[dict[str, Any]], sp: int = 1) -> str:
    head = ["strategy", "step (s)", "vs best", "bubble", "recompute", "peak GiB per stage", "chunks p/s/h", "plan ms"]
    if sp > 1:  # each chunk's sharding mode inside a stage and the bytes moved there
        head[-1:-1] = ["modes u/w/d/m", "stage GiB"]
    rows = []
    for r in records:
        if not r["fits"]:
            rows.append([r["strategy"], f"does not fit: {r['reason']}"])
            continue
        c = r["num_chunks"]
        rows.append([
            r["strategy"], f"{r['step_time_s']:.4g}", f"{r['ratio_to_best']:.3f}x", f"{r['bubble_fraction']:.1%}",
            f"{r['recompute_fraction']:.1%}", "/".join(_gib(b) for b in r["peak_memory_bytes"]),
            f"{c['packed']}/{c['split']}/{c['hybrid']}", f"{r['plan_time_s'] * 1e3:.0f}",
        ])
        if sp > 1:
            m = r["chunk_modes"]
            rows[-1][-1:-1] = [f"{m['ulysses']}/{m['whole-doc']}/{m['per-doc']}/{m['mixed']}",
                               f"{r['stage_comm_bytes'] / _GIB:.4g}"]
    widths = [max([len(head[i])] + [len(row[i]) for row in rows if len(row) == len(head)]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    for row in rows:
        if len(row) == len(head):
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)))
        else:
            lines.append(row[0].ljust(widths[0]) + "  " + row[1])
    return "\n".join(lines)


def _cmd_plan(args) -> int:
    if args.solver is None:  # --layout auto plans tens of layouts: the greedy solver, unless asked
        args.solver = "greedy" if args.layout == "auto" else "ilp"
    if args.layout == "auto":
        return _cmd_layout_auto(args)
    if args.gpus is not None:
        raise SystemExit("--gpus goes with --layout auto (a fixed layout is --pp x --sp x --dp GPUs)")
    records = run_plan(args)
    lens = args._lens
    print(f"batch: {len(lens)} sequences, {sum(lens)} tokens, longest {max(lens)}, median "
          f"{sorted(lens)[len(lens) // 2]} ({args._source})")
    gpus = f"{args._sp} GPUs each (--sp-mode {args.sp_mode}), " if args._sp > 1 else ""
    print(f"model: {args.model_config}, {args.pp} stages {list(args._layout.layer_ranges)}, {gpus}budget "
          f"{args._budget / _GIB:.1f} GiB per GPU, state sharded over {args._cost.state_shards} ranks, "
          f"cost model {args._cost.source}, solver {args.solver}")
    fits = [r for r in records if r["fits"]]
    if fits:
        print(f"ideal step time (all stages busy, no recompute): {fits[0]['ideal_step_time_s']:.4g} s")
    print(_table(records, args._sp))
    if args.show_grid:
        for r in fits:
            print()
            print(r["_plan"].grid())
    if args.json:
        out = [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.gantt and fits:
        from ..planning.viz import describe_parallelism, plot_gantt

        targets = fits if args.gantt_all else [min(fits, key=lambda r: r["step_time_s"])]
        gpath = pathlib.Path(args.gantt)
        for r in targets:
            path = gpath.with_name(f"{gpath.stem}-{r['strategy']}{gpath.suffix}") if args.gantt_all else gpath
            source = (f"--memory-gb {args.memory_gb:g}" if args.memory_gb is not None
                      else f"the memory of one --device {args.device}")
            plot_gantt(r["_plan"], r["_sim"], path, cost=args._cost, budget_source=source,
                       title=f"{r['strategy']}: {len(lens)} sequences, {args.model_config}, "
                             f"{describe_parallelism(r['_plan'], args.pp, args._sp)}")
            print(f"wrote {path}")
    return 0 if fits else 1


# ---------------------------------------------------------------------------------- --layout auto
def run_layout_auto(args) -> list[Any]:
    """Rank every layout of ``--gpus`` GPUs (:func:`concertina_hf.planning.layouts.rank_layouts`);
    sets ``args._lens``, ``_source``, ``_budget``, ``_cost`` like :func:`run_plan`."""
    from ..planning import CostModel
    from ..planning.layouts import rank_layouts

    if args.gpus is None or args.gpus < 1:
        raise SystemExit("--layout auto needs --gpus N (the GPUs of the run, at least 1)")
    cfg = load_model_config(args.model_config)
    dev = _device(args)
    if args.cost_model:
        cost = CostModel.from_dict(json.loads(pathlib.Path(args.cost_model).read_text()))
        cost = dataclasses.replace(cost, gpus_per_node=dev.gpus_per_node)
    else:
        cost = CostModel.from_hf_config(cfg, dev)
    budget = int(args.memory_gb * _GIB) if args.memory_gb is not None else int(dev.memory_bytes)
    try:
        lens, src = _lengths(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"concertina plan: {e}") from None
    args._lens, args._source, args._budget, args._cost = lens, src, budget, cost
    try:
        mode = getattr(args, "sp_mode", None)
        return rank_layouts(lens, cost, args.gpus, budget, gpus_per_node=dev.gpus_per_node, solver=args.solver,
                            shard_parameters=bool(getattr(args, "shard_parameters", False)),
                            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                            time_limit_s=args.time_limit, max_tokens_per_chunk=args.max_tokens_per_chunk,
                            **({"sp_mode": mode} if mode else {}))
    except PlanError as e:
        raise SystemExit(f"concertina plan: {e.worded(FLAGS)}") from None


def _layout_table(rows: list[Any]) -> str:
    head = ["#", "layout", "step (s)", "tok/s/GPU", "vs best", "peak GiB/GPU", "bubble", "recompute", "plan s"]
    lines, table = [], []
    rank = 0
    for r in rows:
        if r.status in ("ok", "reference"):
            if r.step_time_s is None:
                table.append((r, ["-", f"{r.layout.name} (sp-only)"]))
                continue
            rank += r.status == "ok"
            name = r.layout.name if r.status == "ok" else f"sp-only {r.layout.sp}-GPU groups x{r.layout.dp} *"
            table.append((r, [str(rank) if r.status == "ok" else "ref", name, f"{r.step_time_s:.4g}",
                              f"{r.tokens_per_s_per_gpu:.4g}", f"{r.ratio_to_best:.3f}x",
                              f"{_gib(r.peak_memory_bytes)}/{_gib(r.memory_budget_bytes) if r.memory_budget_bytes else '-'}",
                              f"{r.bubble_fraction:.1%}", f"{r.recompute_fraction:.1%}", f"{r.plan_time_s:.2f}"]))
        else:
            table.append((r, ["-", r.layout.name]))
    full = [row for _, row in table if len(row) == len(head)]
    widths = [max([len(head[i])] + [len(row[i]) for row in full]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    for r, row in table:
        if len(row) == len(head):
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        else:
            why = r.error.worded(FLAGS) if r.error is not None else r.reason
            lines.append(f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {r.status}: {why}")
    return "\n".join(lines)


def _cmd_layout_auto(args) -> int:
    t0 = time.perf_counter()
    rows = run_layout_auto(args)
    wall = time.perf_counter() - t0
    lens = args._lens
    print(f"batch: {len(lens)} sequences, {sum(lens)} tokens, longest {max(lens)}, median "
          f"{sorted(lens)[len(lens) // 2]} ({args._source})")
    print(f"model: {args.model_config}, {args.gpus} GPUs ({args._cost.gpus_per_node} per node), --device {args.device}, "
          f"budget {args._budget / _GIB:.1f} GiB per GPU, cost model {args._cost.source}, strategy adaptive, "
          f"solver {args.solver}; optimizer state sharded over each stage's dp x sp ranks "
          "(concertina_shard_optimizer=True), weights and gradients whole"
          + ("; pp=1: weights and gradients sharded too (concertina_shard_parameters=True), pp > 1 refused (the "
             "trainer shards parameters at concertina_pipeline_size=1 only)"
             if getattr(args, "shard_parameters", False) else ""))
    print(_layout_table(rows))
    best = next((r for r in rows if r.status == "ok"), None)
    print("* sp-only (no pipeline, the GPUs in Ulysses groups, micro-batches in rounds) is a reference, never "
          "chosen: its memory and traffic are ZeRO-3's, as the trainer holds its layout with "
          "concertina_shard_parameters=True (over each replica's sp GPUs), but the trainer runs that layout (pp=1) "
          "with the adaptive strategy"
          + ("" if getattr(args, "shard_parameters", False) else " (ranked so with --shard-parameters)") + ".")
    counts = {k: sum(r.status == k for r in rows) for k in ("ok", "pruned", "infeasible", "refused")}
    print(f"{counts['ok']} planned, {counts['pruned']} pruned (a lower bound of their step time above the best "
          f"found), {counts['infeasible']} do not fit, {counts['refused']} the runtime cannot run; {wall:.1f} s")
    # the mode the stages run: --sp-mode, else Ulysses (rank_layouts' default, as the trainer runs it)
    mode = (getattr(args, "sp_mode", None) or "ulysses") if best is not None and best.layout.sp > 1 else None
    if best is not None:
        print(f"chosen: {best.layout.name}: concertina_pipeline_size={best.layout.pp} "
              f"concertina_sequence_parallel_size={best.layout.sp} concertina_data_parallel_size={best.layout.dp} "
              + (f"concertina_sequence_parallel_mode={mode} " if mode else "")
              + f"concertina_shard_{'parameters' if best.shard_parameters else 'optimizer'}=True, "
              f"{best.step_time_s:.4g} s per step")
    if args.json:
        out = {"gpus": args.gpus, "gpus_per_node": args._cost.gpus_per_node, "model": args.model_config,
               "device": args.device, "memory_budget_bytes": args._budget, "solver": args.solver,
               "num_seqs": len(lens), "tokens": sum(lens), "longest": max(lens), "source": args._source,
               "wall_s": wall, "chosen": best.layout.name if best else None, "sequence_parallel_mode": mode,
               "shard_parameters": bool(getattr(args, "shard_parameters", False)),
               "rows": [r.to_dict() for r in rows]}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if best is not None else 1


# ---------------------------------------------------------------------------------- parser
class _OneDefaultFormatter(argparse.HelpFormatter):
    """Each option's default once: appended when it means something (not None / False) and the
    help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from ..planning import SOLVERS, STRATEGIES
    from ..planning.coefficients import DEVICE_PRESETS

    ap = argparse.ArgumentParser(
        prog="concertina",
        description="Data-centric adaptive pipeline parallelism for Hugging Face models.",
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "plan", help="plan one step for a batch of sequence lengths and compare strategies",
        description="Plan one training step under each strategy and compare predicted step time, "
                    "bubbles, recompute and memory.",
        formatter_class=_OneDefaultFormatter,
    )
    src = p.add_argument_group("sequence lengths (one source)")
    one = src.add_mutually_exclusive_group(required=True)
    one.add_argument("--lengths", metavar="FILE", help="text (integers) or JSON (list or {'lengths': [...]}) file")
    one.add_argument("--dataset", metavar="NAME", help="datasets.load_dataset name or path, or 'stdlib'")
    one.add_argument("--distribution", metavar="NAME", help="shipped distribution (github, commoncrawl) or JSON file")
    src.add_argument("--dataset-config", default=None, help="dataset configuration name")
    src.add_argument("--data-files", nargs="+", default=None,
                     help="data files for a builder dataset (--dataset json|text|parquet|csv)")
    src.add_argument("--split", default="train", help="dataset split (slicing like train[:1000] works)")
    src.add_argument("--text-column", default="text", help="dataset column holding the text")
    src.add_argument("--tokenizer", default=None, help="tokenizer name or path (default: the bundled one, 8192 tokens)")
    src.add_argument("--num-seqs", type=int, default=None,
                     help="sequences in the batch (distribution: default 512; file/dataset: a seeded sample)")
    src.add_argument("--max-len", "--max-length", dest="max_len", type=int, default=None,
                     help="truncate sequences to this many tokens (distribution default 65536)")
    src.add_argument("--seed", type=int, default=0,
                     help="seed of the sampled lengths (--distribution, or --num-seqs of a file or dataset)")

    m = p.add_argument_group("model and hardware")
    m.add_argument("--model-config", default="llama-13b",
                   help=f"preset ({', '.join(MODEL_PRESETS)}), JSON file of config fields, or AutoConfig name/path")
    m.add_argument("--cost-model", metavar="JSON", default=None,
                   help="a CostModel.to_dict() file (e.g. fitted from measurements) instead of the analytic one")
    m.add_argument("--pp", type=int, default=4, help="pipeline stages")
    m.add_argument("--sp", type=int, default=None,
                   help="GPUs of one stage (sequence parallelism; --sp-mode ulysses needs it to divide the attention "
                        "heads); default 1")
    m.add_argument("--sp-mode", choices=("auto", "ulysses", "context"), default=None,
                   help="how a stage of --sp GPUs shards each chunk: auto (the planner picks Ulysses, whole-doc or "
                        "per-doc per chunk; a fixed layout's choice when unset), ulysses (--layout auto's when "
                        "unset, as the trainer runs today), or context (whole-doc / per-doc only, any head count); "
                        "the table's modes column counts the chunks of each: u(lysses)/w(hole-doc)/d (per-doc)/m(ixed)")
    m.add_argument("--dp", type=int, default=1,
                   help="pipeline replicas (optimizer state is sharded over dp x sp ranks)")
    m.add_argument("--memory-gb", type=float, default=None, help="memory budget per GPU in GiB (default: the device's)")
    m.add_argument("--device", choices=DEVICE_PRESETS, default="a800",
                   help="rates of one GPU (DeviceSpec presets: dense bf16 at 50%% of peak, HBM, NVLink, NIC)")
    m.add_argument("--tflops", type=float, default=None, help="sustained TFLOP/s of one device (overrides --device)")
    m.add_argument("--p2p-gbps", type=float, default=None, help="stage-to-stage bandwidth in GB/s (overrides --device)")
    m.add_argument("--a2a-gbps", type=float, default=None,
                   help="intra-node bandwidth each GPU sends at in collectives, GB/s (overrides --device)")
    m.add_argument("--inter-node-gbps", type=float, default=None,
                   help="inter-node bandwidth per GPU, GB/s (overrides --device)")
    m.add_argument("--gpus-per-node", type=int, default=None, help="GPUs of one node (overrides --device)")

    s = p.add_argument_group("planner")
    s.add_argument("--strategy", action="append", default=None, metavar="NAME",
                   help=f"one of {', '.join(STRATEGIES)}, or all; repeatable or comma separated (default: all)")
    s.add_argument("--solver", choices=SOLVERS, default=None,
                   help="recompute solver (default: ilp; greedy with --layout auto)")
    s.add_argument("--layout", choices=("fixed", "auto"), default="fixed",
                   help="auto: rank every pp x sp x dp layout of --gpus GPUs the runtime can run, each planned with "
                        "adaptive (--pp/--sp/--dp/--strategy ignored); fixed: --pp x --sp x --dp (default: fixed)")
    s.add_argument("--gpus", type=int, default=None, help="GPUs in all, with --layout auto")
    s.add_argument("--shard-parameters", action="store_true",
                   help="pp=1 layouts as the trainer runs them with concertina_shard_parameters=True (ZeRO-3, FSDP2: "
                        "weights, gradients and optimizer state over the sp GPUs, each layer gathered per chunk)")
    s.add_argument("--time-limit", type=float, default=1.0, help="ILP time limit per call, seconds")
    s.add_argument("--max-tokens-per-chunk", type=int, default=None,
                   help="token cap of one chunk (default: none, the planner chooses)")

    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT", default=None, help="write the results as a JSON list")
    o.add_argument("--gantt", metavar="PNG", default=None, help="draw the best plan's schedule and memory")
    o.add_argument("--gantt-all", action="store_true", help="draw every strategy's plan to PNG stem-<strategy>")
    o.add_argument("--show-grid", action="store_true", help="print every plan's action grid")
    p.set_defaults(func=_cmd_plan)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
