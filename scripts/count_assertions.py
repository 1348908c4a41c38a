"""Count the checks the test suite makes, per file and in total (an AST walk, nothing is run).

A check is one of:

- ``assert``: an ``assert`` statement;
- ``raises``: a call of ``pytest.raises`` / ``pytest.warns`` / ``pytest.fail`` (as a context or not);
- ``assert_call``: a call of a function named ``assert_*`` (``torch.testing.assert_close``,
  ``np.testing.assert_allclose``, ...) or of anything under ``np.testing`` / ``numpy.testing``;
- ``recorded``: a failure recorded by a worker for the test to assert on: ``.append`` / ``.extend``
  on a list named ``fail``, ``failures``, ``problems`` or ``bad``, or on ``report["failures"]``, and
  any ``.append`` / ``.extend`` inside a function whose name ends with ``problems`` (a helper
  returning the problems it found).

The files: every ``*.py`` under ``tests/`` (the test modules, their fixtures and the workers
``tests/_*.py``) and the benchmark scripts under ``benchmarks/`` that a test runs or imports, with the
benchmarks' private modules (``benchmarks/_*.py``).

    python scripts/count_assertions.py             # the working tree
    python scripts/count_assertions.py --rev HEAD  # a commit's tree (git show)
    python scripts/count_assertions.py --json      # {path: {kind: count}} on stdout

The total must not drop when tests are moved or merged; a file's checks may only move to another.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("assert", "raises", "assert_call", "recorded")
RECORDERS = {"fail", "failures", "problems", "bad"}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of a Name / Attribute chain ('' for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _records_a_failure(call: ast.Call, in_problems_helper: bool) -> bool:
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in ("append", "extend")):
        return False
    target = func.value
    if in_problems_helper:
        return True
    if isinstance(target, ast.Name):
        return target.id in RECORDERS
    if isinstance(target, ast.Subscript):
        key = target.slice
        return isinstance(key, ast.Constant) and key.value == "failures"
    return False


class _Counter(ast.NodeVisitor):
    def __init__(self) -> None:
        self.counts = dict.fromkeys(KINDS, 0)
        self._helpers: list[bool] = []

    def visit_FunctionDef(self, node):  # noqa: N802 (ast's names)
        self._helpers.append(node.name.endswith("problems"))
        self.generic_visit(node)
        self._helpers.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assert(self, node):  # noqa: N802
        self.counts["assert"] += 1
        self.generic_visit(node)

    def visit_Call(self, node):  # noqa: N802
        name = _dotted(node.func)
        last = name.rsplit(".", 1)[-1]
        if name in ("pytest.raises", "pytest.warns", "pytest.fail", "raises", "warns"):
            self.counts["raises"] += 1
        elif last.startswith("assert_") or re.match(r"(np|numpy)\.testing\.", name):
            self.counts["assert_call"] += 1
        elif _records_a_failure(node, bool(self._helpers) and self._helpers[-1]):
            self.counts["recorded"] += 1
        self.generic_visit(node)


def count_source(text: str) -> dict[str, int]:
    counter = _Counter()
    counter.visit(ast.parse(text))
    return counter.counts


def _files(rev: str | None) -> dict[str, str]:
    """path -> source of every counted file (of the working tree, or of ``rev``'s tree)."""
    if rev:
        names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "tests", "benchmarks"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()

        def read(path: str) -> str:
            return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout
    else:
        names = [str(p.relative_to(ROOT)) for d in ("tests", "benchmarks") for p in (ROOT / d).rglob("*.py")]

        def read(path: str) -> str:
            return (ROOT / path).read_text()

    names = sorted(n for n in names if n.endswith(".py") and "__pycache__" not in n)
    tests = {n: read(n) for n in names if n.startswith("tests/")}
    text = "\n".join(tests.values())
    bench = {}
    for n in names:
        p = pathlib.PurePosixPath(n)
        if not n.startswith("benchmarks/") or len(p.parts) != 2:
            continue  # the one-off studies under benchmarks/studies/ check themselves
        stem = p.stem
        used = (stem.startswith("_") or f"benchmarks/{stem}.py" in text
                or re.search(rf"^\s*(import {stem}\b|from {stem} import)", text, re.M))
        if used:
            bench[n] = read(n)
    return {**tests, **bench}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="count the files of this commit's tree (default: the working tree)")
    parser.add_argument("--json", action="store_true", help="print {path: {kind: count}} as JSON")
    args = parser.parse_args(argv)
    per_file = {path: count_source(text) for path, text in _files(args.rev).items()}
    if args.json:
        json.dump(per_file, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    total = dict.fromkeys(KINDS, 0)
    print(f"{'file':<52}" + "".join(f"{k:>12}" for k in KINDS) + f"{'all':>8}")
    for path, c in per_file.items():
        for k in KINDS:
            total[k] += c[k]
        if sum(c.values()):
            print(f"{path:<52}" + "".join(f"{c[k]:>12}" for k in KINDS) + f"{sum(c.values()):>8}")
    print(f"{'total (' + str(len(per_file)) + ' files)':<52}" + "".join(f"{total[k]:>12}" for k in KINDS)
          + f"{sum(total.values()):>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
