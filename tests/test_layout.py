"""Rules of the package layout that a change could silently break: the import table of
``docs/architecture.md`` (quoted from :data:`MAY_IMPORT` below), no import cycle, no private name
imported across modules, process groups made in one module only."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "concertina_hf"

#: layer -> the layers its modules may import (every import counts, lazy ones inside functions
#: too). A layer is a sub-package, or one module of one where the two differ
#: (``integrations.peft`` is used by training, ``integrations.trl`` builds on training).
MAY_IMPORT = {
    "planning": {"planning"},
    "runtime": {"runtime", "planning"},
    "integrations": set(),  # the package's docstring
    "integrations.peft": set(),
    "training": {"training", "runtime", "planning", "integrations.peft"},
    "integrations.trl": {"training", "integrations.peft"},
    "tools": {"tools", "planning"},
}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text(), filename=str(path))


def _imports(name: str, path: pathlib.Path, tree: ast.AST):
    """(line, imported module) for every import of the package in a module, lazy ones included;
    ``from pkg import mod`` counts as an import of ``pkg.mod`` when that is a module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("concertina_hf"):
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("concertina_hf"):
                target = node.module
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                as_path = SRC.parent.joinpath(*sub.split("."))
                yield node.lineno, sub if (as_path.with_suffix(".py").exists() or as_path.is_dir()) else target


def _layer(module: str) -> str | None:
    parts = module.split(".")[1:]
    if not parts:
        return None  # the package's __init__: the public names, imported lazily by name
    two = ".".join(parts[:2])
    return two if two in MAY_IMPORT else parts[0]


def test_every_import_follows_the_layer_table():
    bad = []
    for name, path, tree in _modules():
        layer = _layer(name)
        if layer is None:
            continue
        allowed = MAY_IMPORT.get(layer)
        assert allowed is not None, f"{name}: in no layer of MAY_IMPORT (add the sub-package to the table and the docs)"
        for line, target in _imports(name, path, tree):
            to = _layer(target)
            if to is not None and to != layer and to not in allowed:
                bad.append(f"{name}:{line} imports {target} ({layer} -> {to})")
    assert not bad, "imports against docs/architecture.md's table:\n" + "\n".join(sorted(set(bad)))


def test_no_import_cycle_between_modules():
    graph = {name: {t for _, t in _imports(name, path, tree) if t != name} for name, path, tree in _modules()}
    # a package's __init__ re-exporting its modules is not an edge back into them
    for name in graph:
        graph[name] = {t for t in graph[name] if not (t in graph and name.startswith(t + "."))}
    cycles, state = [], {}

    def visit(n, stack):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if m not in graph:
                continue
            if state.get(m) == 1:
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


def test_the_top_level_holds_only_packages():
    loose = sorted(p.name for p in SRC.glob("*.py") if p.name != "__init__.py")
    assert not loose, loose


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for name, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("concertina_hf")):
                bad += [f"{name}: from {'.' * node.level}{node.module or ''} import {a.name}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_only_runtime_distributed_creates_process_groups():
    makers = {"new_group", "init_device_mesh", "new_subgroups", "split_group", "init_process_group"}
    found = []
    for name, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if called in makers:
                    found.append(f"{name}:{node.lineno} {called}")
    assert found and all(f.startswith("concertina_hf.runtime.distributed:") for f in found), found
