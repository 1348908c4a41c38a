"""Rules of the package layout (docs/architecture.md) that a change could silently break."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "concertina_hf"


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(), filename=str(path))


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("concertina_hf")):
                bad += [f"{name}: from {'.' * node.level}{node.module or ''} import {a.name}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_only_distributed_py_creates_process_groups():
    makers = {"new_group", "init_device_mesh", "new_subgroups", "split_group", "init_process_group"}
    found = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if called in makers:
                    found.append(f"{name}:{node.lineno} {called}")
    assert found and all(f.startswith("runtime/distributed.py:") for f in found), found
