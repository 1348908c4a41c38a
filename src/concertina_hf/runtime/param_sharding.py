"""ZeRO-3 for a stage (``concertina_shard_parameters``): parameters and gradients sharded over the
stage's ``dp x sp`` ranks with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

:func:`shard_stage` makes each decoder layer of the stage one FSDP2 unit, and the stage's
embedding, final norm and LM head (those it holds) one unit each, over a 1-D
:class:`~torch.distributed.device_mesh.DeviceMesh` on the stage's gradient group
(:meth:`Topology.shard_mesh <concertina_hf.runtime.distributed.Topology.shard_mesh>`). Every
parameter becomes a ``DTensor`` holding this rank's rows (dim 0, ``torch.chunk``'s split). A
unit's parameters are all-gathered before its forward and freed after it
(``reshard_after_forward=True``), all-gathered again for its backward (and for the replay of a
recomputed layer, which FSDP2 runs inside that backward), and its gradients are
reduce-scattered after each backward, each rank adding its rows into its sharded ``.grad``. The
executor calls the units directly (no root module's forward), so each unit is its own FSDP2 root
(which is also why the embedding and the head are not one unit: FSDP2 refuses a root of several
modules; tied embeddings on one stage are refused);
every chunk's forward and backward gathers and reduce-scatters anew (no unsharded gradient is
kept between chunks). The reduction matches
:func:`~concertina_hf.runtime.distributed.reduce_gradients`: summed over the ``sp`` ranks and
summed (``average=False``) or averaged over the replicas (FSDP2's divide factor). The optimizer
steps on the shards: weights, gradients and optimizer state per rank are the stage's divided by
``dp x sp``.

Cost per chunk and unit: one all-gather of its parameters in forward, one more in backward and
one reduce-scatter of its gradients, each moving ``(n - 1) / n`` of the unit's bytes per rank;
memory: the shards plus the largest gathered unit (two while one is prefetched).

:func:`full_state` gathers the whole stage (collective over its ``dp x sp`` ranks, each calls it
in the same order) for saving; :func:`load_full` copies full tensors into the shards (no
collective); :func:`local_tensor` is the rank's own part of a tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .distributed import Topology

__all__ = ["TIED_EMBEDDINGS_REFUSAL", "full_state", "is_sharded_module", "load_full", "local_tensor", "shard_stage"]


#: why tied embeddings on one stage cannot be sharded (:func:`shard_stage`; auto layout's table)
TIED_EMBEDDINGS_REFUSAL = ("concertina_shard_parameters=True cannot shard tied input/output embeddings on one stage "
                           "yet (the embedding and the LM head share one weight, and FSDP2 cannot run a unit of "
                           "two modules called apart): set model.config.tie_word_embeddings=False (untie them) or "
                           "concertina_shard_parameters=False")


def shard_stage(wrapper: Any, topology: Topology) -> bool:
    """Shard ``wrapper``'s (a :class:`~concertina_hf.runtime.stage.PipelineWrapper`) parameters
    over the stage's ``sp`` ranks (collective: every rank of the job calls it, before the
    optimizer is built). Returns False (nothing done) at ``sp = 1``."""
    from torch.distributed.fsdp import fully_shard

    mesh = topology.shard_mesh()
    if mesh is None:
        return False
    if wrapper.tied_embeddings and wrapper.is_first and wrapper.is_last:
        raise ValueError(TIED_EMBEDDINGS_REFUSAL)
    hf = wrapper.model
    # the executor calls the embedding, each layer, the norm and the head itself: each is its own
    # FSDP2 root (a unit of several modules cannot be a root)
    units = list(wrapper.decoder_layers) + [
        m for m in (getattr(hf.model, wrapper.family.embedding, None), getattr(hf.model, wrapper.family.final_norm, None),
                  getattr(hf, "lm_head", None))
        if m is not None and any(True for _ in m.parameters(recurse=True))]
    fsdp = [fully_shard(unit, mesh=mesh, reshard_after_forward=True) for unit in units]
    # FSDP2 averages over the mesh by default; the runtime sums over sp (each rank holds its
    # tokens' share); the replicas' all-reduce comes once per step (reduce_gradients(shards=True))
    for unit in fsdp:
        unit.set_gradient_divide_factor(1.0)
        if topology.comm_device.type == "cpu":  # gloo has no PREMUL_SUM: a SUM, then the division
            unit.set_force_sum_reduction_for_comms(True)
    loose = [n for n, p in hf.named_parameters() if not isinstance(p, _dtensor_type())]
    if loose:
        raise RuntimeError(f"concertina_shard_parameters: parameters outside every sharded unit: {loose[:3]}")
    wrapper.sharded = True
    return True


def is_sharded_module(module: nn.Module) -> bool:
    """Whether ``module`` holds sharded parameters (:func:`shard_stage`)."""
    return any(isinstance(p, _dtensor_type()) for p in module.parameters())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a ``DTensor``'s local shard, else ``t`` itself."""
    return t.to_local() if isinstance(t, _dtensor_type()) else t


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every sharded tensor gathered whole (collective over the
    stage's ``dp x sp`` ranks when the module is sharded: each of them calls it)."""
    dtensor = _dtensor_type()
    return {k: (v.full_tensor() if isinstance(v, dtensor) else v) for k, v in module.state_dict().items()}


def load_full(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy each full tensor of ``tensors`` whose parameter is sharded into this rank's rows of
    it (no collective); returns the entries left for ``load_state_dict`` (unsharded ones)."""
    dtensor = _dtensor_type()
    params = dict(module.named_parameters())
    rest = {}
    with torch.no_grad():
        for k, full in tensors.items():
            p = params.get(k)
            if not isinstance(p, dtensor):
                rest[k] = full
                continue
            local = p.to_local()
            rank, n = p.device_mesh.get_local_rank(), p.device_mesh.size()
            chunks = torch.chunk(full, n, dim=0)
            part = chunks[rank] if rank < len(chunks) else full[:0]
            if tuple(part.shape) != tuple(local.shape):
                raise ValueError(f"{k}: a full tensor of shape {tuple(full.shape)} does not give this rank's shard "
                                 f"{tuple(local.shape)}")
            local.copy_(part)
    return rest


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor
