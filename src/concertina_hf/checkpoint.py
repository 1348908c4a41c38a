"""Checkpoint I/O of a pipeline-parallel run: standard HF model directories plus per-stage state.

A checkpoint directory holds:

- the FULL model as ``save_pretrained`` writes it (``model.safetensors`` or shards with their
  index, ``config.json``), gathered once to the main process
  (:meth:`~concertina_hf.runtime.stage.PipelineWrapper.full_state_dict`), so
  ``AutoModelForCausalLM.from_pretrained`` loads it without this package; tied embeddings are
  written once, as HF does, and the last stage's copy is loaded from them;
- ``optimizer.stage{s}-of-{p}.pt``: each stage's optimizer state (replica 0 writes it);
- ``scheduler.pt`` (the main process), plus the Trainer's own ``trainer_state.json`` and RNG files;
- ``concertina.json``: the stage layout and the cost model the planner was using, and
  ``layout_cost_model.json``: the cost model the stage layout was made from (pass it as
  ``concertina_cost_model_path`` to rebuild the same layout; a resumed run must split the
  layers the same way).

Costs: saving moves every parameter once to pipeline rank 0 of replica 0; loading reads only
this stage's tensors from the safetensors files.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

from .distributed import Topology
from .planning import CostModel, StageLayout

__all__ = [
    "LAYOUT_COST_NAME", "PLAN_META_NAME", "SCHEDULER_NAME", "StageCheckpointer", "layout_cost_model",
    "optimizer_name",
]

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "scheduler.pt"
PLAN_META_NAME = "concertina.json"
LAYOUT_COST_NAME = "layout_cost_model.json"


def optimizer_name(stage: int, num_stages: int) -> str:
    """File name of one stage's optimizer state."""
    return f"optimizer.stage{stage}-of-{num_stages}.pt"


def layout_cost_model(checkpoint: Any) -> CostModel | None:
    """The cost model a checkpoint's stage layout was made from (``None`` if not a concertina one)."""
    if not isinstance(checkpoint, str) or not os.path.isfile(os.path.join(checkpoint, LAYOUT_COST_NAME)):
        return None
    with open(os.path.join(checkpoint, LAYOUT_COST_NAME)) as fh:
        return CostModel.from_dict(json.load(fh))


