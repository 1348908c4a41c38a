"""The single-process baseline of ``measured.py``: plain ``transformers.Trainer`` on one thread.

The model is the one the pipeline runs (same config, same seed, so the same initial weights),
the collator ``DataCollatorWithFlattening`` (padding-free: one row of concatenated sequences with
restarting ``position_ids``, which HF's SDPA path turns into a block-diagonal causal mask), the
optimizer the Trainer's default (fused AdamW). Two things are added, neither changing what a step
computes:

- the step's batches are fixed (a batch sampler yielding the benchmark's batches in order: the
  memory batch first as warm-up, then the timed batches), so the Trainer sees exactly the
  sequences the pipeline sees;
- the first ``training_step`` (forward and backward of the memory batch) runs under the
  runtime's :class:`~concertina_hf.runtime.memory.SavedTensorMeter` and
  :class:`~concertina_hf.runtime.memory.AllocationTracker`, so activation memory is counted the
  same way as on the pipeline stages.

Gradient clipping is off (``max_grad_norm=0``) as in the pipeline runs, so both do the same work
per step. A step's time is the time between consecutive ``on_step_end`` callbacks (data,
forward, backward, optimizer and scheduler).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

__all__ = ["run_trainer"]


def _checkpointing_arg(on: bool) -> dict:
    """``activation_checkpointing`` (transformers >= 5.x) or the older ``gradient_checkpointing``."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}


def run_trainer(config: dict, seed: int, batches: Sequence[Sequence[Sequence[int]]], memory_batch: int,
                timed_batches: Sequence[int], gradient_checkpointing: bool) -> dict:
    """Train ``[memory_batch] + timed_batches`` with ``transformers.Trainer``; return step times,
    losses and the memory of the first step (see the module docstring)."""
    from torch.utils.data import DataLoader, Dataset
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from _pipeline_worker import build_model
    from concertina_hf.runtime.memory import AllocationTracker, SavedTensorMeter

    order = [memory_batch] + list(timed_batches)
    flat: list[dict] = []
    index_batches: list[list[int]] = []
    for b in order:
        idx = []
        for seq in batches[b]:
            idx.append(len(flat))
            flat.append({"input_ids": list(seq)})
        index_batches.append(idx)

    class _Rows(Dataset):
        def __len__(self):
            return len(flat)

        def __getitem__(self, i):
            return flat[i]

    class _Timer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    class _MeasuredTrainer(Trainer):
        memory: dict = {}
        losses: list[float] = []

        def get_train_dataloader(self):
            dl = DataLoader(self.train_dataset, batch_sampler=index_batches, collate_fn=self.data_collator,
                            num_workers=0)
            return self.accelerator.prepare(dl)

        def training_step(self, model, inputs, num_items_in_batch=None):
            if not self.memory:
                params = list(model.parameters())
                meter = SavedTensorMeter(exclude=params + list(model.buffers()))
                with AllocationTracker() as tracker, meter:
                    loss = super().training_step(model, inputs, num_items_in_batch)
                self.memory = {"meter_peak_bytes": meter.peak_bytes,
                               # parameters (a layer's ``weight.t()`` view makes the tracker
                               # count their storage), buffers and gradients: not activations
                               "alloc_peak_bytes": tracker.peak_bytes(
                                   exclude=[*params, *model.buffers(), *(p.grad for p in params)])}
            else:
                loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append(float(loss))
            return loss

    model = build_model(config, seed)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, use_cpu=True, report_to="none", max_steps=len(order), per_device_train_batch_size=1,
            logging_strategy="no", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            max_grad_norm=0.0, seed=seed, **_checkpointing_arg(gradient_checkpointing),
        )
        timer = _Timer()
        trainer = _MeasuredTrainer(model=model, args=args, train_dataset=_Rows(),
                                   data_collator=DataCollatorWithFlattening(), callbacks=[timer])
        trainer.memory, trainer.losses = {}, []
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its final metrics
            trainer.train()
    ends = timer.ends
    if len(ends) != len(order):
        raise RuntimeError(f"the Trainer ran {len(ends)} steps, expected {len(order)}")
    steps = [ends[k] - ends[k - 1] for k in range(1, len(ends))]
    tokens = [sum(len(s) for s in batches[b]) for b in timed_batches]
    return {
        "gradient_checkpointing": gradient_checkpointing,
        "step_s": steps,
        "tokens": tokens,
        "tokens_per_s": [t / s for t, s in zip(tokens, steps)],
        "warmup_step_s": ends[0] - timer.start,
        "losses": trainer.losses,
        "memory_batch": memory_batch,
        **trainer.memory,
        "static_bytes": sum(p.numel() for p in model.parameters()) * 16,
        "threads": torch.get_num_threads(),
    }
