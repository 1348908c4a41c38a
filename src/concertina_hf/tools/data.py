"""Data utilities: a real long-tailed corpus, a bundled tokenizer, sequence-length sources.

Everything here works offline, on every machine:

- **stdlib corpus**: the ``*.py`` sources of the running Python's standard library (test
  packages and ``site-packages`` excluded): about 700 files, 12 MB, with lengths from a few
  dozen to ~200K tokens: the same many-short, few-very-long shape as code corpora.
  :func:`load_text_dataset` writes them once as JSON lines (fields ``text``, ``path``) into a
  cache directory and loads that file with ``datasets.load_dataset("json", ...)``, so the
  stdlib corpus, a local file and a Hub dataset all go through the same call. Writing it costs
  one pass over 12 MB (about a second); later calls only stat the cache file.
- **bundled tokenizer** (:func:`bundled_tokenizer_path`): a byte-level BPE with 8192 tokens
  trained on that corpus by ``scripts/train_tokenizer.py``; ``AutoTokenizer.from_pretrained``
  loads it without the Hub. Special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>``.
- **tokenization** (:func:`tokenize_dataset`): one batched ``Dataset.map`` with the fast
  tokenizer, appending EOS and truncating to ``max_length``; it keeps ``input_ids`` and
  ``length`` only.
- **length sources** for the planner: :func:`read_lengths` (a text or JSON file) and
  :func:`sample_lengths` (i.i.d. draws from a shipped binned distribution: pick a bin by its
  probability, then a length log-uniformly inside it; lengths above ``max_len`` are truncated
  to ``max_len``, as a training pipeline truncates documents at its context length).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import random
import sys
import sysconfig
from typing import Any, Sequence

__all__ = [
    "DISTRIBUTIONS",
    "bundled_tokenizer_path",
    "distribution_path",
    "load_distribution",
    "load_text_dataset",
    "read_lengths",
    "sample_lengths",
    "stdlib_source_files",
    "tokenize_dataset",
]

_ASSETS = pathlib.Path(__file__).resolve().parent / "assets"
# Directory names under the stdlib root that are not library source: test suites (they are
# large, generated-looking and unlike real code) and third-party packages.
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# A single local file given as the dataset name is loaded with the packaged builder for its
# suffix (load_dataset itself only accepts directories and builder names as paths).
_BUILDER_BY_SUFFIX = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet",
                      ".csv": "csv", ".arrow": "arrow"}
# Length distributions shipped with the package, constructed from the paper's published statements
# (not measured) by benchmarks/data/make_distributions.py.
DISTRIBUTIONS = ("github", "commoncrawl")


# ---------------------------------------------------------------------------------- tokenizer
def bundled_tokenizer_path() -> str:
    """Directory of the bundled byte-level BPE tokenizer (``AutoTokenizer.from_pretrained`` it)."""
    path = _ASSETS / "tokenizer"
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"the bundled tokenizer is missing from {path}; regenerate it with "
            "`python scripts/train_tokenizer.py`"
        )
    return str(path)


# ---------------------------------------------------------------------------------- corpus
def stdlib_source_files(limit: int | None = None) -> list[pathlib.Path]:
    """The standard library's ``*.py`` files, sorted by path relative to the stdlib root.

    Test directories (``test``, ``tests``, ``idle_test``), ``site-packages`` and caches are
    excluded. ``limit`` keeps the first ``limit`` files of that order.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and p.is_file():
            files.append(rel)
    files.sort(key=lambda r: r.as_posix())
    if limit is not None:
        files = files[: max(0, int(limit))]
    return [root / r for r in files]


