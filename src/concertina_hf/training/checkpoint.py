"""Checkpoint I/O of a pipeline-parallel run: standard HF model directories plus per-stage state,
written atomically and verified on resume.

A checkpoint directory holds:

- the full model in HF's format, so ``AutoModelForCausalLM.from_pretrained`` loads it without
  this package: with several stages each stage (replica 0, sp rank 0) writes its own shard
  ``model-{s+1:05d}-of-{p:05d}.safetensors`` under the HF names and the main process
  ``model.safetensors.index.json`` and ``config.json`` (no rank holds another stage's weights:
  :func:`~concertina_hf.training.stage_loading.write_stage_shard`); with one stage
  ``save_pretrained``'s own files. Tied embeddings are written once, as HF does, and the last
  stage's copy is loaded from them; a composite model trained through its language model
  (:class:`~concertina_hf.training.stage_loading.CompositeCheckpoint`) always as stage shards, under
  the composite checkpoint's names, its other towers in stage 0's shard and its config; for a ``PeftModel``
  instead the adapter directory ``PeftModel.save_pretrained`` writes (``adapter_config.json``,
  ``adapter_model.safetensors`` with every stage's adapter weights), as ``Trainer`` + PEFT does;
- ``optimizer.stage{s}-of-{p}.pt``: each stage's optimizer state (replica 0 writes it); with
  ``concertina_shard_optimizer`` instead ``optimizer.stage{s}-of-{p}.dcp/``, the stage's state
  sharded over its ``dp x sp`` ranks written with ``torch.distributed.checkpoint`` (each rank
  writes its own share, ``__{i}_0.distcp``, nothing is gathered to one rank; ``.metadata``),
  keyed by parameter name, so a run of another ``dp x sp`` (or unsharded) reads it back, each
  rank only its share (:func:`~concertina_hf.training.sharded_optimizer.save_optimizer_shards`);
- ``scheduler.pt`` (the main process), plus the Trainer's own ``trainer_state.json`` and RNG files;
- ``concertina_rng_{i}.pt`` (``concertina_rng.pt`` for one process): process ``i``'s own random
  stream, from which its stage draws dropout (:class:`~concertina_hf.runtime.rng.StageRNG`);
- ``concertina.json``: the layout (``pipeline_size``, ``data_parallel_size``,
  ``sequence_parallel_size``, the stages' ``layer_ranges``, ``shard_optimizer``) and the cost
  model the planner was using; a resume at another pipeline size, layer split or number of
  processes is refused before the first step, on every rank, naming the setting and both
  ``dp x pp x sp`` layouts (:meth:`StageCheckpointer.check_layout`); data- and sequence-parallel
  sizes exchanged at the same number of processes, or another ``concertina_shard_optimizer``,
  reshard the optimizer state; and
  ``layout_cost_model.json``: the cost model the stage layout was made from (pass it as
  ``concertina_cost_model_path`` to rebuild the same layout; a resumed run must split the
  layers the same way);
- ``manifest.json``, written last: every other file with its size and digest
  (:mod:`~concertina_hf.training.manifest`, which names the files and verifies them).

Atomic saving: every rank writes into ``tmp-checkpoint-N``; after a barrier (every rank's files
are complete) the main process checks that each expected file is there, writes the manifest and
renames the folder to ``checkpoint-N``. A folder named ``checkpoint-N`` with a manifest is thus
complete; a save killed half-way leaves ``tmp-checkpoint-N`` (or, after a power cut, a renamed
folder whose files disagree with its manifest: nothing is fsynced), and both are skipped.

Verified loading: :meth:`StageCheckpointer.verified` and :meth:`StageCheckpointer.latest_verified`
verify on rank 0 (:func:`~concertina_hf.training.manifest.verify_checkpoint`) and give every rank
the same answer; a file the resume needs (a stage's optimizer shard, ``scheduler.pt``, this
process's RNG files) is an error when missing, never a silent default.

Costs: saving writes each stage's tensors from its own rank, streamed to its shard (only names
and sizes travel to pipeline rank 0, for the index); loading reads only this stage's tensors from
the safetensors files. Each stage hashes the files it wrote (its optimizer shard), the main
process the rest, in background threads started as each file is complete (the manifest's cost:
:mod:`~concertina_hf.training.manifest`). Nothing is fsynced (as the plain save).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from ..runtime.distributed import Topology
from ..runtime.param_sharding import full_state, load_full
from .manifest import (
    PLAN_META_NAME,
    SCHEDULER_NAME,
    STAGING_PREFIX,
    CheckpointError,
    file_digest,
    latest_verified_checkpoint,
    optimizer_name,
    rng_state_name,
    sharded_optimizer_name,
    stage_rng_name,
    verify_checkpoint,
    write_manifest,
)
from .sharded_optimizer import is_sharded, load_optimizer_shards, save_optimizer_shards
from .stage_loading import CompositeCheckpoint, write_index, write_stage_shard
from ..integrations.peft import ADAPTER_CONFIG_NAME, load_stage_adapter, save_adapter
from ..planning import CostModel, StageLayout

__all__ = ["LAYOUT_COST_NAME", "StageCheckpointer", "layout_cost_model"]

logger = logging.getLogger(__name__)

LAYOUT_COST_NAME = "layout_cost_model.json"


def layout_cost_model(checkpoint: Any) -> CostModel | None:
    """The cost model a checkpoint's stage layout was made from (``None`` if not a concertina one)."""
    if not isinstance(checkpoint, str) or not os.path.isfile(os.path.join(checkpoint, LAYOUT_COST_NAME)):
        return None
    with open(os.path.join(checkpoint, LAYOUT_COST_NAME)) as fh:
        return CostModel.from_dict(json.load(fh))


