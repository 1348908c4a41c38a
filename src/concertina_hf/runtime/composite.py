"""Composite (multimodal) HF models trained on text: their language model as a causal LM.

A composite checkpoint (``Gemma3ForConditionalGeneration``: a vision tower, a projector and a
language model under one config with ``text_config``) is what people download. On text alone,
its ``forward`` runs the language model's embedding, decoder layers and norm, then its
``lm_head``, exactly as the text type's causal LM does; the other towers are never called.
:func:`text_view` returns that part as a :class:`TextView`, a module of the layout
:class:`~.stage.PipelineWrapper` prunes (``.model`` = the composite's language model, ``.lm_head``
= its head, ``.config`` = its ``text_config``), sharing the composite's modules (no copy). The
view holds no reference to the other towers: on a rank that drops the composite, they are freed.
Every refusal of the text type still applies (:func:`~.families.inspect_model` sees the view).

:data:`COMPOSITE_TYPES` lists the composite model types whose text-only ``forward`` has been
checked against the view (Gemma3, Mistral3, Qwen3.5, Llama 4, whose language model is a whole causal LM at
``language_model``, Gemma 4, whose forward soft-caps the logits as its text type's; its inputs for other modalities: :attr:`CompositeLayout.other_inputs`,
refused in a batch by :func:`refuse_other_modalities`). Checkpoint names: a composite's files may
name tensors otherwise than its modules (Gemma3's ``language_model.model.layers.0...`` for the
module ``model.language_model.layers.0...``); :func:`module_names` and :func:`saved_names` apply
transformers' own renamings (loading, saving), :meth:`CompositeLayout.text_key` maps a module
name to the view's. Cost: a walk over the names, once.

The loss is the pipeline's token-weighted one over the step, what ``Trainer`` computes for the text
type's causal LM; Qwen3.5's composite class declares ``accepts_loss_kwargs = False``, with which
``Trainer`` would average each micro-batch's mean loss instead.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn

__all__ = ["COMPOSITE_TYPES", "CompositeLayout", "TextView", "composite_layout", "module_names",
           "refuse_other_modalities", "saved_names", "text_view"]


@dataclass(frozen=True)
class CompositeLayout:
    """Where a composite model keeps its language model and head (module paths)."""

    model_type: str
    language_model: str = "model.language_model"
    lm_head: str = "lm_head"
    #: batch entries that carry another modality (refused: the pipeline runs the text model only)
    other_inputs: tuple[str, ...] = ("pixel_values",)
    #: the composite's forward soft-caps the logits by ``text_config.final_logit_softcapping`` (Gemma 4),
    #: as its text type's does; otherwise such a cap is refused
    softcaps_logits: bool = False

    def text_key(self, module_key: str) -> str | None:
        """The view's name of a composite module's tensor (``None``: not the language model's or head's)."""
        for prefix, view in ((self.language_model + ".", "model."), (self.lm_head + ".", "lm_head.")):
            if module_key.startswith(prefix):
                return view + module_key[len(prefix):]
        return None


#: composite model types whose text-only forward is the view's (checked by
#: ``tests/training/test_composite.py``)
COMPOSITE_TYPES = {
    "gemma3": CompositeLayout("gemma3", other_inputs=("pixel_values", "mm_encoder_outputs", "inputs_embeds")),
    "mistral3": CompositeLayout("mistral3", other_inputs=("pixel_values", "image_sizes", "inputs_embeds")),
    # hybrid text layers (Gated DeltaNet and attention): supported as their text type is
    "qwen3_5": CompositeLayout("qwen3_5", other_inputs=("pixel_values", "pixel_values_videos", "inputs_embeds")),
    "qwen3_5_moe": CompositeLayout("qwen3_5_moe",
                                   other_inputs=("pixel_values", "pixel_values_videos", "inputs_embeds")),
    # a Llama4ForCausalLM inside: chunked attention and MoE layers, supported as llama4_text is
    "llama4": CompositeLayout("llama4", language_model="language_model.model", lm_head="language_model.lm_head",
                              other_inputs=("pixel_values", "mm_encoder_outputs", "inputs_embeds")),
    # Gemma 4: per-layer inputs computed by its language model from the token ids, as gemma4_text's
    "gemma4": CompositeLayout("gemma4", other_inputs=("pixel_values", "pixel_values_videos", "input_features",
                                                      "mm_encoder_outputs", "inputs_embeds", "per_layer_inputs"),
                              softcaps_logits=True),
    "gemma4_unified": CompositeLayout("gemma4_unified", other_inputs=(
        "pixel_values", "pixel_values_videos", "input_features", "mm_encoder_outputs", "inputs_embeds"),
        softcaps_logits=True),
}
#: what the pipeline gets in a text batch: any other entry of the composite's forward is refused
_TEXT_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "labels", "use_cache", "cache",
                          "past_key_values", "cache_position", "logits_to_keep", "num_items_in_batch",
                          "return_dict", "output_attentions", "output_hidden_states"})


def composite_layout(config: Any) -> CompositeLayout | None:
    """The :class:`CompositeLayout` of a composite config whose language model the pipeline trains."""
    return COMPOSITE_TYPES.get(str(getattr(config, "model_type", "") or ""))


class TextView(nn.Module):
    """The language model and head of a composite model, laid out as a causal LM (see the module
    docstring). ``forward`` is the composite's on text: the language model, the head, HF's
    causal-LM loss (what the self-check compares with)."""

    def __init__(self, composite: nn.Module, layout: CompositeLayout) -> None:
        super().__init__()
        lm, head = composite.get_submodule(layout.language_model), composite.get_submodule(layout.lm_head)
        self.model = lm
        self.lm_head = head
        self.config = lm.config
        self.layout = layout
        #: the composite's class name and config (saved with the checkpoint); not a module reference
        self.composite_class = type(composite).__name__
        self.composite_config = composite.config
        #: what a batch may not carry (other modalities)
        self.other_inputs = other_inputs(composite, layout)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, **kwargs: Any) -> Any:
        from transformers.loss.loss_utils import ForCausalLMLoss
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache, **kwargs)
        logits = self.lm_head(out.last_hidden_state)
        cap = getattr(self.config, "final_logit_softcapping", None) if self.layout.softcaps_logits else None
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        loss = None
        if labels is not None:
            loss = ForCausalLMLoss(logits, labels, self.config.vocab_size, num_items_in_batch=num_items)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def other_inputs(composite: nn.Module, layout: CompositeLayout) -> tuple[str, ...]:
    """The composite forward's inputs that carry another modality: the layout's, and every
    parameter of its ``forward`` that is not a text input (``token_type_ids`` only when not all 0)."""
    params = inspect.signature(type(composite).forward).parameters
    names = [n for n, p in params.items() if n != "self" and n not in _TEXT_INPUTS
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return tuple(dict.fromkeys([*layout.other_inputs, *names]))


def refuse_other_modalities(batch: Mapping[str, Any], names: Iterable[str], model_type: str) -> None:
    """Raise a ``ValueError`` naming the entries of ``batch`` (a collated batch or a dataset row)
    that carry another modality than text (``token_type_ids`` all 0 is text)."""
    found = []
    for name in names:
        value = batch.get(name)
        if value is None:
            continue
        if name == "token_type_ids" and not bool(torch.as_tensor(value).any()):
            continue
        found.append(name)
    if found:
        raise ValueError(f"a batch with {', '.join(found)}: ConcertinaTrainer trains the language model of the "
                         f"composite model type {model_type!r} on text only (its other towers are neither run nor "
                         "trained); give it text-only batches (input_ids, labels, attention_mask)")


def text_view(model: nn.Module) -> TextView | None:
    """The :class:`TextView` of a composite model of :data:`COMPOSITE_TYPES` (its tied weights
    tied first), ``None`` for a model that is not one; a composite whose forward does work on the
    logits that its text type's would not is refused."""
    layout = composite_layout(getattr(model, "config", None))
    if layout is None:
        return None
    try:
        model.get_submodule(layout.language_model), model.get_submodule(layout.lm_head)
    except AttributeError:  # built otherwise (e.g. the text causal LM of a composite config)
        return None
    from .families import UnsupportedModelError

    text = model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if name == "final_logit_softcapping" and layout.softcaps_logits:
            continue
        if getattr(text, name, None) is not None:
            raise UnsupportedModelError(
                f"model type {layout.model_type!r} ({type(model).__name__}): its text_config.{name} is "
                f"{getattr(text, name)!r}, which the composite's forward does not apply and the pipeline would")
    return TextView(model, layout)


