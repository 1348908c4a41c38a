"""The ``"concertina"`` attention backend against HF's own attention on each sequence alone.

Each case runs chunks (packed sequences, slices of a sequence carrying K/V to later slices,
tails packed with whole sequences) through :func:`concertina_attention_forward` the way the
executor does (forward in chunk order, storing non-final slices' K/V; backward in reverse with
the gradients later slices left on the stored leaves), and compares every sequence's output and
the gradients of its query, key and value with HF's ``sdpa_attention_forward`` (or the model's
own eager attention, for soft-capping and sinks) on that sequence alone. Plus: a decoder layer
that drops ``**kwargs`` (StableLM) through the runtime, refusals naming keyword and model type.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _runtime_cases import VOCAB, batch, make_plan, reference, compare_grads
from concertina_hf.planning import StageLayout
from concertina_hf.runtime import ChunkAttentionContext, KVStore, PipelineExecutor, PipelineWrapper, SliceSpec
from concertina_hf.runtime import attention as A
from concertina_hf.runtime.attention import cpu as A_cpu, forward as A_forward, kernels as A_kernels
from concertina_hf.runtime.attention import segments as A_segments, varlen as A_varlen

TOL = dict(rtol=1e-5, atol=1e-5)

# sequences (lengths) and chunks [(seq, start, length), ...]: packed, split with carry, tails packed
LENS = {0: 23, 1: 9, 2: 6, 3: 14}
CHUNKS = {
    "packed": [[(0, 0, 23)], [(1, 0, 9), (2, 0, 6), (3, 0, 14)]],
    "split": [[(0, 0, 7)], [(0, 7, 5)], [(0, 12, 11)], [(3, 0, 6)], [(3, 6, 8), (1, 0, 9), (2, 0, 6)]],
    "hybrid": [[(3, 0, 5), (1, 0, 9)], [(0, 0, 10), (3, 5, 4)], [(2, 0, 6), (0, 10, 13), (3, 9, 5)]],
}


def _module(heads: int, kv_heads: int, model_type: str = "test", sinks: torch.Tensor | None = None):
    m = torch.nn.Module()
    m.layer_idx = 0
    m.config = types.SimpleNamespace(model_type=model_type)
    m.num_key_value_groups = heads // kv_heads
    m.is_causal = True
    m.head_dim = None
    if sinks is not None:
        m.sinks = sinks
    return m


def _tensors(H, K, D, Dv, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s, n in LENS.items():
        q = (torch.randn(1, H, n, D, generator=g) * scale).requires_grad_()
        k = (torch.randn(1, K, n, D, generator=g) * scale).requires_grad_()
        v = torch.randn(1, K, n, Dv, generator=g).requires_grad_()
        w = torch.randn(1, n, H, Dv, generator=g)  # weights of the loss sum(out * w)
        out[s] = (q, k, v, w)
    return out


def _run_backend(module, data, chunks, **kw):
    """Forward in chunk order, backward in reverse, as the executor does. -> per sequence (out, dq, dk, dv)."""
    store = KVStore()
    done = []
    for chunk in chunks:
        specs, off = [], 0
        for seq, start, n in chunk:
            specs.append(SliceSpec(seq, start, n, off, start + n == LENS[seq]))
            off += n
        ctx = ChunkAttentionContext(specs, store, "cpu", True)
        q, k, v = (torch.cat([data[s.seq][j][:, :, s.start:s.start + s.length] for s in specs], dim=2)
                   for j in range(3))
        out, _ = A.concertina_attention_forward(module, q, k, v, None, concertina_ctx=ctx, **kw)
        done.append((specs, out))
    for specs, out in reversed(done):
        g = torch.cat([data[s.seq][3][:, s.start:s.start + s.length] for s in specs], dim=1)
        tensors, grads = [out], [g]
        for s in specs:
            if not s.final:
                for e in store.entries(s.seq, s.start):
                    for t, leaf in ((e.k, e.k_leaf), (e.v, e.v_leaf)):
                        if leaf.grad is not None:
                            tensors.append(t)
                            grads.append(leaf.grad)
        torch.autograd.backward(tensors, grads)
        for s in specs:
            if not s.final:
                store.free_slice(s.seq, s.start)
    assert len(store) == 0
    outs = {s: [] for s in LENS}
    for specs, out in done:
        for s in specs:
            outs[s.seq].append(out[:, s.offset:s.offset + s.length].detach())
    return {s: (torch.cat(outs[s], dim=1), *(t.grad.clone() for t in data[s][:3])) for s in LENS}


def _run_reference(module, data, fn, window=None, **kw):
    """HF's attention ``fn`` on each sequence alone (its own mask: causal, sliding window)."""
    res = {}
    for s, n in LENS.items():
        q, k, v, w = (t.detach().clone().requires_grad_(t.requires_grad) for t in data[s])
        i = torch.arange(n)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed &= (i[:, None] - i[None, :]) < window
        allowed = allowed.to(q.device)
        if fn is _hf_sdpa:
            mask = allowed[None, None]
        else:  # eager functions add the mask
            mask = torch.zeros(1, 1, n, n, device=q.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
        out, _ = fn(module, q, k, v, mask, **kw)
        (out * w).sum().backward()
        res[s] = (out.detach(), q.grad, k.grad, v.grad)
    return res


def _hf_sdpa(*a, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*a, **kw)


def _compare(got, want, tol=TOL):
    for s in LENS:
        for name, a, b in zip(("out", "dq", "dk", "dv"), got[s], want[s]):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"sequence {s} {name}: {m}")


