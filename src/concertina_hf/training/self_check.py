"""The numerical self-check at construction: does the runtime compute what the HF model computes?

``ConcertinaTrainer`` promises the model ``Trainer`` would train, but it never calls the HF
model's ``forward``: it runs the model's pieces itself (embedding, decoder layers with the chunk
context, final norm, LM head, cross-entropy; :class:`~concertina_hf.runtime.stage.PipelineWrapper`)
inside its own plan interpreter (:class:`~concertina_hf.runtime.executor.PipelineExecutor`). A
model that does something the runtime does not reproduce trains a different model without an
error, e.g. a decoder layer that drops the keyword arguments carrying the chunk context, a mixer
that bypasses HF's attention interface (recurrent or convolutional state then leaks between
packed sequences and is lost between slices), scaling or soft-capping done in the model's
``forward`` outside the layers, an auxiliary loss added to HF's training loss. Rather than
listing models, :func:`self_check` measures, before the model is split, on pipeline rank 0 of
replica 0 (global rank 0):

1. **Probe.** Four random sequences (24, 7, 5 and 6 tokens, ids from a fixed seed) in three
   chunks: a *split* chunk (the first 10 tokens of sequence 0), a *hybrid* chunk (its other 14
   tokens, which attend to the first 10 through the stored K/V, plus sequence 1 whole), and a
   *packed* chunk (sequences 2 and 3), the hybrid chunk's first layer recomputed in backward
   (:data:`PROBE`). A model with recurrent or convolutional mixers gets a longer probe
   (:func:`recurrent_probe`: a sequence over two scan chunks split at non-multiples of the scan
   chunk, a slice shorter than a convolution window, three short packed documents; every chunk
   reading an earlier slice recomputes its first layer). Chunked attention and Llama 4's query
   temperature are probed at chunks of :data:`PROBE_CHUNK` tokens and a temperature step of
   :data:`PROBE_FLOOR_SCALE` (lowered for the probe only: released sizes, 8192, exceed the probe).
   The model runs in its dtype on the training device (only the probed modules are moved there,
   and back: a model still on the CPU when the trainer is built is not copied whole to the GPU),
   in eval mode (no dropout), through a shallow prefix of its decoder layers: the shortest one holding every kind of layer the model has
   (by module structure, ``attention_type`` and ``config.layer_types``; at least 2 layers).
2. **Slice losses.** The runtime's loss of each slice of each sequence (the stage's head
   called once more per slice, without gradient, on that slice's targets alone) against the HF model run on each
   sequence alone (``use_cache=False``), cross-entropy of its logits summed over the same
   tokens. A difference on every sequence points at work outside the layers; one on the slice
   with context or on packed sequences only, at a context that did not reach a layer's mixer.
3. **Gradients.** The same training run of the executor (token-weighted loss) against the HF model's
   per-sequence backward, on the parameters of the first and the last probed decoder layer and
   of the final norm (the other parameters are frozen for the probe: no gradient memory).
4. **Auxiliary losses.** HF's training loss (``model(input_ids, labels=...).loss``, train mode)
   against the cross-entropy of the logits of the same call: a model that adds a term (a MoE
   router's load-balancing loss with ``output_router_logits=True``) is refused, since the
   runtime's loss is the cross-entropy. With ``concertina_router_aux_loss='per_chunk'`` the
   router's term is the runtime's own (:mod:`~concertina_hf.runtime.router_aux`): the probe
   runs with ``output_router_logits`` off and compares the rest.

A mismatch raises :class:`SelfCheckError` on every rank (the verdict is broadcast from rank 0,
so all ranks stop together), naming the model type, the check, the worst sequence or parameter
and the two values; an exception of the runtime itself on the probe (a refusal of an unsupported
layout) is reported the same way. Tolerances: relative ``1e-4`` on losses and ``1e-3`` on
gradients in float32 (real mismatches are of order 1), ``5e-2`` / ``2e-1`` in 16-bit dtypes;
``1e-5`` between HF's training loss and the cross-entropy of the same logits in any dtype (a
Mixtral router loss with the default coefficient adds ``5e-4`` relative).

Nothing of the model changes: weights are only read, gradients and ``requires_grad`` flags,
train/eval mode, the attention implementation, the layer list and every random generator state
are restored. Cost: 6 forwards and 5 backwards of at most 42 tokens through the prefix layers,
the embedding and the head (the recurrent probe: about 10 and 9 of at most ``2 c + 22``), on rank 0 only (``benchmarks`` / CHANGELOG give the measured share of
``ConcertinaTrainer`` start-up); the other ranks wait for the verdict.
``concertina_self_check=False`` skips it.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.distributed import Topology, on_every_rank
from ..runtime.families import final_norm
from ..planning import Chunk, ChunkKind, Plan, Slice, StageLayout, build_schedule

__all__ = ["PROBE", "Probe", "SelfCheckError", "check_model", "probe_for", "probe_layers", "self_check"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class Probe:
    """The probe batch: sequence lengths, and per chunk its ``(seq, start, length)`` slices."""

    lengths: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, int, int], ...], ...]

    def recomputed(self, i: int) -> bool:
        """Chunk ``i`` recomputes its first layer: every chunk with a slice reading an earlier one."""
        return any(start > 0 for _, start, _ in self.chunks[i])


#: attention models: split, hybrid (tail + whole sequence), packed
PROBE = Probe((24, 7, 5, 6), (((0, 0, 10),), ((0, 10, 14), (1, 0, 7)), ((2, 0, 5), (3, 0, 6))))


def recurrent_probe(scan_chunk: int) -> Probe:
    """Models with recurrent or convolutional mixers: a sequence longer than two scan chunks of
    ``scan_chunk`` tokens, split at tokens ``c + 3``, ``c + 5`` and ``2 c - 9`` (none a multiple of
    ``c``; the second slice, 2 tokens, shorter than a convolution window, so the third reads two
    slices back), its tail in a hybrid chunk with a whole sequence, and a packed chunk of three short
    documents (the last, 3 tokens, shorter than a window). A scan chunk under 16 tokens is probed as
    16 (the third slice, ``c - 14`` tokens, stays non-empty)."""
    c = max(16, scan_chunk)
    return Probe((2 * c + 22, 7, 5, 6, 3), (((0, 0, c + 3),), ((0, c + 3, 2),), ((0, c + 5, c - 14),),
                                          ((0, 2 * c - 9, 31), (1, 0, 7)), ((2, 0, 5), (3, 0, 6), (4, 0, 3))))


def probe_for(model: nn.Module) -> Probe:
    """:data:`PROBE`, or :func:`recurrent_probe` for a model whose decoder layers mix tokens with a
    convolution or a recurrent state (a ``Conv1d``, or ``linear_attention`` in ``config.layer_types``),
    its scan chunk from the config (``chunk_size`` / ``mamba_chunk_size``; 64, HF's Gated DeltaNet
    torch scan's, by default)."""
    types = getattr(model.config, "layer_types", None) or ()
    if "linear_attention" not in types and not any(isinstance(m, nn.Conv1d) for m in model.model.layers.modules()):
        return PROBE
    chunk = max(int(getattr(model.config, n, 0) or 0) for n in ("chunk_size", "mamba_chunk_size"))
    return recurrent_probe(chunk or 64)

_PROBE_SEED = 20240917
_TOL = {torch.float32: (1e-4, 1e-3), torch.float64: (1e-4, 1e-3)}
_TOL_LOW = (5e-2, 2e-1)  # bfloat16 / float16
_AUX_TOL = 1e-5


class SelfCheckError(ValueError):
    """The runtime does not compute what the HF model computes (see the module docstring)."""


@dataclass
class _Finding:
    what: str
    runtime: float
    hf: float

    def __str__(self) -> str:
        return f"{self.what}: runtime {self.runtime:.6g}, HF {self.hf:.6g}"


def self_check(model: nn.Module, topology: Topology, device: torch.device | str | None = None,
               router_aux_loss: str | None = None) -> None:
    """Run :func:`check_model` on global rank 0 (on ``device``) and broadcast its verdict: every
    rank raises :class:`SelfCheckError` with the same message, or none does. Collective."""
    verdict = None
    if topology.rank == 0:
        t0 = time.perf_counter()
        try:
            check_model(model, device, router_aux_loss)
        except SelfCheckError as exc:
            verdict = str(exc)
        except Exception as exc:  # the runtime itself failed on the probe: a refusal too
            from ..integrations.peft import base_model_of

            verdict = (f"concertina self-check of model type {_model_type(base_model_of(model))!r}: the runtime "
                       "failed on a "
                       f"probe batch: {type(exc).__name__}: {exc}")
        logger.info("concertina self-check: %s in %.2f s", "mismatch" if verdict else "passed",
                    time.perf_counter() - t0)
    verdict = topology.broadcast_from_rank0(verdict)
    if verdict:
        raise on_every_rank(SelfCheckError(verdict))


def check_model(model: nn.Module, device: torch.device | str | None = None,
                router_aux_loss: str | None = None) -> None:
    """The checks of the module docstring on this process; :class:`SelfCheckError` on a mismatch.
    ``model``: an HF causal LM, or a ``PeftModel`` around one (its adapters are in the layers).
    ``device``: where to run the probe (default: where the model is); only the probed modules
    (the prefix layers, the embedding, the head) go there, and back afterwards.
    ``router_aux_loss``: ``concertina_router_aux_loss`` (set: the probe runs without the router
    logits, whose term the runtime adds itself)."""
    from ..integrations.peft import base_model_of
    from ..runtime.router_aux import without_router_logits

    hf = base_model_of(model)
    kind = _model_type(hf)
    home = next(hf.parameters()).device
    dev = home if device is None else torch.device(device)
    if dev.type == home.type and (dev.type != "cuda" or dev.index == home.index):
        dev = home
    dtype = next(hf.parameters()).dtype
    loss_tol, grad_tol = _TOL.get(dtype, _TOL_LOW)
    probe = probe_for(hf)
    ids, labels = _probe_batch(probe, int(hf.config.vocab_size), dev)
    with _preserved(hf, home), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), \
            without_router_logits(hf, router_aux_loss is not None), _probe_scales(hf):
        k = probe_layers(hf)
        hf.model.layers = nn.ModuleList(list(hf.model.layers)[:k])
        hf.to(dev)  # the probed modules only (a no-op when the model is there already)
        checked = _checked_parameters(hf)
        for p in hf.parameters():
            p.requires_grad_(False)
        for p in checked.values():
            p.requires_grad_(True)
        # HF's training loss against the cross-entropy of the same forward (auxiliary losses)
        hf.train()
        aux = _auxiliary_loss_finding(hf, ids, labels)
        hf.eval()
        hf_slices, hf_grads = _hf_reference(probe, hf, ids, labels, checked)
        for p in checked.values():
            p.grad = None
        rt_slices, rt_grads = _runtime(probe, model, ids, labels, k, checked)
    problems: list[str] = []
    if aux is not None:
        problems.append(
            f"HF's training loss is not the cross-entropy of its logits ({aux}): the model adds a term (a router "
            "auxiliary loss with output_router_logits=True?) that the pipeline's cross-entropy does not; set "
            "output_router_logits=False (or the model's equivalent) to train without it")
    bad = [_Finding(f"loss of {name}", rt, hf) for (name, hf), rt in zip(hf_slices.items(), rt_slices)
           if not abs(rt - hf) <= loss_tol * max(abs(hf), 1.0)]
    if bad:
        where = _diagnose(bad, len(hf_slices))
        problems.append(f"slice losses differ on {len(bad)} of {len(hf_slices)} probe slices ({where}); worst: "
                        f"{max(bad, key=lambda f: abs(f.runtime - f.hf))}")
    grad_bad = []
    # a parameter whose gradient is nearly 0 compares its float noise: relative to at least 1% of the
    # largest checked gradient
    floor = 1e-2 * max((float(g.float().norm()) for g in hf_grads.values()), default=0.0)
    for name, ref in hf_grads.items():
        got = rt_grads.get(name)
        if got is None:
            grad_bad.append((float("inf"), name))
            continue
        err = float((got.float() - ref.float()).norm()) / max(float(ref.float().norm()), floor, 1e-30)
        if not err <= grad_tol:
            grad_bad.append((err, name))
    if grad_bad:
        err, name = max(grad_bad)
        problems.append(f"gradients differ on {len(grad_bad)} of {len(hf_grads)} checked parameters; worst "
                        f"{name} (relative difference {err:.3g}, tolerance {grad_tol:g})")
    if problems:
        raise SelfCheckError(
            f"concertina self-check: the pipeline runtime does not reproduce model type {kind!r} "
            f"({type(hf).__name__}, {dtype}, first {k} decoder layers probed): " + "; ".join(problems)
            + ". ConcertinaTrainer would train a different model than Trainer; this model type is not supported "
            "(concertina_self_check=False skips this check at your own risk)")


