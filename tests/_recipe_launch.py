"""Runs ``recipes/train_long_context.py`` under ``accelerate launch`` for tests/test_recipe.py, and
proves the launched ranks form ONE process group: just before the trainer tears the group down,
every rank all-reduces a one; the main process writes the sum to ``<output_dir>/group_check.json``.

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
    _end(self)


_end = ConcertinaTrainer.end
ConcertinaTrainer.end = _end_with_group_check

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("train_long_context", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.main(sys.argv[1:])
