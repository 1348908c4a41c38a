"""The MoE router's load-balancing loss per chunk and per layer (``concertina_router_aux_loss='per_chunk'``).

HF's MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, ...) with ``output_router_logits=True`` add
``router_aux_loss_coef * load_balancing_loss_func(router logits of every layer)`` to the training
loss: the Switch Transformer loss ``num_experts * sum_e f_e * P_e``, with ``f_e`` the share of the
tokens routed to expert ``e`` among their top-k (summing to ``top_k`` over the experts) and
``P_e`` the mean router probability of ``e``, both pooled over every token of the forward call
*and every MoE layer* before the product. A 1F1B pipeline cannot compute that: each chunk's
backward starts before the step's last forward, and each stage holds only its own layers.

This module computes instead, as Megatron-Core does per micro-batch, one term per (chunk, MoE
layer), on the stage that runs the layer, over the chunk's tokens only:

    aux(chunk, layer) = num_experts * sum_e f_e * P_e       (HF's formula on one layer's logits)
    step aux          = coef * sum over chunks c of (tokens(c) / tokens of the step)
                             * mean over the model's MoE layers of aux(c, layer)

``coef`` is the model's ``router_aux_loss_coef`` (TRL: ``SFTConfig.router_aux_loss_coef`` when
set). Each stage adds its layers' terms of a chunk to that chunk's backward (so the gradient
reaches each layer's router on its own stage); chunks are weighted by their token share of the
step (of the whole step over the data-parallel replicas when the cross-entropy is normalised over
them), so the term's weight does not depend on how the planner cuts the step. It is a different
loss from ``Trainer``'s, in three ways:

- **per chunk**: the statistics of each chunk's tokens, not of the micro-batch's (a chunk holds
  a slice of a long sequence, or several short ones);
- **per layer**: the mean over the MoE layers of each layer's product, where HF pools ``f`` and
  ``P`` over the layers first (the two agree with one MoE layer, or when every layer routes alike);
- **normalisation**: HF's ``f_e`` (summing to ``top_k``), so ``router_aux_loss_coef`` means what
  it means for HF; Megatron-Core's ``f_e`` sums to 1 (divided by ``top_k``), so its
  ``moe_aux_loss_coeff`` ``c`` is ``router_aux_loss_coef = c / top_k`` here, and it sums its
  layers' terms where this takes their mean (``c * num_moe_layers / top_k``).

With one chunk holding the whole batch and one MoE layer, the term equals HF's
``router_aux_loss_coef * aux_loss`` exactly (``tests/runtime/test_router_aux.py``). The term is
added in training steps only, whatever ``config.output_router_logits`` says (the option is the
switch); the logged ``loss`` and the evaluation loss are the cross-entropy (HF's evaluation loss
includes its term), the term is logged as ``concertina/router_aux_loss``.

Supported model types (:data:`ROUTER_AUX_LOSS_TYPES`): those whose ``load_balancing_loss_func`` is
this formula over the softmax of the logits their router module returns (HF's
``_can_record_outputs["router_logits"]``); the router logits are read by a forward hook on those
modules, in the forward of each chunk (a checkpointed layer's replay in backward is not read
again). Other MoE families are refused with a message naming the setting. Costs: per chunk and
MoE layer a softmax and a top-k over ``[tokens, num_experts]`` in float32, and the logits and
probabilities kept until the chunk's backward (``2 x tokens x num_experts x 4`` bytes per layer,
not in the planner's memory model).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

__all__ = ["ROUTER_AUX_LOSS_MODES", "ROUTER_AUX_LOSS_TYPES", "RouterAux", "layer_balance_loss", "router_aux_of",
           "without_router_logits"]

#: values of ``concertina_router_aux_loss`` that add a term (``None`` / ``"none"``: none)
ROUTER_AUX_LOSS_MODES = ("per_chunk",)
#: model types whose HF training loss adds :func:`layer_balance_loss`'s formula over the logits of
#: their ``_can_record_outputs["router_logits"]`` module (checked against each one's
#: ``load_balancing_loss_func`` in the tests)
ROUTER_AUX_LOSS_TYPES = frozenset({"mixtral", "olmoe", "qwen2_moe", "qwen3_moe"})


def layer_balance_loss(logits: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` on one layer's router logits ``[tokens, num_experts]``:
    ``num_experts * sum_e f_e * P_e`` (``f_e``: share of the tokens with ``e`` among their
    ``top_k``; ``P_e``: mean softmax probability), in float32."""
    probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
    counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=torch.float32, device=probs.device))
    tokens = probs.shape[0]
    return num_experts * torch.sum(counts / tokens * probs.mean(dim=0))


@dataclass(frozen=True)
class RouterAux:
    """What the stage needs for the term: the router module type whose output ``index`` holds the
    logits, the model's expert count and top-k, ``coef`` and the number of MoE layers of the
    whole model (the mean's divisor)."""

    router_type: type
    index: int
    num_experts: int
    top_k: int
    coef: float
    num_layers: int

    def chunk_loss(self, router_logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """``coef`` x the sum over the given layers (a stage's share of one chunk) of
        :func:`layer_balance_loss`, divided by the model's MoE layer count."""
        total = sum(layer_balance_loss(x, self.num_experts, self.top_k) for x in router_logits)
        return total * (self.coef / self.num_layers)

    def logits_of(self, output: Any) -> torch.Tensor:
        """The router logits in a router module's output."""
        return output[self.index] if isinstance(output, (tuple, list)) else output


def router_aux_of(model: nn.Module) -> RouterAux:
    """The :class:`RouterAux` of an HF MoE causal LM (whole, before it is split), or
    ``ValueError`` saying why its loss is not reproduced."""
    config = model.config
    kind = str(getattr(config, "model_type", "") or "")
    if kind not in ROUTER_AUX_LOSS_TYPES:
        raise ValueError(f"the per-chunk router auxiliary loss reproduces the load-balancing loss of model types "
                         f"{', '.join(sorted(ROUTER_AUX_LOSS_TYPES))} only (its formula and its router's output "
                         "are checked for those)")
    recorder = getattr(type(model), "_can_record_outputs", None) or {}
    spec = recorder.get("router_logits")
    router_type = getattr(spec, "target_class", None)
    if router_type is None:
        raise ValueError("its classes declare no module whose output is the router logits (_can_record_outputs)")
    num_layers = sum(1 for m in model.model.layers.modules() if isinstance(m, router_type))
    num_experts = getattr(model, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None)
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    if not num_layers or num_experts is None or top_k is None or coef is None:
        raise ValueError(f"no {router_type.__name__} in its decoder layers, or no num_experts / num_experts_per_tok / "
                         "router_aux_loss_coef")
    return RouterAux(router_type=router_type, index=int(getattr(spec, "index", 0) or 0), num_experts=int(num_experts),
                     top_k=int(top_k), coef=float(coef), num_layers=num_layers)


@contextmanager
def without_router_logits(model: nn.Module, active: bool = True) -> Iterator[None]:
    """``model.config.output_router_logits`` off inside (restored after): for the probes that run
    the model's layers for another purpose than training it (the cost-model profile, the
    self-check's cross-entropy comparison), under ``concertina_router_aux_loss='per_chunk'``,
    where the router term is the stage's own. ``active=False``: nothing changes."""
    config = getattr(model, "config", None)
    if not active or not getattr(config, "output_router_logits", False):
        yield
        return
    config.output_router_logits = False
    try:
        yield
    finally:
        config.output_router_logits = True
