#!/usr/bin/env python
"""Long-context causal-LM training with ConcertinaTrainer (adaptive pipeline parallelism).

With no arguments this runs the embedded default, offline and on CPU: a tiny Llama built from a
config, the byte-level BPE tokenizer bundled with concertina_hf, and the source files of the
local Python standard library as the corpus (a real long-tailed length distribution: many short
modules, a few of tens of thousands of tokens), 30 optimizer steps with a progress bar, then an
evaluation on held-out files and a standard HF checkpoint in ``runs/train_long_context``::

    python recipes/train_long_context.py                                    # one process, pp = 1
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        recipes/train_long_context.py                                       # two processes, pp = 2

Everything is a flag (``--help`` lists them): the model (``--model_name_or_path`` for pretrained
weights, ``--model_config`` for a config name / path / JSON of Llama fields, random init), the
data (``--dataset`` a Hub name or a packaged builder such as ``json`` with ``--data_files``,
``--dataset_config``, ``--dataset_split``, ``--text_column``, ``--streaming``), ``--max_length``,
every ``TrainingArguments`` field and every ``--concertina_*`` field. For example, on 8 GPUs::

    accelerate launch --config_file configs/accelerate/gpu8_pp8.yaml recipes/train_long_context.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset HuggingFaceFW/fineweb-edu \\
        --dataset_config sample-10BT --streaming --max_length 65536 --max_steps 1000 \\
        --per_device_train_batch_size 64 --torch_dtype bfloat16 --concertina_memory_budget auto

Besides the checkpoint, the main process writes ``run_info.json`` (world size, the pipeline and
data-parallel sizes, the stage layout, per-step losses, the held-out loss).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, LlamaConfig, set_seed

from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments, LengthAwareCollator
from concertina_hf.tools.data import bundled_tokenizer_path, load_text_dataset, tokenize_dataset

logger = logging.getLogger("train_long_context")

# The embedded default model: a tiny Llama (about 3M parameters with the 8K vocabulary).
TINY_LLAMA = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)

# TrainingArguments defaults of the embedded run (each can be overridden on the command line).
RECIPE_DEFAULTS = dict(
    output_dir="runs/train_long_context",
    max_steps=30,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    learning_rate=3e-3,
    warmup_steps=3,
    lr_scheduler_type="cosine",
    weight_decay=0.01,
    max_grad_norm=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    concertina_max_tokens_per_chunk=512,
    concertina_cost_model="online",
    concertina_replan_interval=5,
)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pretrained model (Hub name or local directory). Default: a tiny Llama from "
                                        "a config (see --model_config)."})
    model_config: str | None = field(
        default=None, metadata={"help": "Train from random init with this config: a Hub name or directory "
                                        "(AutoConfig), or a JSON object of LlamaConfig fields overriding the tiny "
                                        "default, e.g. '{\"num_hidden_layers\": 8}'."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer (Hub name or directory). Default: the model's, else the "
                                        "tokenizer bundled with concertina_hf."})
    torch_dtype: str = field(default="float32", metadata={"help": "Parameter dtype: float32 or bfloat16."})
    untie_embeddings: bool = field(
        default=True, metadata={"help": "With tied input/output embeddings and more than one pipeline stage, give "
                                        "the LM head its own copy (the stages cannot share one tensor)."})


@dataclass
class DataArguments:
    dataset: str = field(
        default="stdlib", metadata={"help": "datasets.load_dataset name: a Hub dataset, a local path, or a packaged "
                                            "builder (json, text, parquet, csv) with --data_files. 'stdlib': the "
                                            "local Python standard library's sources."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration (subset) name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to read, e.g. train or train[:10%%]."})
    text_column: str = field(default="text", metadata={"help": "Column holding the documents."})
    data_files: str | None = field(default=None, metadata={"help": "Local file(s) for a packaged builder, comma "
                                                                   "separated."})
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset (needs --max_steps)."})
    max_files: int | None = field(default=None, metadata={"help": "With --dataset stdlib: only the first N files."})
    max_length: int = field(default=1024, metadata={"help": "Truncate documents to this many tokens."})
    eval_samples: int = field(default=8, metadata={"help": "Documents held out for evaluation (the last N; the "
                                                           "first N when streaming). 0 disables evaluation."})


def build_model(model_args: ModelArguments, tokenizer, max_length: int) -> torch.nn.Module:
    dtype = getattr(torch, model_args.torch_dtype)
    if model_args.model_name_or_path:  # loaded by stage by ConcertinaTrainer (args.model_init_kwargs)
        return model_args.model_name_or_path
    text = (model_args.model_config or "").strip()
    if text and not text.startswith("{"):
        config = AutoConfig.from_pretrained(text)
    else:
        fields = {**TINY_LLAMA, **(json.loads(text) if text else {})}
        fields.setdefault("vocab_size", len(tokenizer))
        fields.setdefault("max_position_embeddings", max(2048, max_length))
        config = LlamaConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **fields)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def untie_embeddings(model: torch.nn.Module) -> None:
    """Give the LM head its own copy of the tied embedding (same values, trained separately)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is emb.weight:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False


