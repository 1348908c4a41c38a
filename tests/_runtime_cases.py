"""Shared pieces of the runtime tests: tiny HF models, plans built by hand, the HF reference.

Plans are built from explicit chunk lists (``[(seq, start, length), ...]`` per chunk) with the
plan types and :func:`build_schedule`, so the tests exercise every chunk kind on purpose; when
the planner's ``plan_step`` exists, an "adaptive" case uses it too.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable, Sequence

import torch

from concertina_hf.planning import Action, ActionKind, Chunk, ChunkKind, Plan, Slice, StageLayout, build_schedule

SEQ_LENS = (46, 9, 7, 5, 12, 20)  # one long sequence (split), one medium (split in the hybrid case)
VOCAB = 96


def tiny_config(kind: str, num_layers: int = 8):
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                           tie_word_embeddings=False, attention_dropout=0.0)
    if kind == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           tie_word_embeddings=False, use_sliding_window=False)
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0, num_layers: int = 8):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, num_layers), attn_implementation="sdpa")
    # larger init than HF's 0.02 so that gradients are not all tiny (a stricter comparison)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model.float()


def batch(seq_lens: Sequence[int] = SEQ_LENS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in seq_lens]
    labels = []
    for i, t in enumerate(ids):
        lab = t.clone()
        if i % 2 == 1:  # some ignored targets, also across a slice boundary of the long sequence
            lab[1:3] = -100
        labels.append(lab)
    labels[0][15:18] = -100
    return ids, labels


def make_plan(seq_lens: Sequence[int], chunk_specs: Sequence[Sequence[tuple[int, int, int]]], layout: StageLayout,
              recompute: Callable[[int, int, int], int] | str = "none",
              groups: Sequence[Sequence[int]] | None = None, strategy: str = "test",
              prefetch: bool = False, extra_warmup: int = 0) -> Plan:
    """A validated plan from explicit chunks. ``recompute``: "none", "full", "partial" or
    ``f(stage, chunk, num_stage_layers) -> layers``."""
    chunks = []
    for i, spec in enumerate(chunk_specs):
        slices = tuple(Slice(*s) for s in spec)
        split = [s for s in slices if s.length != seq_lens[s.seq]]
        if not split:
            kind = ChunkKind.PACKED
        elif split[0].end == seq_lens[split[0].seq]:
            kind = ChunkKind.HYBRID
        else:
            kind = ChunkKind.SPLIT
        chunks.append(Chunk(i, kind, slices))
    chunks = tuple(chunks)
    if groups is None:
        groups = (tuple(range(len(chunks))),)
    groups = tuple(tuple(g) for g in groups)
    if recompute == "none":
        rfun = lambda s, c, n: 0  # noqa: E731
    elif recompute == "full":
        rfun = lambda s, c, n: n  # noqa: E731
    elif recompute == "partial":
        rfun = lambda s, c, n: (s + c) % (n + 1)  # noqa: E731
    else:
        rfun = recompute
    rec = tuple(tuple(rfun(s, c.index, layout.num_stage_layers(s)) for c in chunks) for s in range(layout.num_stages))
    plan = Plan(strategy=strategy, seq_lens=tuple(seq_lens), layout=layout, chunks=chunks, groups=groups,
                schedule=build_schedule(chunks, groups, layout.num_stages, prefetch=prefetch,
                                        extra_warmup=extra_warmup), recompute=rec)
    return plan.validate()


# chunkings of SEQ_LENS = (46, 9, 7, 5, 12, 20)
CHUNKINGS = {
    # whole sequences packed
    "packed": [[(0, 0, 46)], [(5, 0, 20), (1, 0, 9)], [(4, 0, 12), (2, 0, 7), (3, 0, 5)]],
    # the long sequence in 4 uneven slices (tail alone), the rest packed
    "split": [[(0, 0, 16)], [(0, 16, 12)], [(0, 28, 10)], [(0, 38, 8)],
              [(5, 0, 20)], [(4, 0, 12), (1, 0, 9), (2, 0, 7), (3, 0, 5)]],
    # two split sequences, their tails packed with short sequences
    "hybrid": [[(0, 0, 14)], [(0, 14, 13)], [(0, 27, 11)], [(0, 38, 8), (1, 0, 9), (3, 0, 5)],
               [(5, 0, 11)], [(5, 11, 9), (4, 0, 12), (2, 0, 7)]],
}
# two pipeline groups run back to back
GROUPED = ("hybrid", [(0, 1, 2, 3), (4, 5)])


@functools.lru_cache(maxsize=None)
def plans_for(layout: StageLayout, seq_lens: tuple[int, ...] = SEQ_LENS) -> list[tuple[str, Plan]]:
    """Every chunking x recompute setting (plus a grouped plan and an adaptive one if the planner
    exists) for ``layout``."""
    out = []
    for name, spec in CHUNKINGS.items():
        for rec in ("none", "partial", "full"):
            out.append((f"{name}/{rec}", make_plan(seq_lens, spec, layout, rec)))
    name, groups = GROUPED
    out.append((f"{name}-2groups/partial", make_plan(seq_lens, CHUNKINGS[name], layout, "partial", groups=groups)))
    out.append(("split-prefetch/partial", make_plan(seq_lens, CHUNKINGS["split"], layout, "partial", prefetch=True)))
    # one forward more ahead on every stage but the last (what adaptive picks when it simulates faster)
    out.append(("hybrid-warmup/partial", make_plan(seq_lens, CHUNKINGS["hybrid"], layout, "partial", prefetch=True,
                                                   extra_warmup=1)))
    out.append(("hybrid-gpipe/partial", gpipe(make_plan(seq_lens, CHUNKINGS["hybrid"], layout, "partial"))))
    return out + adaptive_plans(layout, seq_lens)


def gpipe(plan: Plan) -> Plan:
    """The same chunks under a GPipe schedule (all forwards, then all backwards in reverse), to
    show the runtime follows whatever order the plan gives."""
    order = [c.index for c in plan.chunks]
    schedule = tuple(
        tuple([Action(s, ActionKind.FORWARD, c) for c in order]
              + [Action(s, ActionKind.BACKWARD, c) for c in order[::-1]])
        for s in range(plan.num_stages)
    )
    return dataclasses.replace(plan, schedule=schedule, strategy="gpipe").validate()


def adaptive_plans(layout: StageLayout, seq_lens: Sequence[int]) -> list[tuple[str, Plan]]:
    """Plans of the planner (``plan_step``), once it exists: unconstrained, and with a budget of
    half the unconstrained activation peak, or the least of 55%, 60%, ... that plans (forcing
    split chains and per-chunk recompute)."""
    try:
        from concertina_hf.planning import plan_step
    except ImportError:
        try:
            from concertina_hf.planning.strategies import plan_step
        except ImportError:
            return []
    from concertina_hf.planning import CostModel, PlanError
    from concertina_hf.planning.simulate import simulate

    cost = CostModel.from_hf_config(tiny_config("llama", layout.num_layers), dtype_bytes=4)
    free = plan_step(list(seq_lens), cost, layout, 0, "adaptive", max_tokens_per_chunk=24)
    peaks = simulate(free, cost).peak_memory_bytes
    static = [cost.static_memory(layout, s) for s in range(layout.num_stages)]
    # half the way from nothing to the unconstrained peak, raised in steps of 5% where that is
    # below what a stage needs whatever the plan (e.g. a late slice's backward at pp=4)
    for fraction in (0.5, 0.55, 0.6, 0.65, 0.7):
        budget = [int(st + fraction * (pk - st)) for st, pk in zip(static, peaks)]
        try:
            tight = plan_step(list(seq_lens), cost, layout, budget, "adaptive", max_tokens_per_chunk=24)
            break
        except PlanError:
            if fraction == 0.7:
                raise
    return [("adaptive", free), ("adaptive-tight", tight)]


def reference(model, ids, labels, autocast: torch.dtype | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """HF on one process: each sequence separately, ``num_items_in_batch`` = the batch total.

    ``autocast``: run the forward under ``torch.autocast("cpu", dtype=autocast)`` and the
    backward outside it, as ``Trainer(bf16=True)`` does. With tied embeddings the gradient of
    the shared weight is also given under ``lm_head.weight`` (the last stage's copy)."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    n = int(sum(int((lab[1:] != -100).sum()) for lab in labels))
    total = 0.0
    for t, lab in zip(ids, labels):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = ref(input_ids=t[None], labels=lab[None], num_items_in_batch=n).loss
        loss.backward()
        total += float(loss.detach())
    grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}
    if ref.lm_head.weight is ref.model.embed_tokens.weight:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return total, grads