# ---------------------------------------------------------------------------- against HF per sequence
@pytest.mark.parametrize("chunking", sorted(CHUNKS))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_matches_hf_sdpa_per_sequence(chunking, heads):
    H, K = heads
    module = _module(H, K)
    data = _tensors(H, K, 8, 8)
    got = _run_backend(module, data, CHUNKS[chunking], scaling=8 ** -0.5)
    _compare(got, _run_reference(module, data, _hf_sdpa, scaling=8 ** -0.5))
    assert "sdpa-cpu-flash on cpu" in A.kernels_used()


@pytest.mark.parametrize("window", [3, 8])
def test_sliding_window(window):
    """Windows shorter than slices and than contexts: earlier slices' keys partly out of the
    window (cut from the front of the prefix), and whole earlier slices out of it."""
    module = _module(4, 2)
    data = _tensors(4, 2, 8, 8, seed=1)
    got = _run_backend(module, data, CHUNKS["split"], scaling=0.3, sliding_window=window)
    _compare(got, _run_reference(module, data, _hf_sdpa, window=window, scaling=0.3))


def test_mla_value_head_dim():
    """DeepSeek-V3's MLA: query/key heads of 12, value heads of 8 (and the reverse)."""
    for d, dv in ((12, 8), (8, 12)):
        module = _module(4, 4)
        data = _tensors(4, 4, d, dv, seed=2)
        got = _run_backend(module, data, CHUNKS["hybrid"], scaling=d ** -0.5)
        _compare(got, _run_reference(module, data, _hf_sdpa, scaling=d ** -0.5))


