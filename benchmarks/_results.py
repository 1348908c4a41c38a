"""The one header every benchmark prints and writes, and writing a benchmark's result.

A benchmark makes its header's start when it starts (``run = Run(__file__, argv)``: the command
line, the date, the git commit, the machine's cores, the load average before, the torch and
transformers versions) and closes it when it is done (``run.header()``: the load average after,
the wall time). :func:`write_results` prints the table, then writes ``<out>.md`` (the header as
its first lines under the title) and ``<out>.json`` (the record with ``header``, and ``command``
and ``load_average`` at the top as before). Benchmarks writing their files themselves use
:func:`header_markdown` and put ``header`` in their record.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent

__all__ = ["Run", "header_markdown", "header_of", "self_check", "write_results"]


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _version(name: str) -> str | None:
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str:
    """The short commit, ``+dirty`` when tracked files differ from it; ``unknown`` without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _command(script: str | os.PathLike, argv) -> str:
    path = pathlib.Path(script).resolve()
    try:
        rel = path.relative_to(ROOT).as_posix()
    except ValueError:
        rel = path.name
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", rel, *map(str, args)])


class Run:
    """A benchmark run's header, started when the benchmark starts (the load average before)."""

    def __init__(self, script: str | os.PathLike, argv=None):
        self.t0 = time.perf_counter()
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.start: dict[str, Any] = {
            "command": _command(script, argv),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "commit": _git_commit(),
            "machine": {"cores": os.cpu_count(), "cores_usable": affinity, "arch": platform.machine(),
                        "python": platform.python_version()},
            "load_before": _load(),
        }

    @property
    def command(self) -> str:
        return self.start["command"]

    def header(self) -> dict[str, Any]:
        """The header, closed now: the load average after, the wall time, the versions."""
        return dict(self.start, load_after=_load(), elapsed_s=round(time.perf_counter() - self.t0, 1),
                    versions={"torch": _version("torch"), "transformers": _version("transformers")})


def header_markdown(header: dict[str, Any]) -> str:
    """The header as markdown lines (the same for every benchmark; fields a record from before the
    shared header lacks read ``unknown``)."""
    m = header.get("machine") or {}
    lb, la = header.get("load_before"), header.get("load_after")
    fmt = lambda x: "/".join(f"{v:g}" for v in x) if x else "unknown"  # noqa: E731
    v = header.get("versions") or {}
    versions = ", ".join(f"{k} {val}" for k, val in v.items() if val) or "versions unknown"
    cores = f"{m.get('cores', '?')} cores"
    if m.get("cores_usable") not in (None, m.get("cores")):
        cores += f" ({m['cores_usable']} usable)"
    elapsed = header.get("elapsed_s")
    return (f"Command: `{header['command']}`  \n"
            f"Run {header.get('date') or 'unknown'}, commit {header.get('commit') or 'unknown'}"
            f"{f', {elapsed:g} s' if elapsed is not None else ''}; {m.get('arch', 'unknown')}, {cores}, "
            f"load average (1/5/15 min) before {fmt(lb)}, after {fmt(la)}; Python {m.get('python', 'unknown')}, "
            f"{versions}.")


def header_of(record: dict[str, Any]) -> dict[str, Any]:
    """A written record's header (``--from-json`` rewrites keep it); a record from before the
    shared header: its command and load average."""
    if "header" in record:
        return record["header"]
    load = record.get("load_average")
    return {"command": record["command"], "date": record.get("date"),
            "load_after": list(load) if isinstance(load, (list, tuple)) else [load] if load is not None else None}


def _with_header(text: str, header: dict[str, Any]) -> str:
    """The header under the markdown's title (first line ``# ...``), else at the top."""
    block = header_markdown(header)
    lines = text.split("\n")
    if lines and lines[0].startswith("# "):
        return "\n".join([lines[0], "", block, *([""] if len(lines) > 1 and lines[1] else []), *lines[1:]])
    return block + "\n\n" + text


def write_results(out: str | pathlib.Path, text: str, record: dict, run: "Run | dict") -> dict[str, Any]:
    """Print the header and ``text``, write ``<out>.md`` and ``<out>.json``; returns the header."""
    header = run.header() if isinstance(run, Run) else run
    md = _with_header(text, header)
    print(md)
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md if md.endswith("\n") else md + "\n")
    load = header.get("load_after") or header.get("load_before")
    rec = dict(record, header=header, command=header["command"], load_average=load[0] if load else None)
    out.with_suffix(".json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return header


def self_check(main, check, args=("--quick",)) -> int:
    """``--check``: ``main([*args, "--out", tmp])``, then ``check(record, markdown)`` (asserts) on
    what it wrote; prints and returns 0 when every assertion holds, else raises."""
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "check"
        main([*args, "--out", str(out)])
        rec = json.loads(out.with_suffix(".json").read_text())
        check(rec, out.with_suffix(".md").read_text())
    print("check: passed", flush=True)
    return 0
