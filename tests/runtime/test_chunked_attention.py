"""Chunked attention (``runtime/attention/chunked.py``): Llama 4's text model through the runtime.

The model: ``scripts/model_support.py``'s tiny ``llama4_text`` (4 layers: chunked attention with
rotary embeddings and QK norm at layers 0 and 2, ``attention_chunk_size`` 8; full attention without
rotary and with the query temperature at layers 1 and 3, ``floor_scale`` 4 so that it grows within
the sequences; MoE feed-forward with a shared expert and a sigmoid router, float32, eager).
Sequences of 40, 11, 8, 5 and 3 tokens; sequence 0 split at tokens 12 and 19 (inside chunks: each
of these slices reads the carried keys of its chunk from the edge at 8 or 16, and crosses the edge
16 or ends on 24), 24 (on an edge: it reads no carried key) and 33. Chunks: four split chunks, a
hybrid chunk (the tail plus sequence 1 whole) and a packed chunk (sequences 2, 3, 4).

- **HF's model**: pp=1 (``PipelineExecutor``) and the sequential pp=2
  (``model_support.run_sequential``) under recompute none / partial / full against HF on the
  right-padded batch: loss 1e-5, every gradient 1e-4; with the chunks or the temperature ignored
  the same comparison fails.
- **The other kernels**: the CUDA varlen layout of the pieces (through a CPU stand-in of torch's
  ``varlen_attn``), per-segment SDPA and eager, against HF.
- **No leak between documents** of the packed and the hybrid chunk.
- **output_router_logits**: Llama 4 adds no router loss; accepted.
- **The pieces**: a slice's pieces and their keys (``ChunkAttentionContext.chunked``).
- **Refusals**: sequence parallelism (named), a window with chunks.
- **Cost**: a chunked layer's attention term is that of the pairs within the chunk (linear in a
  long sequence's length), below a full layer's.
"""

from __future__ import annotations

import copy

import pytest
import torch

import _linear_attention_cases as cases
from concertina_hf.planning import StageLayout
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

model_support = cases.model_support

SEQ_LENS = (40, 11, 8, 5, 3)
CHUNKS = (((0, 0, 12),), ((0, 12, 7),), ((0, 19, 5),), ((0, 24, 9),), ((0, 33, 7), (1, 0, 11)),
          ((2, 0, 8), (3, 0, 5), (4, 0, 3)))
CHUNK_SIZE = 8


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    cfg = model_support.tiny_config("llama4_text")
    assert cfg.attention_chunk_size == CHUNK_SIZE and cfg.layer_types[0] == "chunked_attention"
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().train()
    assert [layer.self_attn.use_rope for layer in m.model.layers] == [1, 0, 1, 0]
    assert hasattr(m.model.layers[0].self_attn, "qk_norm") and m.model.layers[0].is_moe_layer
    return m


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model_support.VOCAB, (n,), generator=g) for n in SEQ_LENS]
    labels = [t.clone() for t in ids]
    labels[0][11:14] = -100  # across the first slice boundary
    return ids, labels


def _plan(layout, recompute, chunks=CHUNKS, seq_lens=SEQ_LENS):
    return cases.make_plan(layout, recompute, chunks, seq_lens)


def _pp1(model, ids, labels, recompute="none", chunks=CHUNKS, seq_lens=SEQ_LENS):
    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(4, 1), 0)
    res = PipelineExecutor(w).run_step(_plan(w.layout, recompute, chunks, seq_lens), ids, labels,
                                       num_items_in_batch=cases.num_items(labels))
    return res.loss, {k: p.grad for k, p in w.named_parameters() if p.grad is not None}


def _pp2(model, ids, labels, recompute):
    layout = StageLayout.even(4, 2)
    stages = [PipelineWrapper(copy.deepcopy(model), layout, s) for s in range(2)]
    loss = model_support.run_sequential(stages, _plan(layout, recompute), ids, labels, float(cases.num_items(labels)))
    return loss, [(k, p) for w in stages for k, p in w.named_parameters()]


def test_split_hybrid_and_packed_chunks_equal_hf(model):
    ids, labels = _batch()
    ref_loss, ref_grads = cases.padded_reference(model, ids, labels)
    rows, failures = [], []
    for recompute in cases.RECOMPUTE:
        loss, grads = _pp1(model, ids, labels, recompute)
        errors = cases.gradient_errors([(k, _Grad(g)) for k, g in grads.items()], ref_grads)
        row, bad = cases.check_case(f"pp=1 recompute {recompute}", loss, ref_loss, errors, mixer_params=())
        rows.append(row)
        failures += bad
        loss, params = _pp2(model, ids, labels, recompute)
        row, bad = cases.check_case(f"pp=2 recompute {recompute}", loss, ref_loss,
                                    cases.gradient_errors(params, ref_grads), mixer_params=())
        rows.append(row)
        failures += bad
    for row in rows:
        print(row)
    assert failures == []
    assert len(ref_grads) == len(errors)  # every parameter compared (router, experts, shared expert among them)