def grad_error(wrapper, ref_grads: dict[str, torch.Tensor]) -> float:
    """Relative error of this stage's gradients taken as one vector: ``|g - ref| / |ref|``."""
    num = den = 0.0
    for k, p in wrapper.named_parameters():
        assert p.grad is not None, f"{k}: no grad"
        num += float((p.grad.float() - ref_grads[k].float()).square().sum())
        den += float(ref_grads[k].float().square().sum())
    return (num / max(den, 1e-30)) ** 0.5


def tied_model(seed: int = 0, num_layers: int = 8):
    """A tiny Llama whose input and output embeddings are one parameter (``tie_word_embeddings``)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama", num_layers)
    cfg.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.float()


def compare_grads(wrapper, ref_grads: dict[str, torch.Tensor], tol: float = 1e-4) -> list[str]:
    """Names (with relative errors) of this stage's parameters whose gradient is off; checks every
    parameter of the stage has a gradient."""
    bad = []
    names = [k for k, _ in wrapper.named_parameters()]
    assert names, "stage has no parameters"
    for k, p in wrapper.named_parameters():
        r = ref_grads[k]
        if p.grad is None:
            bad.append(f"{k}: no grad")
            continue
        err = float((p.grad - r).norm() / r.norm().clamp_min(1e-30))
        if not err < tol:
            bad.append(f"{k}: rel err {err:.2e}")
    return bad


def allocated_activation_peak(executor, plan: Plan, ids, labels=None, runs: int = 1) -> int:
    """The allocated peak of one step of ``plan`` (``AllocationTracker``: every op output, as the
    benchmarks count it), its stage's parameters, buffers and gradients excluded; ``.grad`` is
    None at the start, so the backward writes the gradients (static memory) in place.

    ``runs``: the smallest peak of that many runs of the step. A gloo collective's worker thread
    drops its reference to the collective's tensors only after waking the caller. The runtime's
    all-to-all waits for that (``ulysses._all_to_all_single``), but about one send buffer in a
    hundred still dies a few hundred microseconds late in that thread (no reference count shows
    what holds it), so it can be counted in the next op's peak; the step's own peak is the one
    it reaches every time."""
    from concertina_hf.runtime.memory import AllocationTracker

    wr = executor.wrapper
    peaks = []
    for _ in range(runs):
        wr.zero_grad(set_to_none=True)
        with AllocationTracker() as t:
            executor.run_step(plan, ids, labels)
        peaks.append(t.peak_bytes(exclude=[*wr.parameters(), *wr.buffers(), *(q.grad for q in wr.parameters())]))
    return min(peaks)
