"""Which HF causal LMs the pipeline runtime reproduces, and what each does outside its decoder layers.

The runtime never calls the HF model's ``forward``: it runs the embedding, the decoder layers
(with the chunk context) and the final norm and LM head itself
(:class:`~concertina_hf.runtime.stage.PipelineWrapper`). :func:`inspect_model` reads, once at
construction and before anything else runs, what the model's ``forward`` does around those
pieces, from the model's structure and its config, and returns it as a :class:`ModelFamily`
that the stage applies; what the runtime cannot reproduce raises :class:`UnsupportedModelError`
naming the model type and the feature:

- **layout** (GPT-2, GPT-NeoX, Falcon, Phi, Persimmon, BERT, T5/BART-style decoders, multimodal
  wrappers): the supported layout is ``model.model.embed_tokens / .layers / .norm / .rotary_emb``
  and ``model.lm_head``, nothing else at either level (an extra module there, such as an
  embedding norm, per-layer inputs or shared blocks, runs in ``forward`` between the pieces);
- **mixers that are not attention** (Mamba, Mamba2, RG-LRU, linear attention, short convolutions:
  Jamba, Zamba, RecurrentGemma, ...) and attention the backend does not implement
  (indexed / sparse): ``config.layer_types`` naming anything but ``full_attention`` /
  ``sliding_attention`` / ``chunked_attention`` (Llama 4's, :mod:`.attention.chunked`) /
  ``indexed_attention`` of :data:`~.attention.indexed.INDEXED_ATTENTION_TYPES` (DeepSeek-V3.2,
  GLM-MoE-DSA: top-k sparse attention, :mod:`.attention.indexed`; others refused naming what
  their forward does besides, :data:`~.attention.indexed.NOT_REPRODUCED`), a
  decoder layer without ``self_attn`` (or JetMoe's ``self_attention``),
  or a token-mixing ``Conv1d`` in a layer. Their state would leak between packed sequences and be
  lost between slices. The exception: the Gated DeltaNet layers (``linear_attention``,
  ``linear_attn``) of the model types of :data:`~.linear_attention.LINEAR_ATTENTION_TYPES`
  (Qwen3-Next, Qwen3.5, OLMo Hybrid, Lara-Mini), exactly HF's mixer class of each,
  which :mod:`.linear_attention` runs per document with its state carried across slices
  (:attr:`ModelFamily.linear_attention`; sequence parallel size 1 only), and the Mamba2 layers
  (``linear_attention``, ``mamba``) of the model types of :data:`~.ssm.SSM_TYPES` (Bamba,
  Granite-4.0 hybrid, Falcon-H1's ``hybrid`` layers beside their attention, Nemotron-H's ``mixer`` beside
  its ``mlp`` / ``moe`` layers without a token mixer), exactly HF's mixer class of each, which :mod:`.ssm` runs likewise (:attr:`ModelFamily.ssm`),
  and the short convolutions (``conv``) of :data:`~.short_conv.SHORT_CONV_TYPES` (LFM2, LFM2-MoE,
  LFM3), exactly HF's class of each, which :mod:`.short_conv` runs likewise
  (:attr:`ModelFamily.short_conv`), and the lightning attention (``linear_attention``, in
  ``self_attn``) of :data:`~.lightning_attention.LIGHTNING_TYPES` (MiniMax), exactly HF's class, which
  :mod:`.lightning_attention` runs likewise (:attr:`ModelFamily.lightning_attention`), and the Kimi
  Delta Attention (``linear_attention``, in ``self_attn``) of :data:`~.kda.KDA_TYPES` (Kimi Linear),
  which :mod:`.kda` runs likewise (:attr:`ModelFamily.kda`);
- **inputs the model's forward computes for its layers**: a decoder layer whose ``forward`` takes
  a parameter outside :data:`LAYER_INPUTS` (Beam's ``attention_scaling``; Gemma 4's per-layer inputs and
  shared K/V are reproduced, below), and
  the few model types of :data:`FORWARD_WORK` whose forward or attention does what neither the
  config nor the module structure reveals (DiffLlama, Doge, Dory);
- **the router auxiliary loss** (``output_router_logits=True``: Mixtral, Qwen3-MoE, ...; Llama 4's
  forward adds none, :data:`NO_ROUTER_AUX_LOSS`): HF adds
  ``coef * num_experts * sum_e(f_e * P_e)`` to the training loss, with ``f_e`` and ``P_e`` means
  over the tokens of the forward call *and over all layers at once*. Neither is a sum over
  stages or chunks: the stages would have to exchange per-expert statistics, and a chunk is not
  one of ``Trainer``'s micro-batches. Refused unless ``router_aux_loss="per_chunk"``
  (``concertina_router_aux_loss``): then the stage adds the loss per chunk and per layer, as
  Megatron-Core computes it per micro-batch (a different loss from ``Trainer``'s, see
  :mod:`.router_aux`), for the model types of :data:`~.router_aux.ROUTER_AUX_LOSS_TYPES`
  (others refused); or set ``output_router_logits=False`` (HF then trains without it, and the
  routers still learn from the language-model loss).

Reproduced outside the layers (:class:`ModelFamily`), each read from a config attribute:

- ``embedding_multiplier`` (Granite): the embedding output times it (Gemma's ``sqrt(hidden)``
  normalizer lives in its embedding module and needs nothing);
- ``logit_scale`` (Cohere; Falcon-H1's ``lm_head_multiplier``, :data:`LOGIT_SCALE_NAMES`): logits times it; ``logits_scaling`` (Granite, MiniCPM3): logits
  divided by it, except for the model types in :data:`LOGITS_SCALING_MULTIPLIES`, whose
  ``forward`` multiplies by the attribute of the same name (the config does not say which);
- ``final_logit_softcapping`` (Gemma2/3, nanochat): ``tanh(logits / cap) * cap``;
- rotary embeddings per layer type (Gemma3, OLMo3: ``rotary_emb(x, position_ids, layer_type)``
  with ``config.layer_types``): each layer gets the cos/sin of its own type (a type the rotary
  cannot produce is refused);
- Gemma 4's per-layer inputs (computed on the first stage, travelling with the hidden states) and
  K/V shared between layers of one stage (:mod:`.per_layer`, :data:`~.per_layer.PER_LAYER_TYPES`;
  bidirectional attention refused);
- nanochat's final norm applied to the embeddings too (:data:`NORM_BEFORE_LAYERS`; no config
  attribute says it);
- the final norm under another name than ``model.model.norm`` (LFM2's ``embedding_norm``, which runs
  after the last layer, Bamba's ``final_layernorm``, Nemotron-H's ``norm_f`` and embedding ``embeddings``, and LFM2-MoE's rotary embedding ``pos_emb``:
  :data:`MODULE_NAMES`);
- layers without position embeddings: Lara-Mini's global layers, LFM3's convolutions
  (:data:`NO_POSITION_LAYER_TYPES`),
  every layer of an OLMo Hybrid without a rotary embedding (:data:`ROTARY_OPTIONAL`).

``scripts/model_support.py`` checks every causal-LM model type of the installed transformers
against HF numerically (``docs/supported_models.md``); the trainer's self-check
(:mod:`concertina_hf.training.self_check`) does it for the model at hand. Cost: a walk over the model's
modules once; per chunk, one rotary evaluation per layer type of the stage.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .attention.indexed import INDEXED_ATTENTION_TYPES, INDEXED_LAYER_INPUTS, NOT_REPRODUCED
from .linear_attention import LINEAR_ATTENTION_TYPES, MIXER_ATTRIBUTE, mixer_class
from .ssm import HYBRID_TYPES, MIXERLESS_LAYER_TYPES, MIXERS, SSM_REFUSED, SSM_TYPES
from .ssm import mixer_class as ssm_mixer_class
from .short_conv import MIXER_ATTRIBUTE as SHORT_CONV_ATTRIBUTE
from .short_conv import SHORT_CONV_LAYER_TYPE, SHORT_CONV_TYPES
from .short_conv import mixer_class as short_conv_mixer_class
from .lightning_attention import LIGHTNING_TYPES
from .lightning_attention import mixer_class as lightning_mixer_class
from .kda import KDA_TYPES
from .kda import mixer_class as kda_mixer_class
from .per_layer import PER_LAYER_MODULES, PER_LAYER_PARAMETERS, PER_LAYER_TYPES, kv_sources, per_layer_input_size
from .router_aux import ROUTER_AUX_LOSS_MODES, RouterAux, router_aux_of

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "ATTENTION_MODULES",
    "FORWARD_WORK",
    "LAYER_INPUTS",
    "LOGITS_SCALING_MULTIPLIES",
    "LOGIT_SCALE_NAMES",
    "MODULE_NAMES",
    "NORM_BEFORE_LAYERS",
    "NO_POSITION_LAYER_TYPES",
    "NO_ROUTER_AUX_LOSS",
    "ROTARY_OPTIONAL",
    "SUPPORTED_LAYOUT",
    "ModelFamily",
    "UnsupportedModelError",
    "check_config",
    "recurrent_sp_refusal",
    "final_norm",
    "rotary_embedding",
    "inspect_model",
]

SUPPORTED_LAYOUT = (
    "ConcertinaTrainer supports decoder-only causal LMs laid out as model.model.embed_tokens / .layers / .norm / "
    ".rotary_emb and model.lm_head, whose decoder layers mix tokens only through self_attn and HF's attention "
    "interface (Llama, Mistral, Qwen2/3, Gemma, Granite, Cohere, OLMo, DeepSeek, Mixtral, ...; see "
    "docs/supported_models.md)"
)
#: ``config.layer_types`` entries that are attention the runtime's backend implements (``chunked_attention``:
#: Llama 4's, within ``config.attention_chunk_size`` tokens of the document, :mod:`.attention.chunked`)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
#: the name of a decoder layer's attention module (HF's ``self_attn``; JetMoe's ``self_attention``)
ATTENTION_MODULES = ("self_attn", "self_attention")
#: model types whose ``forward`` multiplies the logits by ``config.logits_scaling`` (Granite and
#: MiniCPM3 divide by it): the attribute's name does not tell
LOGITS_SCALING_MULTIPLIES = frozenset({"hyperclovax"})
#: model types whose ``forward`` multiplies the logits by a config attribute named otherwise than
#: ``logit_scale`` (Falcon-H1's mup ``lm_head_multiplier``)
LOGIT_SCALE_NAMES = {"falcon_h1": "lm_head_multiplier"}
#: model types whose ``forward`` applies the final norm to the embeddings too, before the layers
#: (no config attribute says it); the stage does the same (a norm without parameters only)
NORM_BEFORE_LAYERS = frozenset({"nanochat"})
#: model types whose ``forward`` passes no position embeddings to the decoder layers of these types
#: (no config attribute says it): Lara-Mini's global attention layers (only its sliding ones rotate)
NO_POSITION_LAYER_TYPES = {"lara_mini": frozenset({"full_attention"}), "lfm3": frozenset({"conv"})}
#: model types whose ``model.rotary_emb`` is None when ``config.rope_parameters`` has no ``rope_theta``
#: (OLMo Hybrid's released checkpoints), or absent (Nemotron-H): then no layer gets position embeddings
ROTARY_OPTIONAL = frozenset({"olmo_hybrid", "granitemoehybrid", "kimi_linear", "nemotron_h", "jamba"})
#: model types whose ``forward`` adds no router auxiliary loss whatever ``output_router_logits`` says
#: (Llama 4 returns the router logits only): that flag changes nothing the runtime reproduces
NO_ROUTER_AUX_LOSS = frozenset({"llama4_text"})
#: model types whose ``forward`` or attention does what no config attribute and no module
#: structure reveals, and the runtime does not reproduce
FORWARD_WORK = {
    "diffllama": "differential attention calls the attention function twice per layer with the same keys and "
                 "two different values; the pipeline keeps one K/V per layer for later slices",
    "doge": "its attention adds a learned dynamic mask (computed from the values) through attention_mask; the "
            "pipeline's attention builds its own mask from the chunk",
    "dory": "its forward runs a range of decoder layers several times (n_recurrent_loops), which one pass over "
            "the stages does not",
}
#: parameters of a decoder layer's ``forward`` the stage passes or that HF fills with defaults;
#: another one (``attention_scaling``, ``per_layer_input``, ...) is computed by the model's forward
LAYER_INPUTS = frozenset({"hidden_states", "attention_mask", "position_ids", "position_embeddings", "cache",
                          "past_key_values", "past_key_value", "use_cache", "cache_position", "output_attentions",
                          "output_router_logits", "kwargs", "args",
                          "mamba_attention_mask"})  # Falcon-H1's padding mask of its Mamba2: a chunk has no padding
#: model types whose final norm or rotary embedding has another name in ``model.model`` than ``norm`` /
#: ``rotary_emb`` (LFM2's ``embedding_norm`` runs after the last layer, not on the embeddings; LFM2-MoE's rotary
#: embedding is ``pos_emb``): ``{model type: {layout name: the model's name}}``
MODULE_NAMES = {"lfm2": {"norm": "embedding_norm"}, "lfm2_moe": {"norm": "embedding_norm", "rotary_emb": "pos_emb"},
                "lfm3": {"norm": "embedding_norm"}, "bamba": {"norm": "final_layernorm"},
                "falcon_h1": {"norm": "final_layernorm"},
                "nemotron_h": {"norm": "norm_f", "embed_tokens": "embeddings"},
                "jamba": {"norm": "final_layernorm"}}
_LAYOUT = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
_INNER = frozenset({"embed_tokens", "layers"})
_OUTER = frozenset({"model", "lm_head"})


class UnsupportedModelError(ValueError):
    """The runtime cannot train this model as HF does (the message names the model type and why)."""


def _name(config: Any, model: nn.Module | None = None) -> str:
    kind = getattr(config, "model_type", None) or "?"
    return f"model type {kind!r}" + (f" ({type(model).__name__})" if model is not None else "")


def _refuse(config: Any, model: nn.Module | None, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{_name(config, model)}: {what}. {SUPPORTED_LAYOUT}")


def check_config(config: Any, model: nn.Module | None = None, router_aux_loss: str | None = None) -> None:
    """The refusals a config alone decides (:class:`UnsupportedModelError`); see the module docstring.
    ``router_aux_loss``: ``concertina_router_aux_loss`` (``"per_chunk"`` accepts the router
    auxiliary loss of the model types that have it reproduced; ``None``: refused)."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(config, model, "encoder-decoder models are not supported")
    subs = [k for k in ("text_config", "vision_config", "audio_config", "decoder_config") if
            getattr(config, k, None) is not None]
    if subs:
        hint = ("; train its text model (e.g. AutoModelForCausalLM.from_config(config.text_config)); "
                "ConcertinaTrainer trains the language model of the composite types of runtime/composite.py "
                "given the composite model, its name or directory" if "text_config" in subs else "")
        raise _refuse(config, model, f"a composite config with {', '.join(subs)} (several models in one) is not "
                                     f"supported{hint}")
    refused = SSM_REFUSED.get(str(getattr(config, "model_type", "") or ""))
    if refused is not None:  # state space models whose mixer or layout the pipeline does not run (.ssm)
        raise _refuse(config, model, refused)
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        kind = str(getattr(config, "model_type", "") or "")
        other = sorted({str(t) for t in types} - ATTENTION_LAYER_TYPES
                       - ({"linear_attention"} if kind in LINEAR_ATTENTION_TYPES | SSM_TYPES | LIGHTNING_TYPES
                          | KDA_TYPES else set())
                       - ({"hybrid"} if kind in HYBRID_TYPES else set())
                       - MIXERLESS_LAYER_TYPES.get(kind, frozenset())
                       - ({SHORT_CONV_LAYER_TYPE} if kind in SHORT_CONV_TYPES else set())
                       - ({"indexed_attention"} if kind in INDEXED_ATTENTION_TYPES else set()))
        if other == ["indexed_attention"]:  # top-k sparse attention: .attention.indexed runs these types' classes
            raise _refuse(config, model, "its indexed_attention layers (top-k sparse attention) run in the pipeline "
                                         f"only for the indexer classes of {', '.join(sorted(INDEXED_ATTENTION_TYPES))} "
                                         "(runtime/attention/indexed.py); for this model type: "
                                         + NOT_REPRODUCED.get(kind, "its attention is not reproduced"))
        if other:
            raise _refuse(config, model, f"config.layer_types has {', '.join(repr(t) for t in other)} layers, which "
                                         "the pipeline does not implement (only full_attention, "
                                         "sliding_attention and chunked_attention, and linear_attention for the Gated DeltaNet of "
                                         f"{', '.join(sorted(LINEAR_ATTENTION_TYPES))}, and for the Mamba2 of "
                                         f"{', '.join(sorted(SSM_TYPES))}, and for the lightning attention of "
                                         f"{', '.join(sorted(LIGHTNING_TYPES))}, and for the Kimi Delta "
                                         f"Attention of {', '.join(sorted(KDA_TYPES))}, and conv for the short "
                                         "convolution of "
                                         f"{', '.join(sorted(SHORT_CONV_TYPES))}): other recurrent, "
                                         "linear-attention or convolutional mixers (Mamba, Mamba2 and short "
                                         "convolutions of other model types, RG-LRU, ...) would carry state between packed sequences and lose it between slices of "
                                         "a split sequence; sparse or indexed attention selects keys the "
                                         "pipeline's attention does not")
    if router_aux_loss is not None and router_aux_loss not in ROUTER_AUX_LOSS_MODES:
        raise ValueError(f"concertina_router_aux_loss={router_aux_loss!r}: choose None (no router auxiliary loss) "
                         f"or one of {', '.join(map(repr, ROUTER_AUX_LOSS_MODES))}")
    if router_aux_loss is None and getattr(config, "output_router_logits", False) and (
            str(getattr(config, "model_type", "") or "") not in NO_ROUTER_AUX_LOSS):
        raise _refuse(config, model, "output_router_logits=True adds the router auxiliary (load-balancing) loss "
                                     "to HF's training loss, over the statistics of every token of the forward "
                                     "call, which a 1F1B pipeline cannot compute (each chunk's backward starts "
                                     "before the step's last forward). Set concertina_router_aux_loss='per_chunk' "
                                     "to add it per chunk and per layer instead (Megatron-Core's per-micro-batch "
                                     "loss: a different loss from Trainer's), or config.output_router_logits = "
                                     "False (HF then trains without it too)")


