"""References are code: the text around the code cites only what exists, says what is, and quotes a
measurement only from the file that holds it.

The text is every comment and string of the ``.py`` files under ``src/concertina_hf``, ``tests``,
``benchmarks`` (not its generated ``benchmarks/results/``), ``scripts`` and ``recipes``, and the
Markdown of ``docs/``, ``README.md`` and ``benchmarks/README.md``. The rules, one test each:

- **section**: a cited section (a document then a quoted title, ``docs/architecture.md
  "Glossary"``; the title after the word *section* or before it; *see* then a capitalised quoted
  title; a link's ``#anchor``) is a heading of that document, or of some document when none is
  named. The design notes kept outside the repository are never cited.
- **path**: a cited file or folder exists: ``benchmarks/``, ``tests/``, ``docs/``, ``src/``,
  ``scripts/``, ``recipes/``, ``configs/`` paths from the root; elsewhere in prose
  ``runtime/ulysses.py``, ``assets/`` or ``fit.py`` wherever a path of the repository ends so
  (the citing file's folder first). Braces are expanded, a format field is a glob, a Markdown link
  is relative to its file; what a command writes (``--out``, "writes", "written to", "default")
  and a string with no space (a value the code uses) are not citations.
- **name**: a cited module or name exists: ``concertina_hf.planning.fit``; the Sphinx roles
  (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ...), relative ones resolved as Python's relative
  imports, unqualified ones among the citing module's names, its classes' members, the package's
  top-level names; code spans starting with a sub-package (``planning.plan_step``), a class of the
  package (``Plan.knobs``) or, in Markdown, a module (``lower.rank_program``). Read from the AST: a
  class's attributes are its body and its ``self.x =``; what a class inherits from outside the
  package is not checked. In tests and benchmarks (not parsed) a role may name their own or a
  sibling file's top-level names.
- **history**: no issue number and none of the words of :data:`_HISTORY` (a past tense of the
  code, a "was" in parentheses): the history of a change is the CHANGELOG's.
- **figure**: in ``src/`` and the docs, a ratio quoted to two decimals or more (``1.44-1.92x``,
  ``x1.23``: a measurement, where a design figure reads ``1.5x``) sits in a comment, string or
  paragraph naming the result file that holds it (``benchmarks/results/...``, the benchmark script
  writing it, or ``benchmarks/README.md``), and each number is there (or rounds to it).
- **size**: ``docs/architecture.md`` stays under 12,000 characters (UTF-8 bytes, as ``wc -c``).

Each finding names ``file:line`` and what is wrong. Standard library only: text, regular
expressions, and the AST of the modules a citation reaches (about a second on one core).
"""

from __future__ import annotations

import ast
import functools
import glob
import itertools
import os
import re
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "concertina_hf"
SRC = ROOT / "src" / PACKAGE
PY_DIRS = ("src/concertina_hf", "tests", "benchmarks", "scripts", "recipes")
MARKDOWN = ("README.md", "benchmarks/README.md")
#: top-level folders a path cited from the repository root starts with
ROOTS = ("benchmarks", "tests", "docs", "src", "scripts", "recipes", "configs")
SUBPACKAGES = ("planning", "runtime", "training", "integrations", "tools")
ARCHITECTURE_LIMIT = 12_000
#: figures are checked where the package and its docs quote them (benchmarks compute them)
FIGURE_SCOPE = ("src/", "docs/", "README.md")

# ------------------------------------------------------------------------------------ the text


class Block:
    """One comment (consecutive ``#`` lines), one string (adjacent literals joined) or one
    Markdown paragraph, list item or table row, with its file and first line."""

    def __init__(self, path: str, line: int, text: str, kind: str):
        self.path, self.line, self.text, self.kind = path, line, text, kind

    def at(self, pos: int) -> str:
        return f"{self.path}:{self.line + self.text.count(chr(10), 0, pos)}"


