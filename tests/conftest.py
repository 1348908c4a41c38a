"""Test tiers, cheapest first: the pure planner (no torch.distributed, milliseconds), then the
single-process runtime and trainer, then the ``slow`` multi-process launches (gloo on CPU,
``accelerate launch``). A failure in a cheap tier shows before the launch tests run.

The jobs the selected launch tests declare (their modules' ``LAUNCHES`` tables,
:class:`_helpers.Launch`) start at the start of the session, one after another in the background:
the cheap tiers run one process and leave the second core of a 2-core machine to them. The test
reads its job through the ``launched`` fixture, waiting for it if it still runs.

The environment every test expects is set here too: no Hub access, no wandb, one tokenizer thread.
"""

from __future__ import annotations

import os

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("WANDB_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

import pathlib

import pytest

import _helpers  # shared helpers; puts tests/ and the tier folders on sys.path

LAUNCHES = pytest.StashKey["_helpers.Launches"]()

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
    # stable: the order inside a tier is the collection order, except that in the slow tier the
    # tests reading background jobs (the ``launched`` fixture) come first: those launching in the
    # test itself, some timing what they launch (a fault's exits, a fitted link), run after them,
    # once the background is idle
    items.sort(key=lambda item: (tier(item), tier(item) == 2 and "launched" not in getattr(item, "fixturenames", ())))


def pytest_collection_finish(session):
    """Start the jobs of the selected launch tests in the background (module docstring)."""
    if session.config.option.collectonly:
        return
    modules = []
    for item in session.items:
        module = getattr(item, "module", None)
        if tier(item) == 2 and hasattr(module, "LAUNCHES") and module not in modules:
            modules.append(module)
    if not modules:
        return
    launches = _helpers.Launches(session.config._tmp_path_factory.mktemp("launches"))
    session.config.stash[LAUNCHES] = launches
    launches.prefetch([key for m in modules for key in launches.declare(m.__name__, m.LAUNCHES)])


def pytest_sessionfinish(session):
    launches = session.config.stash.get(LAUNCHES, None)
    if launches is not None:
        launches.close()


@pytest.fixture(scope="module")
def launched(request):
    """``launched(name)``: the finished job ``name`` of the test module's ``LAUNCHES``
    (:class:`_helpers.Launched`: its folder, exit codes and stderr); a job that must succeed and
    did not fails the test with the ranks' stderr."""
    launches = request.config.stash.get(LAUNCHES, None)
    module = request.module
    if launches is None:  # the module was not among the selected ones at collection (or collect-only)
        launches = _helpers.Launches(request.getfixturevalue("tmp_path_factory").mktemp("launches"))
        request.config.stash[LAUNCHES] = launches
    launches.declare(module.__name__, module.LAUNCHES)
    return lambda name: launches.get(f"{module.__name__}::{name}")