class StageCheckpointer:
    """Saves and loads one rank's share of a checkpoint (``pipeline``: this rank's
    :class:`~concertina_hf.runtime.stage.PipelineWrapper`)."""

    def __init__(self, pipeline: Any, topology: Topology) -> None:
        self.pipeline, self.topology = pipeline, topology

    # ------------------------------------------------------------------ model
    def save_model(self, output_dir: str, *, layout: StageLayout, model: nn.Module, is_main: bool,
                   attn_implementation: str,
                   extra_files: dict[str, Any], planning_cost: CostModel, layout_cost: CostModel,
                   processing_class: Any = None) -> None:
        """The full HF model directory (collective over the pipeline of replica 0; written by the
        main process). The saved config names ``attn_implementation`` (one every HF install has),
        not the runtime's backend. ``extra_files``: name -> object for ``torch.save``."""
        state_dict = None
        if self.topology.replica == 0:
            state_dict = self.pipeline.full_state_dict(self.topology.pp_group)
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        logger.info(f"Saving the full model (all {self.topology.pipeline_size} stages) to {output_dir}")
        config = model.config
        runtime_attn = config._attn_implementation
        try:
            config._attn_implementation = attn_implementation
            model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)
        finally:
            config._attn_implementation = runtime_attn
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
        for name, obj in extra_files.items():
            torch.save(obj, os.path.join(output_dir, name))
        _write_json(os.path.join(output_dir, PLAN_META_NAME), {
            "pipeline_size": self.topology.pipeline_size,
            "data_parallel_size": self.topology.data_parallel_size,
            "layer_ranges": [list(r) for r in layout.layer_ranges],
            "cost_model": planning_cost.to_dict(),
        })
        # the cost model the stage layout was made from: concertina_cost_model_path for a rerun
        _write_json(os.path.join(output_dir, LAYOUT_COST_NAME), layout_cost.to_dict())

    def check_layout(self, checkpoint: str, layout: StageLayout) -> CostModel | None:
        """Refuse a checkpoint whose layers were split otherwise than ``layout``; the cost model it
        was planning with (``None`` when it recorded none)."""
        meta_path = os.path.join(checkpoint, PLAN_META_NAME)
        if not os.path.isfile(meta_path):
            return None
        with open(meta_path) as fh:
            meta = json.load(fh)
        ranges = [list(r) for r in layout.layer_ranges]
        if meta.get("layer_ranges") != ranges:
            raise ValueError(
                f"{checkpoint} was trained with the decoder layers split {meta.get('layer_ranges')} "
                f"over the stages, this trainer splits them {ranges}. Build the trainer with "
                f"resume_from_checkpoint={checkpoint!r} in its ConcertinaTrainingArguments (the "
                "layout is then restored at construction), or with concertina_cost_model_path="
                f"{os.path.join(checkpoint, LAYOUT_COST_NAME)!r}, and the same concertina_pipeline_size"
            )
        return CostModel.from_dict(meta["cost_model"]) if "cost_model" in meta else None

    def load_stage_weights(self, model: nn.Module, checkpoint_dir: str) -> None:
        """This stage's parameters out of a full HF checkpoint (single or sharded safetensors)."""
        from safetensors import safe_open

        index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
        single = os.path.join(checkpoint_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        elif os.path.isfile(single):
            with safe_open(single, framework="pt", device="cpu") as fh:
                weight_map = {k: "model.safetensors" for k in fh.keys()}
        else:
            raise ValueError(f"no model.safetensors (or its index) in {checkpoint_dir}: not a checkpoint to resume from")
        source = self.pipeline.checkpoint_keys(weight_map.keys())  # stage key -> checkpoint key
        files: dict[str, list[str]] = {}
        for k, src in source.items():
            files.setdefault(weight_map[src], []).append(k)
        loaded: dict[str, torch.Tensor] = {}
        for fname, keys in files.items():
            with safe_open(os.path.join(checkpoint_dir, fname), framework="pt", device="cpu") as fh:
                for k in keys:
                    loaded[k] = fh.get_tensor(source[k])
        params = dict(model.named_parameters())
        missing = [k for k in model.state_dict() if k not in loaded and k in params]
        if missing:
            raise ValueError(f"{checkpoint_dir} lacks {len(missing)} parameters of stage {self.topology.stage}, "
                             f"e.g. {missing[:3]}")
        model.load_state_dict(loaded, strict=False)

    # ------------------------------------------------------------------ optimizer and scheduler
    def save_optimizer(self, output_dir: str, optimizer: Any, scheduler: Any, is_main: bool) -> None:
        """Each stage of replica 0 writes its optimizer shard; the main process the scheduler."""
        os.makedirs(output_dir, exist_ok=True)
        if self.topology.replica == 0:
            torch.save(optimizer.state_dict(), self._optimizer_path(output_dir))
        if is_main:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def load_optimizer(self, checkpoint: str, optimizer: Any, scheduler: Any, device: torch.device) -> None:
        path = self._optimizer_path(checkpoint)
        if not os.path.isfile(path):
            found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(checkpoint, "optimizer*")))
            raise ValueError(
                f"{checkpoint} has no optimizer state for stage {self.topology.stage} of "
                f"{self.topology.pipeline_size} (found: {found or 'none'}); resume with the same "
                "concertina_pipeline_size the checkpoint was written with"
            )
        # "cpu:0" (the CPU device of distributed runs) is not a valid map_location
        where = "cpu" if device.type == "cpu" else device
        optimizer.load_state_dict(torch.load(path, map_location=where, weights_only=True))
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))

    def _optimizer_path(self, directory: str) -> str:
        return os.path.join(directory, optimizer_name(self.topology.stage, self.topology.pipeline_size))


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)
