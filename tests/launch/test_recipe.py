"""recipes/train_long_context.py: the embedded default, under accelerate (pp = 2) and on one process.

- ``accelerate launch --config_file configs/accelerate/cpu_2proc.yaml`` of the default recipe
  (shrunk: 6 steps, 100 stdlib files, 256 tokens): two ranks in one process group, the loss falls,
  and the saved directory, loaded by ``AutoModelForCausalLM.from_pretrained`` alone, gives on the
  held-out documents the same loss as the pipeline's evaluation (so the same logits).
- one process, in this process: a local JSON-lines file through the same ``load_dataset`` call a
  Hub name takes (``--dataset json --data_files ...``), another text column, pp = 1.
- with no arguments the parser yields the embedded default (tiny Llama, bundled tokenizer,
  stdlib corpus, 30 steps).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "train_long_context.py"
CONFIG = ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"
LAUNCH = ROOT / "tests" / "_recipe_launch.py"  # the recipe, plus a check that the ranks share one group


def _recipe_module():
    spec = importlib.util.spec_from_file_location("train_long_context", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _heldout_ids(argv: list[str]) -> list[list[int]]:
    """The token ids of the documents the recipe holds out with these arguments (its own loader)."""
    from transformers import AutoTokenizer, HfArgumentParser

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.tools.data import bundled_tokenizer_path

    mod = _recipe_module()
    parser = HfArgumentParser((mod.ModelArguments, mod.DataArguments, ConcertinaTrainingArguments))
    parser.set_defaults(**mod.RECIPE_DEFAULTS)
    _, data_args, _ = parser.parse_args_into_dataclasses(args=argv)
    _, eval_ds = mod.load_data(data_args, AutoTokenizer.from_pretrained(bundled_tokenizer_path()))
    return [list(map(int, r["input_ids"])) for r in eval_ds]


def _heldout_loss(model_dir: pathlib.Path, heldout: list[list[int]]) -> float:
    """Token-mean loss of the held-out documents with the plain HF model from the directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in heldout:
            x = torch.tensor([ids])
            logits = model(x, use_cache=False).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            count += len(ids) - 1
    return total / count


def test_no_arguments_mean_the_embedded_default():
    from transformers import HfArgumentParser

    from concertina_hf import ConcertinaTrainingArguments

    mod = _recipe_module()
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
        _recipe_module().main(["--output_dir", str(tmp_path / "out"), *extra])


def test_single_process_with_a_local_file_through_load_dataset(tmp_path, monkeypatch):
    docs = tmp_path / "docs.jsonl"
    lines = [json.dumps({"content": "def f(x):\n    return x * %d\n" % i * (1 + i % 7)}) for i in range(40)]
    docs.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--dataset", "json", "--data_files", str(docs), "--text_column", "content",
            "--max_steps", "3", "--per_device_train_batch_size", "4", "--max_length", "64", "--eval_samples", "4",
            "--concertina_max_tokens_per_chunk", "32", "--disable_tqdm", "true"]
    info = _recipe_module().main(argv)
    assert info["world_size"] == 1 and info["pipeline_size"] == 1
    assert len(info["losses"]) == 3
    assert abs(_heldout_loss(out, _heldout_ids(argv)) - info["eval_loss"]) < 1e-5


def test_single_process_from_a_model_directory_by_name(tmp_path, monkeypatch):
    """--model_name_or_path: the trainer gets the directory's name and reads the weights by stage."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"content": "x = %d\n" % i * (1 + i % 5)}) for i in range(30)) + "\n")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    common = ["--dataset", "json", "--data_files", str(docs), "--text_column", "content", "--max_steps", "2",
              "--per_device_train_batch_size", "4", "--max_length", "48", "--eval_samples", "4",
              "--concertina_max_tokens_per_chunk", "32", "--disable_tqdm", "true"]
    recipe = _recipe_module()
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
    assert abs(_heldout_loss(tmp_path / "second", _heldout_ids(argv)) - info["eval_loss"]) < 1e-5


def test_accelerate_launch_cpu_2proc_default_recipe(tmp_path, monkeypatch):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               HF_DATASETS_CACHE=str(tmp_path / "cache"), TOKENIZERS_PARALLELISM="false")
    env.pop("ACCELERATE_USE_CPU", None)
    argv = ["--output_dir", str(out), "--max_steps", "6", "--max_files", "100", "--max_length", "256",
            "--per_device_train_batch_size", "4", "--eval_samples", "4", "--concertina_max_tokens_per_chunk", "128",
            "--concertina_gantt_steps", "3"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG), str(LAUNCH)] + argv
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500, cwd=str(tmp_path))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    info = json.loads((out / "run_info.json").read_text())
    # really two ranks, in one process group, as one 2-stage pipeline
    group_check = json.loads((out / "group_check.json").read_text())
    assert info["world_size"] == 2 and group_check["all_reduce_ones"] == 2.0
    assert info["pipeline_size"] == 2 and info["data_parallel_size"] == 1
    assert len(info["layer_ranges"]) == 2
    losses = info["losses"]
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.3 and all(x < losses[0] for x in losses[2:]), losses
    # a plain HF directory; its held-out loss is the pipeline's eval loss
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "trainer_state.json"):
        assert (out / name).is_file(), name
    monkeypatch.setenv("HF_DATASETS_CACHE", env["HF_DATASETS_CACHE"])
    assert abs(_heldout_loss(out, _heldout_ids(argv)) - info["eval_loss"]) < 1e-5
    assert (out / "gantt" / "step-3.png").is_file() and (out / "gantt" / "step-6.png").is_file()
