"""Worker of ``torch_pipelining_peer.py``: the PyTorch-native peer beside the project's runtime.

The peer is what a PyTorch user would write for pipeline-parallel training of an HF model:
``torch.distributed.pipelining`` (:class:`PipelineStage` + :class:`Schedule1F1B`), the Llama split
by hand into two stage modules (:class:`PeerStage`), the step's sequences packed into fixed rows of
the context length (:func:`pack_rows`: documents concatenated and cut into rows, position ids
restarting at every document and at every row, the last row padded), with or without activation
checkpointing of every decoder layer. Its attention, two ways:

- ``concertina``: the project's own kernel. A micro-batch's rows are laid out as one packed row
  and every document (each pad run too) becomes a slice of a
  :class:`~concertina_hf.runtime.attention.ChunkAttentionContext`: one SDPA call per document on
  CPU, no ``T x T`` mask. The comparison then measures the pipelining method, not the kernel.
- ``sdpa``: HF's default path as users run it: ``create_causal_mask`` with the packed position
  ids (HF detects the packed documents and builds a block-diagonal causal mask) and SDPA over
  every row.

Loss: the summed token cross-entropy of each micro-batch over the step's count of predicted
tokens, with ``scale_grads=False``, so the micro-batch losses add up to the step's mean loss (what
HF's ``LlamaForCausalLM`` returns for all rows at once) and the gradients are those of that mean.

One process pair runs every job of a context, interleaved round by round (as in
``_pipeline_worker``): the project's pp=2 runs (``PipelineExecutor`` with plans made by the parent
process, so planning is off the clock here), the project's runtime at pp=1 (on rank 0 alone; rank
1 waits in a barrier) and the peer variants. Each job has its own copy of the model (same seed)
and its own AdamW (``Trainer``'s default). Before the timed rounds, the peer's micro-batch count
and layer split are tuned by measurement on one batch, and its loss on the memory batch is checked
against the single-process HF model on the same rows.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from typing import Any, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

__all__ = ["PeerStage", "PeerJob", "pack_rows", "reference_loss", "run_worker"]

PAD_ID = 0
LOSS_RTOL = 1e-4  # the peer's loss against the single-process HF model (fp32; kernels differ in summation order)


# ---------------------------------------------------------------------------------- packing
def pack_rows(seqs: Sequence[Sequence[int]], row_len: int, num_microbatches: int) -> dict[str, torch.Tensor]:
    """The step's sequences concatenated and cut into rows of ``row_len`` tokens.

    Position ids restart at 0 at every document and at every row (a document cut by a row end
    continues in the next row as a new document, as packing collators do); labels are the input
    ids with -100 at every document's first token (the last token of the document before it
    predicts nothing, as with ``DataCollatorWithFlattening``) and on padding. The row count is
    rounded up to a multiple of ``num_microbatches`` (at least 2): the rows after the last real
    token are padding (one pad document per row). Returns ``input_ids``, ``position_ids``,
    ``labels`` ([R, row_len] each) and ``num_tokens`` (real tokens)."""
    flat_ids: list[int] = []
    doc_start: list[int] = []  # flat index where each token's document begins
    for s in seqs:
        g = len(flat_ids)
        flat_ids += list(s)
        doc_start += [g] * len(s)
    n = len(flat_ids)
    rows = max(2, math.ceil(n / row_len))
    rows = math.ceil(rows / num_microbatches) * num_microbatches
    total = rows * row_len
    flat_ids += [PAD_ID] * (total - n)
    doc_start += [n] * (total - n)  # the padding: one document per row
    idx = torch.arange(total)
    start = torch.maximum(torch.tensor(doc_start), (idx // row_len) * row_len)  # cut at every row start
    pos = idx - start
    ids = torch.tensor(flat_ids, dtype=torch.long)
    lab = torch.where((pos == 0) | (idx >= n), torch.full_like(ids, -100), ids)
    ids, pos, lab = (t.view(rows, row_len) for t in (ids, pos, lab))
    return {"input_ids": ids, "position_ids": pos, "labels": lab, "num_tokens": n}


def doc_lengths(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the documents of a packed row (restarts of the position ids), in order."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten().tolist() + [flat.numel()]
    return [b - a for a, b in zip(starts, starts[1:])]


def doc_context(position_ids: torch.Tensor):
    """A :class:`ChunkAttentionContext` with every document of ``position_ids`` as one slice."""
    from concertina_hf.runtime.attention import ChunkAttentionContext, KVStore, SliceSpec

    slices, off = [], 0
    for i, n in enumerate(doc_lengths(position_ids)):
        slices.append(SliceSpec(seq=i, start=0, length=n, offset=off, final=True))
        off += n
    return ChunkAttentionContext(slices, KVStore(), position_ids.device, requires_grad=torch.is_grad_enabled())


# ---------------------------------------------------------------------------------- the stage modules
def _layer_call(layer: nn.Module, ctx, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    if ctx is None:
        out = layer(hidden, **kwargs)
    else:
        from concertina_hf.runtime.attention import chunk_context

        with chunk_context(ctx):  # inside what checkpointing replays
            out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class PeerStage(nn.Module):
    """Decoder layers ``[lo, hi)`` of an HF Llama, the embedding on the first stage, the final
    norm and LM head on the last: ``forward(x, position_ids)`` takes token ids (first stage) or
    hidden states [R, L, H] and returns hidden states or logits [R, L, V]."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool, attention: str,
                 checkpoint_layers: bool) -> None:
        super().__init__()
        if attention not in ("concertina", "sdpa"):
            raise ValueError(f"attention must be 'concertina' or 'sdpa', not {attention!r}")
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.attention = attention
        self.checkpoint_layers = checkpoint_layers

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        rows, length, hidden = h.shape
        extra: dict[str, Any] = {}
        if self.attention == "concertina":
            # the rows as one packed row: per-document attention through the project's kernel
            h = h.reshape(1, rows * length, hidden)
            pos = position_ids.reshape(1, -1)
            ctx, mask = doc_context(pos), None
            extra["concertina_ctx"] = ctx
        else:
            from transformers.masking_utils import create_causal_mask

            pos, ctx = position_ids, None
            # config, inputs_embeds, attention_mask, cache (named past_key_values before transformers 5.2x)
            mask = create_causal_mask(self.config, h, None, None, position_ids=pos)
        cos_sin = self.rotary_emb(h, pos)
        for layer in self.layers:
            call = functools.partial(_layer_call, layer, ctx, attention_mask=mask, position_ids=pos,
                                     position_embeddings=cos_sin, use_cache=False, **extra)
            h = checkpoint(call, h, use_reentrant=False) if self.checkpoint_layers and torch.is_grad_enabled() \
                else call(h)
        h = h.reshape(rows, length, hidden)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def build_peer_model(config: dict, seed: int, attention: str):
    from _pipeline_worker import build_model

    model = build_model(config, seed)
    if attention == "concertina":
        from concertina_hf.runtime.attention import register_attention

        name = register_attention()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(name)
        model.config._attn_implementation = name
    return model


