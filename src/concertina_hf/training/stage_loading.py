"""Loading and saving by stage: no process ever holds the whole model.

**Loading** (:func:`model_source`, ``ConcertinaTrainer(model="org/name" or a local directory)``):
the config is read as ``from_pretrained`` reads it (``model_init_kwargs``: ``dtype`` / ``torch_dtype``,
``attn_implementation``, ``revision``, ``trust_remote_code``, ``token``, ``cache_dir``; other
keys that name a config field override it, as ``from_pretrained`` does; ``tie_word_embeddings=False``
on a tied checkpoint gives the head its own copy of the embedding); each rank builds the model
with its parameters on the meta device (buffers on the CPU, computed by the modules themselves:
non-persistent ones such as the rotary ``inv_freq`` are thus exact), the trainer prunes it to its
stage, and :meth:`ModelSource.load_stage` allocates the stage's parameters and reads only their
tensors from the safetensors files (``model.safetensors``, or the shards listed by
``model.safetensors.index.json``; a Hub name resolves each file through ``transformers``'
cached-file lookup, so a rank downloads only the shards it reads). Bytes go straight from the
file into the parameter's storage (no mmap, no intermediate copy when the dtypes agree). Tied
embeddings: the last stage's head copy is read from ``model.embed_tokens.weight``. The dtype is
``from_pretrained``'s: ``model_init_kwargs['dtype']``, else (``"auto"``) the config's ``dtype``,
else the checkpoint's. Every rank reads the same files, so no weight sync from rank 0 is needed.

**Self-check and profiling** on rank 0 (before the stage is read) run on a *prefix model*
(:meth:`ModelSource.prefix_model`): the embedding, the first ``k`` decoder layers, the final norm
and the head, read the same way and freed afterwards; nothing else of the model is read.

**Saving** (:func:`write_stage_shard`, :func:`write_index`): with several stages, each stage
(replica 0, sp rank 0) writes its own tensors under their HF names to
``model-{s+1:05d}-of-{p:05d}.safetensors`` (tied embeddings once, as ``model.embed_tokens.weight``
on stage 0), streaming each tensor's bytes to the file; pipeline rank 0 writes
``model.safetensors.index.json`` and the config. ``from_pretrained`` loads the directory as any
sharded HF checkpoint.

**Composite checkpoints** (a model type of :data:`~concertina_hf.runtime.composite.COMPOSITE_TYPES`,
e.g. Gemma3's vision tower and language model): the model is the composite's
:class:`~concertina_hf.runtime.composite.TextView`, built from the composite on the meta device
(its other towers are never allocated nor read); the view's tensors are read under the
checkpoint's own names (transformers' renamings: :func:`~concertina_hf.runtime.composite.module_names`).
:class:`CompositeCheckpoint` saves them under the same names, writes the other towers' tensors
into stage 0's shard unchanged (read from the source files at save time, byte for byte; with a
model object, kept by the rank that writes them) and the composite's config, so the composite
class's ``from_pretrained`` loads the directory.
"""

from __future__ import annotations

import gc
import json
import os
import re
import struct
from typing import Any, Callable

import torch
from torch import nn

from ..runtime.composite import TextView, composite_layout, module_names, saved_names, text_view
from ..runtime.param_sharding import full_state

__all__ = ["CompositeCheckpoint", "ModelSource", "composite_text_model", "SAFE_INDEX", "SAFE_SINGLE", "model_source", "read_safetensors_header", "shard_name",
           "write_index", "write_safetensors", "write_stage_shard"]

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
EMBED_WEIGHT = "model.embed_tokens.weight"
HEAD_WEIGHT = "lm_head.weight"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_CODES = {v: k for k, v in _DTYPES.items()}
_HUB_KEYS = ("revision", "token", "cache_dir")
_SHARD_RE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


def shard_name(stage: int, num_stages: int) -> str:
    """The file of stage ``stage``'s weights (HF's shard naming)."""
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def _init_kwargs(kwargs: dict[str, Any] | str | None) -> dict[str, Any]:
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"model_init_kwargs={kwargs!r} is not a JSON object: {e}") from None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"model_init_kwargs must be a dict (or its JSON), got {type(kwargs).__name__}")
    return dict(kwargs or {})


def _torch_dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model_init_kwargs['dtype']={value!r} is not a torch dtype (e.g. 'bfloat16', 'float32', "
                         "'auto')")
    return dtype


