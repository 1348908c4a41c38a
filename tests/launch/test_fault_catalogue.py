"""The fault catalogue: a failure on one rank inside any public ``ConcertinaTrainer`` call that may
run a collective ends every rank, even when the user's script catches it.

One cell per entry point (:data:`ENTRY_POINTS`) and failing rank (0, 1): two plain processes
(pp = 2, gloo, CPU, default ``ddp_timeout`` of 30 minutes, so only the failure guard can end a
waiting rank) run :func:`_worker`. On the failing rank the fault is raised inside the call
(construction: in the run's setup, after the process groups exist; every other call: on entry, by
an override in a subclass, which ``ConcertinaTrainer.__init_subclass__`` guards like its own
calls), the script catches it, checks that it is the exception it raised, and goes on with other
work (a sleep of :data:`STALL_S`). Every rank must exit within :data:`BOUND_S` of the fault, the
peer printing the failing rank and call, the failing rank the caught exception.

``push_to_hub`` with the Hub offline (``HF_HUB_OFFLINE=1``, ``ddp_timeout=10``): rank 0 raises the
Hub's error in the repository creation, the script catches it and goes on to ``end()``; every rank
must be out within ``ddp_timeout`` + 10 s, rank 1 naming rank 0. The same script with plain
``Trainer`` (DDP) ends too (printed for comparison).

Worker: :func:`_worker` (``cell``: ``entry:rank``) on two ranks of :func:`_helpers.start_ranks`;
:data:`CONCURRENT` cells run at once (they mostly wait), one module fixture runs them all and a
test per cell asserts on its own.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import pytest

from _helpers import start_ranks

#: how long a script that caught the fault goes on with other work: ending before shows the guard
STALL_S = 60
#: from the fault to the last rank's exit: the failing rank ends ABORT_GRACE_S (5 s) after its
#: failure, its peer within ABORT_POLL_S (0.5 s) of it; the rest is margin for a loaded machine
BOUND_S = 20
PUSH_TIMEOUT_S = 10
#: cells run at once (2 ranks each): a cell mostly waits, on the fault's grace and the abort flag
CONCURRENT = 4
FAULT = "injected fault"
#: entry point -> what the guard's message calls it
ENTRY_POINTS = {
    "construction": "ConcertinaTrainer construction", "train": "train", "evaluate": "evaluate",
    "predict": "predict", "save_model": "save_model", "push_to_hub": "push_to_hub",
    "create_model_card": "create_model_card", "resume": "resume from checkpoint (weights)", "end": "end",
}
#: a cell runs its entry point after these calls (which must succeed)
BEFORE = {"evaluate": ["train"], "predict": ["train"], "save_model": ["train"], "push_to_hub": ["train"],
          "create_model_card": ["train"], "resume": ["train"], "end": ["train"]}


def _worker(cell: str, out: str) -> None:
    entry, failing = cell.split(":")
    failing_rank = int(failing)
    rank = int(os.environ["RANK"])
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

    import concertina_hf.training.trainer as trainer_module
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    plain = entry == "push_plain"
    injected: list[BaseException] = []

    def fault(where: str) -> None:
        if rank != failing_rank or entry in ("push_to_hub", "push_plain") and failing_rank == 0:
            return  # rank 0's push fails by itself (the Hub is offline)
        with open(os.path.join(out, "fault.json"), "w") as fh:
            json.dump({"t": time.time()}, fh)
        injected.append(RuntimeError(f"{FAULT} in {where} on rank {rank}"))
        raise injected[-1]

    class FaultyTrainer(ConcertinaTrainer):
        def train(self, *a, **kw):
            if entry == "train":
                fault("train")
            return super().train(*a, **kw)

        def evaluate(self, *a, **kw):
            if entry == "evaluate":
                fault("evaluate")
            return super().evaluate(*a, **kw)

        def predict(self, *a, **kw):
            if entry == "predict":
                fault("predict")
            return super().predict(*a, **kw)

        def save_model(self, output_dir=None, _internal_call=False):
            if entry == "save_model":
                fault("save_model")
            return super().save_model(output_dir, _internal_call)

        def push_to_hub(self, *a, **kw):
            if entry == "push_to_hub":
                fault("push_to_hub")
            return super().push_to_hub(*a, **kw)

        def create_model_card(self, *a, **kw):
            if entry == "create_model_card":
                fault("create_model_card")
            return super().create_model_card(*a, **kw)

        def _load_from_checkpoint(self, *a, **kw):
            if entry == "resume":
                fault("resume")
            return super()._load_from_checkpoint(*a, **kw)

        def end(self):
            if entry == "end":
                fault("end")
            return super().end()

    if entry == "construction":
        resolve_run = trainer_module.resolve_run

        def failing_resolve_run(*a, **kw):
            fault("construction")
            return resolve_run(*a, **kw)

        trainer_module.resolve_run = failing_resolve_run

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    rng = random.Random(0)
    data = datasets.Dataset.from_list([{"input_ids": [rng.randrange(64) for _ in range(rng.choice([9, 17, 40]))]}
                                       for _ in range(12)])
    push = entry in ("push_to_hub", "push_plain")
    common = dict(output_dir=out, report_to=[], disable_tqdm=True, max_steps=1, per_device_train_batch_size=3,
                  per_device_eval_batch_size=4, save_strategy="steps" if entry == "resume" else "no", save_steps=1,
                  **(dict(ddp_timeout=PUSH_TIMEOUT_S) if push else {}))
    trainer = None
    try:  # the user's try: a failure is caught and the script goes on with something else
        if plain:
            from transformers import DataCollatorForLanguageModeling
            collator = DataCollatorForLanguageModeling(_Tokenizer(), mlm=False)
            trainer = Trainer(model=model, args=TrainingArguments(use_cpu=True, **common), train_dataset=data,
                              data_collator=collator)
        else:
            trainer = FaultyTrainer(
                model=model, args=ConcertinaTrainingArguments(concertina_max_tokens_per_chunk=16, **common),
                train_dataset=data, eval_dataset=data.select(range(4)))
        for call in BEFORE.get(entry, []) + ([] if entry == "construction" else [entry]):
            if call == "train":
                trainer.train()
            elif call == "evaluate":
                trainer.evaluate()
            elif call == "predict":
                trainer.predict(data.select(range(4)))
            elif call == "save_model":
                trainer.save_model(os.path.join(out, "final"))
            elif call in ("push_to_hub", "push_plain"):
                trainer.push_to_hub()
            elif call == "create_model_card":
                trainer.create_model_card()
            elif call == "resume":
                checkpoint = os.path.join(out, "checkpoint-1")
                trainer.args.max_steps = 2
                trainer.train(resume_from_checkpoint=checkpoint)
            elif call == "end":
                trainer.end()
    except Exception as exc:
        if push and rank == 0 and not injected:
            with open(os.path.join(out, "fault.json"), "w") as fh:  # the Hub's error: the fault
                json.dump({"t": time.time()}, fh)
        print(f"caught: {type(exc).__name__}: {exc}; the injected exception: {bool(injected) and exc is injected[-1]}",
              file=sys.stderr, flush=True)
        if push:  # the script goes on to its end
            if trainer is not None and hasattr(trainer, "end"):
                trainer.end()
            elif torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            return
        time.sleep(STALL_S)
    print("finished without a fault", file=sys.stderr, flush=True)
    if trainer is not None and hasattr(trainer, "end") and entry != "end":
        trainer.end()


class _Tokenizer:
    """The least a padding collator needs (plain Trainer's comparison run)."""
    pad_token_id, pad_token = 0, "<pad>"

    def pad(self, features, return_tensors="pt", **kw):
        import torch
        n = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[i, :len(f["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask}


def _run_cells(cells: list[str], root) -> dict[str, dict]:
    """Every cell's 2 ranks, :data:`CONCURRENT` cells at a time (each with its own port and folder
    ``<root>/<entry>-<rank>``): per cell, the exit codes, the seconds from the fault to each exit,
    the stderr. A cell's ranks still running :data:`STALL_S` + 60 s after its start are killed."""
    pending, running, results = list(cells), {}, {}
    while pending or running:
        while pending and len(running) < CONCURRENT:
            cell = pending.pop(0)
            out = root / cell.replace(":", "-")
            running[cell] = (start_ranks(2, _worker, cell, str(out), logs=out), out)
        for cell, (ranks, out) in list(running.items()):
            if ranks.poll() or time.time() > ranks.started + STALL_S + 60:
                ranks.kill()
                del running[cell]
                fault = out / "fault.json"
                t0 = json.loads(fault.read_text())["t"] if fault.exists() else float("nan")
                seconds = [float("inf") if e is None else round(e - t0, 1) for e in ranks.ended]
                results[cell] = {"cell": cell, "codes": ranks.codes, "seconds": seconds,
                                 "stderr": [ranks.stderr(r) for r in range(2)],
                                 "wall": round(time.time() - ranks.started, 1)}
        time.sleep(0.1)
    return results


def _problems(result: dict) -> list[str]:
    entry, failing = result["cell"].split(":")
    failing, peer = int(failing), 1 - int(failing)
    stderr, seconds = result["stderr"], result["seconds"]
    what = ENTRY_POINTS[entry]
    bound = PUSH_TIMEOUT_S + 10 if entry == "push_to_hub" else BOUND_S
    problems = []
    if not all(s <= bound for s in seconds):  # nan (no fault) fails too
        problems.append(f"seconds from the fault to the exits {seconds} (bound {bound} s)")
    caught = "caught: OfflineModeIsEnabled" if entry == "push_to_hub" and failing == 0 else \
        "the injected exception: True"
    if caught not in stderr[failing]:
        problems.append(f"rank {failing} did not catch its own exception ({caught!r})")
    if f"the job failed: rank {failing} " not in stderr[peer] or f"failed in {what}: " not in stderr[peer]:
        problems.append(f"rank {peer} does not name rank {failing} and {what!r}")
    if problems:
        problems.append(f"rank {peer} stderr: {stderr[peer][-1500:]}\nrank {failing} stderr: {stderr[failing][-1500:]}")
    return problems


CELLS = [f"{entry}:{rank}" for entry in ENTRY_POINTS for rank in (1, 0)]
PLAIN = "push_plain:0"  # for comparison: plain Trainer (DDP)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    results = _run_cells(CELLS + [PLAIN], tmp_path_factory.mktemp("catalogue"))
    for r in results.values():
        print(f"{r['cell']:22s} exits {r['codes']} at {r['seconds']} s after the fault (launch {r['wall']} s)")
    return results


@pytest.mark.parametrize("cell", CELLS)
def test_every_entry_point_fails_together(results, cell):
    problems = _problems(results[cell])
    assert not problems, f"{cell}: " + "\n".join(problems)


def test_plain_trainer_push_ends_within_its_timeout(results):
    assert max(results[PLAIN]["seconds"]) <= PUSH_TIMEOUT_S + 10, results[PLAIN]