class _Grad:
    """A gradient as :func:`cases.gradient_errors` reads a parameter."""

    requires_grad = True

    def __init__(self, grad):
        self.grad = grad


@pytest.mark.parametrize("ignored", ["chunks", "temperature"])
def test_the_comparison_fails_without_the_feature(model, monkeypatch, ignored):
    """With the chunk size (or the temperature's positions) ignored by the backend, the loss
    differs from HF's by over ten times the bound: both matter on this batch."""
    from concertina_hf.runtime.attention import forward

    ids, labels = _batch()
    ref_loss, _ = cases.padded_reference(model, ids, labels)
    if ignored == "chunks":
        monkeypatch.setattr(forward, "attention_chunk", lambda module, layer: None)
    else:
        monkeypatch.setattr(forward, "tempers_queries", lambda module: False)
    loss, _ = _pp1(model, ids, labels)
    assert abs(loss - ref_loss) / ref_loss > 10 * cases.LOSS_TOL


@pytest.mark.parametrize("perturbed", [1, 3])
def test_a_document_does_not_reach_the_others(model, perturbed):
    """Sequence 1 sits in the hybrid chunk after the split sequence's tail; sequence 3 between two
    documents of the packed chunk. The other documents' loss and gradients are unchanged."""
    ids, labels = _batch()
    labels[perturbed][:] = -100
    other = [t.clone() for t in ids]
    other[perturbed] = (other[perturbed] + 7) % model_support.VOCAB
    la, ga = _pp1(model, ids, labels)
    lb, gb = _pp1(model, other, labels)
    assert la == lb
    assert ga.keys() == gb.keys()
    # the experts' batched products run over every token: equal to rounding; the rest bit-identical
    experts = [k for k in ga if ".experts." in k]
    assert [k for k in ga if k not in experts and not torch.equal(ga[k], gb[k])] == []
    assert all(float((ga[k] - gb[k]).norm()) <= 1e-6 * float(ga[k].norm()) for k in experts)


def test_a_slice_reads_the_carried_keys_of_its_chunk_only():
    from concertina_hf.runtime.attention import ChunkAttentionContext, KVStore, SliceSpec

    store = KVStore()
    k = torch.randn(1, 1, 12, 2)
    ctx0 = ChunkAttentionContext([SliceSpec(0, 0, 12, 0, False)], store, "cpu", requires_grad=False)
    ctx0.store_own(0, k, k)
    # the slice at 12 (7 tokens) and a whole document of 3 tokens, chunk size 8
    ctx = ChunkAttentionContext([SliceSpec(0, 12, 7, 0, True), SliceSpec(1, 0, 3, 7, True)], store, "cpu",
                                requires_grad=False)
    view = ctx.chunked(CHUNK_SIZE)
    assert [(s.seq, s.start, s.length, s.offset) for s in view.slices] == [(0, 12, 4, 0), (0, 16, 3, 4), (1, 0, 3, 7)]
    # keys: positions 8..15 (4 carried, 4 own), 16..18, the document's 3
    assert view.cu_seqlens_k.tolist() == [0, 8, 11, 14] and view.cu_seqlens_q.tolist() == [0, 4, 7, 10]
    parts, cut, lo = view.prefix(view.slices[0], 0, None, None)
    assert (lo, cut, len(parts)) == (8, 8, 1)  # the carried slice's keys from position 8 on
    assert view.prefix(view.slices[1], 0, None, None) == ([], 0, 16)  # on an edge: nothing carried
    keys, _ = view.varlen_keys(0, torch.zeros(1, 1, 10, 2), torch.zeros(1, 1, 10, 2))
    assert torch.equal(keys[:, :, :4], k[:, :, 8:12]) and keys.shape[2] == 14
    assert ctx.chunked(CHUNK_SIZE) is view
    with pytest.raises(RuntimeError, match="reads the K/V store"):
        view.store_own(0, k, k)


def test_sequence_parallelism_is_refused_by_name(model):
    from concertina_hf.runtime.attention.chunked import sequence_parallel_refusal

    why = sequence_parallel_refusal(model.config, 2)
    assert "chunked_attention layers and attn_temperature_tuning" in why
    assert "set concertina_sequence_parallel_size=1" in why
    assert sequence_parallel_refusal(model_support.tiny_config("llama"), 2) is None


