"""One pipeline stage of an HF causal LM, and the computations a stage runs on a chunk.

:class:`PipelineWrapper` prunes an HF causal LM *in place* to the modules of one stage of a
:class:`~concertina_hf.planning.types.StageLayout`: decoder layers outside the stage's range
become empty placeholders (so the kept parameters keep their original HF names, e.g.
``model.layers.5.mlp.up_proj.weight``), the embedding stays on stage 0 only, the final norm and
the LM head on the last stage only; the rotary embedding (buffers only) stays everywhere. The
model is switched to the ``"concertina"`` attention backend (:mod:`.attention`) and HF's own
gradient checkpointing is turned off (the plan decides recompute per chunk).

Tied input/output embeddings (``tie_word_embeddings``, e.g. Qwen2-0.5B, Llama-3.2-1B): with one
stage the model is untouched (one shared parameter). With several, the first stage keeps the
embedding and the last stage keeps the LM head, whose weight is then its own copy, initialized
from the same tensor; :meth:`PipelineExecutor.sync_tied_gradients
<concertina_hf.runtime.executor.PipelineExecutor.sync_tied_gradients>` sums the two copies'
gradients once per optimizer step, so both take the same update and stay equal (bit for bit:
``a + b == b + a``). :attr:`PipelineWrapper.tied_weight` is the stage's copy; a global gradient
norm must count it once. :meth:`PipelineWrapper.full_state_dict` writes the weight once, under
``model.embed_tokens.weight`` (an HF tied checkpoint: ``from_pretrained`` ties ``lm_head.weight``
to it), and :meth:`PipelineWrapper.load_state_dict` takes the head's copy from that key.

Supported models: decoder-only HF causal LMs laid out as ``model.model.embed_tokens``,
``.layers``, ``.norm``, ``.rotary_emb`` and ``model.lm_head``, whose decoder layers mix tokens only
through ``self_attn`` and HF's ``AttentionInterface`` (Llama, Mistral, Qwen2/3, Gemma 1-3, Granite,
Cohere, OLMo 1-3, DeepSeek-V3, Mixtral, StableLM, gpt-oss, ...: ``docs/supported_models.md`` lists
every causal-LM model type of the installed transformers, checked numerically by
``scripts/model_support.py``). :func:`~.families.inspect_model` runs first: it refuses what the
runtime cannot reproduce (other layouts, recurrent / linear-attention / convolutional mixers but
the Gated DeltaNet classes of :mod:`.linear_attention`, the Mamba2 classes of :mod:`.ssm`, LFM2's short
convolutions (:mod:`.short_conv`), MiniMax's lightning attention (:mod:`.lightning_attention`) and Kimi
Linear's KDA (:mod:`.kda`), whose modules :func:`~.families.install_mixers` routes through the chunk context, the
router auxiliary loss unless ``concertina_router_aux_loss='per_chunk'`` (then the stage records its
routers' logits for the per-chunk term of :mod:`.router_aux`), work the model's ``forward`` does
between the layers) with a message naming
the model type and the feature, and returns the :class:`~.families.ModelFamily` that
:meth:`PipelineWrapper.embed`, :meth:`PipelineWrapper.run_layers` and
:meth:`PipelineWrapper.head_logits` apply: the embedding multiplier, per-layer-type rotary
embeddings, logit scaling and final soft-capping, read from the config (the final norm and the rotary
embedding under the family's names: LFM2's ``embedding_norm``); Gemma 4's per-layer inputs
(:mod:`.per_layer`) leave the first stage with the hidden states, a message of
:attr:`PipelineWrapper.in_width` numbers per token.

Cost: pruning frees the other stages' parameters (after the caller drops its own references);
:meth:`PipelineWrapper.full_state_dict` moves every parameter once to pipeline rank 0. Tied
embeddings over several stages cost the last stage one more ``vocab x hidden`` matrix (weight,
gradient, optimizer state) and one exchange of its gradient with the first stage per step.
"""

from __future__ import annotations

