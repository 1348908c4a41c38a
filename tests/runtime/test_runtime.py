"""Single-process runtime tests: the attention backend, stage pruning, and one-stage plans.

The backbone is equivalence with the plain HF model: for every chunking (packed, split, hybrid,
two pipeline groups, prefetching schedule) and recompute setting (none, partial, full), the
loss and every parameter gradient of a one-stage pipeline match HF run sequence by sequence with
the same ``num_items_in_batch``. Multi-stage runs are in ``test_runtime_dist.py``.
"""

from __future__ import annotations

import copy
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from _runtime_cases import (
    CHUNKINGS,
    SEQ_LENS,
    VOCAB,
    batch,
    compare_grads,
    make_plan,
    plans_for,
    grad_error,
    reference,
    tied_model,
    tiny_model,
)
from concertina_hf.planning import CostModel, PlanError, StageLayout
from concertina_hf.runtime import (
    ATTN_IMPLEMENTATION,
    ChunkAttentionContext,
    KVStore,
    PipelineExecutor,
    PipelineWrapper,
    SavedTensorMeter,
    SliceSpec,
)

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_ref(request):
    model = tiny_model(request.param)
    ids, labels = batch()
    ref_loss, ref_grads = reference(model, ids, labels)
    return request.param, model, ids, labels, ref_loss, ref_grads


# ---------------------------------------------------------------------------- attention backend
def test_backend_registered_and_plain_forward_falls_back_to_sdpa():
    from transformers import AttentionInterface

    model = tiny_model("qwen2", num_layers=2)
    ids = torch.randint(0, VOCAB, (2, 13))
    want = model(ids).logits
    PipelineWrapper(model, StageLayout.even(2, 1), 0)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert ATTN_IMPLEMENTATION in AttentionInterface._global_mapping
    got = model(ids).logits  # no concertina_ctx: HF's mask + SDPA path, e.g. for generate()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_context_layout_and_masks():
    from concertina_hf.runtime.attention.context import segment_mask as _segment_mask

    store = KVStore()
    # a tail slice [10, 14) of sequence 0 packed with a whole sequence 3 of 3 tokens
    ctx = ChunkAttentionContext([SliceSpec(0, 10, 4, 0, True), SliceSpec(3, 0, 3, 4, True)], store, "cpu", True)
    assert ctx.position_ids.tolist() == [[10, 11, 12, 13, 0, 1, 2]]
    assert ctx.cu_seqlens_q.tolist() == [0, 4, 7] and ctx.cu_seqlens_k.tolist() == [0, 14, 17]
    # per slice: its queries against [prefix, own]; a whole sequence is plain causal (no mask)
    m = _segment_mask(10, 4, 0, None, torch.device("cpu"))
    assert m.shape == (4, 14)
    assert m[0].tolist() == [True] * 11 + [False] * 3  # token 10 sees keys 0..10
    assert _segment_mask(0, 3, 0, None, torch.device("cpu")) is None
    w = _segment_mask(10, 4, 7, 4, torch.device("cpu"))  # window of 4: keys from position 7 on
    assert w.shape == (4, 7) and (w[3].nonzero().flatten() + 7).tolist() == [10, 11, 12, 13]
    with pytest.raises(RuntimeError, match="before token 10 .* incomplete"):
        store.prefix(0, 10, layer=0)


def test_kv_store_set_if_absent_and_free():
    store = KVStore()
    k = torch.randn(1, 2, 5, 4, requires_grad=True) * 1
    v = torch.randn(1, 2, 5, 4, requires_grad=True) * 1
    store.put_if_absent(0, 0, 3, k, v, requires_grad=True)
    store.put_if_absent(0, 0, 3, k * 2, v * 2, requires_grad=True)  # a checkpoint replay: ignored
    (e,) = store.entries(0, 0)
    assert e.k is k and e.k_leaf.requires_grad and e.k_leaf.grad_fn is None
    assert e.k_leaf.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # no copy
    pk, _ = store.prefix(0, 5, 3)
    assert pk is e.k_leaf
    store.free_slice(0, 0)
    assert len(store) == 0


