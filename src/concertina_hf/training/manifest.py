"""The files of a checkpoint and its manifest: what a checkpoint of a layout holds, sealed by a
``manifest.json`` of every file's size and digest, and verified before a resume.

The names: the model in HF's files, ``concertina.json`` (the layout, :data:`PLAN_META_NAME`),
each stage's optimizer state (:func:`optimizer_name`, or a folder of shards,
:func:`sharded_optimizer_name`), ``scheduler.pt``, every process's RNG files
(:func:`rng_state_name`, :func:`stage_rng_name`) and the Trainer's state; a save being written
is ``tmp-checkpoint-N`` (:data:`STAGING_PREFIX`).

``manifest.json``, written last by :func:`write_manifest`: every other file with its size and
XXH3-128 digest, the global step and the layout (world, pipeline, data- and sequence-parallel
sizes, layer ranges, optimizer shards); the files inside ``optimizer.stage{s}-of-{p}.dcp/`` are
listed and hashed like the others. A folder that lacks a file its layout needs is refused.

Verified loading: :func:`verify_checkpoint` re-hashes every file listed in the manifest and
refuses, naming the file, one that is missing, of another size or another hash.
:func:`latest_verified_checkpoint` (``train(resume_from_checkpoint=True)``) takes the newest
checkpoint that verifies and says why it skipped newer ones.

Cost: one read and an XXH3-128 hash of every byte (:data:`DIGEST`), 1 MiB blocks read into one
reused buffer per thread (:func:`file_digest`; the checkpointer hashes each file in a background
thread as soon as it is complete); a resume hashes the checkpoint again on rank 0. On the
recipe's 33.6 MiB checkpoint a verified save takes 1.135x the wall time of a plain one and
1.275x its CPU time (``benchmarks/results/studies/checkpoint_save.md``, made by
``benchmarks/studies/checkpoint_save.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..integrations.peft import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME

__all__ = [
    "DIGEST", "MANIFEST_NAME", "PLAN_META_NAME", "SCHEDULER_NAME", "STAGING_PREFIX", "CheckpointError",
    "file_digest", "latest_verified_checkpoint", "optimizer_name", "rng_state_name", "sharded_optimizer_name",
    "stage_rng_name", "verify_checkpoint", "write_manifest",
]

SCHEDULER_NAME = "scheduler.pt"
PLAN_META_NAME = "concertina.json"
MANIFEST_NAME = "manifest.json"
#: a checkpoint being written: ``tmp-checkpoint-N``, renamed to ``checkpoint-N`` once sealed
STAGING_PREFIX = "tmp-"
MANIFEST_FORMAT = 1
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_STAGING_RE = re.compile(rf"^{STAGING_PREFIX}{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_HASH_BLOCK = 1 << 20
#: the manifest's per-file digest: XXH3-128 (``xxhash``, a dependency of ``datasets`` and of this
#: package) hashes ~10x faster than SHA-256 and detects the same damage (flipped bytes, rewritten
#: files); a cryptographic hash would add nothing here, since whoever can rewrite a file can
#: rewrite the manifest beside it. Manifests written with SHA-256 still verify.
DIGEST = "xxh3_128"


class CheckpointError(ValueError):
    """A checkpoint that is incomplete or damaged; the message names the file."""


def optimizer_name(stage: int, num_stages: int) -> str:
    """File name of one stage's optimizer state."""
    return f"optimizer.stage{stage}-of-{num_stages}.pt"


def sharded_optimizer_name(stage: int, num_stages: int) -> str:
    """Directory of one stage's sharded optimizer state (``torch.distributed.checkpoint``)."""
    return f"optimizer.stage{stage}-of-{num_stages}.dcp"


def rng_state_name(world_size: int, process_index: int) -> str:
    """The Trainer's file name of one process's RNG state."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{process_index}.pth"


def stage_rng_name(world_size: int, process_index: int) -> str:
    """The file name of one process's own random stream (its stage's dropout)."""
    return "concertina_rng.pt" if world_size <= 1 else f"concertina_rng_{process_index}.pt"


# ---------------------------------------------------------------------------------- manifest
def _required_files(directory: str, meta: dict[str, Any]) -> list[str]:
    """The files a checkpoint of this layout must hold (the model's weights included)."""
    names = [TRAINER_STATE_NAME, PLAN_META_NAME]
    index = os.path.join(directory, "model.safetensors.index.json")
    if meta.get("adapter"):  # a PEFT run: the adapter directory, as Trainer + PEFT writes it
        names += [ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME]
    elif os.path.isfile(index):
        names.append("config.json")
        with open(index) as fh:
            names += ["model.safetensors.index.json"] + sorted(set(json.load(fh)["weight_map"].values()))
    else:
        names += ["config.json", "model.safetensors"]
    if not meta["save_only_model"]:
        p, w = meta["pipeline_size"], meta["world_size"]
        shards = int(meta.get("optimizer_shards", 0))  # 0: one plain file per stage
        names.append(SCHEDULER_NAME)
        for s in range(p):
            if shards:
                d = sharded_optimizer_name(s, p)
                names += [f"{d}/.metadata"] + [f"{d}/__{i}_0.distcp" for i in range(shards)]
            else:
                names.append(optimizer_name(s, p))
        names += [rng_state_name(w, i) for i in range(w)] + [stage_rng_name(w, i) for i in range(w)]
    return names


_BUFFERS = threading.local()


def file_digest(path: str, algorithm: str = DIGEST) -> str:
    """``algorithm`` (:data:`DIGEST` by default) of the file, read in blocks into one reused buffer
    per thread: each block is hashed while it sits in the core's cache and no fresh pages are
    faulted in per block (a new 8 MiB ``bytes`` per read made SHA-256 1.5x slower)."""
    view = getattr(_BUFFERS, "view", None)
    if view is None:
        view = _BUFFERS.view = memoryview(bytearray(_HASH_BLOCK))
    h = _new_hash(algorithm)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            h.update(view[:n])  # releases the GIL: files hash in parallel threads
    return h.hexdigest()


def _new_hash(algorithm: str):
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    return hashlib.new(algorithm)


def _digests(directory: str, names: list[str], algorithms: dict[str, str] | None = None) -> dict[str, str]:
    """``{name: digest}``; ``algorithms``: a file's algorithm when not :data:`DIGEST`."""
    workers = max(1, min(len(names), os.cpu_count() or 1, 8))
    algorithms = algorithms or {}
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(
            lambda n: file_digest(os.path.join(directory, n), algorithms.get(n, DIGEST)), names)))