def _conversions(model: nn.Module, reverse: bool) -> tuple[list, list] | None:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings names tensors as its modules
        return None
    if reverse:  # as save_pretrained reverts them
        convs = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
        convs = [c.reverse_transform() for c in convs[::-1]]
    else:
        convs = get_model_conversion_mapping(model)
    return ([c for c in convs if isinstance(c, WeightRenaming)],
            [c for c in convs if isinstance(c, WeightConverter)])


def module_names(model: nn.Module, file_keys: Iterable[str]) -> dict[str, str | None]:
    """``{checkpoint tensor name: the module name from_pretrained loads it into}``; ``None`` for a
    tensor converted (not only renamed) on loading. ``model``: the composite (on meta is enough)."""
    from transformers.core_model_loading import rename_source_key

    convs = _conversions(model, reverse=False)
    if convs is None:
        return {k: k for k in file_keys}
    state = model.state_dict()
    out: dict[str, str | None] = {}
    for k in file_keys:
        name, converter = rename_source_key(k, convs[0], convs[1], getattr(model, "base_model_prefix", None), state)
        out[k] = None if converter is not None else name
    return out


def saved_names(model: nn.Module, module_keys: Iterable[str]) -> dict[str, str]:
    """``{module name: the name save_pretrained writes it under}`` (a tensor converted on saving
    keeps its module name, which from_pretrained reads too)."""
    from transformers.core_model_loading import rename_source_key

    convs = _conversions(model, reverse=True)
    out = {}
    for k in module_keys:
        if convs is None:
            out[k] = k
            continue
        name, converter = rename_source_key(k, convs[0], convs[1], reverse=True)
        out[k] = k if converter is not None else name
    return out
