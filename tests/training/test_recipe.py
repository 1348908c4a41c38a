"""recipes/train_long_context.py on one process (its run under ``accelerate launch``:
``tests/launch/test_accelerate_launch.py``).

- a local JSON-lines file through the same ``load_dataset`` call a Hub name takes (``--dataset json
  --data_files ...``), another text column, pp = 1: the saved directory, loaded by
  ``AutoModelForCausalLM.from_pretrained`` alone, gives on the held-out documents the pipeline's
  evaluation loss; a second run from the first one's directory by name starts from its weights.
- with no arguments the parser yields the embedded default (tiny Llama, bundled tokenizer,
  stdlib corpus, 30 steps); a missing dataset or text column stops naming the flag.
"""

from __future__ import annotations

import json

import pytest

from _recipe import heldout_ids, heldout_loss, recipe_module


def test_no_arguments_mean_the_embedded_default():
    from transformers import HfArgumentParser

    from concertina_hf import ConcertinaTrainingArguments

    mod = recipe_module()
    parser = HfArgumentParser((mod.ModelArguments, mod.DataArguments, ConcertinaTrainingArguments))
    parser.set_defaults(**mod.RECIPE_DEFAULTS)
    text = parser.format_help()  # --help must render (argparse %-formats every help string)
    assert "--concertina_memory_budget" in text and "--dataset_config" in text
    model_args, data_args, args = parser.parse_args_into_dataclasses(args=[])
    assert model_args.model_name_or_path is None and model_args.model_config is None
    assert data_args.dataset == "stdlib" and data_args.max_length == 1024
    assert args.max_steps == 30 and args.output_dir == "runs/train_long_context"
    assert args.concertina_cost_model == "online" and args.report_to in ([], ["none"], "none")


@pytest.mark.parametrize("extra, words", [
    (["--dataset", "/no/such/path"], "--dataset '/no/such/path': no such file or directory"),
    (["--dataset", "stdlib", "--max_files", "2", "--text_column", "wrong"],
     "dataset 'stdlib' .* has no column 'wrong'; its columns are .*Set --text_column to the column holding the text"),
])
def test_missing_dataset_or_column_stops_naming_the_flag(tmp_path, monkeypatch, extra, words):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match="^train_long_context.py: " + words):
        recipe_module().main(["--output_dir", str(tmp_path / "out"), *extra])


def test_single_process_with_a_local_file_through_load_dataset(tmp_path, monkeypatch):
    docs = tmp_path / "docs.jsonl"
    lines = [json.dumps({"content": "def f(x):\n    return x * %d\n" % i * (1 + i % 7)}) for i in range(40)]
    docs.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--dataset", "json", "--data_files", str(docs), "--text_column", "content",
            "--max_steps", "3", "--per_device_train_batch_size", "4", "--max_length", "64", "--eval_samples", "4",
            "--concertina_max_tokens_per_chunk", "32", "--disable_tqdm", "true"]
    info = recipe_module().main(argv)
    assert info["world_size"] == 1 and info["pipeline_size"] == 1
    assert len(info["losses"]) == 3
    assert abs(heldout_loss(out, heldout_ids(argv)) - info["eval_loss"]) < 1e-5


def test_single_process_from_a_model_directory_by_name(tmp_path, monkeypatch):
    """--model_name_or_path: the trainer gets the directory's name and reads the weights by stage."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"content": "x = %d\n" % i * (1 + i % 5)}) for i in range(30)) + "\n")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    common = ["--dataset", "json", "--data_files", str(docs), "--text_column", "content", "--max_steps", "2",
              "--per_device_train_batch_size", "4", "--max_length", "48", "--eval_samples", "4",
              "--concertina_max_tokens_per_chunk", "32", "--disable_tqdm", "true"]
    recipe = recipe_module()
    first = recipe.main(["--output_dir", str(tmp_path / "first"), *common])
    seen = []
    real = recipe.ConcertinaTrainer

    def spy(model, **kw):
        seen.append(model)
        return real(model=model, **kw)

    monkeypatch.setattr(recipe, "ConcertinaTrainer", spy)
    argv = ["--output_dir", str(tmp_path / "second"), "--model_name_or_path", str(tmp_path / "first"), *common]
    info = recipe.main(argv)
    assert seen == [str(tmp_path / "first")]
    assert info["num_parameters"] == first["num_parameters"] and len(info["losses"]) == 2
    assert info["losses"][0] < first["losses"][0]  # it starts from the first run's trained weights
    assert abs(heldout_loss(tmp_path / "second", heldout_ids(argv)) - info["eval_loss"]) < 1e-5
