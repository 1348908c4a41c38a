"""A plan's predicted activation peak holds what the step allocates.

Every backward computes each weight gradient as a new tensor before adding it into ``.grad``
(the LM head's and the embedding's dense one are ``vocab x hidden``), whatever the chunk's size,
so the model counts it beside the per-token transients: on a short chunk and a large vocabulary
that weight gradient is larger than the chunk's activations (six 16-token chunks on a vocabulary
of 4096 peak 46% over a model of per-token transients only, in the LM head's backward).

One process, one stage (embedding, layers and head), a tiny Llama profiled as the benchmarks do;
the step's allocated peak is counted the benchmarks' way (:class:`AllocationTracker`, every op
output, ``.grad`` absent at the start as after ``zero_grad(set_to_none=True)``, parameters and
their gradients left out). A few seconds. Two stages on two gloo ranks:
``tests/launch/test_memory_model_launch.py``.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from concertina_hf.planning import (Chunk, ChunkKind, CostModel, DeviceSpec, Plan, Slice, StageLayout, build_schedule,
                                    simulate)
from concertina_hf.planning.simulate import memory_moments
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
from concertina_hf.runtime.profiler import profile_cost_model

from _memory_cases import LARGE_VOCAB, LARGE_VOCAB_LAYERS, allocated_step_peak, large_vocab_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def stage():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(large_vocab_config(), attn_implementation="sdpa")
    cost = profile_cost_model(model, repeats=1, warmup=0, num_layers=LARGE_VOCAB_LAYERS, max_tokens=128)
    lay = StageLayout.even(LARGE_VOCAB_LAYERS, 1)
    return PipelineExecutor(PipelineWrapper(copy.deepcopy(model), lay, 0)), cost, lay


def _plan(lay: StageLayout, lens, spec, recompute) -> Plan:
    chunks = []
    for i, sl in enumerate(spec):
        slices = tuple(Slice(*s) for s in sl)
        chunks.append(Chunk(i, ChunkKind.of(slices, lens), slices))
    groups = (tuple(range(len(chunks))),)
    return Plan("t", tuple(lens), lay, tuple(chunks), groups, build_schedule(chunks, groups, 1, prefetch=True),
                (tuple(min(r, LARGE_VOCAB_LAYERS) for r in recompute),)).validate()


CASES = {
    # short chunks: the LM head's weight gradient is the peak (46% over before)
    "short": ([16] * 6, [[(i, 0, 16)] for i in range(6)], [0] * 6),
    "short-recompute": ([16] * 6, [[(i, 0, 16)] for i in range(6)], [2] * 6),
    "whole": ([64] * 3, [[(i, 0, 64)] for i in range(3)], [0] * 3),
    "split": ([200], [[(0, 0, 50)], [(0, 50, 50)], [(0, 100, 50)], [(0, 150, 50)]], [0, 1, 0, 2]),
    "hybrid": ([200, 10, 10], [[(0, 0, 100)], [(0, 100, 100)], [(1, 0, 10)], [(2, 0, 10)]], [0] * 4),
    # long context (profiled on 128 tokens): a whole 2048-token sequence, and one in 8 slices
    # (their K/V and its gradients carried; the 10M Llama of the measured benchmark: whole 4096
    # x1.000, 8 slices of 8192 x1.025 over the allocation, the K/V gradient buffers counted
    # during the LM head's backward, which runs before they exist)
    "long-whole": ([2048], [[(0, 0, 2048)]], [0]),
    "long-split": ([2048], [[(0, 256 * i, 256)] for i in range(8)], [0, 1, 0, 2, 0, 0, 1, 0]),
}


def test_profiled_weight_gradient_terms(stage):
    """The profiler measures the constant parts: the embedding's and the LM head's weight
    gradients (``vocab x hidden`` float32) and a layer's largest (its MLP matrix)."""
    _, cost, _ = stage
    grad = LARGE_VOCAB * 64 * 4
    assert cost.embed_bwd_transient_bytes == grad
    assert grad <= cost.head_bwd_transient_bytes <= 1.05 * grad
    assert 64 * 176 * 4 <= cost.bwd_transient_bytes <= 2 * 64 * 176 * 4


@pytest.mark.parametrize("case", sorted(CASES))
def test_allocated_peak_within_5_percent_of_the_prediction(stage, case):
    ex, cost, lay = stage
    plan = _plan(lay, *CASES[case])
    predicted = simulate(plan, cost).peak_memory_bytes[0] - cost.static_memory(lay, 0)
    got = allocated_step_peak(ex, plan)
    assert got <= 1.05 * predicted and predicted <= 1.05 * got, (case, got, predicted, got / predicted)


def test_weight_gradients_are_per_backward_not_per_token():
    """The analytic model too: a chunk's backward holds the LM head's weight gradient whatever
    its size, the embedding's backward is a moment of its own on stage 0 (after the chunk's
    layers freed their activations), and sp does not divide them (whole weights per GPU)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8)
    cost = CostModel.from_hf_config(cfg, DeviceSpec.a800())
    lay = StageLayout.even(8, 2)
    one = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, 1),))
    grad = 2 * 32000 * 1024
    assert cost.transient_memory(lay, 1, one) >= grad
    assert cost.embed_bwd_memory(lay, 0, one) >= grad and cost.embed_bwd_memory(lay, 1, one) == 0
    sp2 = cost.with_parallel(sp=2)
    assert sp2.embed_bwd_memory(lay, 0, one) >= grad and sp2.transient_memory(lay, 1, one) >= grad
    lens = (1, 1)
    chunks = [Chunk(i, ChunkKind.PACKED, (Slice(i, 0, 1),)) for i in range(2)]
    groups = (tuple(range(2)),)
    plan = Plan("t", lens, lay, tuple(chunks), groups, build_schedule(chunks, groups, 2, prefetch=True),
                ((0, 0), (0, 0))).validate()
    embed = [m for m in memory_moments(plan, cost, 0) if m.backward is None and m.action.kind.value == "B"]
    assert len(embed) == 2 and all(m.action.chunk not in m.in_flight for m in embed)
    static = cost.static_memory(lay, 0)
    assert simulate(plan, cost).peak_memory_bytes[0] >= static + grad