def test_context_attention_saves_pieces_not_the_concatenation():
    """A late slice (context 40, 4 tokens) attending to an earlier slice's stored K/V: same
    output and gradients as cat + SDPA, without saving the 44-token concatenated K/V."""
    from concertina_hf.runtime.attention import concertina_attention_forward
    from concertina_hf.runtime.attention.segments import segments_sdpa as _segments_sdpa

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.layer_idx = 0
    H, K, D, C, s = 4, 2, 8, 40, 4
    k0, v0 = torch.randn(1, K, C, D), torch.randn(1, K, C, D)
    q = torch.randn(1, H, s, D, requires_grad=True)
    k = torch.randn(1, K, s, D, requires_grad=True)
    v = torch.randn(1, K, s, D, requires_grad=True)
    results = []
    for fused in (True, False):
        store = KVStore()
        store.put_if_absent(0, 0, 0, k0, v0, requires_grad=True)
        ctx = ChunkAttentionContext([SliceSpec(0, C, s, 0, True)], store, "cpu", True)
        # count only what the attention adds: inputs and the stored leaves are alive anyway
        meter = SavedTensorMeter(exclude=[q, k, v, k0, v0])
        with meter:
            if fused:
                out, _ = concertina_attention_forward(module, q, k, v, None, scaling=D ** -0.5, concertina_ctx=ctx)
            else:
                ctx.store_own(0, k, v)
                out = _segments_sdpa(ctx, 0, q, k, v, D ** -0.5, None, 0.0).transpose(1, 2)
        saved = meter.current_bytes
        (e,) = store.entries(0, 0)
        grads = torch.autograd.grad(out.square().sum(), [q, k, v, e.k_leaf, e.v_leaf])
        results.append((out.detach(), grads, saved))
    (o1, g1, saved_fused), (o2, g2, saved_cat) = results
    torch.testing.assert_close(o1, o2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    kv_concat_bytes = 2 * K * (C + s) * D * 4
    assert saved_cat - saved_fused >= kv_concat_bytes


# ---------------------------------------------------------------------------- stage pruning
def test_wrapper_partitions_with_original_names():
    model = tiny_model("llama")
    full = {k for k, _ in model.named_parameters()}
    layout = StageLayout.even(8, 4)
    seen: set[str] = set()
    for stage in range(4):
        w = PipelineWrapper(copy.deepcopy(model), layout, stage)
        names = {k for k, _ in w.named_parameters()}
        assert names and names <= full and not names & seen
        seen |= names
        a, b = layout.layer_ranges[stage]
        assert all(any(k.startswith(f"model.layers.{i}.") for i in range(a, b)) or not k.startswith("model.layers.")
                   for k in names)
        assert ("model.embed_tokens.weight" in names) == (stage == 0)
        assert ("lm_head.weight" in names) == ("model.norm.weight" in names) == (stage == 3)
        assert set(w.state_dict()) >= names
        assert sum(p.numel() for p in w.parameters()) == sum(p.numel() for _, p in w.named_parameters())
        if stage != 0:
            with pytest.raises(RuntimeError, match="model.embed_tokens lives on stage 0"):
                w.model.model.embed_tokens(torch.zeros(1, 1, dtype=torch.long))
    assert seen == full


def test_wrapper_refuses_bad_layouts_and_inconsistent_ties():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, tie_word_embeddings=True)
    untied = AutoModelForCausalLM.from_config(cfg)
    untied.lm_head.weight = torch.nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    with pytest.raises(ValueError, match="tie_word_embeddings = False"):  # the config says tied, the weights are not
        PipelineWrapper(untied, StageLayout.even(4, 2), 1)
    with pytest.raises(ValueError, match="covers 8 decoder layers but the model has 4"):
        PipelineWrapper(AutoModelForCausalLM.from_config(cfg), StageLayout.even(8, 1), 0)
    with pytest.raises(ValueError, match="has no `model.embed_tokens`"):
        PipelineWrapper(torch.nn.Linear(2, 2), StageLayout.even(4, 1), 0)


