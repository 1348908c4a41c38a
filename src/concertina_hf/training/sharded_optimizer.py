"""ZeRO-1 for a stage (``concertina_shard_optimizer``) and the checkpoint I/O of its sharded state.

:func:`shard_optimizer` turns the stage's optimizer into torch's ``ZeroRedundancyOptimizer`` over
the stage's ``dp x sp`` ranks (:attr:`~concertina_hf.runtime.distributed.Topology.grad_group`):
each rank keeps the state of its share of the parameters, steps it with the whole (all-reduced,
clipped) gradients and broadcasts the new values after its step. :func:`save_optimizer_shards`
writes each rank's share with ``torch.distributed.checkpoint`` (nothing gathered to one rank);
:func:`load_optimizer_shards` reads it back at any ``dp x sp``, or into a plain optimizer.
:class:`~concertina_hf.training.checkpoint.StageCheckpointer` calls both.

Cost: the optimizer state per rank divided by ``dp x sp``; one broadcast of the stage's
parameters per step; on save, each rank writes only its share.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.distributed import Topology

__all__ = ["is_sharded", "load_optimizer_shards", "optimizer_share", "save_optimizer_shards", "shard_optimizer"]


def shard_optimizer(optimizer: torch.optim.Optimizer, topology: Topology) -> torch.optim.Optimizer:
    """``optimizer`` (built by ``Trainer.create_optimizer`` over this stage's parameters, no state
    yet) as a :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` over the stage's ``dp x
    sp`` ranks (:attr:`Topology.grad_group`), same class, parameter groups and hyperparameters:
    each rank keeps the state of its share of the parameters (ZeRO-1), steps it with the whole
    (all-reduced, clipped) gradients and broadcasts the new values to the other ranks. With one
    rank per stage there is nothing to shard: ``optimizer`` itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if topology.data_parallel_size * topology.sequence_parallel_size == 1 or isinstance(
            optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or optimizer.state:
        raise ValueError(f"concertina_shard_optimizer=True cannot shard {type(optimizer).__name__}: it needs a "
                         "torch.optim optimizer class built from parameter groups, before its first step")
    groups = [dict(g, params=list(g["params"])) for g in optimizer.param_groups]
    # the constructor's own keywords (torch's AdamW records ``decoupled_weight_decay`` in its
    # defaults but does not take it); each group carries every value anyway
    accepted = inspect.signature(type(optimizer).__init__).parameters
    keep = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if keep or k in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=topology.grad_group,
                                   **defaults)


def is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` holds only this rank's share of its stage's state (:func:`shard_optimizer`)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def optimizer_share(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: a sharded one's local optimizer, else ``optimizer``."""
    return optimizer.optim if is_sharded(optimizer) else optimizer


def save_optimizer_shards(optimizer: Any, model: nn.Module, directory: str, topology: Topology) -> list[str]:
    """Write the stage's sharded optimizer state with ``torch.distributed.checkpoint`` (collective
    over the stage's ``dp x sp`` ranks, :attr:`Topology.grad_group`): each rank writes only its
    share, keyed by parameter name (``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``:
    ``state.<name>.exp_avg``, ``param_groups.<name>.lr``, ...), so any number of shards of the
    same stage (or a plain optimizer) reads it back (:func:`load_optimizer_shards`). Nothing is
    gathered to one rank. Returns the files (relative to ``directory``) this rank wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    share = optimizer_share(optimizer)
    if share is not optimizer:  # the hyperparameters the scheduler set since the last step
        _copy_hyperparameters(optimizer.param_groups, share.param_groups)
    state = get_optimizer_state_dict(model, share, options=StateDictOptions(flatten_optimizer_state_dict=True))
    with topology.waiting(f"the optimizer shards of the stage's ranks {list(topology.grad_ranks)}"):
        dcp.save(state, checkpoint_id=directory, process_group=topology.grad_group)
    me = dist.get_rank(topology.grad_group) if topology.grad_group is not None else 0
    return sorted(n for n in os.listdir(directory) if n.startswith(f"__{me}_") or (me == 0 and n == ".metadata"))


def load_optimizer_shards(optimizer: Any, model: nn.Module, directory: str) -> None:
    """This rank's share of a stage's optimizer state written by :func:`save_optimizer_shards`,
    at whatever ``dp x sp`` it was written: each rank reads the keys of the parameters it holds
    (all of them for a plain optimizer) and nothing else, without collectives."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    share = optimizer_share(optimizer)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = get_optimizer_state_dict(model, share, options=options)  # the keys (and shapes) this rank holds
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    set_optimizer_state_dict(model, share, state, options=options)
    if share is not optimizer:  # the saved hyperparameters (the learning rate of the next step)
        _copy_hyperparameters(share.param_groups, optimizer.param_groups)


def _copy_hyperparameters(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    for a, b in zip(src, dst):
        b.update({k: v for k, v in a.items() if k != "params"})
