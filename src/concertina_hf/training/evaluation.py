"""``Trainer.prediction_step`` through the pipeline: the loss, the logits (or what
``preprocess_logits_for_metrics`` makes of them) and the labels of one evaluation batch.

The logits of a batch exist only on the last pipeline stage, one chunk at a time (a chunk packs
several sequences or holds a slice of one; with sequence parallelism the executor first gathers
the chunk's token shards over the stage's sp ranks, so each of them sees the whole chunk). :class:`PipelinePredictor` plans the batch, runs it
forward with an ``on_logits`` hook there that keeps, for every slice of every chunk, the slice's
logits ``[1, tokens, vocab]`` or, with ``preprocess_logits_for_metrics``, what that function
returns for them and the slice's labels ``[1, tokens]`` (so the full logits of a batch never
pile up: ``run_clm.py``'s ``argmax(-1)`` keeps one integer per token). The pieces are then laid
out like the batch's rows (:func:`~concertina_hf.training.collator.sequence_places`: one flat row for
:class:`~concertina_hf.training.collator.LengthAwareCollator` and ``DataCollatorWithFlattening``, row
``r`` at its ``attention_mask`` for padding collators), ``-100`` (Trainer's ``padding_index``)
at positions that hold no token, and broadcast from the last stage to every pipeline rank, so
``Trainer.evaluation_loop`` gathers them over the replicas in the dataset's order and calls
``compute_metrics`` on every rank, as it does for ``Trainer``.

With sequence parallelism (``sp > 1``) the last stage's ranks each hold a token shard of a
chunk's logits: with ``preprocess_logits_for_metrics`` each rank applies it to its own tokens
(each slice's part of its shard) and only the results are gathered over the stage's sp group, so
no rank holds a whole chunk's logits; without it the executor gathers the raw logits first.

What differs from ``Trainer``, and why metrics do not: ``preprocess_logits_for_metrics`` sees a
slice of a sequence at a time, so it must work token by token (return ``[1, tokens, ...]``,
e.g. an argmax; anything else is refused, naming it); the predictions at pad positions of a
padded batch are ``-100`` where Trainer has the model's output on pad tokens (their labels are
``-100`` either way).

Costs per batch beyond the forward: the kept pieces (a ``[tokens, vocab]`` copy of the logits
without preprocessing), and one object broadcast over the pipeline of the batch's predictions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from .collator import sequence_places, split_sequences

if TYPE_CHECKING:
    from ..runtime.distributed import Topology
    from ..runtime import PipelineExecutor, SliceSpec
    from .step_planner import StepPlanner
    from .step_reader import StepReader

__all__ = ["PipelinePredictor", "PADDING_INDEX"]

#: the value at positions without a token (``Trainer``'s ``padding_index`` of its containers)
PADDING_INDEX = -100

Preprocess = Callable[[torch.Tensor, torch.Tensor], Any]


class PipelinePredictor:
    """``(loss, predictions, labels)`` of an evaluation batch, as ``Trainer.prediction_step``.

    ``preprocess``: ``preprocess_logits_for_metrics`` to apply per slice on the last stage (the
    trainer moves it here for the length of an evaluation loop, so the loop does not apply it a
    second time).
    """

    def __init__(self, executor: PipelineExecutor, planner: StepPlanner, steps: StepReader,
                 topology: Topology) -> None:
        self.executor, self.planner, self.steps, self.topology = executor, planner, steps, topology
        self.preprocess: Preprocess | None = None

    def step(self, inputs: Mapping[str, Any], label_names: Sequence[str], loss_only: bool,
             device: torch.device) -> tuple[torch.Tensor, Any, Any]:
        """Run the batch forward (collective over the pipeline) under the caller's autocast."""
        seqs, labels = split_sequences(inputs)
        self.steps.check_token_ids(seqs, 0)
        plan = self.planner.plan(self.planner.submit([int(s.numel()) for s in seqs], background=False))
        keep = None if loss_only else _Pieces(labels, self.preprocess)
        with torch.no_grad():
            result = self.executor.run_step(plan, seqs, labels, train=False,
                                            on_logits=keep if keep is not None and self.executor.wrapper.is_last
                                            else None)
        loss = torch.tensor(float(result.loss), device=device)
        if loss_only:
            return loss, None, None
        preds = keep.assemble(inputs) if self.executor.wrapper.is_last else None
        if self.topology.pipeline_size > 1:
            preds = _to(preds, torch.device("cpu"))
            # (with sequence parallelism every sp rank of the last stage has gathered them)
            preds = self.topology.broadcast_in_pipeline(preds, src_stage=self.topology.pipeline_size - 1,
                                                        same_on_sp_ranks=True)
        label_ids = None
        if label_names and all(inputs.get(k) is not None for k in label_names):
            found = tuple(torch.as_tensor(inputs[k]).detach().to(device) for k in label_names)
            label_ids = found[0] if len(found) == 1 else found
        return loss, _to(preds, device), label_ids