def test_softcap_matches_gemma2_eager():
    """Gemma2's attention soft-capping, with query/key scales that make it bite (scores of tens)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = _module(4, 2, "gemma2")
    data = _tensors(4, 2, 8, 8, seed=3, scale=3.0)
    kw = dict(scaling=8 ** -0.5, softcap=5.0)
    got = _run_backend(module, data, CHUNKS["hybrid"], sliding_window=8, **kw)
    want = _run_reference(module, data, eager_attention_forward, window=8, **kw)
    _compare(got, want)
    # the cap matters here: without it the result is far away
    plain = _run_reference(module, data, eager_attention_forward, window=8, scaling=8 ** -0.5)
    assert (plain[0][0] - want[0][0]).abs().max() > 0.1
    assert "eager-per-segment on cpu" in A.kernels_used()


def test_sinks_match_gpt_oss_eager():
    """gpt-oss's attention sinks (``s_aux``, one logit per head): output, q/k/v and sink gradients."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(4)
    sinks_a = torch.randn(4, generator=g).mul(2).requires_grad_()
    sinks_b = sinks_a.detach().clone().requires_grad_()
    data = _tensors(4, 2, 8, 8, seed=4)
    got = _run_backend(_module(4, 2, "gpt_oss", sinks_a), data, CHUNKS["split"], scaling=0.35, s_aux=sinks_a,
                       sliding_window=5)
    want = _run_reference(_module(4, 2, "gpt_oss", sinks_b), data, eager_attention_forward, window=5, scaling=0.35)
    _compare(got, want)
    torch.testing.assert_close(sinks_a.grad, sinks_b.grad, **TOL)


def test_dropout_path_runs():
    """With attention dropout (per-segment SDPA on CPU): outputs differ from the dropout-free
    result by dropout's noise only, gradients reach queries, keys, values and the earlier slices."""
    module = _module(4, 2)
    data = _tensors(4, 2, 8, 8, seed=5)
    torch.manual_seed(0)
    got = _run_backend(module, data, CHUNKS["hybrid"], scaling=0.35, dropout=0.3)
    want = _run_reference(module, data, _hf_sdpa, scaling=0.35)
    for s in LENS:
        assert not torch.allclose(got[s][0], want[s][0])
        assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in got[s])
    assert "sdpa-per-segment on cpu" in A.kernels_used()


def test_no_mask_bigger_than_a_segment(monkeypatch):
    """CPU: no mask without a window (whole sequences: is_causal; slices with context: two calls
    merged by logsumexp); under a window, masks per segment (queries x keys within the window),
    never T x S."""
    shapes = []
    real = A_cpu.segment_mask

    def spy(start, length, lo, window, device):
        m = real(start, length, lo, window, device)
        shapes.append(None if m is None else tuple(m.shape))
        return m

    monkeypatch.setattr(A_cpu, "segment_mask", spy)
    module = _module(4, 2)
    data = _tensors(4, 2, 8, 8)
    _run_backend(module, data, CHUNKS["hybrid"], scaling=0.35)
    assert shapes and all(s is None for s in shapes)
    shapes.clear()
    _run_backend(module, data, CHUNKS["hybrid"], scaling=0.35, sliding_window=6)
    # (0, 10, 13) -> 13 x (5 + 13); (3, 5, 4) -> 4 x (5 + 4); (3, 9, 5) -> 5 x (5 + 5); whole
    # sequences of 9 and 10 tokens -> 9 x 9, 10 x 10 (band); those of 5 and 6 tokens: is_causal
    assert {s for s in shapes if s is not None} == {(13, 18), (4, 9), (5, 10), (9, 9), (10, 10)}


# ---------------------------------------------------------------------------- context delivery
REAL_MODELS = {
    # decoder layer drops **kwargs: the context arrives through the context variable
    "stablelm": dict(num_key_value_heads=2, partial_rotary_factor=0.5),
    # MLA: query/key heads of 24 (16 + 8 rotary), value heads of 8
    "deepseek_v3": dict(num_key_value_heads=4, moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1),
    # attention soft-capping, a sliding window shorter than the slices
    "gemma2": dict(num_key_value_heads=2, head_dim=8, sliding_window=6, query_pre_attn_scalar=8),
    # attention sinks, a sliding window
    "gpt_oss": dict(num_key_value_heads=2, head_dim=8, sliding_window=6, num_local_experts=4, num_experts_per_tok=2),
}