def test_tied_embeddings_split_over_stages(tmp_path):
    """First stage: the embedding; last stage: the head with its own copy of the same tensor;
    middle stages: neither. One stage: one parameter, saved once, reloaded tied."""
    from transformers import AutoModelForCausalLM

    model = tied_model(num_layers=3)
    weight = model.model.embed_tokens.weight.detach().clone()
    layout = StageLayout.even(3, 3)
    first, middle, last = (PipelineWrapper(copy.deepcopy(model), layout, s) for s in range(3))
    assert first.tied_weight is first.model.model.embed_tokens.weight
    assert middle.tied_weight is None and middle.tied_embeddings
    assert last.tied_weight is last.model.lm_head.weight and torch.equal(last.tied_weight, weight)
    assert {k for k, _ in last.named_parameters()} >= {"lm_head.weight"}
    assert "model.embed_tokens.weight" not in dict(last.named_parameters())
    # an HF tied state dict (no lm_head.weight) loads into the head's copy
    tied_sd = {k: v + 1 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    last.load_state_dict(tied_sd, strict=True)
    assert torch.equal(last.model.lm_head.weight, weight + 1)

    one = PipelineWrapper(copy.deepcopy(model), StageLayout.even(3, 1), 0)
    assert one.tied_weight is None and one.model.lm_head.weight is one.model.model.embed_tokens.weight
    sd = one.full_state_dict()
    assert "lm_head.weight" not in sd and torch.equal(sd["model.embed_tokens.weight"], weight)
    one.config._attn_implementation = "sdpa"
    one.model.save_pretrained(tmp_path, state_dict=sd)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight and torch.equal(loaded.lm_head.weight, weight)


def test_tied_embeddings_one_stage_exact():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ids, labels = batch()
    ref_loss, ref_grads = reference(model, ids, labels)
    layout = StageLayout.even(2, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    res = PipelineExecutor(w).run_step(make_plan(SEQ_LENS, CHUNKINGS["hybrid"], layout, "partial"), ids, labels)
    assert _rel(res.loss, ref_loss) < LOSS_TOL
    assert compare_grads(w, ref_grads, GRAD_TOL) == []


# ---------------------------------------------------------------------------- one-stage plans
def test_one_stage_matches_hf_for_every_chunking_and_recompute(model_and_ref):
    kind, model, ids, labels, ref_loss, ref_grads = model_and_ref
    layout = StageLayout.even(8, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    failures = []
    cases = plans_for(layout)
    assert len(cases) >= 11
    for name, plan in cases:
        w.zero_grad(set_to_none=True)
        res = ex.run_step(plan, ids, labels)
        n = sum(int((lab[1:] != -100).sum()) for lab in labels)
        assert res.num_items == n and abs(res.loss_sum / n - res.loss) < 1e-12
        if not _rel(res.loss, ref_loss) < LOSS_TOL:
            failures.append(f"{kind} {name}: loss {res.loss} vs {ref_loss}")
        failures += [f"{kind} {name}: {b}" for b in compare_grads(w, ref_grads, GRAD_TOL)]
        assert [str(a) for a, _, _ in res.action_times] == [str(a) for a in plan.schedule[0]]
        assert all(0 <= s <= e <= res.wall_time_s for _, s, e in res.action_times)
        assert res.peak_activation_bytes > 0
    assert failures == []


def test_unmetered_step_is_the_same_computation(model_and_ref):
    """``measure_memory=False`` (the saved-tensor hooks cost 1-7% of a small-chunk
    step on CPU) installs no hook and reports no peak, but computes bit for bit the same loss
    and gradients as a metered step; the executor's default and its attribute both apply, and
    a metered step after an unmetered one measures the same peak as before."""
    kind, model, ids, labels, ref_loss, ref_grads = model_and_ref
    layout = StageLayout.even(8, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    assert ex.measure_memory
    for name in ("split/partial", "hybrid/none"):
        plan = dict(plans_for(layout))[name]
        got = {}
        for metered in (True, False, None):
            w.zero_grad(set_to_none=True)
            res = ex.run_step(plan, ids, labels, measure_memory=metered)
            got[metered] = (res, {n: p.grad.clone() for n, p in w.named_parameters() if p.grad is not None})
        (on, g_on), (off, g_off), (default, _) = got[True], got[False], got[None]
        assert off.peak_activation_bytes is None and on.peak_activation_bytes > 0
        assert default.peak_activation_bytes == on.peak_activation_bytes, name
        assert off.loss == on.loss and off.loss_sum == on.loss_sum, name
        assert g_off.keys() == g_on.keys() and len(g_on) > 0
        assert all(torch.equal(g_off[n], g_on[n]) for n in g_on), name
        assert _rel(on.loss, ref_loss) < LOSS_TOL
    ex.measure_memory = False
    assert ex.run_step(plan, ids, labels).peak_activation_bytes is None
    assert ex.run_step(plan, ids, labels, measure_memory=True).peak_activation_bytes == on.peak_activation_bytes


def test_gradients_accumulate_across_steps(model_and_ref):
    kind, model, ids, labels, ref_loss, ref_grads = model_and_ref
    layout = StageLayout.even(8, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    plan = make_plan(SEQ_LENS, CHUNKINGS["split"], layout, "partial")
    ex.run_step(plan, ids, labels)
    ex.run_step(plan, ids, labels)
    assert compare_grads(w, {k: 2 * g for k, g in ref_grads.items()}, GRAD_TOL) == []


def test_eval_is_forward_only(model_and_ref):
    kind, model, ids, labels, ref_loss, _ = model_and_ref
    layout = StageLayout.even(8, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    res = PipelineExecutor(w).run_step(make_plan(SEQ_LENS, CHUNKINGS["hybrid"], layout, "full"), ids, labels,
                                       train=False)
    assert _rel(res.loss, ref_loss) < LOSS_TOL
    assert all(p.grad is None for p in w.parameters())
    assert all(a.kind.value == "F" for a, _, _ in res.action_times)


def test_labels_default_and_explicit_num_items():
    model = tiny_model("llama", num_layers=2)
    ids, _ = batch()
    ref_loss, ref_grads = reference(model, ids, ids)
    layout = StageLayout.even(2, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    plan = make_plan(SEQ_LENS, CHUNKINGS["split"], layout)
    res = ex.run_step(plan, ids)  # labels default to the input ids
    assert _rel(res.loss, ref_loss) < LOSS_TOL and compare_grads(w, ref_grads) == []
    # a global num_items_in_batch (e.g. over data-parallel replicas) scales loss and gradients
    w.zero_grad()
    res2 = ex.run_step(plan, ids, num_items_in_batch=4 * res.num_items)
    assert _rel(res2.loss, ref_loss / 4) < LOSS_TOL and res2.num_items == 4 * res.num_items
    assert compare_grads(w, {k: g / 4 for k, g in ref_grads.items()}) == []


@pytest.mark.parametrize("arch", ["mistral-sliding-window", "qwen3"])
def test_other_architectures(arch):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    torch.manual_seed(0)
    if arch == "qwen3":  # q/k norms inside attention, GQA
        cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    else:  # a window shorter than the slices: keys further back than 6 tokens are invisible
        cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                            tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ids, labels = batch()
    ref_loss, ref_grads = reference(model, ids, labels)
    layout = StageLayout.even(2, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    for rec in ("none", "full"):
        w.zero_grad(set_to_none=True)
        res = ex.run_step(make_plan(SEQ_LENS, CHUNKINGS["hybrid"], layout, rec), ids, labels)
        assert _rel(res.loss, ref_loss) < LOSS_TOL, rec
        assert compare_grads(w, ref_grads, GRAD_TOL) == [], rec


# ---------------------------------------------------------------------------- mixed precision
# bf16 keeps 8 significant bits (unit roundoff 2**-8 = 3.9e-3). The pipeline rounds at other
# places than HF on whole sequences (matmuls over packed chunks, attention over [prefix, own]
# keys, weight gradients summed per chunk in bf16 and then in float32), so its results differ
# from HF under the same autocast by a few roundoffs, amplified through the layers. Measured with
# these large-init models: up to 3e-4 on the loss and 2.5e-2 on the gradients (relative, all of a
# stage's gradients as one vector; largest on the first stage, whose gradients went through every
# layer's backward), while bf16 autocast itself moves the gradients 2.5e-2 to 7e-2 away from
# float32. Tolerances: twice the measured worst here (over pp = 2 and 4, tests/_dist_runtime.py:
# up to 4e-2 on the gradients, a margin of 1.25x); and the result must have been computed in bf16:
# at least bf16's unit roundoff u = 2**-8 away from HF in float32 (measured 2.5e-2 and more: 6x
# u), which a pipeline that ignored autocast fails (float32 compute stays within GRAD_TOL = 1e-4 of
# it, 39x under u). Not "closer to HF under autocast than to float32": bf16 does not promise it
# (two bf16 roundings of one function can be as far from each other as from float32).
AMP_LOSS_TOL = 1e-3
AMP_GRAD_TOL = 5e-2
AMP_ROUNDED = 2.0**-8


def test_one_stage_under_autocast_matches_hf_under_autocast(model_and_ref):
    kind, model, ids, labels, ref_loss, ref_grads = model_and_ref
    amp_loss, amp_grads = reference(model, ids, labels, autocast=torch.bfloat16)
    layout = StageLayout.even(8, 1)
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    assert ex.wire_dtype(torch.bfloat16) == torch.float32  # float32 weights: float32 residual stream
    failures = []
    for name, plan in plans_for(layout):
        w.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = ex.run_step(plan, ids, labels)
        err, err_fp32 = grad_error(w, amp_grads), grad_error(w, ref_grads)
        if not (_rel(res.loss, amp_loss) < AMP_LOSS_TOL and err < AMP_GRAD_TOL and err_fp32 > AMP_ROUNDED):
            failures.append(f"{kind} {name}: loss {res.loss} vs {amp_loss}, grad err {err:.2e} (fp32 {err_fp32:.2e})")
    assert failures == []
    with torch.autocast("cpu", dtype=torch.bfloat16):  # evaluation under autocast too
        res = ex.run_step(make_plan(SEQ_LENS, CHUNKINGS["hybrid"], layout, "none"), ids, labels, train=False)
    assert _rel(res.loss, amp_loss) < AMP_LOSS_TOL
    # bfloat16 weights: the residual stream and the messages between stages are bfloat16
    w16 = PipelineWrapper(copy.deepcopy(model).to(torch.bfloat16), layout, 0)
    assert PipelineExecutor(w16).wire_dtype(torch.bfloat16) == PipelineExecutor(w16).wire_dtype() == torch.bfloat16


def test_autocast_stores_kv_in_the_autocast_dtype(monkeypatch):
    """Stored K/V of split sequences (what later slices read) are in the autocast dtype, also
    when every layer is recomputed; without autocast they stay float32."""
    model = tiny_model("llama", num_layers=2)
    ids, labels = batch()
    layout = StageLayout.even(2, 1)
    ex = PipelineExecutor(PipelineWrapper(copy.deepcopy(model), layout, 0))
    seen = []
    put = KVStore.put_if_absent

    def recording_put(self, seq, start, layer, k, v, requires_grad):
        seen.append((k.dtype, v.dtype))
        return put(self, seq, start, layer, k, v, requires_grad)

    monkeypatch.setattr(KVStore, "put_if_absent", recording_put)
    for amp in (True, False):
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            ex.run_step(make_plan(SEQ_LENS, CHUNKINGS["split"], layout, "full"), ids, labels)
        want = torch.bfloat16 if amp else torch.float32
        assert seen and set(seen) == {(want, want)}, (amp, set(seen))


def test_autocast_attention_casts_leaves_stored_in_another_dtype():
    """Earlier slices' K/V stored as float32 (e.g. profiling with random leaves) and attended to
    under bf16 autocast: cast on the way in, exactly as if stored in bf16, and the gradient still
    reaches the float32 leaves (CPU fused path and the concatenating path with dropout)."""
    from concertina_hf.runtime.attention import concertina_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.layer_idx = 0
    H, K, D, C, s = 4, 2, 8, 12, 5
    k0, v0 = torch.randn(1, K, C, D), torch.randn(1, K, C, D)
    q, k, v = torch.randn(1, H, s, D), torch.randn(1, K, s, D), torch.randn(1, K, s, D)
    for dropout in (0.0, 1e-9):  # a (negligible) dropout takes the torch.cat + SDPA path
        outs, leaf_grads = [], []
        for stored in (torch.float32, torch.bfloat16):
            store = KVStore()
            store.put_if_absent(0, 0, 0, k0.to(stored), v0.to(stored), requires_grad=True)
            ctx = ChunkAttentionContext([SliceSpec(0, C, s, 0, True)], store, "cpu", True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = concertina_attention_forward(module, q, k, v, None, dropout=dropout, scaling=D ** -0.5,
                                                      concertina_ctx=ctx)
            assert out.dtype == torch.bfloat16
            out.float().square().sum().backward()
            (e,) = store.entries(0, 0)
            assert e.k_leaf.grad is not None and e.k_leaf.grad.dtype == stored
            outs.append(out)
            leaf_grads.append(e.k_leaf.grad.float())
        if dropout == 0.0:
            assert torch.equal(outs[0], outs[1]) and torch.equal(leaf_grads[0], leaf_grads[1])


# ---------------------------------------------------------------------------- errors
def test_errors_name_the_problem(caplog):
    model = tiny_model("llama", num_layers=2)
    ids, labels = batch()
    w = PipelineWrapper(copy.deepcopy(model), StageLayout.even(2, 1), 0)
    ex = PipelineExecutor(w)
    plan = make_plan(SEQ_LENS, CHUNKINGS["split"], StageLayout.even(2, 1))
    with pytest.raises(PlanError, match="stage layout"):
        ex.run_step(make_plan(SEQ_LENS, CHUNKINGS["split"], StageLayout(2, ((0, 1), (1, 2)))), ids)
    with pytest.raises(ValueError, match=r"input_ids\[1\] has shape \(8,\), the plan says \[9\]"):
        ex.run_step(plan, [ids[0], ids[1][:8], *ids[2:]])
    with pytest.raises(ValueError, match="labels"):
        ex.run_step(plan, ids, labels[:-1])
    bad = [t.clone() for t in ids]
    bad[0][20] = VOCAB + 5  # an out-of-range token in the second slice of sequence 0
    with caplog.at_level(logging.ERROR, logger="concertina_hf.runtime.executor"):
        with pytest.raises(RuntimeError, match="pipeline stage 0, action 0F1"):
            ex.run_step(plan, bad)
    assert ">0F1<" in caplog.text and "chunk   1 split" in caplog.text
    assert "program of plan" in caplog.text  # the lowered program the executor interprets
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        PipelineExecutor(PipelineWrapper(copy.deepcopy(model), StageLayout.even(2, 2), 0))


# ---------------------------------------------------------------------------- memory
def test_saved_tensor_meter_counts_storages_once_and_releases():
    w = torch.nn.Linear(64, 64)
    meter = SavedTensorMeter(exclude=list(w.parameters()))
    x = torch.randn(8, 64, requires_grad=True)
    with meter:
        y = w(x)  # saves x (2 KiB) and the weight (excluded)
        z = y[:4].sin() + y[4:].cos()  # two views of y's storage: counted once (2 KiB)
    assert meter.current_bytes == 2 * 8 * 64 * 4
    held = torch.zeros(100)
    meter.hold("mine", held, held[10:])  # same storage twice
    assert meter.current_bytes == 2 * 8 * 64 * 4 + 400
    meter.release("mine")
    z.sum().backward()
    del y, z
    assert meter.current_bytes == 0 and meter.peak_bytes == 2 * 8 * 64 * 4 + 400
    meter.reset()
    assert meter.peak_bytes == 0


def test_measured_activation_memory_follows_recompute_and_the_cost_model():
    """Measured peak (saved tensors + stashed K/V) against the simulator's prediction with the
    analytic cost model of the kernel the runtime takes here (static memory removed): recompute
    must lower the measured peak, and the model must be within 25% of the measured bytes
    (deterministic byte counts: measured 0.90x the prediction without recompute, whose backward
    transients, gradients in flight, are no saved tensors, and 0.81x with every layer recomputed,
    where the meter does not see what checkpointing saves, the layers' inputs)."""
    from concertina_hf.planning.simulate import simulate
    from concertina_hf.runtime.attention import attention_kernel

    model = tiny_model("llama")
    ids, labels = batch()
    layout = StageLayout.even(8, 1)
    cost = CostModel.from_hf_config(model.config, dtype_bytes=4, attention_kernel=attention_kernel("cpu"))
    w = PipelineWrapper(copy.deepcopy(model), layout, 0)
    ex = PipelineExecutor(w)
    peaks = {}
    for rec in ("none", "full"):
        plan = make_plan(SEQ_LENS, CHUNKINGS["split"], layout, rec)
        measured = ex.run_step(plan, ids, labels).peak_activation_bytes
        predicted = simulate(plan, cost).peak_memory_bytes[0] - cost.static_memory(layout, 0)
        peaks[rec] = measured
        print(f"split/{rec}: measured {measured} B, predicted {predicted:.0f} B, ratio {measured / predicted:.2f}")
        assert 0.8 < measured / predicted < 1.25, (rec, measured, predicted)
    assert peaks["full"] < 0.5 * peaks["none"]


def test_full_state_dict_one_stage():
    model = tiny_model("llama", num_layers=2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    w = PipelineWrapper(model, StageLayout.even(2, 1), 0)
    got = w.full_state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