import functools
from typing import Any, Collection, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..planning.types import StageLayout
from .attention import ChunkAttentionContext, chunk_context, register_attention, step_active
from .attention import indexed
from .families import inspect_model, install_mixers
from .per_layer import PER_LAYER_MODULES, check_kv_sharing, embed_per_layer, message_width
from .param_sharding import full_state

__all__ = ["EMBED_WEIGHT", "HEAD_WEIGHT", "PipelineWrapper"]

EMBED_WEIGHT = "model.embed_tokens.weight"
HEAD_WEIGHT = "lm_head.weight"  # with tied embeddings: a copy of EMBED_WEIGHT, saved under that name


class _Placeholder(nn.Module):
    """Stands where a module of another stage was; has no parameters and refuses to run."""

    def __init__(self, name: str, owner: str) -> None:
        super().__init__()
        self._name = name
        self._owner = owner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} lives on {self._owner}, not on this pipeline stage")

    def extra_repr(self) -> str:
        return f"{self._name} on {self._owner}"


def _layer_call(layer: nn.Module, ctx: ChunkAttentionContext, hidden: torch.Tensor, **kwargs: Any) -> Any:
    """One decoder layer with ``ctx`` as the chunk context (what checkpointing wraps and replays)."""
    with chunk_context(ctx):
        return layer(hidden, **kwargs)


