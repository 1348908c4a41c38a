"""The recipe the tests run (``recipes/train_long_context.py``): its module, the documents it holds
out with given arguments, and their loss under a saved model (what the pipeline's evaluation must
give). Shared by ``tests/training/test_recipe.py`` and ``tests/launch/test_accelerate_launch.py``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "train_long_context.py"


def recipe_module():
    spec = importlib.util.spec_from_file_location("train_long_context", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def heldout_ids(argv: list[str]) -> list[list[int]]:
    """The token ids of the documents the recipe holds out with these arguments (its own loader)."""
    from transformers import AutoTokenizer, HfArgumentParser

    from concertina_hf import ConcertinaTrainingArguments
    from concertina_hf.tools.data import bundled_tokenizer_path

    mod = recipe_module()
    parser = HfArgumentParser((mod.ModelArguments, mod.DataArguments, ConcertinaTrainingArguments))
    parser.set_defaults(**mod.RECIPE_DEFAULTS)
    _, data_args, _ = parser.parse_args_into_dataclasses(args=argv)
    _, eval_ds = mod.load_data(data_args, AutoTokenizer.from_pretrained(bundled_tokenizer_path()))
    return [list(map(int, r["input_ids"])) for r in eval_ds]


def heldout_loss(model_dir: pathlib.Path, heldout: list[list[int]]) -> float:
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
