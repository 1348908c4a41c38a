"""Runs ``recipes/train_long_context.py`` under ``accelerate launch`` for
tests/launch/test_accelerate_launch.py, and proves the launched ranks form ONE process group: just
before the trainer tears the group down, every rank all-reduces a one; the main process writes the
sum to ``<output_dir>/group_check.json``.
With ``CONCERTINA_RANK_INFO_DIR`` set, every rank also writes ``rank<r>.json`` there: its rank, the
world size (the launcher's ``WORLD_SIZE``, the process group's, the arguments'), whether the
arguments turned CPU on and their parallel mode, the all-reduced sum of every rank's ``rank + 1``,
its node (torchrun's ``GROUP_RANK``), its place in the topology and the losses it logged.

    accelerate launch --config_file ... tests/_recipe_launch.py <recipe arguments>
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

from concertina_hf import ConcertinaTrainer

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "train_long_context.py"


def _end_with_group_check(self) -> None:
    ones = torch.ones(1)
    if dist.is_initialized():
        dist.all_reduce(ones)
    if self.args.should_save:
        with open(os.path.join(self.args.output_dir, "group_check.json"), "w") as fh:
            json.dump({"all_reduce_ones": float(ones.item())}, fh)
    info_dir = os.environ.get("CONCERTINA_RANK_INFO_DIR")
    if info_dir:
        topo = self.topology
        rank = dist.get_rank() if dist.is_initialized() else 0
        ranks = torch.tensor([float(rank + 1)])
        if dist.is_initialized():
            dist.all_reduce(ranks)
        with open(os.path.join(info_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"rank": rank, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                       "env_world": int(os.environ.get("WORLD_SIZE", "1")), "args_world": self.args.world_size,
                       "use_cpu": self.args.use_cpu, "parallel_mode": str(self.args.parallel_mode),
                       "rank_sum": float(ranks.item()),
                       "node": int(os.environ.get("GROUP_RANK", -1)), "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
                       "all_reduce_ones": float(ones.item()), "stage": topo.stage, "sp_rank": topo.sp_rank,
                       "replica": topo.replica, "pipeline_size": topo.pipeline_size,
                       "sequence_parallel_size": topo.sequence_parallel_size,
                       "layers": list(self.layout.layer_ranges[topo.stage]),
                       "losses": [h["loss"] for h in self.state.log_history if "loss" in h]}, fh)
    _end(self)


_end = ConcertinaTrainer.end
ConcertinaTrainer.end = _end_with_group_check

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("train_long_context", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.main(sys.argv[1:])