def _cache_dir(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    if cache_dir is not None:
        return pathlib.Path(cache_dir)
    env = os.environ.get("HF_DATASETS_CACHE")
    if env:
        return pathlib.Path(env) / "concertina_hf"
    return pathlib.Path.home() / ".cache" / "concertina_hf"


def _stdlib_jsonl(max_files: int | None, cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """Write the stdlib sources as JSON lines once; the name encodes the file list so a
    different Python or ``max_files`` gets its own file."""
    files = stdlib_source_files(max_files)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rels = [f.relative_to(root).as_posix() for f in files]
    digest = hashlib.sha256("\n".join(rels).encode()).hexdigest()[:10]
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = _cache_dir(cache_dir) / f"stdlib-py{ver}-{len(files)}-{digest}.jsonl"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write to a private name and rename: several processes may build the cache at once.
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for f, rel in zip(files, rels):
            text = f.read_text(encoding="utf-8", errors="replace")
            fh.write(json.dumps({"text": text, "path": rel}) + "\n")
    os.replace(tmp, out)
    return out


def load_text_dataset(
    name: str = "stdlib",
    *,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    streaming: bool = False,
    data_files: Any = None,
    max_files: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    flags: str = "python",
):
    """Load a text dataset through ``datasets.load_dataset``.

    ``name`` is a Hub dataset name, a local directory or a packaged builder (``"json"``,
    ``"text"``, ``"parquet"``, ``"csv"`` with ``data_files``), passed straight through with
    ``config``, ``split``, ``streaming`` and ``data_files``; a single local ``.json``,
    ``.jsonl``, ``.txt``, ``.parquet``, ``.csv`` or ``.arrow`` file becomes the matching builder
    with ``data_files=name``. The special name ``"stdlib"`` is
    the standard library's sources (optionally only the first ``max_files``) loaded with
    ``load_dataset("json", data_files=<cached JSON lines>)``. ``cache_dir`` is both where the
    stdlib JSON lines go and ``load_dataset``'s cache (default: ``HF_DATASETS_CACHE``, else
    ``~/.cache/concertina_hf``).

    Errors are ``ValueError`` in the project's words, naming the setting to change as the caller
    spells it (``flags``: ``"cli"`` for ``concertina plan``'s ``--text-column``, ``"recipe"`` for
    ``--text_column``, ``"python"`` for ``text_column=``): a local path that does not exist, a
    dataset ``datasets`` cannot load (not found, offline, unknown config or split), a missing
    text column.
    """
    import datasets

    kwargs: dict[str, Any] = {"split": split, "streaming": streaming}
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    if name == "stdlib":
        if config is not None or data_files is not None:
            raise ValueError("the 'stdlib' dataset takes no config or data_files; use max_files to shrink it")
        path = _stdlib_jsonl(max_files, cache_dir)
        ds = datasets.load_dataset("json", data_files=str(path), **kwargs)
    else:
        if max_files is not None:
            raise ValueError("max_files applies to the 'stdlib' dataset only; select rows with split='train[:N]'")
        local = pathlib.Path(name)
        suffix = local.suffix.lower()
        if data_files is None and local.is_file() and suffix in _BUILDER_BY_SUFFIX:
            name, data_files = _BUILDER_BY_SUFFIX[suffix], str(local)
        if data_files is None and _looks_local(name) and not local.exists():
            raise ValueError(
                f"{_flag('dataset', flags)} {name!r}: no such file or directory. Give a local data file "
                f"({', '.join(sorted(_BUILDER_BY_SUFFIX))}), a directory of them, 'stdlib' (the standard library's "
                "sources, offline), or a Hub dataset name")
        if data_files is not None:
            kwargs["data_files"] = data_files
        try:
            ds = datasets.load_dataset(name, config, **kwargs)
        except (FileNotFoundError, ConnectionError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
            offline = " (HF_HUB_OFFLINE is set: a Hub dataset must already be in the cache)" \
                if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False") else ""
            raise ValueError(
                f"could not load {_flag('dataset', flags)} {name!r} (config {config!r}, split {split!r}"
                f"{', data files ' + repr(data_files) if data_files is not None else ''}){offline}: "
                f"{type(e).__name__}: {e}. Check {_flag('dataset', flags)}, {_flag('dataset_config', flags)}, "
                f"{_flag('split', flags)} and {_flag('data_files', flags)}") from e
    columns = _column_names(ds)
    if columns is not None and text_column not in columns:
        raise ValueError(
            f"dataset {name!r} (split {split!r}) has no column {text_column!r}; its columns are "
            f"{sorted(columns)}. Set {_flag('text_column', flags)} to the column holding the text."
        )
    return ds


#: how each caller spells a setting: the name of the command-line flag or keyword to change
_FLAG_STYLES = {
    "cli": {"dataset": "--dataset", "dataset_config": "--dataset-config", "split": "--split",
            "data_files": "--data-files", "text_column": "--text-column", "max_length": "--max-len"},
    "recipe": {"dataset": "--dataset", "dataset_config": "--dataset_config", "split": "--dataset_split",
               "data_files": "--data_files", "text_column": "--text_column", "max_length": "--max_length"},
}


def _flag(setting: str, flags: str) -> str:
    return _FLAG_STYLES.get(flags, {}).get(setting, f"{setting}=")


def _looks_local(name: str) -> bool:
    """A path rather than a Hub id (``org/name``): absolute, relative with ``./``, ``~``, or a data file suffix."""
    return (os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") >= 2
            or pathlib.Path(name).suffix.lower() in _BUILDER_BY_SUFFIX)


def _column_names(ds) -> list[str] | None:
    cols = getattr(ds, "column_names", None)
    if cols is None and getattr(ds, "features", None) is not None:
        cols = list(ds.features)
    return None if cols is None else list(cols)


def tokenize_dataset(ds, tokenizer, text_column: str = "text", max_length: int | None = None, add_eos: bool = True,
                     flags: str = "python"):
    """Tokenize ``ds[text_column]`` into ``input_ids`` and ``length`` (other columns dropped).

    No special tokens are added except one EOS at the end of each document (``add_eos``);
    documents longer than ``max_length`` tokens are truncated (the EOS is then cut too, since
    the document does not end there). Empty documents give empty ``input_ids`` unless EOS is
    added.
    """
    columns = _column_names(ds)
    if columns is not None and text_column not in columns:
        raise ValueError(
            f"dataset has no column {text_column!r}; its columns are {sorted(columns)}. "
            f"Set {_flag('text_column', flags)} to the column holding the text."
        )
    eos = tokenizer.eos_token_id
    if add_eos and eos is None:
        raise ValueError("the tokenizer has no eos_token; pass add_eos=False or use a tokenizer with one")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}; set {_flag('max_length', flags)}")

    def encode(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        if add_eos:
            ids = [x + [eos] for x in ids]
        if max_length is not None:
            ids = [x[:max_length] for x in ids]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    return ds.map(encode, batched=True, batch_size=64, remove_columns=columns)


# ---------------------------------------------------------------------------------- lengths
def read_lengths(path: str | os.PathLike) -> list[int]:
    """Sequence lengths from a file: JSON (a list, or an object with a ``"lengths"`` list), or
    text with integers separated by whitespace or newlines (``#`` starts a comment)."""
    p = pathlib.Path(path)
    text = p.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if p.suffix.lower() == ".json" or stripped.startswith(("[", "{")):
        data = json.loads(text)
        if isinstance(data, dict):
            if "lengths" not in data:
                raise ValueError(f"{p}: a JSON object of lengths needs a 'lengths' key (keys: {sorted(data)})")
            data = data["lengths"]
        if not isinstance(data, list):
            raise ValueError(f"{p}: expected a JSON list of lengths")
        raw: Sequence[Any] = data
    else:
        raw = [tok for line in text.splitlines() for tok in line.split("#", 1)[0].split()]
    out = []
    for i, v in enumerate(raw):
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"{p}: entry {i} ({v!r}) is not an integer length") from None
        if isinstance(v, float) and v != n:
            raise ValueError(f"{p}: entry {i} ({v!r}) is not an integer length")
        if n < 1:
            raise ValueError(f"{p}: entry {i} is {n}; sequence lengths must be positive")
        out.append(n)
    if not out:
        raise ValueError(f"{p}: no sequence lengths found")
    return out


def distribution_path(name: str) -> pathlib.Path:
    """Path of a shipped distribution (``"github"``, ``"commoncrawl"``) or of a given file."""
    p = pathlib.Path(name)
    if p.suffix == ".json" or p.is_file():
        if not p.is_file():
            raise FileNotFoundError(f"no length distribution file {p}")
        return p
    shipped = _ASSETS / "distributions" / f"{name}.json"
    if not shipped.is_file():
        raise ValueError(f"unknown length distribution {name!r}; use one of {DISTRIBUTIONS} or a JSON file path")
    return shipped


def load_distribution(name: str) -> dict[str, Any]:
    """A binned length distribution: ``{"bin_edges": [e0, ..., eK], "probabilities": [p1..pK],
    ...}`` with bin ``i`` covering ``[e_i, e_{i+1})`` tokens. Checked and returned as loaded."""
    p = distribution_path(name)
    d = json.loads(p.read_text(encoding="utf-8"))
    edges, probs = d.get("bin_edges"), d.get("probabilities")
    if not isinstance(edges, list) or not isinstance(probs, list) or len(edges) != len(probs) + 1:
        raise ValueError(f"{p}: needs 'bin_edges' (K+1 numbers) and 'probabilities' (K numbers)")
    if any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] < 1:
        raise ValueError(f"{p}: bin_edges must be increasing and start at 1 or more")
    if any(q < 0 for q in probs) or not math.isclose(sum(probs), 1.0, abs_tol=1e-6):
        raise ValueError(f"{p}: probabilities must be non-negative and sum to 1 (sum {sum(probs)})")
    return d


def sample_lengths(distribution_path_or_name: str, n: int, max_len: int, seed: int = 0) -> list[int]:
    """``n`` i.i.d. lengths from a binned distribution, truncated to ``max_len``.

    A bin is drawn by its probability, then a length log-uniformly within ``[lo, hi)``: within
    a bin of a long-tailed distribution shorter lengths are more frequent. Deterministic for a
    given ``seed``.
    """
    if n < 0 or max_len < 1:
        raise ValueError(f"need n >= 0 and max_len >= 1 (got n={n}, max_len={max_len}); set --num-seqs / --max-len")
    d = load_distribution(distribution_path_or_name)
    edges, probs = d["bin_edges"], d["probabilities"]
    rng = random.Random(seed)
    bins = rng.choices(range(len(probs)), weights=probs, k=n)
    out = []
    for b in bins:
        lo, hi = float(edges[b]), float(edges[b + 1])
        x = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        out.append(max(1, min(max_len, x)))
    return out
