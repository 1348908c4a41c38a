"""The PyTorch-native peer of ``benchmarks/torch_pipelining_peer.py``: its packing and its hand-split
stage modules against the single-process HF model (the benchmark's tiniest run:
``tests/benchmarks/test_torch_pipelining_peer.py``).

The stage modules are chained in one process here (what ``Schedule1F1B`` runs across two ranks,
micro-batch by micro-batch): the summed micro-batch losses and the gradients must equal one HF
forward/backward over all rows (``use_cache=False``; HF's packed-sequence mask from the position
ids), for the project's per-document attention and for HF's SDPA path, with and without
checkpointing.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _peer_worker import PeerStage, build_peer_model, doc_lengths, pack_rows, reference_loss  # noqa: E402

CONFIG = dict(model_type="llama", vocab_size=128, tie_word_embeddings=False, attention_dropout=0.0,
              max_position_embeddings=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=4, intermediate_size=64)


def _seqs() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 3, 9, 14, 2)]


def test_pack_rows_restarts_positions_per_document_and_row_and_pads_the_last_rows():
    seqs = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    p = pack_rows(seqs, 8, 2)
    assert p["num_tokens"] == 17
    assert p["input_ids"].shape == (4, 8)  # 17 tokens: 3 rows, rounded up to a multiple of 2 micro-batches
    assert p["input_ids"].flatten()[:17].tolist() == sum(seqs, [])
    assert p["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2],
        [0, 1, 2, 3, 4, 5, 6, 7],  # the third document from its start
        [0, 0, 1, 2, 3, 4, 5, 6],  # its last token cut by the row end: a new document, then padding
        [0, 1, 2, 3, 4, 5, 6, 7],  # a row of padding
    ]
    lab = p["labels"]
    assert lab[0].tolist() == [-100, 2, 3, 4, 5, -100, 7, 8]
    assert lab[1].tolist() == [-100, 10, 11, 12, 13, 14, 15, 16]
    assert lab[2].tolist() == [-100] * 8 and lab[3].tolist() == [-100] * 8
    assert doc_lengths(p["position_ids"][:2]) == [5, 3, 8]
    assert pack_rows([[1, 2, 3]], 8, 2)["input_ids"].shape == (2, 8)  # 1F1B over 2 stages needs 2 rows


@pytest.mark.parametrize("attention", ["concertina", "sdpa"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_peer_stages_equal_the_single_process_hf_model(attention, ckpt):
    packed = pack_rows(_seqs(), 12, 2)  # 33 tokens -> 4 rows of 12: cut documents and padding
    ref_model = build_peer_model(CONFIG, 0, "sdpa")
    ref_model.train()
    out = ref_model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"],
                    use_cache=False)
    out.loss.backward()
    assert abs(float(out.loss.detach()) - reference_loss(CONFIG, 0, packed)) < 1e-6

    model = build_peer_model(CONFIG, 0, attention)
    s0 = PeerStage(model, 0, 2, True, False, attention, ckpt)
    s1 = PeerStage(model, 2, 4, False, True, attention, ckpt)
    count = int((packed["labels"][:, 1:] != -100).sum())
    total = 0.0
    for mb in range(2):  # two micro-batches of two rows, as Schedule1F1B would split them
        rows = slice(2 * mb, 2 * mb + 2)
        pos = packed["position_ids"][rows]
        logits = s1(s0(packed["input_ids"][rows], pos), pos)
        lab = packed["labels"][rows]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, CONFIG["vocab_size"]),
                                                 lab[:, 1:].reshape(-1), ignore_index=-100, reduction="sum") / count
        loss.backward()
        total += float(loss)
    assert total == pytest.approx(float(out.loss.detach()), rel=1e-5)
    ref = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6, msg=name)
