"""Test tiers, cheapest first: the pure planner (no torch.distributed, milliseconds), then the
single-process runtime and trainer, then the ``slow`` multi-process launches (gloo on CPU,
``accelerate launch``). A failure in a cheap tier shows before the launches start.

The environment every test expects is set here too: no Hub access, no wandb, one tokenizer thread.
"""

from __future__ import annotations

import os

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("WANDB_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

# modules that test the pure planner (and its command line) only
PLANNER_MODULES = frozenset({"test_types", "test_planner", "test_recompute", "test_simulate", "test_fit", "test_cli"})


def tier(item) -> int:
    """0: pure planner; 1: one process; 2: multi-process launches (marked ``slow``)."""
    if item.get_closest_marker("slow") is not None:
        return 2
    return 0 if item.module.__name__ in PLANNER_MODULES else 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=tier)  # stable: the order inside a tier is the collection order