def read_safetensors_header(fh, path: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its data starts."""
    raw = fh.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", raw)
    try:
        header = json.loads(fh.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} has an unreadable safetensors header: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _readinto(fh, tensor: torch.Tensor, nbytes: int, path: str) -> None:
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    if view.nbytes != nbytes:
        raise ValueError(f"{path}: a tensor of {nbytes} bytes for a parameter of {view.nbytes}")
    got = 0
    while got < nbytes:
        n = fh.readinto(view[got:])
        if not n:
            raise ValueError(f"{path} ends early (truncated?)")
        got += n


class ModelSource:
    """A pretrained model known by name or directory, read tensor by tensor (see the module docstring)."""

    def __init__(self, name: str, config: Any, weight_map: dict[str, str], resolve: Callable[[str], str | None],
                 dtype: torch.dtype, model_kwargs: dict[str, Any], generation_config: Any = None,
                 checkpoint_tied: bool = False, file_names: dict[str, str] | None = None,
                 carried_files: dict[str, str] | None = None) -> None:
        self.name, self.config, self.weight_map, self.dtype = name, config, weight_map, dtype
        #: a composite checkpoint: the file's name of each tensor of the text view (``weight_map``'s
        #: keys are the view's names), and the files of the other towers' tensors; None otherwise
        self.file_names, self.carried_files = file_names, carried_files
        #: the checkpoint's own config ties the embeddings (model_init_kwargs may untie them)
        self.checkpoint_tied = checkpoint_tied
        self._resolve, self._model_kwargs, self.generation_config = resolve, model_kwargs, generation_config

    def empty_model(self) -> nn.Module:
        """The HF model with its parameters on the meta device and its buffers on the CPU."""
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        if self.file_names is not None:  # a composite: its text view (the other towers stay on meta, dropped)
            model = text_view(self.empty_composite())
        else:
            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype, **self._model_kwargs)
            model.tie_weights()  # init_empty_weights skips the tie that from_config makes
        if self.generation_config is not None:
            model.generation_config = self.generation_config
        object.__setattr__(model, "_concertina_source", self)  # the profiler and the self-check read from it
        return model

    def empty_composite(self) -> nn.Module:
        """The composite model (a :data:`~concertina_hf.runtime.composite.COMPOSITE_TYPES` type) on
        the meta device, its weights tied."""
        from accelerate import init_empty_weights

        cls = _composite_class(self.config)
        kwargs = {k: v for k, v in self._model_kwargs.items() if k != "trust_remote_code"}
        with init_empty_weights(include_buffers=False):
            model = cls._from_config(self.config, dtype=self.dtype, **kwargs)
        model.tie_weights()
        return model

    def read_carried(self) -> dict[str, torch.Tensor]:
        """The other towers' tensors of a composite checkpoint, under their names, as the files hold
        them (same dtype and bytes)."""
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for k, fname in (self.carried_files or {}).items():
            by_file.setdefault(fname, []).append(k)
        for fname, names in by_file.items():
            path = self._resolve(fname)
            if path is None:
                raise ValueError(f"{self.name}: {fname} (named by {SAFE_INDEX}) is missing")
            with open(path, "rb", buffering=0) as fh:
                header, base = read_safetensors_header(fh, path)
                for k in names:
                    entry = header[k]
                    dtype = _DTYPES.get(entry["dtype"])
                    if dtype is None:
                        raise ValueError(f"{path}: {k} has dtype {entry['dtype']}, which saving by stage cannot carry")
                    a, b = entry["data_offsets"]
                    fh.seek(base + a)
                    out[k] = torch.empty(tuple(entry["shape"]), dtype=dtype)
                    _readinto(fh, out[k], b - a, path)
        return out

    def load(self, model: nn.Module, keys: dict[str, str], what: str) -> None:
        """Allocate ``model``'s meta parameters on the CPU and read them; ``keys``: model key ->
        checkpoint tensor name. A parameter without a tensor is refused by name."""
        fresh: dict[int, nn.Parameter] = {}
        for mod in model.modules():
            for pname, p in list(mod._parameters.items()):
                if p is not None and p.device.type == "meta":
                    if id(p) not in fresh:
                        fresh[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                                    requires_grad=p.requires_grad)
                    mod._parameters[pname] = fresh[id(p)]
        targets = model.state_dict(keep_vars=True)
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        if (self.checkpoint_tied and HEAD_WEIGHT in params and HEAD_WEIGHT not in keys
                and EMBED_WEIGHT in self.weight_map):
            keys = {**keys, HEAD_WEIGHT: EMBED_WEIGHT}  # untied by tie_word_embeddings=False: a copy, trained apart
        missing = sorted(k for k in params if k in targets and k not in keys)
        if missing:
            raise ValueError(f"{self.name} lacks {len(missing)} tensors of {what}, e.g. {missing[:3]}: the "
                             "checkpoint does not match its config (or model_init_kwargs)")
        by_file: dict[str, list[str]] = {}
        for k in keys:
            if k in targets:
                by_file.setdefault(self.weight_map[keys[k]], []).append(k)
        for fname, names in by_file.items():
            path = self._resolve(fname)
            if path is None:
                raise ValueError(f"{self.name}: {fname} (named by {SAFE_INDEX}) is missing")
            with open(path, "rb", buffering=0) as fh, torch.no_grad():
                header, base = read_safetensors_header(fh, path)
                for k in names:
                    src, dst = keys[k], targets[k]
                    src = src if self.file_names is None else self.file_names[src]
                    entry = header.get(src)
                    if entry is None:
                        raise ValueError(f"{path} lacks {src} ({SAFE_INDEX} places it there)")
                    shape, dtype = tuple(entry["shape"]), _DTYPES.get(entry["dtype"])
                    if dtype is None:
                        raise ValueError(f"{path}: {src} has dtype {entry['dtype']}, which loading by stage "
                                         "cannot read")
                    if shape != tuple(dst.shape):
                        raise ValueError(f"{path}: {src} has shape {list(shape)}, the model's {k} {list(dst.shape)}: "
                                         "the checkpoint does not match its config")
                    a, b = entry["data_offsets"]
                    fh.seek(base + a)
                    if dtype == dst.dtype and dst.is_contiguous() and dst.device.type == "cpu":
                        _readinto(fh, dst.data, b - a, path)
                    else:
                        tmp = torch.empty(shape, dtype=dtype)
                        _readinto(fh, tmp, b - a, path)
                        dst.data.copy_(tmp)

    def load_stage(self, pipeline: Any) -> None:
        """This stage's tensors into ``pipeline`` (a :class:`~concertina_hf.runtime.stage.PipelineWrapper`
        built on :meth:`empty_model`). A prefix model read before (self-check, profiler) sits in
        reference cycles (modules, the probe's wrapper): collected first, so that its memory is
        free before the stage's is taken."""
        gc.collect()
        self.load(pipeline.model, pipeline.checkpoint_keys(self.weight_map.keys()), f"stage {pipeline.stage}")

    def prefix_model(self, num_layers: int) -> nn.Module:
        """The model with only its first ``num_layers`` decoder layers (embedding, final norm and
        head kept), read from the files: what the self-check and the profiler run on rank 0."""
        model = self.empty_model()
        model.model.layers = nn.ModuleList(list(model.model.layers)[:num_layers])
        avail = self.weight_map
        keys = {k: k for k in model.state_dict() if k in avail}
        tied = getattr(model.lm_head, "weight", None) is getattr(model.model.embed_tokens, "weight", None)
        if tied and HEAD_WEIGHT not in keys and EMBED_WEIGHT in avail:
            keys[HEAD_WEIGHT] = EMBED_WEIGHT
        self.load(model, keys, f"the first {num_layers} decoder layers")
        return model


def model_source(name: str | os.PathLike, model_init_kwargs: dict[str, Any] | str | None) -> ModelSource:
    """The :class:`ModelSource` of a Hub name or a local HF directory; errors name what to change."""
    from transformers import AutoConfig, GenerationConfig

    name = os.fspath(name)
    kw = _init_kwargs(model_init_kwargs)
    hub = {k: kw.pop(k) for k in _HUB_KEYS if k in kw}
    trust = bool(kw.pop("trust_remote_code", False))
    dtype_arg = kw.pop("dtype", kw.pop("torch_dtype", "auto"))
    model_kwargs: dict[str, Any] = {"trust_remote_code": trust}
    if kw.get("attn_implementation") is not None:
        model_kwargs["attn_implementation"] = kw.pop("attn_implementation")
    kw.pop("attn_implementation", None)
    kw.pop("low_cpu_mem_usage", None)  # what loading by stage does anyway
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust, **hub)
    except (OSError, ValueError) as e:
        raise ValueError(f"model={name!r}: no HF model config found ({e}); pass a Hub name or a local directory "
                         "written by save_pretrained, or a model object") from None
    composite = composite_layout(config)
    outer, config = config, (config.get_text_config() if composite is not None else config)
    unknown = [k for k in kw if not hasattr(config, k)]
    if unknown:
        raise ValueError(f"model_init_kwargs {unknown} cannot be honoured when the model is loaded by stage (each "
                         "rank reads its own stage's tensors); remove them, or pass a model object "
                         "(AutoModelForCausalLM.from_pretrained(...)) as model")
    checkpoint_tied = bool(getattr(outer, "tie_word_embeddings", False))  # a composite's own tie
    for k, v in kw.items():  # from_pretrained's config overrides (a composite's: its text config's)
        setattr(config, k, v)
    config = outer

    def resolve(fname: str) -> str | None:
        if os.path.isdir(name):
            path = os.path.join(name, fname)
            return path if os.path.isfile(path) else None
        from transformers.utils import cached_file

        return cached_file(name, fname, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub)

    index = resolve(SAFE_INDEX)
    if index is not None:
        with open(index) as fh:
            weight_map = dict(json.load(fh)["weight_map"])
        first = None
    else:
        first = resolve(SAFE_SINGLE)
        if first is None:
            raise ValueError(
                f"model={name!r} has neither {SAFE_SINGLE} nor {SAFE_INDEX}: loading by stage reads safetensors "
                "files only; save the model with save_pretrained (safetensors), or pass a model object "
                "(AutoModelForCausalLM.from_pretrained(...)) as model")
        with open(first, "rb") as fh:
            header, _ = read_safetensors_header(fh, first)
        weight_map = {k: SAFE_SINGLE for k in header}
    dtype = None if dtype_arg in (None, "auto") else _torch_dtype(dtype_arg)
    if dtype is None:  # "auto": the config's dtype, else the checkpoint's first floating tensor's
        dtype = _torch_dtype(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    if dtype is None:
        path = first or resolve(next(iter(sorted(set(weight_map.values())))))
        with open(path, "rb") as fh:
            header, _ = read_safetensors_header(fh, path)
        floats = (_DTYPES[e["dtype"]] for e in header.values()
                  if _DTYPES.get(e["dtype"], torch.int8).is_floating_point)
        dtype = next(floats, torch.float32)
    generation = None
    try:
        generation = GenerationConfig.from_pretrained(name, **hub)
    except (OSError, ValueError):
        pass
    source = ModelSource(name, config, weight_map, resolve, dtype, model_kwargs, generation, checkpoint_tied)
    if composite is not None:  # the view's tensors under the checkpoint's names, the other towers carried
        names = module_names(source.empty_composite(), weight_map)
        text_map, file_names, carried = {}, {}, {}
        for fkey, mkey in names.items():
            tkey = composite.text_key(mkey if mkey is not None else fkey)
            if tkey is None:
                carried[fkey] = weight_map[fkey]
            elif mkey is None:
                raise ValueError(f"model={name!r}: its tensor {fkey} is converted (not only renamed) when "
                                 "transformers loads it, which loading by stage does not do; pass the model object "
                                 "(from_pretrained) as model")
            else:
                text_map[tkey], file_names[tkey] = weight_map[fkey], fkey
        source.weight_map, source.file_names, source.carried_files = text_map, file_names, carried
    return source


def _composite_class(config: Any) -> type:
    import transformers

    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText._model_mapping[type(config)]


class CompositeCheckpoint:
    """Saving a composite model trained through its :class:`~concertina_hf.runtime.composite.TextView`
    (see the module docstring): ``names``: view name -> the name saved (the checkpoint's own);
    ``carried``: the other towers' tensors by saved name, or a function reading them (called by
    the rank that writes stage 0's shard, at each save)."""

    def __init__(self, view: TextView, names: dict[str, str], carried: Any, generation_config: Any = None) -> None:
        self.config, self.class_name = view.composite_config, view.composite_class
        self.model_type = view.layout.model_type
        self.other_inputs = view.other_inputs
        self.names, self.generation_config = names, generation_config
        self._carried = carried

    def drop_carried(self) -> None:
        """On a rank that never writes stage 0's shard: no reference to the other towers' tensors."""
        self._carried = {}

    def carried(self) -> dict[str, torch.Tensor]:
        return self._carried() if callable(self._carried) else dict(self._carried)

    def saved(self, tensors: dict[str, torch.Tensor], stage: int) -> dict[str, torch.Tensor]:
        """A stage's tensors under their saved names; stage 0's with the other towers' tensors."""
        out = {self.names.get(k, k): v for k, v in tensors.items()}
        return {**self.carried(), **out} if stage == 0 else out

    def checkpoint_names(self, available: Any) -> dict[str, str]:
        """``{view name: saved name}`` of the view's tensors found among ``available`` (a saved
        checkpoint's names)."""
        return {k: n for k, n in self.names.items() if n in available}

    def save_config(self, output_dir: str, attn_implementation: str) -> None:
        """The composite's config (and generation config), as ``save_pretrained`` writes them."""
        config = self.config
        text = config.get_text_config()
        runtime_attn, architectures = text._attn_implementation, getattr(config, "architectures", None)
        try:
            text._attn_implementation = attn_implementation
            config.architectures = [self.class_name]
            config.save_pretrained(output_dir)
        finally:
            text._attn_implementation, config.architectures = runtime_attn, architectures
        if self.generation_config is not None:
            self.generation_config.save_pretrained(output_dir)


def composite_text_model(model: Any, source: ModelSource | None) -> tuple[Any, CompositeCheckpoint | None]:
    """The model the pipeline trains and, for a composite, its :class:`CompositeCheckpoint`:
    ``model`` as it is (not a composite), the :class:`~concertina_hf.runtime.composite.TextView`
    built by ``source``, or the view of a composite model object (its other towers' tensors kept for
    saving, under the names ``save_pretrained`` gives them)."""
    if source is not None:
        if source.file_names is None:
            return model, None
        return model, CompositeCheckpoint(model, dict(source.file_names), source.read_carried,
                                          source.generation_config)
    view = text_view(model) if isinstance(model, nn.Module) else None
    if view is None:
        return model, None
    state = model.state_dict()
    saved = saved_names(model, state)
    names, carried = {}, {}
    for k, v in state.items():
        tkey = view.layout.text_key(k)
        if tkey is None:
            carried[saved[k]] = v.detach()
        else:
            names[tkey] = saved[k]
    generation = getattr(model, "generation_config", None) if getattr(model, "can_generate", lambda: False)() else None
    return view, CompositeCheckpoint(view, names, carried, generation)


# ---------------------------------------------------------------------------------- saving
def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> int:
    """``tensors`` as a safetensors file (``{"format": "pt"}`` metadata, as HF writes), each
    tensor's bytes streamed to the file (no serialized copy in memory); the bytes of data written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for k in names:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for k in names:
            t = tensors[k].detach()
            t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
            if t.numel():
                fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    os.replace(tmp, path)
    return offset


def write_stage_shard(pipeline: Any, output_dir: str,
                      composite: CompositeCheckpoint | None = None) -> tuple[str, dict[str, int]]:
    """This stage's parameters and persistent buffers under their HF names into its shard file
    (:func:`shard_name`); tied embeddings only from the first stage. Returns the file's name and
    ``{tensor: bytes}``. ``composite``: the names of the composite's checkpoint, and on stage 0
    its other towers' tensors (:class:`CompositeCheckpoint`)."""
    # sharded parameters gathered whole: collective over the stage's dp x sp ranks (each calls it)
    tensors = {k: v for k, v in full_state(pipeline.model).items()
               if not (pipeline.tied_embeddings and k == HEAD_WEIGHT)}
    if composite is not None:
        tensors = composite.saved(tensors, pipeline.stage)
    fname = shard_name(pipeline.stage, pipeline.layout.num_stages)
    write_safetensors(os.path.join(output_dir, fname), tensors)
    return fname, {k: v.numel() * v.element_size() for k, v in tensors.items()}


def write_index(output_dir: str, shards: list[tuple[str, dict[str, int]]]) -> list[str]:
    """``model.safetensors.index.json`` over every stage's shard, and the removal of weight files
    an earlier save left in ``output_dir`` that this one does not list; the shards' names."""
    weight_map: dict[str, str] = {}
    total = 0
    for fname, sizes in shards:
        for k, n in sizes.items():
            weight_map.setdefault(k, fname)
            total += n if weight_map[k] == fname else 0
    names = [f for f, _ in shards]
    for f in os.listdir(output_dir):
        if _SHARD_RE.match(f) and f not in names:
            os.remove(os.path.join(output_dir, f))
    tmp = os.path.join(output_dir, SAFE_INDEX + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
    os.replace(tmp, os.path.join(output_dir, SAFE_INDEX))
    return names