def test_layout_auto_leaves_sequence_parallelism_out(model, tmp_path):
    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.planning.layouts import Layout
    from concertina_hf.training import auto_layout

    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    refused = auto_layout._runtime_refusals(args, model, 4)
    assert set(refused) == {Layout(1, 2, 2), Layout(2, 2, 1), Layout(1, 4, 1)}
    assert all("chunked_attention layers" in why for why in refused.values())


def test_a_window_with_chunks_is_refused(model):
    from concertina_hf.runtime.attention import ChunkAttentionContext, KVStore, SliceSpec, forward

    attn = model.model.layers[0].self_attn
    ctx = ChunkAttentionContext([SliceSpec(0, 0, 4, 0, True)], KVStore(), "cpu", requires_grad=False)
    q = torch.zeros(1, 4, 4, 16)
    with pytest.raises(ValueError, match="chunked_attention layer and passes a sliding window"):
        forward.concertina_attention_forward(attn, q, q[:, :2], q[:, :2], None, sliding_window=4,
                                             concertina_ctx=ctx)


def test_output_router_logits_adds_nothing_to_llama4s_loss(model):
    """Llama 4's forward returns the router logits and adds no load-balancing loss: the flag is
    accepted (no refusal) and HF's loss is the same with it."""
    from concertina_hf.runtime.families import check_config, inspect_model

    ids, labels = _batch()
    flagged = copy.deepcopy(model)
    flagged.config.output_router_logits = True
    check_config(flagged.config)
    assert inspect_model(flagged).router_aux is None
    with torch.no_grad():
        a = model(input_ids=ids[0][None], labels=labels[0][None], use_cache=False).loss
        b = flagged(input_ids=ids[0][None], labels=labels[0][None], use_cache=False, output_router_logits=True)
    assert b.router_logits is not None and torch.equal(a, b.loss)


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), enable_gqa=False):
    """torch's ``varlen_attn`` on CPU (FlashAttention-2's bottom-right causal convention, densely):
    segment ``i`` is queries ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]``."""
    assert window_size == (-1, 0) and (enable_gqa or k.shape[1] == q.shape[1])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    outs = []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        allowed = torch.ones(qs.shape[0], ks.shape[0], dtype=torch.bool).tril(ks.shape[0] - qs.shape[0])
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vs))
    return torch.cat(outs, dim=0)


@pytest.mark.parametrize("kernel", ["torch-varlen", "sdpa-per-segment", "eager-per-segment"])
def test_the_other_kernels_take_the_pieces(model, monkeypatch, kernel):
    """The CUDA varlen layout of the pieces (``cu_seqlens`` of the chunked view, its keys), through
    a CPU stand-in of torch's ``varlen_attn``, and the per-segment SDPA and eager paths: HF's loss
    and gradients at pp=1 (the real CUDA kernels: not run on this machine)."""
    from concertina_hf.runtime.attention import kernels, varlen

    monkeypatch.setattr(kernels, "choose_kernel", lambda *a, **k: kernel)
    calls = []

    def stand_in(*args, **kw):
        calls.append(args[4].tolist())  # cu_seqlens_k
        return _varlen_stand_in(*args, **kw)

    monkeypatch.setattr(varlen, "torch_varlen", lambda: (stand_in, frozenset({"scale", "window_size", "enable_gqa"})))
    ids, labels = _batch()
    ref_loss, ref_grads = cases.padded_reference(model, ids, labels)
    loss, grads = _pp1(model, ids, labels, "partial")
    errors = cases.gradient_errors([(k, _Grad(g)) for k, g in grads.items()], ref_grads)
    _, failures = cases.check_case(kernel, loss, ref_loss, errors, mixer_params=())
    assert failures == []
    # the slice at 12 (7 tokens) on a chunked layer: its pieces 12..15 (keys from 8) and 16..18
    assert (kernel == "torch-varlen") == ([0, 8, 11] in calls)


def test_the_self_check_probes_chunks_and_temperature_of_real_sizes(model, monkeypatch):
    """With Llama 4's released sizes (chunks of 8192 tokens, a temperature step of 8192) the
    self-check's probe of 24 tokens lowers both for its own time: it passes, restores them, and
    refuses a runtime that ignored either."""
    from concertina_hf.runtime.attention import forward
    from concertina_hf.training.self_check import SelfCheckError, check_model

    m = copy.deepcopy(model)
    m.config.attention_chunk_size = 8192
    attns = [layer.self_attn for layer in m.model.layers]
    for a in attns:
        a.floor_scale = 8192
    check_model(m)
    assert m.config.attention_chunk_size == 8192 and all(a.floor_scale == 8192 for a in attns)
    for name, off in (("attention_chunk", lambda module, layer: None), ("tempers_queries", lambda module: False)):
        with monkeypatch.context() as patch:
            patch.setattr(forward, name, off)
            with pytest.raises(SelfCheckError, match="does not reproduce model type 'llama4_text'"):
                check_model(m)