def _real_model(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, tie_word_embeddings=False, **REAL_MODELS[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # realistic scales: soft-capping and sinks matter
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif "sinks" in name:
                p.normal_(0.0, 1.0)
    return model.float()


@pytest.mark.parametrize("model_type", sorted(REAL_MODELS))
def test_real_models_through_the_runtime(model_type):
    """Tiny models built from config, through the runtime's stage functions (a long sequence in
    three slices, its tail packed with a whole sequence, two whole sequences packed), with and
    without recompute (the checkpoint replay in backward): loss and every gradient equal to HF's
    eager attention run on each sequence alone."""
    if model_type == "stablelm":
        import inspect

        from transformers.models.stablelm import modeling_stablelm

        call = inspect.getsource(modeling_stablelm.StableLmDecoderLayer.forward).split("self.self_attn(")[1]
        assert "**kwargs" not in call.split(")")[0]  # still a layer that drops them
    model = _real_model(model_type)
    lens = (30, 9, 7, 5)
    ids, labels = batch(lens)
    ref_loss, ref_grads = reference(model, ids, labels)
    layout = StageLayout.even(2, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    chunks = [[(0, 0, 12)], [(0, 12, 10)], [(0, 22, 8), (1, 0, 9)], [(2, 0, 7), (3, 0, 5)]]
    for rec in ("none", "full"):
        w.zero_grad(set_to_none=True)
        res = ex.run_step(make_plan(lens, chunks, layout, rec), ids, labels)
        assert abs(res.loss - ref_loss) / abs(ref_loss) < 1e-5, rec
        assert compare_grads(w, ref_grads, 1e-4) == [], rec


def test_context_variable_alone_and_kwarg_agree():
    module = _module(4, 2)
    data = _tensors(4, 2, 8, 8)
    specs = [SliceSpec(1, 0, 9, 0, True), SliceSpec(2, 0, 6, 9, True)]
    q, k, v = (torch.cat([data[s.seq][j].detach() for s in specs], dim=2) for j in range(3))
    ctx = ChunkAttentionContext(specs, KVStore(), "cpu", False)
    a, _ = A.concertina_attention_forward(module, q, k, v, None, concertina_ctx=ctx)
    with A.chunk_context(ctx):
        assert A.current_context() is ctx
        b, _ = A.concertina_attention_forward(module, q, k, v, None)
    assert A.current_context() is None
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_context_during_a_step_raises_and_plain_call_falls_back():
    module = _module(4, 2, "stablelm")
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, _ = A.concertina_attention_forward(module, q, k, v, None)  # outside a step: HF SDPA
    want, _ = _hf_sdpa(module, q, k, v, None)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    with A.step_active():
        with pytest.raises(RuntimeError, match="'stablelm'.*without a chunk context while a pipeline step runs"):
            A.concertina_attention_forward(module, q, k, v, None)


# ---------------------------------------------------------------------------- keywords
def test_unknown_or_non_neutral_keywords_raise_naming_them():
    module = _module(4, 2, "mymodel")
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    ctx = ChunkAttentionContext([SliceSpec(0, 0, 5, 0, True)], KVStore(), "cpu", False)
    with pytest.raises(ValueError, match="keyword 'frobnicate'.*'mymodel'"):
        A.concertina_attention_forward(module, q, k, v, None, concertina_ctx=ctx, frobnicate=1)
    with pytest.raises(ValueError, match="keyword 'frobnicate'.*'mymodel'"):  # also without a context
        A.concertina_attention_forward(module, q, k, v, None, frobnicate=1)
    with pytest.raises(ValueError, match="position_bias=a tensor.*'mymodel'"):
        A.concertina_attention_forward(module, q, k, v, None, concertina_ctx=ctx, position_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="'mymodel'.*attention_mask"):
        A.concertina_attention_forward(module, q, k, v, torch.ones(1, 1, 5, 5, dtype=torch.bool), concertina_ctx=ctx)
    with pytest.raises(ValueError, match="'mymodel'.*is_causal=False"):
        A.concertina_attention_forward(module, q, k, v, None, concertina_ctx=ctx, is_causal=False)
    # harmless ones, as HF layers pass them
    A.concertina_attention_forward(module, q, k, v, None, concertina_ctx=ctx, position_ids=torch.arange(5)[None],
                                   use_cache=False, output_attentions=False, output_router_logits=True,
                                   past_key_values=None, is_causal=True)


def test_keywords_hf_layers_pass_are_implemented_or_listed():
    """Every keyword the installed transformers' decoder models pass to ``attention_interface(``
    is a parameter of the backend or in its documented lists (else it would raise at run time:
    the point is that this list is looked at when transformers grows a keyword)."""
    import inspect
    import pathlib
    import re

    import transformers

    params = set(inspect.signature(A.concertina_attention_forward).parameters)
    known = params | set(A.IGNORED_KEYWORDS) | set(A.NEUTRAL_KEYWORDS)
    root = pathlib.Path(transformers.__file__).parent / "models"
    seen: dict[str, set[str]] = {}
    for f in root.glob("*/modeling_*.py"):
        src = f.read_text()
        for m in re.finditer(r"attention_interface\(", src):
            depth, j = 1, m.end()
            while depth and j < len(src):
                depth += {"(": 1, ")": -1}.get(src[j], 0)
                j += 1
            for kw in re.findall(r"(?<![\w.=])([a-z_]\w*)\s*=(?!=)", src[m.end():j - 1]):
                seen.setdefault(kw, set()).add(f.parent.name)
    # keywords of encoders, vision and speech towers (not causal LMs the runtime runs) are refused
    assert {"softcap", "s_aux", "sliding_window", "scaling", "dropout"} <= set(seen)
    unknown = {kw: sorted(ms)[:3] for kw, ms in seen.items() if kw not in known}
    assert set(unknown) <= {"query", "key", "value", "deterministic"}, unknown


# ---------------------------------------------------------------------------- the varlen paths' plumbing
def _fa2_reference(q, k, v, cu_q, cu_k, scale, left, causal, softcap=None):
    """FlashAttention-2's varlen semantics, densely on CPU: segment ``i`` is queries
    ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]``, the causal diagonal aligned
    bottom-right, keys within ``left`` positions before it (``left < 0``: unbounded). q [T, H, D],
    k/v [S, K, D] (K may divide H)."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        sq, sk = qs.shape[0], ks.shape[0]
        diag = torch.arange(sq)[:, None] + (sk - sq)
        t = torch.arange(sk)[None, :]
        allowed = (t <= diag) if causal else torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            allowed &= t >= diag - left
        o = A_segments.eager_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                       scale, softcap, None, 0.0, allowed=allowed)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def _fake_torch_varlen(params):
    """torch's varlen_attn as releases spell it (``params``: its keyword names), on CPU."""
    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        assert set(kw) <= params, (set(kw), params)
        calls.append(dict(kw))
        if k.shape[1] != q.shape[1]:
            assert kw.get("enable_gqa"), "different head counts without enable_gqa"
        window = kw.get("window_size", (-1, -1))
        assert window[1] in (-1, 0)
        causal = kw.get("is_causal", False) or window == (-1, 0) or window[1] == 0
        scale = kw.get("scale") or q.shape[-1] ** -0.5
        return _fa2_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), scale, window[0], causal)

    return varlen_attn, calls


TORCH_VARLEN_SIGNATURES = {  # keyword-only parameters of varlen_attn, read in each release's source
    "2.11": frozenset({"return_aux", "scale", "window_size"}),  # no enable_gqa: K/V heads repeated
    "2.13": frozenset({"return_aux", "scale", "window_size", "enable_gqa", "seqused_k", "block_table", "num_splits"}),
    "is_causal+scale": frozenset({"is_causal", "return_aux", "scale"}),
    "is_causal only": frozenset({"is_causal", "return_aux"}),
}


@pytest.mark.parametrize("sig", sorted(TORCH_VARLEN_SIGNATURES))
def test_torch_varlen_path_plumbing(sig, monkeypatch):
    """The varlen layout (``cu_seqlens`` from the context, keys ``[prefix, own]`` per slice) and
    the keywords chosen for each torch release's ``varlen_attn`` signature (window, GQA, scale,
    causal), run through a CPU stand-in with FlashAttention-2's bottom-right convention: equal to
    HF per sequence, forward and backward. (The real kernel: the GPU test below.)"""
    params = TORCH_VARLEN_SIGNATURES[sig]
    fn, calls = _fake_torch_varlen(params)
    monkeypatch.setattr(A_varlen, "torch_varlen", lambda: (fn, params))
    monkeypatch.setattr(A_kernels, "choose_kernel", lambda *a, **k: "torch-varlen")
    for window, (d, dv) in ((None, (8, 8)), (4, (12, 8))):
        if window is not None and "window_size" not in params:
            continue  # the backend takes per-slice SDPA there (test_choice_of_kernel)
        module = _module(4, 2)
        data = _tensors(4, 2, d, dv, seed=6)
        got = _run_backend(module, data, CHUNKS["hybrid"], scaling=0.3, sliding_window=window)
        _compare(got, _run_reference(module, data, _hf_sdpa, window=window, scaling=0.3))
    assert calls and all(("scale" in c) == ("scale" in params) for c in calls)
    assert all(c.get("enable_gqa", False) == ("enable_gqa" in params) for c in calls)  # the GQA cases


class _RecordVarlen(TorchDispatchMode):
    """Records the calls of torch's varlen kernel op (``torch_attn::_varlen_attn``) by argument name."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "_varlen_attn" in str(func):
            names = [a.name for a in func._schema.arguments]
            self.calls.append({**dict(zip(names, args)), **(kwargs or {})})
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not A.torch_varlen_available(), reason="this torch has no torch.nn.attention.varlen")
def test_installed_varlen_attn_gets_causal_window_scale_and_layout():
    """The installed torch's own ``varlen_attn`` (not a stand-in), called by the backend on meta
    tensors: what reaches its kernel op (``torch_attn::_varlen_attn``, recorded by a dispatch mode)
    is causal without a window (torch derives ``is_causal`` from ``window_size == (-1, 0)``, so a
    list instead of a tuple, or ``(-1, -1)``, would arrive non-causal), a window ``W`` as
    ``(W - 1, 0)``, the backend's scale, the context's int32 ``cu_seqlens`` and maxima, and key
    heads the kernel accepts (repeated to the query heads unless the release has ``enable_gqa``)."""
    # a slice with 6 tokens of context (keys [prefix, own]) packed with a whole sequence
    ctx = ChunkAttentionContext([SliceSpec(0, 6, 4, 0, True), SliceSpec(1, 0, 5, 4, True)], KVStore(), "meta", False)
    H, K, D = 4, 2, 16
    q = torch.empty(9, H, D, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(15, K, D, device="meta", dtype=torch.bfloat16) for _ in range(2))
    params = A_varlen.torch_varlen()[1]
    for window, (want_causal, want_window) in ((None, (True, [-1, 0])), (3, (False, [2, 0]))):
        with _RecordVarlen() as rec:
            out = A_varlen._torch_varlen_call(q, k, v, ctx, 0.3, window)
        assert out.shape == (9, H, D) and out.dtype == torch.bfloat16
        (call,) = rec.calls
        assert call["is_causal"] is want_causal and list(call["window_size"]) == want_window, call
        assert call["scale"] == 0.3
        assert call["cu_seq_q"] is ctx.cu_seqlens_q and call["cu_seq_k"] is ctx.cu_seqlens_k
        assert ctx.cu_seqlens_q.dtype == ctx.cu_seqlens_k.dtype == torch.int32
        assert (call["max_q"], call["max_k"]) == (5, 10)
        if "enable_gqa" in params:
            assert call["enable_gqa"] is True and call["key"].shape[1] == K
        else:
            assert call["key"].shape[1] == call["value"].shape[1] == H


@pytest.mark.skipif(not A.torch_varlen_available(), reason="this torch has no torch.nn.attention.varlen")
def test_installed_varlen_attn_through_the_backend_on_meta(monkeypatch):
    """The whole varlen path of :func:`concertina_attention_forward` with the installed torch's
    ``varlen_attn`` on meta tensors laid out as HF's layers pass them (``[1, T, H, D]`` transposed):
    a sequence split over two chunks (K/V carried), GQA, value heads narrower than query heads
    (MLA). What reaches the kernel op is what ATen's FlashAttention-2 checks on the GPU: a
    contiguous last dimension, one head size (a multiple of 8), as many keys as ``cu_seqlens_k``
    counts; the output comes back ``[1, T, H, Dv]``."""
    monkeypatch.setattr(A_kernels, "choose_kernel", lambda *a, **k: "torch-varlen")
    monkeypatch.setattr(A_forward, "autocast_dtype", lambda device_type: None)  # autocast knows no meta device
    module, store = _module(4, 2), KVStore()
    H, K, D, Dv = 4, 2, 16, 8

    def hf_layout(t, heads, d):  # HF: projection output [1, T, heads * d] viewed, then transposed
        return torch.empty(1, t, heads, d, device="meta", dtype=torch.bfloat16).transpose(1, 2)

    for slices in ([SliceSpec(0, 0, 6, 0, False)], [SliceSpec(0, 6, 5, 0, True), SliceSpec(1, 0, 3, 5, True)]):
        ctx = ChunkAttentionContext(slices, store, "meta", False)
        t = sum(s.length for s in slices)
        with _RecordVarlen() as rec:
            out, _ = A.concertina_attention_forward(module, hf_layout(t, H, D), hf_layout(t, K, D), hf_layout(t, K, Dv),
                                                    None, concertina_ctx=ctx, scaling=0.25)
        assert out.shape == (1, t, H, Dv)
        (call,) = rec.calls
        q, k, v = call["query"], call["key"], call["value"]
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == D and D % 8 == 0
        assert q.shape[0] == t and k.shape[0] == v.shape[0] == sum(s.start + s.length for s in slices)
        assert call["cu_seq_k"] is ctx.cu_seqlens_k and call["is_causal"] is True and call["scale"] == 0.25


def test_flash_attn_path_plumbing(monkeypatch):
    """flash-attn's ``flash_attn_varlen_func`` keywords (window, softcap, dropout 0) through a CPU stand-in."""
    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0):
        calls.append(dict(window_size=window_size, softcap=softcap))
        assert causal and dropout_p == 0.0 and window_size[1] in (-1, 0)
        return _fa2_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), softmax_scale, window_size[0], True,
                              softcap or None)

    monkeypatch.setattr(A_varlen, "_flash_attn_fn", lambda: flash_attn_varlen_func)
    monkeypatch.setattr(A_varlen, "flash_attn_params", lambda: frozenset({"softcap", "window_size", "dropout_p"}))
    monkeypatch.setattr(A_kernels, "choose_kernel", lambda *a, **k: "flash-attn")
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = _module(4, 2, "gemma2")
    data = _tensors(4, 2, 8, 8, seed=7, scale=3.0)
    got = _run_backend(module, data, CHUNKS["split"], scaling=0.35, softcap=5.0, sliding_window=6)
    _compare(got, _run_reference(module, data, eager_attention_forward, window=6, scaling=0.35, softcap=5.0))
    assert calls[0] == dict(window_size=(5, 0), softcap=5.0)