def write_manifest(directory: str, *, global_step: int, layout: dict[str, Any],
                   digests: dict[str, str] | None = None) -> dict[str, Any]:
    """Seal a complete checkpoint folder: ``manifest.json`` with every other file's size and
    digest (:data:`DIGEST`), ``global_step`` and ``layout`` (``world_size``, ``pipeline_size``,
    ``data_parallel_size``, ``sequence_parallel_size``, ``layer_ranges``, ``save_only_model``,
    ``shard_optimizer``, ``optimizer_shards``: the files of each stage's sharded optimizer state, 0
    for one plain file).
    Written last, through a temporary file; refuses a folder that lacks a file the layout needs. ``digests``: digests
    already taken (by the ranks that wrote the files), the others are computed here."""
    meta = {"format": MANIFEST_FORMAT, "global_step": int(global_step), **layout}
    missing = [n for n in _required_files(directory, meta) if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        raise CheckpointError(f"{directory} lacks {missing} after every rank saved: not sealing it")
    names = sorted(os.path.relpath(os.path.join(root, f), directory)
                   for root, _, files in os.walk(directory) for f in files if f != MANIFEST_NAME)
    known = dict(digests or {})
    digests = {**_digests(directory, [n for n in names if n not in known]), **known}
    meta["files"] = {n: {"size": os.path.getsize(os.path.join(directory, n)), DIGEST: digests[n]} for n in names}
    tmp = os.path.join(directory, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(meta, fh, indent=1)
    os.replace(tmp, os.path.join(directory, MANIFEST_NAME))
    return meta


def verify_checkpoint(directory: str) -> dict[str, Any]:
    """The checkpoint's manifest, once every file it lists has its size and digest and the
    trainer state its global step; :class:`CheckpointError` naming the first file that does not."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is not a directory")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} is missing: the save did not finish (the manifest is written last, once every rank's files "
            "are complete), or the checkpoint predates verified checkpoints")
    try:
        with open(path) as fh:
            manifest = json.load(fh)
        files, step = manifest["files"], int(manifest["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e!r}): the checkpoint cannot be verified") from e
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')}, this version reads {MANIFEST_FORMAT}")
    unlisted = [n for n in _required_files(directory, manifest) if n not in files]
    if unlisted:
        raise CheckpointError(f"{path} does not list {unlisted}: the checkpoint is incomplete")
    for name in sorted(files):
        file, size = os.path.join(directory, name), files[name]["size"]
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing (the manifest lists it, {size} bytes)")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"{file} has {os.path.getsize(file)} bytes, the manifest {size}: truncated or "
                                  "rewritten after the save")
    # manifests of earlier versions recorded SHA-256
    algorithms = {n: DIGEST if DIGEST in rec else "sha256" for n, rec in files.items()}
    digests = _digests(directory, sorted(files), algorithms)
    for name in sorted(files):
        if digests[name] != files[name].get(algorithms[name]):
            raise CheckpointError(f"{os.path.join(directory, name)} does not match its {algorithms[name]} digest in "
                                  f"{MANIFEST_NAME}: the file was damaged or edited after the save")
    with open(os.path.join(directory, TRAINER_STATE_NAME)) as fh:
        state_step = json.load(fh).get("global_step")
    if state_step != step:
        raise CheckpointError(f"{os.path.join(directory, TRAINER_STATE_NAME)} says global_step {state_step}, "
                              f"{MANIFEST_NAME} {step}")
    return manifest


def latest_verified_checkpoint(run_dir: str) -> tuple[str | None, list[str]]:
    """The newest ``checkpoint-N`` of ``run_dir`` that verifies (``None`` if none does), and one
    line per newer folder skipped (unfinished ``tmp-checkpoint-N`` saves included), saying why."""
    found: list[tuple[int, str, bool]] = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        for pattern, staged in ((_CHECKPOINT_RE, False), (_STAGING_RE, True)):
            m = pattern.match(name)
            if m and os.path.isdir(os.path.join(run_dir, name)):
                found.append((int(m.group(1)), name, staged))
    skipped: list[str] = []
    for _, name, staged in sorted(found, reverse=True):
        path = os.path.join(run_dir, name)
        if staged:
            skipped.append(f"{path}: an unfinished save (never sealed with a {MANIFEST_NAME})")
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            skipped.append(str(e))  # names the folder and the file
            continue
        return path, skipped
    return None, skipped