class PipelineWrapper(nn.Module):
    """The modules of pipeline stage ``stage`` of an HF causal LM (the model is pruned in place).

    ``parameters()`` / ``named_parameters()`` / ``state_dict()`` are those of the pruned HF model,
    so names are the original HF names and only this stage's parameters appear.

    ``model`` is a plain HF model; for a ``peft.PeftModel`` the caller hands over the HF model
    inside it (adapter layers in place, pruned like any other module) and keeps the ``PeftModel``
    for saving the adapter (:func:`concertina_hf.training.run_setup.pipeline_stage`).
    """

    #: parameters sharded over the stage's ``dp x sp`` ranks (:func:`~.param_sharding.shard_stage`)
    sharded: bool = False
    #: ``TrainingArguments.label_smoothing_factor``: the loss is HF's ``LabelSmoother`` (with
    #: ``num_items_in_batch``): ``(1 - eps) * nll + eps * mean over the vocabulary of -log p``
    label_smoothing: float = 0.0

    def __init__(self, model: nn.Module, layout: StageLayout, stage: int, router_aux_loss: str | None = None) -> None:
        """``router_aux_loss``: ``concertina_router_aux_loss`` (``"per_chunk"``: the stage records its
        routers' logits for :meth:`router_aux_loss`; ``None``: a model adding a router loss is refused)."""
        super().__init__()
        #: what the HF model's forward does around its modules (refuses what cannot be reproduced)
        self.family = inspect_model(model, router_aux_loss)
        #: the router load-balancing loss per chunk and per layer (:mod:`.router_aux`; None: not added).
        #: Its ``coef`` may be replaced (``dataclasses.replace``), e.g. by TRL's ``router_aux_loss_coef``
        self.router_aux = self.family.router_aux
        self._router_sink: list[torch.Tensor] | None = None  # where the router hooks put the logits, while set
        layers = model.model.layers
        if layout.num_layers != len(layers):
            raise ValueError(
                f"the stage layout covers {layout.num_layers} decoder layers but the model has {len(layers)}; "
                "build the layout from config.num_hidden_layers"
            )
        if not 0 <= stage < layout.num_stages:
            raise ValueError(f"stage {stage} outside 0..{layout.num_stages - 1}")
        embed_weight = getattr(getattr(model.model, self.family.embedding), "weight", None)
        tied = embed_weight is not None and getattr(model.lm_head, "weight", None) is embed_weight
        if layout.num_stages > 1 and not tied and getattr(model.config, "tie_word_embeddings", False):
            raise ValueError(
                "model.config.tie_word_embeddings is True but lm_head.weight is not model.embed_tokens.weight, so "
                "the saved checkpoint would be reloaded with the wrong LM head. Tie them (model.tie_weights()) or "
                "set model.config.tie_word_embeddings = False to train two matrices"
            )
        #: the input and output embeddings are one tensor (one parameter with one stage; a copy on
        #: the first and on the last stage with several, kept equal by sync_tied_gradients)
        self.tied_embeddings = bool(tied)
        # the final norm, for a model whose forward also applies it to the embeddings (parameter-free:
        # kept as a plain attribute, so stage 0 registers nothing more)
        norm_name = self.family.final_norm  # model.model.norm, or its name in this family
        object.__setattr__(self, "_embedding_norm",
                           getattr(model.model, norm_name) if self.family.norm_before_layers else None)
        self.layout = layout
        self.stage = stage
        self.is_first = layout.has_embedding(stage)
        self.is_last = layout.has_head(stage)
        self.layer_start, self.layer_end = layout.layer_ranges[stage]
        owner = {i: s for s, (a, b) in enumerate(layout.layer_ranges) for i in range(a, b)}
        for i in range(len(layers)):
            if not self.layer_start <= i < self.layer_end:
                layers[i] = _Placeholder(f"model.layers.{i}", f"stage {owner[i]}")
        if not self.is_first:
            emb = self.family.embedding  # model.model.embed_tokens, or its name in this family
            setattr(model.model, emb, _Placeholder(f"model.{emb}", "stage 0"))
            if self.family.per_layer_input_size:  # Gemma 4's per-layer inputs come from stage 0 (.per_layer)
                for name in PER_LAYER_MODULES:
                    setattr(model.model, name, _Placeholder(f"model.{name}", "stage 0"))
        check_kv_sharing(self.family.kv_sources, layout.layer_ranges, self.family.model_type)
        #: numbers per token of this stage's input and output messages (hidden states, and Gemma 4's
        #: per-layer inputs of the later layers: :func:`~.per_layer.message_width`)
        self.in_width, self.out_width = (
            message_width(int(model.config.hidden_size), self.family.per_layer_input_size, len(layers), b)
            for b in (self.layer_start, self.layer_end))
        if not self.is_last:
            last = f"stage {layout.num_stages - 1}"
            setattr(model.model, norm_name, _Placeholder(f"model.{norm_name}", last))
            model.lm_head = _Placeholder("lm_head", last)
        elif tied and not self.is_first:
            # the head's own copy of the shared weight (the embedding module is gone from this
            # rank); a new Parameter on the same tensor: no copy, no link to the old module
            shared = model.lm_head.weight
            model.lm_head.weight = nn.Parameter(shared.detach(), requires_grad=shared.requires_grad)
        for mod in model.modules():  # HF's checkpointing would wrap every layer; the plan decides
            if getattr(mod, "gradient_checkpointing", False) is True:
                mod.gradient_checkpointing = False
        name = register_attention()
        try:
            model.set_attn_implementation(name)
        except Exception:  # models without the functional attention API still read the config field
            model.config._attn_implementation = name
        if model.config._attn_implementation != name:
            model.config._attn_implementation = name
        install_mixers(model, self.family)  # recurrent mixers read the chunk context too (.recurrent)
        if self.family.indexed_attention:  # top-k indexed attention's indexers (.attention.indexed)
            indexed.check_stage(model.config, range(self.layer_start, self.layer_end))
            indexed.install(model)
        # `model` is registered as a child so .to() / .train() reach it; names are delegated below
        self.model = model
        self.config = model.config
        if self.router_aux is not None:
            for layer in self.decoder_layers:
                for mod in layer.modules():
                    if isinstance(mod, self.router_aux.router_type):
                        mod.register_forward_hook(self._record_router_logits)

    # ------------------------------------------------------------------ HF names
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.model.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        """Load this stage's entries of ``state_dict`` (a full or a stage state dict); with
        ``strict``, every parameter of this stage must be present."""
        sub = {k: state_dict[src] for k, src in self.checkpoint_keys(state_dict.keys()).items()}
        return self.model.load_state_dict(sub, strict=strict, assign=assign)

    def checkpoint_keys(self, available: Collection[str]) -> dict[str, str]:
        """``{stage key: key of a full HF state dict}`` for this stage's entries found among
        ``available`` (a full state dict's or a checkpoint's keys). An HF tied checkpoint keeps the
        shared weight once, as ``model.embed_tokens.weight``: the last stage's head copy loads
        from it. The one place that maps stage names to checkpoint names."""
        own = self.model.state_dict().keys()
        keys = {k: k for k in own if k in available}
        if self.tied_embeddings and HEAD_WEIGHT in own and HEAD_WEIGHT not in keys and EMBED_WEIGHT in available:
            keys[HEAD_WEIGHT] = EMBED_WEIGHT
        return keys

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of tied input/output embeddings when the tie spans stages (first
        stage: the embedding's weight, last stage: the LM head's); ``None`` otherwise (untied,
        one stage, or a middle stage)."""
        if not self.tied_embeddings or self.layout.num_stages == 1:
            return None
        if self.is_first:
            return getattr(self.model.model, self.family.embedding).weight
        if self.is_last:
            return self.model.lm_head.weight
        return None

    @property
    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.model.layers[self.layer_start:self.layer_end])

    @property
    def final_norm(self) -> nn.Module:
        """The final norm (``model.model.norm``, or the family's :attr:`~.families.ModelFamily.final_norm`;
        a placeholder but on the last stage)."""
        return getattr(self.model.model, self.family.final_norm)

    @property
    def rotary_emb(self) -> nn.Module | None:
        """The rotary embedding (``model.model.rotary_emb``, or the family's
        :attr:`~.families.ModelFamily.rotary`)."""
        return getattr(self.model.model, self.family.rotary, None)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ computations
    def embed(self, input_ids_T: torch.Tensor) -> torch.Tensor:
        """Stage 0: token ids [T] -> hidden states [1, T, hidden]."""
        embed_tokens = getattr(self.model.model, self.family.embedding)
        hidden = self.family.scale_embeddings(embed_tokens(input_ids_T.unsqueeze(0)))
        hidden = hidden if self._embedding_norm is None else self._embedding_norm(hidden)
        if self.family.per_layer_input_size:  # [1, T, hidden + L x D]: Gemma 4's per-layer inputs too
            return embed_per_layer(self.model.model, input_ids_T.unsqueeze(0), hidden)
        return hidden

    def run_layers(self, hidden: torch.Tensor, ctx: ChunkAttentionContext, num_recompute: int = 0,
                   router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        """This stage's decoder layers on a chunk; the first ``num_recompute`` run under
        non-reentrant activation checkpointing (only their inputs and the K/V of non-final
        slices stay alive until backward).

        The context reaches the attention as the ``concertina_ctx`` keyword and, for layers that
        drop ``**kwargs``, through :func:`~.attention.chunk_context`, set inside the function
        that checkpointing wraps so that its replay in backward sees it too.

        ``router_logits`` (with :attr:`router_aux`): the logits of each MoE layer's router on
        this chunk are appended to it, in layer order (a checkpointed layer's replay in backward
        runs after this returns, and is not recorded)."""
        pos = ctx.position_ids
        ple_size, extra = self.family.per_layer_input_size, {}
        if ple_size:  # the message [hidden | per-layer inputs of layers layer_start..L-1] (.per_layer)
            width = int(self.config.hidden_size)
            ple = hidden[..., width:].unflatten(-1, (-1, ple_size))
            hidden = hidden[..., :width]
        if self.family.shared_kv_states:  # K/V a layer stores for later layers of this chunk (.per_layer)
            extra["shared_kv_states"] = {}
        rotary = self.family.position_embeddings(self.rotary_emb, hidden, pos,
                                                 range(self.layer_start, self.layer_end))
        self._router_sink = router_logits
        try:
            with step_active():
                for i, layer in enumerate(self.decoder_layers):
                    if ple_size:
                        extra["per_layer_input"] = ple[:, :, i]
                    call = functools.partial(_layer_call, layer, ctx, attention_mask=None, position_ids=pos,
                                             position_embeddings=rotary[i], use_cache=False, concertina_ctx=ctx,
                                             **extra)
                    if i < num_recompute and torch.is_grad_enabled():
                        out = checkpoint(call, hidden, use_reentrant=False)
                    else:
                        out = call(hidden)
                    hidden = out[0] if isinstance(out, tuple) else out
        finally:
            self._router_sink = None
        if ple_size and not self.is_last:  # the later stages' per-layer inputs travel on
            hidden = torch.cat([hidden, ple[:, :, len(rotary):].flatten(2)], dim=-1)
        return hidden

    def _record_router_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook of the stage's router modules: their logits, while :meth:`run_layers` collects them."""
        sink = self._router_sink
        if sink is not None:
            sink.append(self.router_aux.logits_of(output))

    def router_aux_loss(self, router_logits: list[torch.Tensor]) -> torch.Tensor:
        """This stage's share of one chunk's router load-balancing term (``coef`` included, not yet
        weighted by the chunk's token share): :meth:`~.router_aux.RouterAux.chunk_loss`."""
        return self.router_aux.chunk_loss(router_logits)

    def head_loss_sum(self, hidden: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        """Last stage: final norm, LM head, and the summed float32 token cross-entropy (targets
        already shifted; -100 ignored), like HF's ``ForCausalLMLoss``."""
        return self.loss_sum(self.head_logits(hidden), targets_T)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage: the logits of HF's ``forward`` for ``hidden``: final norm, LM head, and the
        model's logit scaling and soft-capping (:class:`~.families.ModelFamily`)."""
        return self.family.transform_logits(self.model.lm_head(self.final_norm(hidden)))

    def loss_sum(self, logits: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        """The summed float32 token cross-entropy of ``logits`` (targets shifted; -100 ignored),
        label-smoothed by :attr:`label_smoothing` as HF's ``LabelSmoother`` does (its
        per-token ``(1 - eps) * nll + eps * sum(-log p) / vocab`` is torch's ``label_smoothing``)."""
        vocab = logits.shape[-1]
        return F.cross_entropy(logits.float().view(-1, vocab), targets_T, ignore_index=-100, reduction="sum",
                               label_smoothing=self.label_smoothing)

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self, pp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor] | None:
        """All stages' parameters and persistent buffers gathered on pipeline rank 0 (CPU
        tensors; ``None`` on other ranks): a full HF state dict. Collective over ``pp_group``
        (``None``: the default group, or no group at all with one stage). Tied embeddings appear
        once, as ``model.embed_tokens.weight`` (HF's tied checkpoint format)."""
        # sharded parameters gathered whole: collective over the stage's dp x sp ranks (each calls it)
        own = {k: v.detach() for k, v in full_state(self.model).items()
               if not (self.tied_embeddings and k == HEAD_WEIGHT)}
        if self.layout.num_stages == 1:
            return {k: v.cpu().clone() for k, v in own.items()}
        if not dist.is_initialized():
            raise RuntimeError("full_state_dict with several stages needs an initialized torch.distributed group")
        group = pp_group if pp_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        backend = dist.get_backend(group)
        comm_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # non-owned keys of each stage: stage-local entries only (rotary buffers are on all stages)
        meta = [(k, tuple(v.shape), v.dtype) for k, v in own.items()]
        metas: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(meta, metas, dst=dist.get_global_rank(group, 0), group=group)
        if rank == 0:
            out = {k: v.cpu().clone() for k, v in own.items()}
            for src in range(1, len(metas)):
                for k, shape, dtype in metas[src]:
                    buf = torch.empty(shape, dtype=dtype, device=comm_device)
                    dist.recv(buf, src=dist.get_global_rank(group, src), group=group)
                    out.setdefault(k, buf.cpu())
            return out
        for k, v in own.items():
            dist.send(v.to(comm_device).contiguous(), dst=dist.get_global_rank(group, 0), group=group)
        return None