def test_per_segment_sdpa_path(monkeypatch):
    """The CUDA fallback without a varlen kernel (and CPU with dropout): SDPA once per slice."""
    module = _module(4, 2)
    data = _tensors(4, 2, 12, 8, seed=8)
    monkeypatch.setattr(A_kernels, "choose_kernel", lambda *a, **k: "sdpa-per-segment")
    got = _run_backend(module, data, CHUNKS["hybrid"], scaling=0.3, sliding_window=5)
    _compare(got, _run_reference(module, data, _hf_sdpa, window=5, scaling=0.3))


def test_choice_of_kernel(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert A.attention_kernel("cpu") == "sdpa-cpu-flash"
    assert A_kernels.choose_kernel(cpu, torch.float32, dropout=0.1) == "sdpa-per-segment"
    assert A_kernels.choose_kernel(cpu, torch.float32, softcap=30.0) == "eager-per-segment"
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, sink=True) == "eager-per-segment"
    monkeypatch.setattr(A_varlen, "_flash_attn_fn", lambda: None)
    monkeypatch.setattr(A_varlen, "torch_varlen", lambda: (None, TORCH_VARLEN_SIGNATURES["2.13"]))
    assert A.attention_kernel("cuda") == "torch-varlen"
    assert A.attention_kernel("cuda", torch.float32) == "sdpa-per-segment"
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, dropout=0.1) == "sdpa-per-segment"  # varlen_attn has no dropout
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, softcap=30.0) == "eager-per-segment"
    monkeypatch.setattr(A_varlen, "torch_varlen", lambda: (None, TORCH_VARLEN_SIGNATURES["is_causal only"]))
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, window=128) == "sdpa-per-segment"  # no window_size there
    assert A_kernels.choose_kernel(cuda, torch.bfloat16) == "torch-varlen"
    # FlashAttention-2's limits (ATen's copy): head dim <= 256 and a multiple of 8, Ampere or newer
    monkeypatch.setattr(A_varlen, "torch_varlen", lambda: (None, TORCH_VARLEN_SIGNATURES["2.11"]))
    monkeypatch.setattr(A_kernels, "_cuda_capability", lambda index: (9, 0))
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, window=128, head_dim=256) == "torch-varlen"
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, head_dim=100) == "sdpa-per-segment"
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, head_dim=264) == "sdpa-per-segment"
    monkeypatch.setattr(A_kernels, "_cuda_capability", lambda index: (7, 5))
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, head_dim=64) == "sdpa-per-segment"
    assert A.attention_kernel("cuda") == "sdpa-per-segment"
    monkeypatch.setattr(A_kernels, "_cuda_capability", lambda index: (8, 0))
    monkeypatch.setattr(A_varlen, "_flash_attn_fn", lambda: object())
    monkeypatch.setattr(A_varlen, "flash_attn_params", lambda: frozenset({"softcap"}))
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, softcap=30.0, dropout=0.1, window=64) == "flash-attn"
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, head_dim=100) == "flash-attn"  # flash-attn pads to a multiple of 8
    assert A_kernels.choose_kernel(cuda, torch.bfloat16, head_dim=264) == "sdpa-per-segment"


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_match_hf_per_sequence(dtype):
    """On CUDA: the kernel the backend picks (flash-attn, torch varlen_attn, or per-slice SDPA)
    against HF's SDPA per sequence, forward and backward (bf16: within a few roundoffs)."""
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for chunking in ("packed", "split", "hybrid"):
        for window in (None, 5):
            module = _module(4, 2)
            data = {s: tuple(t.detach().to("cuda", dtype).requires_grad_(t.requires_grad) if j < 3
                             else t.to("cuda", dtype) for j, t in enumerate(ts)) for s, ts in _tensors(4, 2, 64, 64).items()}
            got = _run_backend_cuda(module, data, CHUNKS[chunking], scaling=0.125, sliding_window=window)
            want = _run_reference(module, data, _hf_sdpa, window=window, scaling=0.125)
            for s in LENS:
                for a, b in zip(got[s], want[s]):
                    torch.testing.assert_close(a.float(), b.float().to(a.device), **tol)
    assert any(k.endswith("on cuda") for k in A.kernels_used())


def _run_backend_cuda(module, data, chunks, **kw):
    dev_ctx = ChunkAttentionContext.__init__

    def on_cuda(self, slices, store, device, requires_grad):
        dev_ctx(self, slices, store, "cuda", requires_grad)

    ChunkAttentionContext.__init__ = on_cuda
    try:
        return _run_backend(module, data, chunks, **kw)
    finally:
        ChunkAttentionContext.__init__ = dev_ctx