# ---------------------------------------------------------------------------------- probe
def probe_layers(model: nn.Module) -> int:
    """The shortest prefix of the decoder layers holding every kind of layer of the model (by
    module structure, ``attention_type`` and ``config.layer_types``), at least 2 layers."""
    layers = list(model.model.layers)
    types = getattr(model.config, "layer_types", None)
    first: dict[Any, int] = {}
    for i, layer in enumerate(layers):
        sig = (type(layer).__name__, tuple((n, type(m).__name__) for n, m in layer.named_children()),
               getattr(layer, "attention_type", None),
               types[i] if isinstance(types, (list, tuple)) and i < len(types) else None)
        first.setdefault(sig, i)
    return min(len(layers), max(2, max(first.values(), default=0) + 1))


def _probe_batch(probe: Probe, vocab: int, dev: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(_PROBE_SEED)
    ids = [torch.randint(0, vocab, (n,), generator=g).to(dev) for n in probe.lengths]
    labels = [t.clone() for t in ids]
    return ids, labels


def _slice_groups(probe: Probe) -> dict[str, tuple[int, int, int]]:
    """Name -> (seq, first token, end token) of each probe slice; its targets are its tokens'."""
    out = {}
    for chunk in probe.chunks:
        for seq, start, length in chunk:
            n = probe.lengths[seq]
            name = (f"sequence {seq} ({n} tokens)" if length == n else
                    f"sequence {seq}, tokens {start}:{start + length} (after {start} tokens of context in an "
                    "earlier chunk)" if start else f"sequence {seq}, tokens {start}:{start + length} (split)")
            out[name] = (seq, start, start + length)
    return out


def _checked_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    layers = list(model.model.layers)
    out: dict[str, nn.Parameter] = {}
    for i in sorted({0, len(layers) - 1}):
        out.update({f"model.layers.{i}.{n}": p for n, p in layers[i].named_parameters() if p.is_floating_point()})
    norm = final_norm(model)  # model.model.norm, or its name in this family
    name = next(n for n, m in model.model.named_children() if m is norm)
    out.update({f"model.{name}.{n}": p for n, p in norm.named_parameters() if p.is_floating_point()})
    return out


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of token ``t`` predicting ``labels[t + 1]`` (float32, 0 where ignored)."""
    logits = logits[0, :-1].float()
    tgt = labels[1:]
    return F.cross_entropy(logits, tgt, ignore_index=-100, reduction="none")


def _auxiliary_loss_finding(model: nn.Module, ids: Sequence[torch.Tensor],
                            labels: Sequence[torch.Tensor]) -> _Finding | None:
    with torch.no_grad():
        out = model(input_ids=ids[0][None], labels=labels[0][None], use_cache=False)
    if getattr(out, "loss", None) is None:
        return None
    ce = float(_token_losses(out.logits, labels[0]).sum()) / max(1, int((labels[0][1:] != -100).sum()))
    hf = float(out.loss)
    # both from the same logits, in float32: only the summation order differs, in any dtype
    if abs(hf - ce) <= _AUX_TOL * max(abs(ce), 1.0):
        return None
    return _Finding("sequence 0", ce, hf)


def _hf_reference(probe: Probe, model: nn.Module, ids: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                  checked: dict[str, nn.Parameter]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Per-slice loss sums and the checked parameters' gradients of HF's model on each sequence alone."""
    total = sum(int((lab[1:] != -100).sum()) for lab in labels)
    per_token = []
    for x, lab in zip(ids, labels):
        logits = model(input_ids=x[None], use_cache=False).logits
        losses = _token_losses(logits, lab)
        (losses.sum() / total).backward()
        per_token.append(losses.detach())
    slices = {}
    for name, (seq, a, b) in _slice_groups(probe).items():
        # token t of [a, b) predicts label t + 1; the sequence's last token predicts nothing
        slices[name] = float(per_token[seq][a:min(b, probe.lengths[seq] - 1)].sum())
    grads = {n: p.grad.detach().clone() for n, p in checked.items() if p.grad is not None}
    return slices, grads


def _runtime(probe: Probe, model: nn.Module, ids: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], k: int,
             checked: dict[str, nn.Parameter]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same through the runtime, in one training run of the executor: the stage's head is
    also called, without gradient, on each slice's targets alone to give the per-slice losses."""
    from ..runtime import PipelineExecutor
    from .run_setup import pipeline_stage

    layout = StageLayout.even(k, 1)
    wrapper, _ = pipeline_stage(model, layout, 0)  # a PeftModel: its HF model, adapters in place
    executor = PipelineExecutor(wrapper)
    plan = _probe_plan(probe, layout, num_recompute=1)
    groups = _slice_groups(probe)
    names = list(groups)
    per_chunk = []  # per chunk: (slice name, its token range in the chunk)
    for chunk in probe.chunks:
        spans, offset = [], 0
        for seq, start, length in chunk:
            spans.append((names.index(next(n for n, g in groups.items() if g == (seq, start, start + length))),
                          offset, offset + length))
            offset += length
        per_chunk.append(spans)
    losses = [float("nan")] * len(names)
    head = wrapper.head_loss_sum
    calls = []

    def head_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        spans = per_chunk[len(calls)]  # one stage: the chunks' forwards run in plan order
        calls.append(len(spans))
        with torch.no_grad():
            for i, a, b in spans:
                only = torch.full_like(targets, -100)
                only[a:b] = targets[a:b]
                losses[i] = float(head(hidden, only, *args, **kwargs))
        return head(hidden, targets, *args, **kwargs)

    wrapper.head_loss_sum = head_loss_sum  # this probe's own wrapper only
    total = sum(int((lab[1:] != -100).sum()) for lab in labels)
    executor.run_step(plan, ids, labels, num_items_in_batch=total, train=True)
    grads = {n: p.grad.detach().clone() for n, p in checked.items() if p.grad is not None}
    return losses, grads


def _probe_plan(probe: Probe, layout: StageLayout, num_recompute: int) -> Plan:
    chunks = []
    for i, spec in enumerate(probe.chunks):
        slices = tuple(Slice(*s) for s in spec)
        chunks.append(Chunk(i, ChunkKind.of(slices, probe.lengths), slices))
    groups = (tuple(range(len(chunks))),)
    r = min(num_recompute, layout.num_layers)
    recompute = (tuple(r if probe.recomputed(i) else 0 for i in range(len(chunks))),)
    plan = Plan(strategy="self-check", seq_lens=probe.lengths, layout=layout, chunks=tuple(chunks), groups=groups,
                schedule=build_schedule(chunks, groups, 1), recompute=recompute)
    return plan.validate()


def _diagnose(bad: list[_Finding], num_slices: int) -> str:
    names = [f.what for f in bad]
    if len(bad) == num_slices:
        return "every sequence: work outside the decoder layers (embedding or logit scaling, soft-capping) or a " \
               "layer computing differently"
    ctx = [n for n in names if "context" in n]
    if ctx and len(ctx) == len(names):
        return "only the slice attending to an earlier chunk: the chunk context did not reach a layer's mixer"
    return "slices of packed or split sequences: a layer's mixer does not keep sequences apart or loses the " \
           "context of earlier slices (the chunk context did not reach it, or it bypasses the attention interface)"


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


#: what the probe lowers for its own time, so that its short sequences reach it: chunked attention's
#: chunk (``config.attention_chunk_size``; 10-token slices then start inside a chunk) and Llama 4's
#: temperature step (its attention modules' ``floor_scale``)
PROBE_CHUNK, PROBE_FLOOR_SCALE = 8, 4


@contextmanager
def _probe_scales(model: nn.Module) -> Iterator[None]:
    """Chunks of :data:`PROBE_CHUNK` tokens and a temperature step of :data:`PROBE_FLOOR_SCALE`
    while the probe runs (HF and the runtime read both at call time), restored afterwards."""
    saved: list[tuple[Any, str, Any]] = []
    config = model.config
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > PROBE_CHUNK and "chunked_attention" in (getattr(config, "layer_types", None)
                                                                                 or ()):
        saved.append((config, "attention_chunk_size", chunk))
    for m in model.modules():
        step = getattr(m, "floor_scale", None)
        if getattr(m, "attn_temperature_tuning", False) and isinstance(step, (int, float)) and step > PROBE_FLOOR_SCALE:
            saved.append((m, "floor_scale", step))
    try:
        for obj, name, _ in saved:
            setattr(obj, name, PROBE_CHUNK if name == "attention_chunk_size" else PROBE_FLOOR_SCALE)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


@contextmanager
def _preserved(model: nn.Module, home: torch.device) -> Iterator[None]:
    """Restore everything the probe touches on ``model`` (see the module docstring); the probed
    modules go back to ``home``."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    flags = [p.requires_grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    ckpt = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    attn = getattr(model.config, "_attn_implementation", None)
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, g, f in zip(params, grads, flags):
            p.grad = g
            p.requires_grad_(f)
        for m, t in modes:
            m.training = t
        for m in ckpt:
            m.gradient_checkpointing = True
        model.to(home)
        if layers is not None:
            inner.layers = layers
        if attn is not None and model.config._attn_implementation != attn:
            try:
                model.set_attn_implementation(attn)
            except Exception:
                model.config._attn_implementation = attn
            if model.config._attn_implementation != attn:
                model.config._attn_implementation = attn
