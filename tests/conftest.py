"""Test tiers, cheapest first: the pure planner (no torch.distributed, milliseconds), then the
single-process runtime and trainer, then the ``slow`` multi-process launches (gloo on CPU,
``accelerate launch``). A failure in a cheap tier shows before the launches start.

The environment every test expects is set here too: no Hub access, no wandb, one tokenizer thread.
"""

from __future__ import annotations

import os

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("WANDB_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

import pathlib

import pytest

import _helpers  # noqa: F401  (shared helpers; puts tests/ and the tier folders on sys.path)

#: a test's tier is its folder's (a test file at the top of tests/ is tier 0); tier 2 is ``slow``
TIERS = {"planning": 0, "runtime": 1, "training": 1, "launch": 2, "benchmarks": 2}


def tier(item) -> int:
    """0: pure planner; 1: one process; 2: multi-process launches and benchmark runs (``slow``)."""
    folder = pathlib.Path(str(item.fspath)).parent.name
    return TIERS.get(folder, 0)


def pytest_collection_modifyitems(config, items):
    # slow is the folder's: a multi-process test goes to launch/ (or benchmarks/), not under a mark
    marked = [item.nodeid for item in items if tier(item) < 2 and item.get_closest_marker("slow") is not None]
    if marked:
        raise pytest.UsageError(f"tests marked slow outside tests/launch and tests/benchmarks: {marked}")
    for item in items:
        if tier(item) == 2:
            item.add_marker(pytest.mark.slow)
    items.sort(key=tier)  # stable: the order inside a tier is the collection order