class StageCheckpointer:
    """Saves and loads one rank's share of a checkpoint (``pipeline``: this rank's
    :class:`~concertina_hf.runtime.stage.PipelineWrapper`; ``peft_model``: the ``PeftModel`` around
    its HF model, whose adapter is saved instead of the model, else ``None``)."""

    #: concertina_layout="auto"'s choice (``LayoutChoice.to_dict()``), recorded in ``concertina.json``
    layout_choice: dict | None = None

    def __init__(self, pipeline: Any, topology: Topology, shard_optimizer: bool = False,
                 peft_model: nn.Module | None = None, shard_parameters: bool = False,
                 composite: CompositeCheckpoint | None = None) -> None:
        self.pipeline, self.topology, self.shard_optimizer = pipeline, topology, shard_optimizer
        #: a composite model trained through its language model: saved in the composite's layout
        self.composite = composite
        #: the stage's parameters are sharded (``concertina_shard_parameters``): saving gathers them
        #: on every rank of the stage, the optimizer state is written with torch.distributed.checkpoint
        self.shard_parameters = shard_parameters
        self.peft_model = peft_model
        self._optimizer_shards = 0  # files per stage of the sharded optimizer state last saved
        # the checkpoint being written, and the digests of its files this rank started taking
        # in the background as soon as each was complete (they overlap the writing of the next)
        self._staging: str | None = None
        self._hashing: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _hash_in_background(self, directory: str, names: list[str]) -> None:
        if self._staging is None or os.path.abspath(directory) != os.path.abspath(self._staging):
            return  # not a checkpoint (save_model to a plain folder)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="checkpoint-digest")
        for name in names:
            self._hashing[name] = self._pool.submit(file_digest, os.path.join(directory, name))

    # ------------------------------------------------------------------ atomic checkpoints
    def begin_checkpoint(self, final_dir: str) -> str:
        """The staging folder ``tmp-checkpoint-N`` beside ``final_dir``, emptied of an earlier
        unfinished save (collective: every rank calls it before writing)."""
        staging = os.path.join(os.path.dirname(final_dir), STAGING_PREFIX + os.path.basename(final_dir))
        if self.topology.rank == 0 and os.path.exists(staging):
            logger.warning(f"removing {staging}, left by an unfinished save")
            shutil.rmtree(staging)
        self.topology.barrier()
        self._staging, self._hashing = staging, {}
        return staging

    def seal_checkpoint(self, staging: str, final_dir: str, *, global_step: int, layout: StageLayout,
                        save_only_model: bool) -> None:
        """Once every rank wrote its files: the manifest, then ``staging`` renamed to
        ``final_dir`` (replacing an older folder of that name); collective."""
        mine = {name: job.result() for name, job in self._hashing.items()}
        self._staging, self._hashing = None, {}
        self.topology.barrier()  # every rank's files are complete
        # each rank hashed the files it wrote (a stage's optimizer file, its share of a sharded one)
        hashed = self.topology.objects_of_every_rank(mine)
        if self.topology.rank == 0:
            known = {name: digest for part in hashed for name, digest in part.items()}
            write_manifest(staging, global_step=global_step, digests=known, layout={
                "world_size": self.topology.world_size, "pipeline_size": self.topology.pipeline_size,
                "data_parallel_size": self.topology.data_parallel_size,
                "sequence_parallel_size": self.topology.sequence_parallel_size,
                "layer_ranges": [list(r) for r in layout.layer_ranges], "save_only_model": save_only_model,
                "shard_optimizer": self.shard_optimizer,
                "optimizer_shards": 0 if save_only_model else self._optimizer_shards,
                "adapter": self.peft_model is not None})
            replaced = staging + ".replaced"
            if os.path.exists(final_dir):
                os.replace(final_dir, replaced)
            os.replace(staging, final_dir)
            shutil.rmtree(replaced, ignore_errors=True)
        self.topology.barrier()  # nobody reads or rotates the folder before it has its name

    def verified(self, checkpoint: str) -> str:
        """``checkpoint`` once it verifies (rank 0 hashes, every rank raises the same error);
        collective."""
        error = None
        if self.topology.rank == 0:
            try:
                verify_checkpoint(checkpoint)
            except CheckpointError as e:
                error = str(e)
        error = self.topology.broadcast_from_rank0(error)
        if error is not None:
            raise CheckpointError(f"refusing checkpoint {checkpoint}: {error}")
        return checkpoint

    def latest_verified(self, run_dir: str) -> str:
        """The newest checkpoint of ``run_dir`` that verifies, with a warning for each newer one
        skipped (rank 0 decides, every rank gets the same answer); collective."""
        found: tuple[str | None, list[str]] = (None, [])
        if self.topology.rank == 0:
            found = latest_verified_checkpoint(run_dir)
            for line in found[1] if found[0] is not None else []:
                logger.warning(f"resume_from_checkpoint=True: resuming from {found[0]}, skipping the newer {line}")
        path, skipped = self.topology.broadcast_from_rank0(found)
        if path is None:
            raise CheckpointError(f"no verified checkpoint in {run_dir} to resume from"
                                  + "".join(f"\n  skipped {s}" for s in skipped))
        return path

    def check_rng_state(self, checkpoint: str, world_size: int, process_index: int) -> None:
        """Refuse a checkpoint without this process's RNG file (Trainer would go on without it)."""
        path = os.path.join(checkpoint, rng_state_name(world_size, process_index))
        if not os.path.isfile(path):
            found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(checkpoint, "rng_state*")))
            raise CheckpointError(f"{path} is missing (found: {found or 'none'}): resume with as many processes "
                                  "as the checkpoint was written with")

    def save_stage_rng(self, output_dir: str, state: dict[str, Any]) -> None:
        """This process's random stream (:meth:`StageRNG.state_dict
        <concertina_hf.runtime.rng.StageRNG.state_dict>`) into the checkpoint being written."""
        os.makedirs(output_dir, exist_ok=True)
        torch.save(state, os.path.join(output_dir, stage_rng_name(self.topology.world_size, self.topology.rank)))

    def load_stage_rng(self, checkpoint: str) -> dict[str, Any]:
        """This process's random stream from a checkpoint; an error naming the file when missing."""
        path = os.path.join(checkpoint, stage_rng_name(self.topology.world_size, self.topology.rank))
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: the stage's dropout stream would restart from the seed; resume "
                                  "with as many processes as the checkpoint was written with")
        return _torch_load(path, "cpu")

    # ------------------------------------------------------------------ model
    def save_model(self, output_dir: str, *, layout: StageLayout, model: nn.Module, is_main: bool,
                   attn_implementation: str,
                   extra_files: dict[str, Any], planning_cost: CostModel, layout_cost: CostModel,
                   processing_class: Any = None) -> None:
        """The full HF model directory (collective over the pipeline of replica 0): each stage's
        shard written by its stage, the index and config by the main process. The saved config names ``attn_implementation`` (one every HF install has),
        not the runtime's backend. ``extra_files``: name -> object for ``torch.save``. A PEFT
        model (``peft_model``) is saved as ``Trainer`` + PEFT saves it: the adapter
        directory (every stage's adapter weights, :func:`~concertina_hf.integrations.peft.save_adapter`),
        not the base model."""
        peft_model = self.peft_model
        hashed: set[str] = set()
        if peft_model is not None:
            if self.topology.writes_stage:
                logger.info(f"Saving the PEFT adapter (all {self.topology.pipeline_size} stages) to {output_dir}")
                save_adapter(peft_model, output_dir, gather=self.topology.gather_in_pipeline, is_main=is_main)
            if not is_main:
                return
        elif self.topology.pipeline_size > 1 or self.composite is not None:
            # each stage writes its own shard: no rank holds another's weights
            shards = None
            if self.topology.writes_stage:
                os.makedirs(output_dir, exist_ok=True)
                shard = write_stage_shard(self.pipeline, output_dir, self.composite)
                self._hash_in_background(output_dir, [shard[0]])
                shards = self.topology.gather_in_pipeline(shard)  # names and sizes only
            elif self.shard_parameters:  # the stage's other ranks join the gathers of its weights
                full_state(self.pipeline.model)
            if not is_main:
                return
            logger.info(f"Saving the model ({self.topology.pipeline_size} stage shards) to {output_dir}")
            hashed = set(write_index(output_dir, shards))  # each shard hashed by the stage that wrote it
            if self.composite is not None:
                self.composite.save_config(output_dir, attn_implementation)
            else:
                _save_config(model, output_dir, attn_implementation)
        else:
            state_dict = None
            if self.topology.writes_stage:
                state_dict = self.pipeline.full_state_dict(self.topology.pp_group)
            elif self.shard_parameters:  # the stage's other ranks join the gathers of its weights
                full_state(self.pipeline.model)
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
        # the weights, while the rest is written
        self._hash_in_background(output_dir, _written_here(output_dir, hashed))
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
        for name, obj in extra_files.items():
            torch.save(obj, os.path.join(output_dir, name))
        _write_json(os.path.join(output_dir, PLAN_META_NAME), {
            "pipeline_size": self.topology.pipeline_size,
            "data_parallel_size": self.topology.data_parallel_size,
            "sequence_parallel_size": self.topology.sequence_parallel_size,
            "layer_ranges": [list(r) for r in layout.layer_ranges],
            "shard_optimizer": self.shard_optimizer,
            "shard_parameters": self.shard_parameters,
            "cost_model": planning_cost.to_dict(),
            **({"layout_choice": self.layout_choice} if self.layout_choice is not None else {}),
        })
        # the cost model the stage layout was made from: concertina_cost_model_path for a rerun
        _write_json(os.path.join(output_dir, LAYOUT_COST_NAME), layout_cost.to_dict())
        self._hash_in_background(output_dir, _written_here(output_dir, hashed | set(self._hashing)))

    def check_layout(self, checkpoint: str, layout: StageLayout) -> CostModel | None:
        """Refuse a checkpoint written at another pipeline size, or whose layers were split
        otherwise than ``layout`` (every rank reads the checkpoint's ``concertina.json`` and raises
        the same error, before the first step), or by another number of processes (the RNG
        files are per process, the replicas' batches change with their number), naming both
        ``dp x pp x sp`` layouts; the cost model it was planning with (``None`` when it recorded
        none). Another ``dp x sp`` at the same number of processes, or another
        ``concertina_shard_optimizer``, is accepted: the optimizer state is per stage, and a
        sharded one is keyed by parameter name and resharded as it is read (:meth:`load_optimizer`);
        each process continues the random stream of the process of its index."""
        meta_path = os.path.join(checkpoint, PLAN_META_NAME)
        if not os.path.isfile(meta_path):
            return None
        with open(meta_path) as fh:
            meta = json.load(fh)
        topo = self.topology
        pp = meta.get("pipeline_size", len(meta.get("layer_ranges") or ()))
        written = (meta.get("data_parallel_size"), pp, meta.get("sequence_parallel_size"))
        layouts = (f"(checkpoint: {_layout_name(written)}, this run: "
                   f"{_layout_name((topo.data_parallel_size, topo.pipeline_size, topo.sequence_parallel_size))})")
        if pp != topo.pipeline_size:
            raise ValueError(
                f"{checkpoint} was written with concertina_pipeline_size={pp}, this run has "
                f"concertina_pipeline_size={topo.pipeline_size}: resume with concertina_pipeline_size={pp} (its "
                f"optimizer state and layer split are per pipeline stage) {layouts}")
        if None not in written and written[0] * written[1] * written[2] != topo.world_size:
            n = written[0] * written[1] * written[2]
            raise ValueError(
                f"{checkpoint} was written by {n} processes, this run has {topo.world_size} {layouts}: the RNG "
                "states (rng_state_<i>.pth, concertina_rng_<i>.pt) are per process and the replicas' batches "
                f"change with their number; resume with {n} processes (data- and sequence-parallel sizes may be "
                "exchanged at that number)")
        ranges = [list(r) for r in layout.layer_ranges]
        if meta.get("layer_ranges") != ranges:
            raise ValueError(
                f"{checkpoint} was trained with the decoder layers split {meta.get('layer_ranges')} "
                f"over the stages, this trainer splits them {ranges}. Build the trainer with "
                f"resume_from_checkpoint={checkpoint!r} in its ConcertinaTrainingArguments (the "
                "layout is then restored at construction), or with concertina_cost_model_path="
                f"{os.path.join(checkpoint, LAYOUT_COST_NAME)!r}, and the same concertina_pipeline_size"
            )
        was = (meta.get("data_parallel_size"), meta.get("sequence_parallel_size"), meta.get("shard_optimizer", False))
        now = (topo.data_parallel_size, topo.sequence_parallel_size, self.shard_optimizer)
        if None not in was and was != now:
            logger.info(f"{checkpoint} was written at dp={was[0]} x sp={was[1]} (concertina_shard_optimizer={was[2]}), "
                        f"this run is dp={now[0]} x sp={now[1]} (concertina_shard_optimizer={now[2]}): the optimizer "
                        "state is resharded as it is loaded")
        return CostModel.from_dict(meta["cost_model"]) if "cost_model" in meta else None

    def load_stage_weights(self, model: nn.Module, checkpoint_dir: str) -> None:
        """This stage's parameters out of a full HF checkpoint (single or sharded safetensors), or
        with a PEFT model its adapter weights out of the adapter directory; an unreadable (e.g.
        truncated) file is refused by name."""
        from safetensors import SafetensorError, safe_open

        peft_model = self.peft_model
        if peft_model is not None:
            if not os.path.isfile(os.path.join(checkpoint_dir, ADAPTER_CONFIG_NAME)):
                raise ValueError(f"{checkpoint_dir} has no {ADAPTER_CONFIG_NAME}: the model is a PeftModel, so the "
                                 "checkpoint must be a PEFT adapter directory written by this trainer")
            try:
                load_stage_adapter(peft_model, checkpoint_dir, self.topology.stage)
            except ValueError as e:
                raise CheckpointError(str(e)) from e
            return

        index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
        single = os.path.join(checkpoint_dir, "model.safetensors")
        try:
            if os.path.isfile(index):
                with open(index) as fh:
                    weight_map = json.load(fh)["weight_map"]
            elif os.path.isfile(single):
                with safe_open(single, framework="pt", device="cpu") as fh:
                    weight_map = {k: "model.safetensors" for k in fh.keys()}
            else:
                raise ValueError(f"no model.safetensors (or its index) in {checkpoint_dir}: not a checkpoint to "
                                 "resume from")
        except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index if os.path.isfile(index) else single} is unreadable: {e}") from e
        if self.composite is not None:  # the view's names -> the composite checkpoint's
            names = self.composite.checkpoint_names(weight_map)
            source = {k: names[src] for k, src in self.pipeline.checkpoint_keys(names).items()}
            weight_map = {n: weight_map[n] for n in names.values()}
        else:
            source = self.pipeline.checkpoint_keys(weight_map.keys())  # stage key -> checkpoint key
        files: dict[str, list[str]] = {}
        for k, src in source.items():
            files.setdefault(weight_map[src], []).append(k)
        loaded: dict[str, torch.Tensor] = {}
        for fname, keys in files.items():
            path = os.path.join(checkpoint_dir, fname)
            try:
                with safe_open(path, framework="pt", device="cpu") as fh:
                    for k in keys:
                        loaded[k] = fh.get_tensor(source[k])
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path} is unreadable (truncated or damaged?): {e}") from e
        params = dict(model.named_parameters())
        missing = [k for k in model.state_dict() if k not in loaded and k in params]
        if missing:
            raise ValueError(f"{checkpoint_dir} lacks {len(missing)} parameters of stage {self.topology.stage}, "
                             f"e.g. {missing[:3]}")
        model.load_state_dict(load_full(model, loaded), strict=False)  # sharded ones: this rank's rows

    # ------------------------------------------------------------------ optimizer and scheduler
    def save_optimizer(self, output_dir: str, optimizer: Any, scheduler: Any, is_main: bool,
                       model: nn.Module | None = None) -> None:
        """Each stage of replica 0 writes its optimizer state, the main process the scheduler. A
        sharded optimizer (``concertina_shard_optimizer``) is written by every rank of the stage,
        each its own share, with ``torch.distributed.checkpoint`` into ``optimizer.stage{s}-of-{p}.dcp/``
        (collective over the stage's ``dp x sp`` ranks; ``model``: the stage's module, whose
        parameter names key the state)."""
        os.makedirs(output_dir, exist_ok=True)
        if is_sharded(optimizer) or self.shard_parameters:
            if model is None:
                raise ValueError("save_optimizer of a sharded optimizer needs the stage's model (its parameter names)")
            name = sharded_optimizer_name(self.topology.stage, self.topology.pipeline_size)
            wrote = save_optimizer_shards(optimizer, model, os.path.join(output_dir, name), self.topology)
            self._optimizer_shards = self.topology.data_parallel_size * self.topology.sequence_parallel_size
            self._hash_in_background(output_dir, [f"{name}/{n}" for n in wrote])
        else:
            self._optimizer_shards = 0
            if self.topology.writes_stage:
                torch.save(optimizer.state_dict(), self._optimizer_path(output_dir))
                self._hash_in_background(output_dir, [os.path.basename(self._optimizer_path(output_dir))])
        if is_main:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def load_optimizer(self, checkpoint: str, optimizer: Any, scheduler: Any, device: torch.device,
                       model: nn.Module | None = None) -> None:
        """This stage's optimizer state and the scheduler; either missing is an error. A sharded
        checkpoint (``optimizer.stage{s}-of-{p}.dcp/``) is read at any ``dp x sp``: each rank reads
        the state of the parameters it holds (all of them without ``concertina_shard_optimizer``);
        a plain file is read whole, a sharded optimizer keeping its rank's share."""
        sharded = os.path.join(checkpoint, sharded_optimizer_name(self.topology.stage, self.topology.pipeline_size))
        path = self._optimizer_path(checkpoint)
        if not os.path.isfile(path) and not os.path.isdir(sharded):
            found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(checkpoint, "optimizer*")))
            same_size = [f for f in found if re.search(rf"-of-{self.topology.pipeline_size}\.(pt|dcp)$", f)]
            raise CheckpointError(
                f"{path} is missing (found: {found or 'none'}): "
                + ("the checkpoint is incomplete (a stage did not finish its save); resume from an earlier one"
                   if same_size else
                   "resume with the same concertina_pipeline_size the checkpoint was written with"))
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isfile(sched):
            raise CheckpointError(f"{sched} is missing: the learning-rate schedule would restart; resume from a "
                                  "complete checkpoint")
        if os.path.isdir(sharded):
            if model is None:
                raise ValueError("load_optimizer of a sharded checkpoint needs the stage's model (its parameter names)")
            try:
                load_optimizer_shards(optimizer, model, sharded)
            except (RuntimeError, OSError, EOFError, ValueError, KeyError) as e:
                raise CheckpointError(f"{sharded} is unreadable (truncated, damaged or another model?): {e}") from e
        else:
            # "cpu:0" (the CPU device of distributed runs) is not a valid map_location
            where = "cpu" if device.type == "cpu" else device
            optimizer.load_state_dict(_torch_load(path, where))
        scheduler.load_state_dict(_torch_load(sched, "cpu"))

    def _optimizer_path(self, directory: str) -> str:
        return os.path.join(directory, optimizer_name(self.topology.stage, self.topology.pipeline_size))


