"""Writing a benchmark's result: the table printed, then ``<out>.md`` and ``<out>.json`` (the
record with the command that made it and the load average seen)."""

from __future__ import annotations

import json
import pathlib


def write_results(out: str | pathlib.Path, text: str, record: dict, command: str, load_average: float) -> None:
    print(text)
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(dict(record, command=command, load_average=load_average), indent=1))
