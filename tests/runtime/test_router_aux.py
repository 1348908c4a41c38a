"""The router load-balancing term per chunk and per layer (``concertina_router_aux_loss='per_chunk'``).

On one process (pp = 1), against HF's own MoE models (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE; a
tiny config each):

- the refusals: ``output_router_logits=True`` without the option names it; the option on a model
  type whose loss is not reproduced, a bad value and sequence parallelism are refused, naming it;
- one chunk of one sequence, one MoE layer: the stage's term is HF's
  ``router_aux_loss_coef * load_balancing_loss_func(router logits)`` (HF's ``aux_loss``), and the
  gradients of every parameter are those of HF's training loss (cross-entropy + that term), with
  the layer recomputed in backward (the router's replay is not recorded twice);
- two chunks (one sequence each): each chunk's term weighted by its share of the step's tokens,
  the gradients those of ``sum CE / tokens + coef * sum_c share_c * aux_c`` on HF;
- two MoE layers: each layer's term is HF's ``load_balancing_loss_func`` of that layer's logits
  alone, and the stage adds their mean; HF pools the two layers' statistics before the product,
  a different value: the normalisation is the same, the aggregation over layers is not (printed;
  measured 2.79, the mean of 2.71 and 2.88, against HF's pooled 2.23).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts"))

import model_support  # noqa: E402
from _runtime_cases import compare_grads, make_plan  # noqa: E402

from concertina_hf.planning import StageLayout  # noqa: E402
from concertina_hf.runtime.families import UnsupportedModelError, check_config  # noqa: E402
from concertina_hf.runtime.router_aux import ROUTER_AUX_LOSS_TYPES, layer_balance_loss  # noqa: E402

COEF = 0.5  # large: the term's share of the routers' gradients is then far above float noise
SEQ_LENS = (23, 14)


def _moe(kind: str, layers: int = 1, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = model_support.tiny_config(kind, num_hidden_layers=layers, router_aux_loss_coef=COEF,
                                    output_router_logits=True, **over)
    return AutoModelForCausalLM.from_config(cfg).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model_support.VOCAB, (n,), generator=g) for n in SEQ_LENS]
    return ids, [t.clone() for t in ids]


def _stage(model, layers: int):
    from concertina_hf.runtime import PipelineExecutor
    from concertina_hf.runtime.stage import PipelineWrapper

    layout = StageLayout.even(layers, 1)
    wrapper = PipelineWrapper(model, layout, 0, router_aux_loss="per_chunk")
    return wrapper, PipelineExecutor(wrapper), layout


def _hf_module(model):
    return sys.modules[type(model).__module__]


# ---------------------------------------------------------------------------------- refusals
def test_refusals_name_the_setting(tmp_path):
    from transformers import Qwen3MoeConfig

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from concertina_hf.runtime.families import inspect_model

    with pytest.raises(UnsupportedModelError) as err:
        check_config(Qwen3MoeConfig(output_router_logits=True))
    msg = str(err.value)
    assert ("model type 'qwen3_moe': output_router_logits=True adds the router auxiliary (load-balancing) loss to "
            "HF's training loss, over the statistics of every token of the forward call, which a 1F1B pipeline "
            "cannot compute (each chunk's backward starts before the step's last forward). Set "
            "concertina_router_aux_loss='per_chunk' to add it per chunk and per layer instead (Megatron-Core's "
            "per-micro-batch loss: a different loss from Trainer's), or config.output_router_logits = False") in msg
    check_config(Qwen3MoeConfig(output_router_logits=True), router_aux_loss="per_chunk")
    # the trainer refuses it the same way, before anything runs
    args = ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[])
    with pytest.raises(UnsupportedModelError, match="Set concertina_router_aux_loss='per_chunk'"):
        ConcertinaTrainer(model=_moe("qwen3_moe"), args=args)
    # a MoE model type whose loss is not reproduced (DeepSeek-V3: sigmoid scores, its own balancing) and a
    # dense model are refused with the option, naming it
    for kind in ("deepseek_v3", "llama"):
        with pytest.raises(UnsupportedModelError) as err:
            inspect_model(_tiny(kind), "per_chunk")
        msg = str(err.value)
        assert f"model type {kind!r}" in msg and "concertina_router_aux_loss='per_chunk' is not supported for it" in msg
        assert "Set concertina_router_aux_loss=None" in msg, msg
    with pytest.raises(ValueError, match="concertina_router_aux_loss='sum': choose None"):
        ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_router_aux_loss="sum")
    with pytest.raises(ValueError, match="concertina_router_aux_loss='per_chunk' runs with "
                                         "concertina_sequence_parallel_size=1 only"):
        ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_router_aux_loss="per_chunk",
                                    concertina_sequence_parallel_size=2)
    assert ConcertinaTrainingArguments(output_dir=str(tmp_path), concertina_router_aux_loss="none") \
        .concertina_router_aux_loss is None


def _tiny(kind: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_support.tiny_config(kind, num_hidden_layers=2))


# ---------------------------------------------------------------------------------- HF's loss, one MoE layer
@pytest.mark.parametrize("kind", sorted(ROUTER_AUX_LOSS_TYPES))
def test_one_chunk_is_hf_aux_loss_and_two_chunks_are_token_weighted(kind):
    model = _moe(kind)
    ref = copy.deepcopy(model)
    wrapper, executor, layout = _stage(model, 1)
    ids, labels = _batch()
    total = sum(int((lab[1:] != -100).sum()) for lab in labels)
    tokens = sum(SEQ_LENS)

    # one chunk of one sequence (the layer recomputed in backward): HF's coef * aux_loss, HF's gradients
    plan = make_plan(SEQ_LENS[:1], [[(0, 0, SEQ_LENS[0])]], layout, recompute="full")
    res = executor.run_step(plan, ids[:1], labels[:1], train=True)
    out = ref(input_ids=ids[0][None], labels=labels[0][None], output_router_logits=True, use_cache=False)
    assert res.router_aux_loss == pytest.approx(COEF * out.aux_loss.item(), rel=1e-6), kind
    out.loss.backward()  # HF: mean cross-entropy + coef * aux_loss
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    assert not compare_grads(wrapper, ref_grads, tol=1e-4), kind

    # two chunks, one sequence each: each term weighted by its chunk's share of the step's tokens
    for p in list(ref.parameters()) + list(wrapper.parameters()):
        p.grad = None
    plan = make_plan(SEQ_LENS, [[(0, 0, SEQ_LENS[0])], [(1, 0, SEQ_LENS[1])]], layout, recompute="none")
    res = executor.run_step(plan, ids, labels, num_items_in_batch=total, train=True)
    want, router_only = 0.0, 0.0
    for x, lab in zip(ids, labels):
        out = ref(input_ids=x[None], output_router_logits=True, use_cache=False)
        ce = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), lab[1:], reduction="sum")
        term = COEF * out.aux_loss * (len(x) / tokens)
        (ce / total + term).backward(retain_graph=True)  # the term's own gradient is taken below
        want += float(term.detach())
        router_only = router_only + term
    assert res.router_aux_loss == pytest.approx(want, rel=1e-6), kind
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    assert not compare_grads(wrapper, ref_grads, tol=1e-4), kind
    # the term moves the routers' gradients by far more than the tolerance
    router = [n for n, p in ref.named_parameters() if p.grad is not None and ".gate." in f".{n}"
              and "proj" not in n and p.shape[0] == wrapper.router_aux.num_experts]
    assert router, [n for n, _ in ref.named_parameters()]
    params = [dict(ref.named_parameters())[n] for n in router]
    only = torch.autograd.grad(router_only, params)
    for n, g in zip(router, only):
        assert g.norm() > 0.05 * ref_grads[n].norm(), (kind, n, float(g.norm()), float(ref_grads[n].norm()))


# ---------------------------------------------------------------------------------- per layer
def test_each_layer_is_hf_load_balancing_loss_and_the_stage_adds_their_mean():
    kind = "qwen3_moe"
    model = _moe(kind, layers=2)
    ref = copy.deepcopy(model)
    wrapper, executor, layout = _stage(model, 2)
    ids, labels = _batch()
    plan = make_plan(SEQ_LENS[:1], [[(0, 0, SEQ_LENS[0])]], layout, recompute="partial")
    res = executor.run_step(plan, ids[:1], labels[:1], train=True)
    with torch.no_grad():
        out = ref(input_ids=ids[0][None], output_router_logits=True, use_cache=False)
    hf = _hf_module(ref).load_balancing_loss_func
    E, k = ref.config.num_experts, ref.config.num_experts_per_tok
    per_layer = []
    for logits in out.router_logits:
        mine = float(layer_balance_loss(logits, E, k))
        assert mine == pytest.approx(float(hf((logits,), E, k)), rel=1e-6)  # HF's formula, one layer
        per_layer.append(mine)
    assert res.router_aux_loss == pytest.approx(COEF * sum(per_layer) / 2, rel=1e-6)
    pooled = float(hf(tuple(out.router_logits), E, k))  # HF: f and P pooled over both layers first
    print(f"{kind}, 2 MoE layers: per layer {per_layer}, their mean {sum(per_layer) / 2:.6f}, HF's pooled "
          f"{pooled:.6f}")