def _skipped(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return "__pycache__" in rel or rel.startswith("benchmarks/results/")


@functools.lru_cache(maxsize=None)
def _files() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(python files, markdown files), relative to the root."""
    py = sorted(p.relative_to(ROOT).as_posix() for d in PY_DIRS for p in (ROOT / d).rglob("*.py") if not _skipped(p))
    md = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    return tuple(py), tuple(md) + MARKDOWN


#: a string literal (any prefix, triple-quoted or not) or a comment; strings first, so a ``#``
#: inside a string is not a comment (a lexer's rule, in one C-speed pass instead of tokenize's)
_LEXEME = re.compile(
    r"""(?P<string>(?<![\w])[rRbBuUfF]{0,2}(?:\"\"\"(?:[^\\]|\\.)*?\"\"\"|'\'\'(?:[^\\]|\\.)*?'\'\'"""
    r"""|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'))|(?P<comment>\#[^\n]*)""",
    re.S,
)


def _py_blocks(rel: str) -> list[Block]:
    """Comments (consecutive ``#`` lines joined) and strings (adjacent literals joined) of a file.
    A string with no whitespace is a value the code uses (a file name, a key), not prose."""
    source = (ROOT / rel).read_text()
    blocks, run, line = [], None, [1, 0]  # run: [kind, start, end]; line: [number, at position]

    def flush():
        if run is not None:
            text = source[run[1]: run[2]]
            line[0] += source.count("\n", line[1], run[1])
            line[1] = run[1]
            prose = run[0] == "comment" or re.search(r"\s", text)
            blocks.append(Block(rel, line[0], text, "prose" if prose else "string"))

    for m in _LEXEME.finditer(source):
        kind = m.lastgroup
        gap = source[run[2]: m.start()] if run is not None else "x"
        joined = run is not None and run[0] == kind and not gap.strip() and (
            kind == "string" or gap.count("\n") <= 1)
        if joined:
            run[2] = m.end()
        else:
            flush()
            run = [kind, m.start(), m.end()]
    flush()
    return blocks


_ITEM = re.compile(r"\s*([-*+]|\d+\.|\|)\s")


def _md_blocks(rel: str) -> list[Block]:
    blocks, cur, first = [], [], 0
    for number, line in enumerate((ROOT / rel).read_text().splitlines(), 1):
        if not line.strip() or _ITEM.match(line) or line.startswith("#"):
            if cur:
                blocks.append(Block(rel, first, "\n".join(cur), "markdown"))
            cur, first = ([line], number) if line.strip() else ([], 0)
        else:
            if not cur:
                first = number
            cur.append(line)
    if cur:
        blocks.append(Block(rel, first, "\n".join(cur), "markdown"))
    return blocks


@functools.lru_cache(maxsize=None)
def _blocks() -> tuple[Block, ...]:
    py, md = _files()
    return tuple(itertools.chain(*(_py_blocks(r) for r in py), *(_md_blocks(r) for r in md)))


@functools.lru_cache(maxsize=None)
def _repo_paths() -> frozenset[str]:
    """Every file and folder of the repository (not .git, the venv or caches), relative; folders
    end with ``/``."""
    out = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        rel = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if rel == "." else rel + "/"
        out.update(prefix + d + "/" for d in dirs)
        out.update(prefix + f for f in files)
    return frozenset(out)


@functools.lru_cache(maxsize=None)
def _tails() -> frozenset[str]:
    """Every end of every path of the repository: ``fit.py``, ``planning/fit.py``, ... and folders."""
    out = set()
    for p in _repo_paths():
        parts = p.rstrip("/").split("/")
        end = "/" if p.endswith("/") else ""
        out.update("/".join(parts[i:]) + end for i in range(len(parts)))
    return frozenset(out)


# ------------------------------------------------------------------------------------ sections

_DESIGN_NOTES = re.compile(r"\bDESIGN\.md\b")
_DOC = r"(?P<doc>[\w./-]*\.md)"
_TITLE = r"[\"“](?P<title>[^\"”\n]{2,80})[\"”]"
_SECTION_CITES = (
    re.compile(_DOC + r"`{0,2}(?:'s)?,?\s+(?:section\s+)?" + _TITLE),
    re.compile(r"\bsections?\s+" + _TITLE),
    re.compile(_TITLE + r"\s+sections?\b"),
    re.compile(r"\b[Ss]ee\s+(?:the\s+)?" + _TITLE.replace("(?P<title>", "(?P<title>[A-Z]")),
)
_ANCHOR = re.compile(r"\((?P<doc>[\w./-]*\.md)#(?P<anchor>[\w-]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _normal(title: str) -> str:
    return " ".join(title.replace("`", "").replace("*", "").strip(" .:").casefold().split())


def _slug(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _headings(doc: str) -> tuple[str, ...]:
    text = _FENCE.sub("", (ROOT / doc).read_text())
    return tuple(m.group(1) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M))


@functools.lru_cache(maxsize=None)
def _all_headings() -> tuple[str, ...]:
    return tuple(h for doc in _files()[1] for h in _headings(doc))


def _doc_path(name: str, citing: str) -> str | None:
    """The repository's Markdown file ``name`` cited from ``citing``: by path, then by file name."""
    paths = _repo_paths()
    for cand in (os.path.normpath((Path(citing).parent / name).as_posix()), name):
        if cand in paths:
            return cand
    same = [p for p in paths if p.endswith("/" + name) or p == name]
    return same[0] if len(same) == 1 else None


def _section_findings(block: Block) -> list[str]:
    out = []
    for m in _DESIGN_NOTES.finditer(block.text):
        out.append(f"{block.at(m.start())}: cites the design notes outside the repository ({m.group()});"
                   " say here what it says, or cite a doc of the repository")
    for pattern in _SECTION_CITES:
        for m in pattern.finditer(block.text):
            title, doc = m.group("title"), m.groupdict().get("doc")
            if doc and _DESIGN_NOTES.search(doc):
                continue
            if doc:
                where = _doc_path(doc.lstrip("./"), block.path)
                if where is None:
                    continue  # the path rule reports a missing document
                known = _headings(where)
            else:
                where, known = "any document", _all_headings()
            if _normal(title) not in {_normal(h) for h in known}:
                out.append(f"{block.at(m.start())}: cites section \"{title}\", not a heading of {where}")
    for m in _ANCHOR.finditer(block.text):
        where = _doc_path(m.group("doc"), block.path)
        if where is not None and m.group("anchor") not in {_slug(h) for h in _headings(where)}:
            out.append(f"{block.at(m.start())}: cites #{m.group('anchor')}, not a heading of {where}")
    return out


# ------------------------------------------------------------------------------------ paths

_EXT = r"(?:py|md|json|ya?ml|png|txt|toml|sh|cfg|jsonl|csv)"
_PATH_CHARS = r"[\w.{},*-]"
_ROOTED = re.compile(rf"(?<![\w./$~-])((?:{'|'.join(ROOTS)})/(?:{_PATH_CHARS}+/)*{_PATH_CHARS}*)")
_RELATIVE = re.compile(
    rf"(?<![\w./$~-])((?:[A-Za-z_][\w-]*/)+{_PATH_CHARS}+\.(?:{_EXT}\b|\{{[\w,]+\}})"  # a file
    rf"|(?:[A-Za-z_]\w*/){{2,}}(?![\w/]))"  # a folder of two names or more: ``planning/strategies/``
)
_BARE = re.compile(r"(?<![\w./$~{-])([A-Za-z_]\w*\.py)\b(?![/\w])")
_LINK = re.compile(r"\]\((?!https?:|#)([^)\s#]+)")
_URL = re.compile(r"\b(?:https?|file)://\S+")
#: what a command writes (``--out X``, "writes X", "written to X", "default X"): not a citation
_OUTPUT = re.compile(
    r"(?:--out(?:put|-dir)?[= ]|\b[Ww]rites?\s+(?:to\s+)?|\bwritten\s+(?:to|in)\s+|\bdefault\s+)[`'\"]*$")
#: paths and files of other projects the text cites (torch's, HF's, torchtitan's)
_FOREIGN = ("torch/", "transformers/", "accelerate/", "trl/", "peft/", "flash_attn/", "torchtitan/",
            "nanochat/", "picotron/", "tests/integration_tests/", "site-packages/", "examples/pytorch/")
_FOREIGN_FILES = {"schedules.py", "_IR.py", "_utils.py", "features.py", "setup.py", "run_clm.py"}


def _expand(path: str) -> list[str]:
    """Brace alternatives expanded; a format field (``{name}``) becomes a glob."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m is None:
        return [path]
    alts = m.group(1).split(",") if "," in m.group(1) else ["*"]
    return [x for a in alts for x in _expand(path[: m.start()] + a + path[m.end():])]


def _exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return bool(glob.glob(str(ROOT / path)))
    return path in _repo_paths() or path + "/" in _repo_paths() or path.rstrip("/") in _repo_paths()


def _exists_somewhere(path: str, citing: str) -> bool:
    """Each of ``path``'s expansions relative to the citing file's folder, or the end of a path
    of the repository."""
    for p in _expand(path):
        here = os.path.normpath((Path(citing).parent / p).as_posix()) + ("/" if p.endswith("/") else "")
        if _exists(here) or p in _tails() or p.rstrip("/") in _tails():
            continue
        if "*" in p and glob.glob(str(ROOT / "**" / p), recursive=True):
            continue
        return False
    return True


def _path_findings(block: Block) -> list[str]:
    if block.kind == "string":
        return []  # a value the code uses, not prose: its tests read it
    text = _URL.sub(lambda m: " " * len(m.group()), block.text)
    out, seen = [], set()
    for m in _ROOTED.finditer(text):
        raw = m.group(1).rstrip(".,:")
        seen.update(range(m.start(), m.end()))
        if raw.endswith("/") and raw.count("/") == 1 or raw.startswith(_FOREIGN):
            continue  # "tests/" alone names the folder
        if _OUTPUT.search(text[max(0, m.start() - 30): m.start()]):
            continue
        if any(not _exists(p) for p in _expand(raw)):
            out.append(f"{block.at(m.start())}: cites {raw}, which does not exist")
    links = _LINK.finditer(text) if block.kind == "markdown" else ()
    for m in itertools.chain(_RELATIVE.finditer(text), links):
        raw = m.group(1).rstrip(".,:")
        if m.start(1) in seen or raw.startswith(_FOREIGN) or _DESIGN_NOTES.search(raw):
            continue
        seen.update(range(m.start(1), m.end(1)))
        if _OUTPUT.search(text[max(0, m.start(1) - 30): m.start(1)]):
            continue
        if not _exists_somewhere(raw, block.path):
            out.append(f"{block.at(m.start(1))}: cites {raw}, which no path of the repository ends with")
    for m in _BARE.finditer(text):
        if m.start() in seen or m.group(1) in _FOREIGN_FILES:
            continue
        if m.group(1) not in _tails():
            out.append(f"{block.at(m.start())}: cites {m.group(1)}, no file of the repository")
    return out


# ------------------------------------------------------------------------------------ names


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


@functools.lru_cache(maxsize=None)
def _module_of(rel: str) -> str | None:
    """The module name of a file of the package, or None."""
    return {path: name for name, path in _modules().items()}.get(ROOT / rel)


@functools.lru_cache(maxsize=None)
def _tree(key: str) -> ast.Module:
    path = _modules().get(key) or ROOT / key
    return ast.parse(_text(path), filename=str(path))


def _package_of(key: str) -> str:
    path = _modules().get(key)
    return key if path is not None and path.name == "__init__.py" else key.rsplit(".", 1)[0]


def _statements(body: list[ast.stmt]):
    """Every statement under ``body`` (nested blocks, functions and classes included), no
    expression: a fraction of :func:`ast.walk`'s nodes."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody"):
            yield from _statements(getattr(node, field, []))
        for h in getattr(node, "handlers", []):
            yield from _statements(h.body)
        for case in getattr(node, "cases", []):
            yield from _statements(case.body)


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [n for t in node.targets for n in ([t] if not isinstance(t, (ast.Tuple, ast.List)) else t.elts)]
    return [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []


@functools.lru_cache(maxsize=None)
def _namespace(key: str) -> dict[str, tuple[str, object]]:
    """name -> ("def" | "class" | "var", node) or ("ref", dotted target) for one module (``key``
    a module name) or one file (``key`` a path): top-level bindings, then imports anywhere."""
    tree, ns = _tree(key), {}

    def bind(stmts):
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                ns.setdefault(node.name, ("def", node))
            elif isinstance(node, ast.ClassDef):
                ns.setdefault(node.name, ("class", node))
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in _targets(node):
                    if isinstance(t, ast.Name):
                        ns.setdefault(t.id, ("var", node))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                bind(node.body)
                bind(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    bind(h.body)

    bind(tree.body)
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            for a in node.names:
                ns.setdefault(a.asname or a.name.split(".")[0], ("ref", a.name if a.asname else a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if key not in _modules():
                    continue
                pkg = _package_of(key).split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                ns.setdefault(a.asname or a.name, ("ref", f"{base}.{a.name}"))
    return ns


def _resolve(dotted: str, depth: int = 0) -> str | None:
    """None when ``dotted`` (``concertina_hf.…``) exists, else what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in _modules():
            return _resolve_in(".".join(parts[:i]), parts[i:], depth)
    return f"{dotted}: no such module"


def _resolve_in(key: str, rest: list[str], depth: int = 0) -> str | None:
    if not rest or depth > 8:
        return None
    if len(rest) == 1 and key in _modules() and rest[0] in _top_names(_modules()[key]):
        return None  # defined at the module's top: no need to parse it
    name, ns = rest[0], _namespace(key)
    if name not in ns:
        if key in _modules() and f"{key}.{name}" in _modules():
            return _resolve_in(f"{key}.{name}", rest[1:], depth + 1)
        if "__getattr__" in ns and any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(_tree(key))):
            return None  # a lazy export
        return f"{key} has no {name}"
    kind, obj = ns[name]
    if kind == "ref":
        if obj.split(".")[0] != PACKAGE:
            return None
        return _resolve(".".join([obj, *rest[1:]]), depth + 1)
    if kind == "class":
        return _resolve_class(key, obj, rest[1:], depth)
    return None


@functools.lru_cache(maxsize=None)
def _class_members(cls: ast.ClassDef) -> frozenset[str]:
    """Names of a class's body (methods, fields, nested classes) and its ``self.x =``."""
    members = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(node.name)
        members.update(t.id for t in _targets(node) if isinstance(t, ast.Name))
    for node in _statements(cls.body):
        members.update(t.attr for t in _targets(node) if isinstance(t, ast.Attribute)
                       and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
    return frozenset(members)


def _resolve_class(key: str, cls: ast.ClassDef, rest: list[str], depth: int) -> str | None:
    if not rest or depth > 8:
        return None
    name = rest[0]
    if name in _class_members(cls):
        inner = [n for n in cls.body if isinstance(n, ast.ClassDef) and n.name == name]
        return _resolve_class(key, inner[0], rest[1:], depth + 1) if inner else None
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            return None  # a base from elsewhere: its attributes are not checked
        kind, obj = _namespace(key).get(base.id, ("ref", "builtins"))
        if kind == "class" and _resolve_class(key, obj, rest, depth + 1) is None:
            return None
        if kind == "ref" and (obj.split(".")[0] != PACKAGE or _resolve(".".join([obj, *rest]), depth + 1) is None):
            return None
        if kind not in ("class", "ref"):
            return None
    return f"{key}.{cls.name} has no {name}"


@functools.lru_cache(maxsize=None)
def _tops() -> tuple[dict[str, str], dict[str, list[str]]]:
    """Module base names that name one module of the package, and every top-level name of the
    package -> the modules defining it."""
    mods, names = {}, {}
    for name, path in _modules().items():
        mods.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        for top in _top_names(path):
            names.setdefault(top, []).append(name)
    return {k: v[0] for k, v in mods.items() if len(v) == 1}, names


_TOP = re.compile(r"^(?:(?:async\s+)?def|class)\s+(\w+)|^(\w+)\s*(?::|=(?!=))", re.M)
_TOP_TUPLE = re.compile(r"^(\w+(?:\s*,\s*\w+)+)\s*=(?!=)", re.M)


def _defines(path: Path, name: str) -> bool:
    """``path`` binds ``name`` somewhere (read without parsing): at its top, as a ``def`` or
    ``class``, as ``self.name =``, or in an import."""
    text = _text(path)
    return name in _top_names(path) or bool(
        re.search(rf"^\s*(?:(?:from|import)\s[^\n]*|(?:async\s+)?def\s+|class\s+)\b{name}\b", text, re.M)
        or re.search(rf"\bself\.{name}\s*(?::[^=\n]*)?=[^=]", text))


@functools.lru_cache(maxsize=None)
def _top_names(path: Path) -> frozenset[str]:
    """The names a file defines at its top (``def``, ``class``, ``name =``, ``a, b =``), read
    without parsing."""
    text = _text(path)
    unpacked = (n.strip() for m in _TOP_TUPLE.findall(text) for n in m.split(","))
    return frozenset(a or b for a, b in _TOP.findall(text)) | frozenset(unpacked)


@functools.lru_cache(maxsize=None)
def _text(path: Path) -> str:
    return path.read_text()


def _in_package(target: str) -> str | None:
    """Resolve ``target`` whose first name is defined at the top of some module of the package."""
    problems = [_resolve_in(m, target.split(".")) for m in _tops()[1].get(target.split(".")[0], [])]
    if not problems:
        return f"{target.split('.')[0]} is defined nowhere in the package"
    return None if None in problems else problems[0]


def _in_file(key: str, target: str) -> str | None:
    """Resolve an unqualified role target as Sphinx would from ``key`` (a module or a file): its
    names, a member of one of its classes, a name of the package, a sub-package. In a test or a
    benchmark (not parsed): its own top-level names, a sibling file's, the package's."""
    parts = target.split(".")
    here = _modules().get(key) or ROOT / key
    if (len(parts) == 1 or key not in _modules()) and _defines(here, parts[0]):
        return None  # its own name, a method or attribute of its class, or an import
    if key not in _modules():
        if parts[0] in _LIBRARIES or parts[0] in sys.stdlib_module_names:
            return None
        for folder in here.parents[: len(here.relative_to(ROOT).parts) - 1]:  # up to tests/, benchmarks/
            sibling = folder / f"{parts[0]}.py"
            if sibling.exists():
                found = len(parts) == 1 or parts[1] in _top_names(sibling)
                return None if found else f"{sibling.name} has no {parts[1]}"
        if parts[0] in SUBPACKAGES:
            return _resolve(f"{PACKAGE}.{target}")
        return _in_package(target)
    ns = _namespace(key)
    if parts[0] in ns:
        return _resolve_in(key, parts)
    classes = [obj for kind, obj in ns.values() if kind == "class"]
    if any(parts[0] in _class_members(c) for c in classes):
        return None  # a method or attribute of the class it is cited in
    if parts[0] in SUBPACKAGES:
        return _resolve(f"{PACKAGE}.{target}")
    return _in_package(target)


_ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|attr|data|exc|obj):`~?([\w.]+)(?:\(\))?`")
_SPAN = re.compile(r"(?<![`:])``?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``?(?!`)")
_ABSOLUTE = re.compile(rf"(?<![\w.]){PACKAGE}(?:\.[A-Za-z_]\w*)+")
#: libraries whose names are also module names of the package (``peft.PeftModel`` is peft's)
_LIBRARIES = {"peft", "trl", "torch", "transformers", "accelerate", "datasets", "pulp"}


def _name_findings(block: Block) -> list[str]:
    out = []
    key = _module_of(block.path) or (block.path if block.path.endswith(".py") else None)
    mods, _ = _tops()

    def check(pos: int, target: str, problem: str | None):
        if problem:
            out.append(f"{block.at(pos)}: cites {target}: {problem}")

    for m in _ABSOLUTE.finditer(block.text):
        check(m.start(), m.group(), _resolve(m.group()))
    for m in _ROLE.finditer(block.text):
        target = m.group(2)
        if target.startswith(PACKAGE) or key is None:
            continue  # absolute names: checked above
        if target.startswith("."):
            if key in _modules():
                level = len(target) - len(target.lstrip("."))
                pkg = _package_of(key).split(".")
                check(m.start(), target, _resolve(".".join(pkg[: len(pkg) - level + 1] + [target.lstrip(".")])))
            continue
        check(m.start(), target, _in_file(key, target))
    for m in _SPAN.finditer(block.text):
        target = m.group(1)
        parts = target.split(".")
        first = parts[0]
        if first == PACKAGE or parts[-1] in ("py", "md", "json", "yaml", "png", "txt", "toml", "sh"):
            continue
        if first in SUBPACKAGES:
            check(m.start(), target, _resolve(f"{PACKAGE}.{target}"))
        elif first[0].isupper() and first in _tops()[1]:
            check(m.start(), target, _in_package(target))  # a class of the package
        elif block.kind == "markdown" and first in mods and first not in _LIBRARIES:
            check(m.start(), target, _resolve_in(mods[first], parts[1:]))
    return out


# ------------------------------------------------------------------------------------ history

_HISTORY = re.compile(
    r"\b[Ii]ssues?\s+#?\d+|\b[Pp]reviously\b|\b[Ff]ormerly\b|\bbefore (?:this|the) (?:change|fix|commit)\b"
    r"|\(was\s|\b[Uu]sed to\s|\bStop\s+\d+\b|(?<![\w.])Before[:,]\s"
)
#: "is used to", "are used to": a purpose, not a past
_PASSIVE = re.compile(r"\b(?:is|are|be|been|being|was|were|get|gets|got)\s+$", re.I)


def _history_findings(block: Block) -> list[str]:
    out = []
    for m in _HISTORY.finditer(block.text):
        if m.group().lower().startswith("used") and _PASSIVE.search(block.text[max(0, m.start() - 12): m.start()]):
            continue
        out.append(f"{block.at(m.start())}: history ({m.group().strip()!r}): say what is;"
                   " the change belongs in CHANGELOG.md")
    return out


# ------------------------------------------------------------------------------------ figures

_RATIO = re.compile(r"(?<![\w.])(?:(\d+\.\d+)\s*(?:-|–|to)\s*)?(\d+\.\d+)x\b|(?<![\w.])x(\d+\.\d+)\b")
_SCRIPT = re.compile(r"(?<![\w./-])benchmarks/((?:studies/)?[\w]+)\.py\b")
_RESULT = re.compile(r"(?<![\w./-])benchmarks/(results/[\w./{},-]+|README\.md)")


_NUMBER = re.compile(r"(?<![\w.])\d+\.\d+")


def _rounds_to(held: str, quoted: str) -> bool:
    """``held`` (a figure of a result file) is ``quoted`` at ``quoted``'s decimals (half up)."""
    places = len(quoted.split(".")[1])
    if len(held.split(".")[1]) < places:
        return False
    return Decimal(held).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP) == Decimal(quoted)


def _sources(text: str) -> list[Path]:
    """The result files a block cites: result paths, the scripts' result files, the README."""
    found = []
    for m in _RESULT.finditer(text):
        for p in _expand(m.group(1).rstrip(".,:")):
            found += [Path(x) for x in glob.glob(str(ROOT / "benchmarks" / p)) if Path(x).is_file()]
    for m in _SCRIPT.finditer(text):
        found += [Path(x) for x in glob.glob(str(ROOT / "benchmarks" / "results" / f"{m.group(1)}*.md"))]
    return found


def _figure_findings(block: Block) -> list[str]:
    if not block.path.startswith(FIGURE_SCOPE):
        return []
    out = []
    for m in _RATIO.finditer(block.text):
        numbers = [n for n in m.groups() if n]
        if not any(len(n.split(".")[1]) >= 2 for n in numbers):
            continue  # a design figure or an order of magnitude, not a measurement
        sources = _sources(block.text)
        if not sources:
            out.append(f"{block.at(m.start())}: quotes {m.group()} without the result file that holds it"
                       " (benchmarks/results/..., the benchmark script, or benchmarks/README.md)")
            continue
        held = {x for s in sources for x in _NUMBER.findall(s.read_text())}
        for n in numbers:
            if not any(_rounds_to(x, n) for x in held):
                names = ", ".join(s.relative_to(ROOT).as_posix() for s in sources)
                out.append(f"{block.at(m.start())}: quotes {n} ({m.group()}), which {names} does not say")
    return out


# ------------------------------------------------------------------------------------ the tests

RULES = {
    "section": _section_findings,
    "path": _path_findings,
    "name": _name_findings,
    "history": _history_findings,
    "figure": _figure_findings,
}


@functools.lru_cache(maxsize=None)
def findings(rule: str) -> tuple[str, ...]:
    return tuple(f for block in _blocks() for f in RULES[rule](block))


@pytest.mark.parametrize("rule", sorted(RULES))
def test_references(rule):
    found = findings(rule)
    assert not found, f"{len(found)} {rule} finding(s):\n" + "\n".join(found)


def test_architecture_is_short():
    size = len((ROOT / "docs" / "architecture.md").read_bytes())
    assert size < ARCHITECTURE_LIMIT, f"docs/architecture.md: {size} characters (at most {ARCHITECTURE_LIMIT - 1})"
