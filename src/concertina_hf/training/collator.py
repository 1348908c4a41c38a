"""Padding-free batches that keep each sequence's length.

:class:`LengthAwareCollator` concatenates the batch's sequences into one row (no padding
tokens, so no compute or memory is spent on them) and returns their lengths, which is what the
step planner needs. The output is also a valid padding-free batch for a plain HF causal LM (the
same layout as ``transformers.DataCollatorWithFlattening``): ``position_ids`` restart at 0 for
each sequence, so HF's attention masks keep the sequences apart, and the first label of every
sequence is ``-100``, so no token is ever trained to predict the next sequence's first token.
Labels are per sequence: a row's own ``labels`` when it has them (``-100`` entries kept), else
its ``input_ids``. A row's positions with ``attention_mask == 0`` (pre-padded rows) are dropped:
padding never enters a chunk.

Padding and ``Trainer``: HF's causal-LM loss ignores ``attention_mask``: it trains every target
whose label is not ``-100``, including targets at padded positions and targets predicted from a
padded position. ConcertinaTrainer drops padding, so it does not train those;
:func:`padding_targets` counts them, and the collator (and ``ConcertinaTrainer`` for any other
collator's padded batches) warns once with the count. Give padded positions the label ``-100``
(``DataCollatorForLanguageModeling`` does) and the two agree.

Cost: one pass over the tokens (a Python list concatenation and one tensor per field).
:func:`split_sequences` is the inverse, and also understands the batches of
``DataCollatorWithFlattening`` and of padding collators (``attention_mask``), so
:class:`ConcertinaTrainer` accepts the collators people already use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

__all__ = ["LengthAwareCollator", "padding_targets", "padding_warning", "sequence_places",
           "split_sequences"]

logger = logging.getLogger(__name__)


def padding_warning(count: int, where: str) -> str:
    """The once-per-run warning about ``count`` targets involving padding (see the module docstring)."""
    return (f"{count} label(s) of {where} involve padding (a position with attention_mask == 0, or a target "
            "predicted from one) and are not -100: ConcertinaTrainer drops padded positions, so it does not train "
            "on them, but Trainer would have trained on them (HF's loss ignores attention_mask). Set the labels of "
            "padded positions to -100 (DataCollatorForLanguageModeling does) to train the same model; this warning "
            "is shown once")


@dataclass
class LengthAwareCollator:
    """Collate tokenized rows (``{"input_ids": [...], "labels": [...] (optional)}``) into one
    padding-free row.

    ``max_length``: sequences longer than this are truncated to their first ``max_length``
    tokens (``None``: keep them whole). A row's ``attention_mask`` (when it has one) drops its
    padded positions first, warning once when some of them carry labels (see the module
    docstring). Empty sequences are dropped (they hold no token to train on). A row with
    ``seq_lengths`` (a packed row of TRL's ``pack_dataset``) holds that many documents: each
    becomes its own sequence, so packed documents never attend to each other. Other fields of
    the rows (``length``, ``text``, ...) are ignored.

    >>> collate = LengthAwareCollator(max_length=4)
    >>> batch = collate([{"input_ids": [5, 6, 7]},
    ...                  {"input_ids": [8, 9, 10, 11, 12]},
    ...                  {"input_ids": [13, 14], "labels": [-100, 14]}])
    >>> batch["input_ids"]
    tensor([[ 5,  6,  7,  8,  9, 10, 11, 13, 14]])
    >>> batch["labels"]
    tensor([[-100,    6,    7, -100,    9,   10,   11, -100,   14]])
    >>> batch["position_ids"]
    tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]])
    >>> batch["seq_lens"]
    tensor([3, 4, 2])
    >>> [t.tolist() for t in split_sequences(batch)[0]]
    [[5, 6, 7], [8, 9, 10, 11], [13, 14]]
    >>> collate([{"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [2, 3]}])["seq_lens"]
    tensor([2, 3])
    """

    max_length: int | None = None
    return_position_ids: bool = True
    _warned: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"LengthAwareCollator(max_length={self.max_length}): max_length must be at least 1")

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        lens: list[int] = []
        for i, row in enumerate(features):
            if "input_ids" not in row:
                raise ValueError(
                    f"row {i} of the batch has no 'input_ids' (fields: {sorted(row)}); tokenize the dataset first "
                    "(concertina_hf.tools.data.tokenize_dataset) or keep the column (remove_unused_columns)"
                )
            x = _as_list(row["input_ids"])
            y = _as_list(row["labels"]) if row.get("labels") is not None else list(x)
            if len(y) != len(x):
                raise ValueError(f"row {i}: {len(y)} labels for {len(x)} input_ids; labels must be unshifted, one per token")
            m = _as_list(row["attention_mask"]) if row.get("attention_mask") is not None else None
            if m is not None:
                if len(m) != len(x):
                    raise ValueError(f"row {i}: attention_mask has {len(m)} entries for {len(x)} input_ids")
                if all(m):
                    m = None
                else:
                    lost = padding_targets({"input_ids": [x], "labels": [y], "attention_mask": [m]})
                    if lost and not self._warned:
                        self._warned = True
                        logger.warning(padding_warning(lost, f"row {i} of a batch"))
            docs = [len(x)]
            if row.get("seq_lengths") is not None:
                docs = _as_list(row["seq_lengths"])
                if sum(docs) != len(x):
                    raise ValueError(f"row {i}: seq_lengths sum to {sum(docs)} but the row has {len(x)} input_ids")
            start = 0
            for n in docs:
                dx, dy = x[start:start + n], y[start:start + n]
                if m is not None:  # padding never enters a chunk
                    keep = m[start:start + n]
                    dx = [t for t, k in zip(dx, keep) if k]
                    dy = [t for t, k in zip(dy, keep) if k]
                start += n
                if self.max_length is not None:
                    dx, dy = dx[: self.max_length], dy[: self.max_length]
                if not dx:
                    continue
                # The first label of a sequence is never a target of its own tokens; -100 also keeps a
                # flat HF forward from training the previous sequence's last token to predict it.
                dy[0] = -100
                ids += dx
                labels += dy
                positions += range(len(dx))
                lens.append(len(dx))
        out = {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "seq_lens": torch.tensor(lens, dtype=torch.long),
        }
        if self.return_position_ids:
            out["position_ids"] = torch.tensor([positions], dtype=torch.long)
        return out


def _as_list(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).tolist()
    return [int(t) for t in x]


def padding_targets(batch: Mapping[str, Any]) -> int:
    """How many targets ``Trainer`` would train on in a padded batch that ConcertinaTrainer
    drops: label ``labels[r, t + 1]`` is a target of position ``t`` (HF's shift) unless it is
    ``-100``; it involves padding when ``attention_mask`` is 0 at ``t`` or at ``t + 1``. 0 for a
    batch without ``attention_mask``.

    >>> padding_targets({"input_ids": [[5, 6, 0, 0]], "labels": [[5, 6, 0, 0]], "attention_mask": [[1, 1, 0, 0]]})
    2
    >>> padding_targets({"input_ids": [[5, 6, 0]], "labels": [[5, 6, -100]], "attention_mask": [[1, 1, 0]]})
    0
    """
    mask = batch.get("attention_mask")
    if mask is None:
        return 0
    mask = torch.as_tensor(mask).bool()
    labels = batch.get("labels")
    labels = torch.as_tensor(batch["input_ids"] if labels is None else labels)
    if mask.dim() == 1:
        mask, labels = mask[None], labels[None]
    if mask.shape != labels.shape or mask.shape[-1] < 2:
        return 0
    both = mask[:, :-1] & mask[:, 1:]
    return int(((labels[:, 1:] != -100) & ~both).sum())


def split_sequences(batch: Mapping[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The batch's sequences as ``(input_ids, labels)`` lists of 1-D tensors (labels unshifted).

    Understands, in this order: ``seq_lens`` (:class:`LengthAwareCollator`); ``cu_seq_lens_q``
    or ``position_ids`` restarting at 0 on a single row (``DataCollatorWithFlattening``); a
    padded ``[B, L]`` batch with ``attention_mask`` (pad positions dropped); a ``[B, L]`` batch
    without mask (every row is a whole sequence). Without ``labels`` the labels are the inputs.
    """
    input_ids, labels = _rows(batch)
    places = sequence_places(batch)
    return [input_ids[r][cols] for r, cols in places], [labels[r][cols] for r, cols in places]


def sequence_places(batch: Mapping[str, Any]) -> list[tuple[int, slice | torch.Tensor]]:
    """Where each sequence of :func:`split_sequences` sits in the batch's ``[B, L]`` rows:
    ``(row, columns)`` per sequence, ``columns`` a slice or a boolean mask of the row (so
    ``input_ids[row][columns]`` is the sequence). Per-token results laid out this way have the
    batch's shape, as the HF model's logits do.

    >>> sequence_places({"input_ids": torch.tensor([[5, 6, 7, 8]]), "seq_lens": torch.tensor([3, 1])})
    [(0, slice(0, 3, None)), (0, slice(3, 4, None))]
    """
    input_ids, _ = _rows(batch)
    lens: list[int] | None = None
    if batch.get("seq_lens") is not None:
        lens = [int(n) for n in torch.as_tensor(batch["seq_lens"]).reshape(-1).tolist()]
    elif batch.get("cu_seq_lens_q") is not None and input_ids.shape[0] == 1:
        cu = torch.as_tensor(batch["cu_seq_lens_q"]).reshape(-1).tolist()
        lens = [b - a for a, b in zip(cu, cu[1:])]
    elif batch.get("position_ids") is not None and input_ids.shape[0] == 1 and batch.get("attention_mask") is None:
        pos = torch.as_tensor(batch["position_ids"]).reshape(-1)
        starts = (pos == 0).nonzero().reshape(-1).tolist()
        if not starts or starts[0] != 0:
            raise ValueError("position_ids of a flattened batch must start at 0 for every sequence")
        bounds = starts + [pos.numel()]
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
    if lens is not None:
        mask = batch.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError(
                "a flattened batch (seq_lens / cu_seq_lens_q / position_ids) with attention_mask zeros: padding "
                "inside a flattened row is ambiguous; drop the padded positions in the collator or pass a padded "
                "[batch, length] batch with its attention_mask"
            )
        if sum(lens) != input_ids.shape[1] or input_ids.shape[0] != 1:
            raise ValueError(
                f"sequence lengths sum to {sum(lens)} but the flattened batch holds {input_ids.shape[1]} tokens"
            )
        starts = [sum(lens[:i]) for i in range(len(lens))]
        return [(0, slice(a, a + n)) for a, n in zip(starts, lens)]

    mask = batch.get("attention_mask")
    places: list[tuple[int, slice | torch.Tensor]] = []
    for r in range(input_ids.shape[0]):
        cols = slice(None) if mask is None else torch.as_tensor(mask[r]).bool()
        if input_ids[r][cols].numel():
            places.append((r, cols))
    return places


def _rows(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``labels`` (the inputs when there are none) as ``[B, L]`` tensors."""
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids)
    labels = batch.get("labels")
    if labels is None:
        labels = input_ids
    elif not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} differs from input_ids shape {tuple(input_ids.shape)}")
    if input_ids.dim() == 1:
        input_ids, labels = input_ids[None], labels[None]
    return input_ids, labels
