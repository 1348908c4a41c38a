"""Data utilities: bundled tokenizer, stdlib corpus through ``load_dataset``, length sources."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from concertina_hf.tools import data  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(data.bundled_tokenizer_path())


def test_bundled_tokenizer_loads_offline_and_round_trips(tokenizer):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert len(tokenizer) == 8192
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert len(ids) == 3 and None not in ids
    samples = [
        "def f(x):\n    return x ** 2  # square\n",
        "naïve café ✓ 日本語 \t\r\n\x00 trailing  ",
        "",
        "class A(B, metaclass=M):\n    '''doc'''\n" * 3,
    ]
    for s in samples:
        enc = tokenizer(s, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(enc) == s
    # Trained on Python: common code compresses well (far fewer tokens than bytes).
    src = (data.stdlib_source_files()[0]).read_text()
    assert len(tokenizer(src, add_special_tokens=False)["input_ids"]) < len(src.encode()) / 2.5


def test_stdlib_files_sorted_and_exclude_tests():
    files = data.stdlib_source_files()
    assert len(files) > 300
    assert files == sorted(files, key=lambda p: p.as_posix())
    assert all(p.suffix == ".py" for p in files)
    parts = {part for p in files for part in p.parts}
    assert "site-packages" not in parts
    assert not any(p.parent.name in ("test", "tests", "idle_test") for p in files)
    assert data.stdlib_source_files(limit=5) == files[:5]


def test_stdlib_dataset_through_load_dataset_is_long_tailed(tmp_path, tokenizer, monkeypatch):
    import datasets

    calls = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    ds = data.load_text_dataset("stdlib", cache_dir=tmp_path)
    assert calls and calls[0][0][0] == "json"
    assert set(ds.column_names) == {"text", "path"}
    assert len(ds) == len(data.stdlib_source_files())
    tok = data.tokenize_dataset(ds, tokenizer, max_length=None)
    lengths = sorted(tok["length"])
    n = len(lengths)
    median, p99, top = lengths[n // 2], lengths[int(0.99 * n)], lengths[-1]
    # long tail: the longest file is far longer than the typical one
    assert top > 20 * median and p99 > 5 * median
    assert sum(lengths[-n // 20:]) > 0.25 * sum(lengths)  # top 5% of files hold > 25% of tokens
    row = tok[0]
    assert row["input_ids"][-1] == tokenizer.eos_token_id and row["length"] == len(row["input_ids"])
    # truncation
    short = data.tokenize_dataset(ds.select(range(20)), tokenizer, max_length=64)
    assert max(short["length"]) == 64
    # second call reuses the cached JSON lines file
    files = list(tmp_path.glob("stdlib-*.jsonl"))
    assert len(files) == 1
    small = data.load_text_dataset("stdlib", max_files=10, cache_dir=tmp_path)
    assert len(small) == 10 and len(list(tmp_path.glob("stdlib-*.jsonl"))) == 2


def test_local_json_through_the_same_call(tmp_path, tokenizer):
    path = tmp_path / "docs.jsonl"
    rows = [{"body": "x = 1\n" * k, "id": k} for k in (1, 5, 50)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = data.load_text_dataset("json", data_files=str(path), text_column="body", cache_dir=tmp_path / "c")
    assert ds["id"] == [1, 5, 50]
    tok = data.tokenize_dataset(ds, tokenizer, text_column="body", add_eos=False)
    assert tok.column_names == ["input_ids", "length"]
    assert tok["length"][0] < tok["length"][1] < tok["length"][2]
    with pytest.raises(ValueError, match="Set text_column= to the column"):
        data.load_text_dataset("json", data_files=str(path), cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="Set --text-column to the column"):
        data.load_text_dataset("json", data_files=str(path), cache_dir=tmp_path / "c", flags="cli")
    direct = data.load_text_dataset(str(path), text_column="body", cache_dir=tmp_path / "c")
    assert direct["id"] == [1, 5, 50]
    stream = data.load_text_dataset("json", data_files=str(path), text_column="body", streaming=True)
    assert [r["id"] for r in stream] == [1, 5, 50]


@pytest.mark.parametrize("flags, dataset_flag", [("cli", "--dataset"), ("recipe", "--dataset"), ("python", "dataset=")])
def test_missing_datasets_are_named_with_the_setting_to_change(tmp_path, flags, dataset_flag, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for path in ("/no/such/path", "./missing.jsonl", str(tmp_path / "gone" / "docs")):
        with pytest.raises(ValueError, match=f"^{dataset_flag} '.*': no such file or directory. Give a local"):
            data.load_text_dataset(path, flags=flags)
    # a Hub name that is not there (offline): datasets' error, in a sentence naming the settings
    with pytest.raises(ValueError, match=f"could not load {dataset_flag} 'no-such-org/no-such-dataset' .*"
                                         "HF_HUB_OFFLINE is set.*Check " + dataset_flag):
        data.load_text_dataset("no-such-org/no-such-dataset", flags=flags)


def test_read_lengths_formats(tmp_path):
    (tmp_path / "a.txt").write_text("10\n20 30\n# comment\n40  # trailing\n")
    (tmp_path / "b.json").write_text("[1, 2, 3]")
    (tmp_path / "c.json").write_text(json.dumps({"lengths": [7, 8], "note": "x"}))
    (tmp_path / "d.lens").write_text("[5, 6]")
    assert data.read_lengths(tmp_path / "a.txt") == [10, 20, 30, 40]
    assert data.read_lengths(tmp_path / "b.json") == [1, 2, 3]
    assert data.read_lengths(tmp_path / "c.json") == [7, 8]
    assert data.read_lengths(tmp_path / "d.lens") == [5, 6]
    for bad, match in [("1 x 3", "not an integer"), ("0 1", "positive"), ("", "no sequence"),
                       ('{"len": [1]}', "'lengths'"), ("[1.5]", "not an integer")]:
        (tmp_path / "bad.txt").write_text(bad)
        with pytest.raises(ValueError, match=match):
            data.read_lengths(tmp_path / "bad.txt")


def test_sample_lengths_match_the_published_facts():
    gh = data.sample_lengths("github", 50_000, max_len=1 << 18, seed=0)
    assert gh == data.sample_lengths("github", 50_000, max_len=1 << 18, seed=0)
    assert gh != data.sample_lengths("github", 50_000, max_len=1 << 18, seed=1)
    frac_under_16k = sum(x < 16384 for x in gh) / len(gh)
    frac_over_64k = sum(x > 65536 for x in gh) / len(gh)
    assert frac_under_16k > 0.8 and 0.003 < frac_over_64k < 0.008
    cc = data.sample_lengths("commoncrawl", 50_000, max_len=1 << 18, seed=0)
    assert sum(x > 65536 for x in cc) < sum(x > 65536 for x in gh)  # shorter tail
    assert sorted(cc)[len(cc) // 2] < sorted(gh)[len(gh) // 2]
    capped = data.sample_lengths("github", 5000, max_len=4096, seed=0)
    assert max(capped) == 4096 and min(capped) >= 1
    assert data.load_distribution("github")["constructed_not_measured"] is True
    with pytest.raises(ValueError, match="unknown length distribution"):
        data.sample_lengths("nope", 3, 10)