@dataclass(frozen=True)
class ModelFamily:
    """What the stage does around the HF modules (see the module docstring)."""

    model_type: str
    #: the embedding output times this (``config.embedding_multiplier``); None: nothing
    embedding_multiplier: float | None = None
    #: logits times this (``config.logit_scale``)
    logit_scale: float | None = None
    #: logits divided by this (``config.logits_scaling``); multiplied with ``logits_scaling_multiplies``
    logits_scaling: float | None = None
    logits_scaling_multiplies: bool = False
    #: ``tanh(logits / cap) * cap`` (``config.final_logit_softcapping``)
    final_logit_softcapping: float | None = None
    #: ``config.layer_types`` when the rotary embedding takes the layer type; None: one rotary
    rotary_layer_types: tuple[str, ...] | None = None
    #: the final norm (without parameters) applied to the embeddings too (:data:`NORM_BEFORE_LAYERS`)
    norm_before_layers: bool = False
    #: the router's load-balancing loss per chunk and per layer (:mod:`.router_aux`); None: not added
    router_aux: RouterAux | None = None
    #: decoder layers mix tokens with a Gated DeltaNet (:mod:`.linear_attention`), sequence parallel size 1 only
    linear_attention: bool = False
    #: decoder layers mix tokens with a Mamba2 (:mod:`.ssm`), sequence parallel size 1 only
    ssm: bool = False
    #: decoder layers run top-k indexed attention (:mod:`.attention.indexed`), sequence parallel size 1 only
    indexed_attention: bool = False
    #: decoder layers mix tokens with a short convolution (:mod:`.short_conv`), sequence parallel size 1 only
    short_conv: bool = False
    #: decoder layers mix tokens with MiniMax's lightning attention (:mod:`.lightning_attention`), sequence
    #: parallel size 1 only
    lightning_attention: bool = False
    #: decoder layers mix tokens with Kimi Delta Attention (:mod:`.kda`), sequence parallel size 1 only
    kda: bool = False
    #: the final norm's name in ``model.model`` (:data:`MODULE_NAMES`)
    final_norm: str = "norm"
    #: the rotary embedding's name in ``model.model`` (:data:`MODULE_NAMES`)
    rotary: str = "rotary_emb"
    #: indices of the decoder layers HF's forward passes no position embeddings (:data:`NO_POSITION_LAYER_TYPES`,
    #: :data:`ROTARY_OPTIONAL`); None: every layer (no rotary embedding)
    no_position_layers: frozenset[int] | None = frozenset()
    #: the token embedding's name in ``model.model`` (:data:`MODULE_NAMES`)
    embedding: str = "embed_tokens"
    #: ``D`` of Gemma 4's per-layer inputs (:mod:`.per_layer`; 0: none): the first stage computes them and
    #: they travel with the hidden states
    per_layer_input_size: int = 0
    #: per decoder layer, the layer whose K/V it reads (:func:`.per_layer.kv_sources`); None: no KV sharing
    kv_sources: tuple[int | None, ...] | None = None
    #: the decoder layers take ``shared_kv_states`` (Gemma 4: the stage passes one dict per chunk)
    shared_kv_states: bool = False

    def scale_embeddings(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        return hidden

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """HF's ``forward`` after the LM head, in its order."""
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits * self.logits_scaling if self.logits_scaling_multiplies else logits / self.logits_scaling
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    def position_embeddings(self, rotary: Callable, hidden: torch.Tensor, position_ids: torch.Tensor,
                            layers: range) -> list[Any]:
        """The ``position_embeddings`` of each of ``layers`` (indices into the model's layers)."""
        if self.no_position_layers is None:
            return [None] * len(layers)
        if self.rotary_layer_types is None:
            cos_sin = rotary(hidden, position_ids) if any(i not in self.no_position_layers for i in layers) else None
            return [None if i in self.no_position_layers else cos_sin for i in layers]
        per_type: dict[str, Any] = {}
        out = []
        for i in layers:
            if i in self.no_position_layers:
                out.append(None)
                continue
            kind = self.rotary_layer_types[i]
            if kind not in per_type:
                per_type[kind] = rotary(hidden, position_ids, kind)
            out.append(per_type[kind])
        return out


def recurrent_sp_refusal(config: Any, sp: int) -> str | None:
    """Why a stage of ``sp`` ranks cannot run ``config``'s short convolutions (:mod:`.short_conv`),
    lightning attention (:mod:`.lightning_attention`), Kimi Delta Attention (:mod:`.kda`) or Mamba2
    (:mod:`.ssm`): their state
    would have to pass between the stage's ranks (``None``: it can, or the model has none)."""
    kind = str(getattr(config, "model_type", "") or "")
    types = {str(t) for t in (getattr(config, "layer_types", None) or ())}
    feature = ("short-convolution (LFM2 conv)" if kind in SHORT_CONV_TYPES and SHORT_CONV_LAYER_TYPE in types else
               "lightning-attention (MiniMax linear attention)" if kind in LIGHTNING_TYPES and "linear_attention" in types
               else "Kimi Delta Attention (KDA)" if kind in KDA_TYPES and "linear_attention" in types
               else "Mamba2 (SSD)" if kind in SSM_TYPES and types & {"linear_attention", "hybrid"} else None)
    if sp <= 1 or feature is None:
        return None
    return (f"model type {kind!r}: {feature} layers run with sequence parallel size 1 only (a chunk sharded over a "
            f"stage's {sp} ranks would need their state passed between them); set concertina_sequence_parallel_size=1 "
            "(concertina_layout='auto' leaves sp > 1 out for this model)")


def sequence_parallel_refusal(config: Any, sp: int, mode: str = "ulysses") -> str | None:
    """Why a stage of ``sp`` ranks cannot run ``config``'s layers under
    ``concertina_sequence_parallel_mode`` ``mode`` (``None``: it can): chunked attention and Llama 4's
    query temperature (:mod:`.attention.chunked`), top-k indexed attention (:mod:`.attention.indexed`),
    the recurrent mixers but Gated DeltaNet (:func:`recurrent_sp_refusal`), Gated DeltaNet outside
    Ulysses or with key heads ``sp`` does not divide (:mod:`.linear_attention`). The executor, the
    run's set-up and ``concertina_layout='auto'`` ask this one function."""
    from .attention.chunked import sequence_parallel_refusal as chunked
    from .attention.indexed import sequence_parallel_refusal as indexed
    from .linear_attention import sequence_parallel_refusal as linear

    if sp <= 1:
        return None
    for why in (chunked(config, sp), indexed(config, sp), recurrent_sp_refusal(config, sp), linear(config, sp, mode)):
        if why is not None:
            return why
    return None


def install_mixers(model: Any, family: ModelFamily) -> None:
    """Route ``model``'s recurrent and convolutional mixers (the family's: Gated DeltaNet, Mamba,
    short convolutions, lightning attention, KDA) through the chunk context (:mod:`.recurrent`).
    ``model``: anything with the HF ``config`` and ``modules()`` (a model, or a holder of copies of
    its layers)."""
    from . import kda, lightning_attention, linear_attention, short_conv, ssm

    for flag, mixers in (("linear_attention", linear_attention), ("ssm", ssm), ("short_conv", short_conv),
                         ("lightning_attention", lightning_attention), ("kda", kda)):
        if getattr(family, flag):
            mixers.install(model)


def _module_name(model: nn.Module, name: str) -> str:
    kind = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    return MODULE_NAMES.get(kind, {}).get(name, name)


def final_norm(model: nn.Module) -> nn.Module:
    """The norm an HF causal LM's ``forward`` applies after its last decoder layer (``model.model.norm``,
    or the module :data:`MODULE_NAMES` names for its model type)."""
    return getattr(model.model, _module_name(model, "norm"))


def rotary_embedding(model: nn.Module) -> nn.Module | None:
    """An HF causal LM's rotary embedding (``model.model.rotary_emb``, or as :data:`MODULE_NAMES` names it)."""
    return getattr(model.model, _module_name(model, "rotary_emb"), None)


def _number(config: Any, name: str) -> float | None:
    value = getattr(config, name, None)
    return None if value is None or isinstance(value, bool) else float(value)


def inspect_model(model: nn.Module, router_aux_loss: str | None = None) -> ModelFamily:
    """The :class:`ModelFamily` of an HF causal LM, or :class:`UnsupportedModelError` (see the module
    docstring). Reads the model only. ``router_aux_loss="per_chunk"``: the family's
    :attr:`ModelFamily.router_aux` (refused for a model type whose loss is not reproduced)."""
    config = getattr(model, "config", None)
    check_config(config, model, router_aux_loss)
    kind = str(getattr(config, "model_type", "") or "")
    nope = kind in ROTARY_OPTIONAL and getattr(getattr(model, "model", None), "rotary_emb", None) is None
    names = MODULE_NAMES.get(kind, {})
    norm_name, rotary_name = names.get("norm", "norm"), names.get("rotary_emb", "rotary_emb")
    for path in _LAYOUT:
        path = path if not path.startswith("model.") else f"model.{names.get(path[6:], path[6:])}"
        if nope and path == "model.rotary_emb":
            continue
        cur, where = model, "model"
        for part in path.split("."):
            parent, cur = cur, getattr(cur, part, None)
            if cur is None:
                kids = ", ".join(n for n, _ in parent.named_children()) if isinstance(parent, nn.Module) else ""
                raise _refuse(config, model, f"it has no `{path}` ({where} has: {kids})")
            where = f"{where}.{part}"
    inner = model.model
    if not isinstance(inner.layers, nn.ModuleList):
        raise _refuse(config, model, "model.model.layers is not a ModuleList of decoder layers")
    extra = [f"model.{n} ({type(m).__name__})" for n, m in model.named_children() if n not in _OUTER]
    extra += [f"model.model.{n} ({type(m).__name__})" for n, m in inner.named_children()
              if n not in _INNER and n not in (norm_name, rotary_name, names.get("embed_tokens", "embed_tokens"))
              and not (kind in PER_LAYER_TYPES and n in PER_LAYER_MODULES)]
    if extra:
        raise _refuse(config, model, f"{', '.join(extra)} run(s) in the model's forward outside the decoder layers, "
                                     "which the pipeline does not reproduce")
    linear, attribute = (mixer_class(kind), MIXER_ATTRIBUTE) if kind in LINEAR_ATTENTION_TYPES else (None, "")
    if kind in SSM_TYPES:
        linear, attribute = ssm_mixer_class(kind), MIXERS[kind].attribute
    if kind in SHORT_CONV_TYPES:
        linear, attribute = short_conv_mixer_class(kind), SHORT_CONV_ATTRIBUTE
    if kind in LIGHTNING_TYPES:  # in the self_attn of the linear_attention layers (.lightning_attention)
        linear, attribute = lightning_mixer_class(kind), "self_attn"
    if kind in KDA_TYPES:  # likewise (.kda)
        linear, attribute = kda_mixer_class(kind), "self_attn"
    layer_types = getattr(config, "layer_types", None) or ()
    has_linear = False
    for i, layer in enumerate(inner.layers):
        mixer = getattr(layer, attribute, None) if attribute else None
        if mixer is not None and (attribute in ATTENTION_MODULES or kind in MIXERLESS_LAYER_TYPES) and not (
                i < len(layer_types) and layer_types[i] == "linear_attention"):
            mixer = None  # an attention layer of the model (its layer type says so)
        if linear is not None and mixer is not None:
            if type(mixer) is not linear:
                raise _refuse(config, model, f"decoder layer {i}'s {attribute} is a {type(mixer).__name__}, not "
                                             f"HF's {linear.__name__}, the recurrent mixer the pipeline implements")
            has_linear = True
        elif kind in MIXERLESS_LAYER_TYPES and getattr(layer, "block_type", None) in (
                MIXERLESS_LAYER_TYPES[kind] | ATTENTION_LAYER_TYPES):
            pass  # Nemotron-H: an MLP or MoE without a token mixer, or its attention in `mixer`
        elif all(getattr(layer, n, None) is None for n in ATTENTION_MODULES):
            kids = ", ".join(n for n, _ in layer.named_children())
            raise _refuse(config, model, f"decoder layer {i} ({type(layer).__name__}) has no self_attn (its modules: "
                                         f"{kids}): a layer whose token mixer is not attention is not supported")
        conv = next((n for n, m in layer.named_modules() if isinstance(m, nn.Conv1d)
                     and not (linear is not None and n.startswith(f"{attribute}."))), None)
        if conv is not None:
            raise _refuse(config, model, f"decoder layer {i} mixes tokens with a convolution ({conv}): its state "
                                         "would leak between packed sequences and be lost between slices")
        extra_inputs = sorted(n for n, prm in inspect.signature(layer.forward).parameters.items()
                              if n not in LAYER_INPUTS and not n.startswith("_")
                              and not (kind in INDEXED_ATTENTION_TYPES and n in INDEXED_LAYER_INPUTS)
                              and not (kind in PER_LAYER_TYPES and n in PER_LAYER_PARAMETERS)
                              and prm.kind not in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD))
        if extra_inputs:
            raise _refuse(config, model, f"decoder layer {i} ({type(layer).__name__}) takes "
                                         f"{', '.join(extra_inputs)}, which the model's forward computes and the "
                                         "pipeline does not")
    if kind in FORWARD_WORK:
        raise _refuse(config, model, FORWARD_WORK[kind])
    rotary_types = None
    no_position: frozenset[int] | None = None
    if not nope:
        types = getattr(config, "layer_types", None)
        free = NO_POSITION_LAYER_TYPES.get(kind, frozenset())
        if free and (not isinstance(types, (list, tuple)) or len(types) < len(inner.layers)):
            raise _refuse(config, model, "its forward gives no position embeddings to its "
                                         f"{', '.join(sorted(free))} layers but config.layer_types does not give "
                                         "one type per decoder layer")
        no_position = frozenset(i for i in range(len(inner.layers)) if free and str(types[i]) in free)
    params = inspect.signature(getattr(inner, rotary_name).forward).parameters if not nope else {}
    if "layer_type" in params:
        types = getattr(config, "layer_types", None)
        if not isinstance(types, (list, tuple)) or len(types) < len(inner.layers):
            raise _refuse(config, model, "its rotary embedding takes a layer type but config.layer_types does not "
                                         "give one per decoder layer")
        rotary_types = tuple(str(t) for t in types)
        probe = torch.zeros(1, 1, 1)
        for t in sorted(set(rotary_types) - NO_POSITION_LAYER_TYPES.get(kind, frozenset())):
            try:
                with torch.no_grad():
                    getattr(inner, rotary_name)(probe, torch.zeros(1, 1, dtype=torch.long), t)
            except Exception as exc:
                raise _refuse(config, model, f"its rotary embedding gives no position embeddings for layer type {t!r} "
                                             f"({type(exc).__name__}: {exc}): the model's forward computes them "
                                             "otherwise") from exc
    per_layer = kind in PER_LAYER_TYPES
    if per_layer and getattr(config, "use_bidirectional_attention", None) == "all":
        raise _refuse(config, model, "use_bidirectional_attention='all' makes every layer attend both ways; the "
                                     "pipeline's attention is causal (set config.use_bidirectional_attention = None)")
    norm_first = kind in NORM_BEFORE_LAYERS
    if norm_first and any(True for _ in inner.norm.parameters()):
        raise _refuse(config, model, "its forward applies the final norm to the embeddings too, and that norm has "
                                     "parameters the first and the last stage would both need")
    return ModelFamily(
        indexed_attention=kind in INDEXED_ATTENTION_TYPES,
        model_type=kind,
        embedding_multiplier=_number(config, "embedding_multiplier"),
        logit_scale=_number(config, LOGIT_SCALE_NAMES.get(kind, "logit_scale")),
        logits_scaling=_number(config, "logits_scaling"),
        logits_scaling_multiplies=kind in LOGITS_SCALING_MULTIPLIES,
        final_logit_softcapping=_number(config, "final_logit_softcapping"),
        rotary_layer_types=rotary_types,
        norm_before_layers=norm_first,
        router_aux=None if router_aux_loss is None else _router_aux(model),
        linear_attention=has_linear and kind in LINEAR_ATTENTION_TYPES,
        ssm=has_linear and kind in SSM_TYPES,
        short_conv=has_linear and kind in SHORT_CONV_TYPES,
        lightning_attention=has_linear and kind in LIGHTNING_TYPES,
        kda=has_linear and kind in KDA_TYPES,
        final_norm=norm_name,
        rotary=rotary_name,
        embedding=names.get("embed_tokens", "embed_tokens"),
        per_layer_input_size=per_layer_input_size(model) if per_layer else 0,
        kv_sources=kv_sources(config) if per_layer else None,
        shared_kv_states=per_layer,
        no_position_layers=no_position,
    )


def _router_aux(model: nn.Module) -> RouterAux:
    try:
        return router_aux_of(model)
    except ValueError as exc:
        raise _refuse(model.config, model, f"concertina_router_aux_loss='per_chunk' is not supported for it: {exc}. "
                                           "Set concertina_router_aux_loss=None (and config.output_router_logits = "
                                           "False: HF then trains without the router loss too)") from None