class _Pieces:
    """The last stage's ``on_logits`` hook: per sequence, its slices' (preprocessed) logits."""

    def __init__(self, labels: Sequence[torch.Tensor], preprocess: Preprocess | None) -> None:
        self.labels = labels
        self.preprocess = preprocess
        self.by_seq: dict[int, list[tuple[int, tuple[torch.Tensor, ...]]]] = {}
        self.single = True

    @property
    def takes_sp_shards(self) -> bool:
        """With sequence parallelism, take each rank's token shard of the logits (the executor's
        ``on_logits`` protocol) when preprocessing: each rank preprocesses its own tokens and only
        the per-token results are gathered (raw logits are gathered by the executor instead)."""
        return self.preprocess is not None

    def __call__(self, slices: Sequence[SliceSpec], logits: torch.Tensor, sp: Any = None) -> None:
        if sp is not None:
            return self._shard(slices, logits, sp)
        for s in slices:
            self._keep(s.seq, s.start, logits[:, s.offset:s.offset + s.length])

    def _keep(self, seq: int, start: int, part: torch.Tensor, device: torch.device | None = None) -> None:
        """The (preprocessed) logits of tokens ``[start, start + tokens)`` of sequence ``seq``."""
        if self.preprocess is None:
            out: Any = part.clone()  # a copy: not a view keeping the chunk's logits alive
        else:
            lab = self.labels[seq][start:start + part.shape[1]].to(part.device)[None]
            out = self.preprocess(part, lab)
        self.single = isinstance(out, torch.Tensor)
        parts = (out,) if self.single else tuple(out)
        for p in parts:
            if not isinstance(p, torch.Tensor) or p.dim() < 2 or tuple(p.shape[:2]) != (1, part.shape[1]):
                got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise ValueError(
                    f"preprocess_logits_for_metrics returned {got} for logits of shape {tuple(part.shape)}: "
                    "ConcertinaTrainer applies it on the last pipeline stage to one slice of a sequence at "
                    "a time (logits [1, tokens, vocab], labels [1, tokens]) and lays the results out like "
                    "the batch's rows, so it must return one value per token, [1, tokens, ...] (e.g. "
                    "logits.argmax(-1)), or a tuple of such tensors")
        self.by_seq.setdefault(seq, []).append((start, tuple(p.detach().to(device or p.device) for p in parts)))

    def _shard(self, slices: Sequence[SliceSpec], logits: torch.Tensor, sp: Any) -> None:
        """Sequence parallelism: this rank preprocesses the tokens of its shard (chunk tokens
        ``[rank * t, (rank + 1) * t)``, each slice's part of them with its labels) and every rank
        of the group gets everyone's results (on the CPU; a failure on any rank raises on all)."""
        t = logits.shape[1]
        lo = sp.rank * t
        own: Exception | None = None
        self.by_seq, kept = {}, self.by_seq  # this chunk's pieces of this rank, apart
        try:
            for s in slices:
                a, b = max(s.offset, lo), min(s.offset + s.length, lo + t)
                if a < b:
                    self._keep(s.seq, s.start + a - s.offset, logits[:, a - lo:b - lo], torch.device("cpu"))
        except Exception as exc:  # raised below on every rank, so that none waits in the gather
            own = exc
        mine, self.by_seq = self.by_seq, kept
        gathered = sp.gather_objects((mine, self.single, None if own is None else f"{type(own).__name__}: {own}"))
        errors = [(r, e) for r, (_, _, e) in enumerate(gathered) if e is not None]
        if errors:
            rank, first = errors[0]
            raise ValueError(f"preprocess_logits_for_metrics failed on sequence-parallel rank {rank}: {first}") from own
        for pieces, single, _ in gathered:
            if pieces:
                self.single = single
            for seq, items in pieces.items():
                self.by_seq.setdefault(seq, []).extend(items)

    def assemble(self, batch: Mapping[str, Any]) -> Any:
        """The pieces in the batch's ``[B, L, ...]`` layout, ``PADDING_INDEX`` where no token is."""
        rows, length = _batch_shape(batch)
        places = sequence_places(batch)
        if not self.by_seq:
            return None
        per_seq = []
        for i in range(len(places)):
            pieces = [p for _, p in sorted(self.by_seq[i], key=lambda x: x[0])]
            per_seq.append(tuple(torch.cat([p[k] for p in pieces], dim=1)[0] for k in range(len(pieces[0]))))
        outs = []
        for k, first in enumerate(per_seq[0]):
            out = torch.full((rows, length, *first.shape[1:]), PADDING_INDEX, dtype=first.dtype, device=first.device)
            for (r, cols), seq in zip(places, per_seq):
                out[r][cols] = seq[k]
            outs.append(out)
        return outs[0] if self.single else tuple(outs)


def _batch_shape(batch: Mapping[str, Any]) -> tuple[int, int]:
    ids = torch.as_tensor(batch["input_ids"])
    return (1, int(ids.shape[0])) if ids.dim() == 1 else (int(ids.shape[0]), int(ids.shape[1]))


def _to(obj: Any, device: torch.device) -> Any:
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    return tuple(t.to(device) for t in obj)
