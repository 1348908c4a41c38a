"""The pipeline under an emulation of NCCL's message semantics on gloo (``CONCERTINA_EMULATE_NCCL``,
:mod:`concertina_hf.runtime.p2p`): a send completes only once its receive is posted, a channel runs
in issue order, the ``k``-th receive meets the ``k``-th send.

- The runtime's own cases (``_dist_runtime``: every chunking, split chains, the adaptive plans,
  evaluation, tied embeddings, two pipelines on subgroups) at pp = 2 and 4 on the executor's
  channels (one per direction between neighbours): every case passes against HF as under gloo.
- The same programs on one channel per neighbour pair (what one NCCL communicator per pair with
  batched sends and receives would run): the first split chain deadlocks, and the step fails
  naming the stage, the stuck batch and the peer it waited for. So the emulation bites.
- ``ConcertinaTrainer`` at pp = 2, pp = 4 and pp = 2 x sp = 2, sequences split into chains, on
  the executor's channels: the losses of one ``Trainer`` process.
"""

from __future__ import annotations

import json
import os
import re

import _dist_runtime
from _helpers import Launch, reports as read_reports, run_ranks


def _emulated(mode: str, timeout_s: int) -> dict[str, str]:
    return {"CONCERTINA_EMULATE_NCCL": mode, "CONCERTINA_EMULATE_NCCL_TIMEOUT_S": str(timeout_s)}


def test_runtime_cases_run_on_the_executors_channels(launched):
    for p in (2, 4):
        reports = read_reports(launched(f"runtime-pp{p}").out, p)
        assert [f for r in reports for f in r["failures"]] == []
        assert all(r["cases"] >= 2 * 11 + 2 * 2 + 3 for r in reports)


def test_one_channel_per_pair_deadlocks_on_a_split_chain(tmp_path):
    # its own launch, in the test: the 5 s the emulation waits for a receive is the subject
    run_ranks(2, _dist_runtime.worker, str(tmp_path), logs=tmp_path / "logs", env=_emulated("pair", 5))
    reports = read_reports(tmp_path, 2)
    first = [r["failures"][0] for r in reports]
    # stage 0 queued the forward after the chain ahead of the chain's first backward; stage 1
    # receives that forward only after sending the chain's backwards
    assert re.search(r"pipeline stage 0 \(rank 0\) failed after [\d.]+ s in 0SEND_F(\d+)\+0RECV_B(\d+) waiting for "
                     r"0RECV_B\2 from stage 1 \(rank 1\): emulated NCCL: .* failed: stage 0 SEND_F tag \d+ with stage 1 "
                     r"\(channel 0, message \d+\): its receive was not posted within 5 s", first[0]), first[0]
    assert re.search(r"pipeline stage 1 \(rank 1\) failed after [\d.]+ s in 1SEND_B\d+\+1RECV_F\d+ waiting for "
                     r"1RECV_F\d+ from stage 0 \(rank 0\): emulated NCCL", first[1]), first[1]


# ---------------------------------------------------------------------------------- trainer
LAYOUTS = {"pp2": (2, 1), "pp4": (4, 1), "pp2sp2": (2, 2)}


def test_trainer_on_the_executors_channels_matches_trainer(launched, tmp_path):
    from _models import train_reference

    ref, _ = train_reference("llama", tmp_path / "ref", metrics=False)
    for name, (pp, sp) in LAYOUTS.items():
        out = launched(f"trainer-{name}").out
        ranks = [json.loads((out / f"info-rank{r}.json").read_text()) for r in range(pp * sp)]
        assert all(r["emulated"] == "direction" for r in ranks)
        assert sum(ranks[0]["split_chunks"]) > 0, name  # the steps ran split chains
        diffs = [abs(a - b) for a, b in zip(ranks[0]["losses"], ref["losses"])]
        assert len(diffs) == len(ref["losses"]) and max(diffs) < 1e-5, (name, ranks[0]["losses"], ref["losses"])


def _worker(out: str, name: str) -> None:
    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments
    from _models import COMMON, logged, tiny_dataset, tiny_model

    pp, sp = LAYOUTS[name]
    args = ConcertinaTrainingArguments(output_dir=out, save_strategy="no", concertina_pipeline_size=pp,
                                       concertina_sequence_parallel_size=sp, concertina_max_tokens_per_chunk=24,
                                       **COMMON)
    trainer = ConcertinaTrainer(model=tiny_model("llama"), args=args, train_dataset=tiny_dataset())
    trainer.train()
    info = dict(logged(trainer), emulated=os.environ.get("CONCERTINA_EMULATE_NCCL"))
    with open(os.path.join(out, f"info-rank{args.process_index}.json"), "w") as f:
        json.dump(info, f)


#: the launches (started by the session, read through the ``launched`` fixture)
LAUNCHES = {f"runtime-pp{p}": Launch(p, _dist_runtime.worker, env=_emulated("direction", 60)) for p in (2, 4)}
LAUNCHES.update({f"trainer-{name}": Launch(pp * sp, _worker, name, env=_emulated("direction", 120))
                 for name, (pp, sp) in LAYOUTS.items()})
