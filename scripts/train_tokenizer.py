"""Train the bundled byte-level BPE tokenizer on the standard library's Python sources.

    python scripts/train_tokenizer.py [--vocab-size 8192] [--out src/concertina_hf/tools/assets/tokenizer]

The corpus is :func:`concertina_hf.tools.data.stdlib_source_files` (sorted, so the input order is
fixed) and the ``tokenizers`` BPE trainer breaks ties between equally frequent pairs
deterministically, so rerunning on the same Python gives the same files (the stdlib differs a
little between Python versions; the shipped files were made on the one named in
``tokenizer_config.json``). Byte-level: every byte has a token, so any text encodes and
decodes losslessly. Takes about a minute on one core.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from concertina_hf.tools.data import stdlib_source_files

SPECIAL = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "src" / "concertina_hf" / "tools" / "assets" / "tokenizer"


def _texts():
    for f in stdlib_source_files():
        yield f.read_text(encoding="utf-8", errors="replace")


def train(out: pathlib.Path, vocab_size: int = 8192) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=1 << 30,  # documents are long on purpose; the trainer truncates
        clean_up_tokenization_spaces=False,
        **SPECIAL,
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # Record provenance and make sure the special-token map exists whatever the
    # transformers version writes by default.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # The generic class name loads in every transformers version (v5 writes its own alias).
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["trained_on"] = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library sources"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL, indent=2, sort_keys=True) + "\n")
    for extra in ("chat_template.jinja",):
        (out / extra).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    train(args.out, args.vocab_size)
    print(f"wrote {sorted(p.name for p in args.out.iterdir())} to {args.out}")


if __name__ == "__main__":
    main()