def load_data(data_args: DataArguments, tokenizer):
    """(train, held-out eval or None) tokenized datasets, through datasets.load_dataset."""
    data_files = data_args.data_files.split(",") if data_args.data_files else None
    if data_files is not None and len(data_files) == 1:
        data_files = data_files[0]
    raw = load_text_dataset(data_args.dataset, config=data_args.dataset_config, split=data_args.dataset_split,
                            text_column=data_args.text_column, streaming=data_args.streaming,
                            data_files=data_files, max_files=data_args.max_files, flags="recipe")
    tokenized = tokenize_dataset(raw, tokenizer, data_args.text_column, data_args.max_length, flags="recipe")
    k = data_args.eval_samples
    if k <= 0:
        return tokenized, None
    if data_args.streaming:
        import datasets

        return tokenized.skip(k), datasets.Dataset.from_list(list(tokenized.take(k)))
    n = len(tokenized)
    if n <= k:
        raise ValueError(f"the dataset has {n} documents; --eval_samples {k} would leave none to train on")
    return tokenized.select(range(n - k)), tokenized.select(range(n - k, n))


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, ConcertinaTrainingArguments))
    parser.set_defaults(**RECIPE_DEFAULTS)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        model_args, data_args, args = parser.parse_json_file(os.path.abspath(argv[0]))
    else:
        model_args, data_args, args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if args.should_log else logging.WARNING)
    transformers.utils.logging.set_verbosity(args.get_process_log_level())

    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path or bundled_tokenizer_path())
    with args.main_process_first(desc="tokenizing the dataset"):
        try:
            train_ds, eval_ds = load_data(data_args, tokenizer)
        except ValueError as e:  # a dataset or column that is not there: the message names the flag
            raise SystemExit(f"train_long_context.py: {e}") from None

    set_seed(args.seed)  # every rank builds the same initial model
    model = build_model(model_args, tokenizer, data_args.max_length)
    world = dist.get_world_size() if dist.is_initialized() else 1
    pipeline_size = args.concertina_pipeline_size or world // (args.concertina_data_parallel_size or 1)
    if isinstance(model, str):  # by name: each rank reads only its stage's tensors
        kw = {"dtype": model_args.torch_dtype, **(args.model_init_kwargs or {})}
        config = AutoConfig.from_pretrained(model, revision=kw.get("revision"),
                                            trust_remote_code=bool(kw.get("trust_remote_code", False)))
        if model_args.untie_embeddings and pipeline_size > 1 and getattr(config, "tie_word_embeddings", False):
            logger.info("untying the input and output embeddings so they can live on different pipeline stages")
            kw["tie_word_embeddings"] = False  # the head's own copy of the embedding, trained apart
        args.model_init_kwargs = kw
        with torch.device("meta"):  # counted without weights
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    else:
        if model_args.untie_embeddings and pipeline_size > 1 and getattr(model.config, "tie_word_embeddings", False):
            logger.info("untying the input and output embeddings so they can live on different pipeline stages")
            untie_embeddings(model)
        n_params = sum(p.numel() for p in model.parameters())

    trainer = ConcertinaTrainer(
        model=model, args=args, data_collator=LengthAwareCollator(max_length=data_args.max_length),
        train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
    )
    topo = trainer.topology
    logger.info("world size %d = %d pipeline stages x %d replicas; layers per stage %s; %.2fM parameters",
                topo.world_size, topo.pipeline_size, topo.data_parallel_size, list(trainer.layout.layer_ranges),
                n_params / 1e6)

    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = dict(result.metrics)
    if eval_ds is not None:
        metrics.update(trainer.evaluate())
    trainer.save_model(args.output_dir)
    trainer.save_state()

    info = {
        "world_size": topo.world_size,
        "pipeline_size": topo.pipeline_size,
        "data_parallel_size": topo.data_parallel_size,
        "layer_ranges": [list(r) for r in trainer.layout.layer_ranges],
        "num_parameters": n_params,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": metrics.get("eval_loss"),
        "metrics": metrics,
    }
    if trainer.args.should_save:
        with open(os.path.join(args.output_dir, "run_info.json"), "w") as fh:
            json.dump(info, fh, indent=1)
        logger.info("losses %s -> eval loss %s; checkpoint in %s", [round(x, 3) for x in info["losses"]],
                    info["eval_loss"], args.output_dir)
    # finish the trackers and tear the process group down before exit (a live gloo group can abort
    # the interpreter's shutdown)
    trainer.end()
    return info


if __name__ == "__main__":
    main()