def _layout_name(sizes: tuple) -> str:
    """``dp=2 x pp=2 x sp=1`` (``?`` for a size a checkpoint did not record)."""
    return " x ".join(f"{d}={'?' if n is None else n}" for d, n in zip(("dp", "pp", "sp"), sizes))


def _torch_load(path: str, map_location: Any) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable (truncated or damaged?): {e}") from e


def _save_config(model: nn.Module, output_dir: str, attn_implementation: str) -> None:
    """The config (and generation config) as ``save_pretrained`` writes them beside the weights."""
    config = model.config
    runtime_attn, architectures = config._attn_implementation, getattr(config, "architectures", None)
    try:
        config._attn_implementation = attn_implementation
        config.architectures = [type(model).__name__]
        config.save_pretrained(output_dir)
    finally:
        config._attn_implementation, config.architectures = runtime_attn, architectures
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(output_dir)


def _files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))


#: the files other processes write into a checkpoint while the main process saves the model (each
#: RNG state, each stage's optimizer state): the main process must not hash them, one may be half
#: written; the writer hashes its optimizer file, the manifest the RNG states after the barrier
_OTHER_PROCESSES_FILES = re.compile(r"^(rng_state(_\d+)?\.pth|concertina_rng(_\d+)?\.pt|optimizer\.stage\d+-of-\d+\.pt)$")


def _written_here(directory: str, skip: set[str]) -> list[str]:
    """The files of ``directory`` that :meth:`StageCheckpointer.save_model` wrote on this process,
    less ``skip`` (hashed already)."""
    return [n for n in _files(directory) if n not in skip and not _OTHER_PROCESSES_FILES.match(n)]


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)