def reference_loss(config: dict, seed: int, packed: dict[str, torch.Tensor]) -> float:
    """The single-process HF model's mean loss on the packed rows (HF's SDPA path; ``use_cache=False``:
    with a cache HF drops the packed-sequence mask)."""
    from _pipeline_worker import build_model

    model = build_model(config, seed)
    model.train()
    with torch.no_grad():
        out = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"],
                    use_cache=False)
    return float(out.loss)


class PeerJob:
    """One peer configuration on one rank: its stage module, AdamW, and a 1F1B schedule per
    micro-batch shape (``PipelineStage`` fixes the shapes it communicates)."""

    def __init__(self, name: str, config: dict, seed: int, rank: int, split: int, num_microbatches: int,
                 attention: str, checkpoint_layers: bool, row_len: int, optimizer) -> None:
        self.name, self.rank, self.split, self.n_mb = name, rank, split, num_microbatches
        self.row_len = row_len
        model = build_peer_model(config, seed, attention)
        n = int(config["num_hidden_layers"])
        lo, hi = (0, split) if rank == 0 else (split, n)
        self.module = PeerStage(model, lo, hi, rank == 0, rank == 1, attention, checkpoint_layers)
        self.module.train()
        self.hidden = int(config["hidden_size"])
        self.vocab = int(config["vocab_size"])
        opt_cls, opt_kwargs = optimizer
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.opt = opt_cls(self.params, **opt_kwargs)
        self._schedules: dict[int, Any] = {}
        self._count = [1]

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, self.vocab), labels[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum") / self._count[0]

    def _schedule(self, rows_per_mb: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        if rows_per_mb not in self._schedules:
            L = self.row_len
            if self.rank == 0:
                inp = torch.zeros(rows_per_mb, L, dtype=torch.long)
                out = torch.empty(rows_per_mb, L, self.hidden, requires_grad=True)  # it gets a gradient back
            else:
                inp = torch.empty(rows_per_mb, L, self.hidden, requires_grad=True)  # its gradient goes back to stage 0
                out = torch.empty(rows_per_mb, L, self.vocab)
            stage = PipelineStage(self.module, self.rank, 2, torch.device("cpu"), input_args=(inp,),
                                  output_args=out)
            self._schedules[rows_per_mb] = Schedule1F1B(stage, self.n_mb, loss_fn=self._loss, scale_grads=False)
        return self._schedules[rows_per_mb]

    def step(self, packed: dict[str, torch.Tensor]) -> float | None:
        """One training step (forward, backward, optimizer) on the packed rows; the loss on rank 1."""
        rows = packed["input_ids"].shape[0]
        sched = self._schedule(rows // self.n_mb)
        self._count[0] = max(1, int((packed["labels"][:, 1:] != -100).sum()))
        pos = packed["position_ids"]
        if self.rank == 0:
            sched.step(packed["input_ids"], position_ids=pos)
            loss = None
        else:
            losses: list[torch.Tensor] = []
            sched.step(position_ids=pos, target=packed["labels"], losses=losses)
            loss = float(sum(x.detach() for x in losses))
        return loss

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------- the worker
def run_worker(rank: int, world: int, port: int, spec_path: str, out_path: str) -> None:
    from _pipeline_worker import serve

    serve(rank, world, port, spec_path, out_path, lambda spec: _run(rank, spec))


def _gather(mine: dict) -> list[dict] | None:
    got = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, got, dst=0)
    return sorted(got, key=lambda m: m["rank"]) if got is not None else None


def _timed(fn, track: bool, exclude_params) -> tuple[Any, float, float, int | None]:
    """``(result, run seconds, optimizer seconds, allocation peak or None)`` of a step; the
    allocation peak (parameter gradients excluded) when ``track``."""
    from concertina_hf.runtime.memory import AllocationTracker

    tracker = AllocationTracker() if track else None
    t0 = time.perf_counter()
    if tracker is not None:
        tracker.__enter__()
    try:
        res = fn()
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    t1 = time.perf_counter()
    peak = tracker.peak_bytes(exclude=[p.grad for p in exclude_params()]) if tracker is not None else None
    return res, t1 - t0, t1, peak


class _ProjectJob:
    """The project's runtime on this rank: pp=2 (both ranks) or pp=1 (rank 0 only); the stage,
    executor and optimizer are :class:`_pipeline_worker._Replica`'s."""

    def __init__(self, job: dict, spec: dict, rank: int) -> None:
        from _pipeline_worker import _Replica
        from concertina_hf.planning import Plan, StageLayout

        self.name = job["name"]
        self.pp = job["pp"]
        self.plans = [Plan.from_json(p) for p in job["plans"]]
        n = int(spec["config"]["num_hidden_layers"])
        replica = _Replica(spec, StageLayout(n, tuple(tuple(r) for r in job["layer_ranges"])), rank)
        self.active = replica.active
        if self.active:
            self.params, self.executor, self.opt = replica.params, replica.executor, replica.opt

    def step(self, batch_index: int, ids: list[torch.Tensor]):
        # no saved-tensor meter (its figure is not used here), as the trainer's unlogged steps
        return self.executor.run_step(self.plans[batch_index], ids, measure_memory=False).loss

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _run_one(rank: int, job, kind: str, b: int, batch_ids, packed_by_nmb, track: bool) -> dict:
    """One step of one job on this rank, between barriers: times, loss, allocation peak."""
    dist.barrier()
    t0 = time.perf_counter()
    active = kind == "peer" or job.active
    loss = peak = None
    run_s = opt_s = 0.0
    if active:
        if kind == "peer":
            fn = functools.partial(job.step, packed_by_nmb[job.n_mb])
        else:
            fn = functools.partial(job.step, b, batch_ids)
        loss, run_s, t_run, peak = _timed(fn, track, lambda: job.params)
        job.optimizer_step()
        opt_s = time.perf_counter() - t_run
    t1 = time.perf_counter()
    return {"rank": rank, "step_s": t1 - t0 if active else 0.0, "run_s": run_s, "opt_s": opt_s, "loss": loss,
            "alloc_peak": peak, "active": active}


def _run(rank: int, spec: dict) -> dict:
    from _pipeline_worker import _capacity_probe

    L = spec["row_len"]
    batches = [[torch.tensor(s, dtype=torch.long) for s in b] for b in spec["batches"]]
    packs: dict[tuple[int, int], dict] = {}

    def packed(b: int, n_mb: int) -> dict:
        if (b, n_mb) not in packs:
            packs[(b, n_mb)] = pack_rows(spec["batches"][b], L, n_mb)
        return packs[(b, n_mb)]

    def peer(name, split, n_mb, attention, ckpt) -> PeerJob:
        return PeerJob(name, spec["config"], spec["seed"], rank, split, n_mb, attention, ckpt, L, spec["optimizer"])

    capacity = [_capacity_probe(rank, 2)]
    # --- tuning: every (split, micro-batches) of the grid on the tuning batch, concertina attention;
    # a warm-up step (schedule set-up) then the timed one; rows per micro-batch as packing gives them
    tb = spec["tune_batch"]
    tuning = []
    for ckpt in spec["tune_ckpt"]:
        for split in spec["splits"]:
            for n_mb in spec["microbatches"]:
                job = peer("tune", split, n_mb, "concertina", ckpt)
                recs = [_run_one(rank, job, "peer", tb, None, {n_mb: packed(tb, n_mb)}, False) for _ in range(2)]
                got = _gather(recs[-1])
                if rank == 0:
                    s = max(m["step_s"] for m in got)
                    tuning.append({"checkpoint": ckpt, "split": split, "microbatches": n_mb, "step_s": s,
                                   "tokens_per_s": packed(tb, n_mb)["num_tokens"] / s})
                    print(f"[peer] tune ckpt={ckpt} split={split} n_mb={n_mb}: {s:.2f}s", flush=True)
                del job
    best = [None]
    if rank == 0:
        best[0] = {}
        for ckpt in spec["tune_ckpt"]:
            rows = [t for t in tuning if t["checkpoint"] == ckpt]
            t = min(rows, key=lambda t: t["step_s"])
            best[0][ckpt] = (t["split"], t["microbatches"])
    dist.broadcast_object_list(best, src=0)
    best = best[0]

    # --- the jobs of the timed run
    jobs: list[tuple[str, str, Any]] = []
    for job in spec["project_jobs"]:
        jobs.append((job["name"], "project", _ProjectJob(job, spec, rank)))
    peer_info = {}
    for attention in ("concertina", "sdpa"):
        for ckpt in (False, True):
            split, n_mb = best.get(ckpt, best[next(iter(best))])
            name = f"peer {attention}{'+ckpt' if ckpt else ''}"
            peer_info[name] = {"attention": attention, "checkpoint": ckpt, "split": split, "microbatches": n_mb}
            jobs.append((name, "peer", peer(name, split, n_mb, attention, ckpt)))

    # --- loss check: the peer on the memory batch (initial weights) vs one HF process on the same rows
    mb = spec["memory_batch"]
    rounds = [mb] + list(spec["timed_batches"])
    records: list[dict] = []
    loss_check = {}
    for r, b in enumerate(rounds):
        for j in range(len(jobs)):
            name, kind, job = jobs[(j + r) % len(jobs)]
            pk = {job.n_mb: packed(b, job.n_mb)} if kind == "peer" else None
            mine = _run_one(rank, job, kind, b, batches[b], pk, track=(r == 0))
            got = _gather(mine)
            if rank != 0:
                continue
            act = [m for m in got if m["active"]]
            rec = {"job": name, "kind": kind, "round": r, "batch": b, "memory_round": r == 0,
                   "tokens": sum(len(s) for s in spec["batches"][b]),
                   "step_s": max(m["step_s"] for m in act), "run_s": max(m["run_s"] for m in act),
                   "opt_s": max(m["opt_s"] for m in act), "loss": act[-1]["loss"],
                   "alloc_peak_bytes": [m["alloc_peak"] for m in act] if r == 0 else None}
            if kind == "peer":
                p = pk[job.n_mb]
                rec["rows"] = int(p["input_ids"].shape[0])
                rec["padded_tokens"] = int(p["input_ids"].numel()) - p["num_tokens"]
            records.append(rec)
            print(f"[peer] round {r} {name:<24} {rec['tokens']:>6} tok  step {rec['step_s']:.2f}s", flush=True)
            if r == 0 and kind == "peer":
                loss_check.setdefault(name, {"peer": rec["loss"], "microbatches": job.n_mb})
        if r == 0:
            # the loss check, before any timed step: the peer at initial weights vs one HF process
            verdict = [None]
            if rank == 0:
                refs: dict[int, float] = {}
                for name, c in loss_check.items():
                    n_mb = c["microbatches"]
                    if n_mb not in refs:
                        refs[n_mb] = reference_loss(spec["config"], spec["seed"], packed(mb, n_mb))
                    c["reference"] = refs[n_mb]
                    c["rel_diff"] = abs(c["peer"] - c["reference"]) / abs(c["reference"])
                    c["ok"] = c["rel_diff"] <= LOSS_RTOL
                bad = {k: v for k, v in loss_check.items() if not v["ok"]}
                verdict[0] = (f"the peer's loss differs from the single-process HF model's on the same rows: {bad}"
                              if bad else "")
            dist.broadcast_object_list(verdict, src=0)
            if verdict[0]:
                raise AssertionError(verdict[0])
    capacity.append(_capacity_probe(rank, 2))
    return {"records": records, "tuning": tuning, "best": {str(k): v for k, v in best.items()},
            "peer_jobs": peer_info, "loss_check": loss_check, "capacity": capacity,
            "loadavg_end": os.getloadavg()}
