"""The stages whose activation memory the runtime tests measure against the plan's prediction,
on one process and on two gloo ranks (``tests/launch/test_profiler_launch.py``,
``tests/launch/test_memory_model_launch.py``).

- the profiler's (``tests/runtime/test_profiler.py``): a 4-layer Llama (or Qwen2) of hidden size 64
  on a 256-token vocabulary, a batch of 6 sequences in 4 chunks (split, hybrid, packed), four
  recompute settings; a step's peaks by the executor's meter and by every live tensor;
- a large vocabulary against short chunks (``tests/runtime/test_memory_model.py``): a 2-layer
  Llama on 4096 tokens, whose LM head's weight gradient outweighs a short chunk's activations; a
  step's allocated peak as the benchmarks count it.
"""

from __future__ import annotations

import torch

from concertina_hf.planning import Chunk, ChunkKind, Plan, Slice, StageLayout, build_schedule
from concertina_hf.runtime import PipelineExecutor
from concertina_hf.runtime.memory import AllocationTracker, LiveTensorMeter

# ---------------------------------------------------------------------------------- the profiler's stages
VOCAB = 256
NUM_LAYERS = 4
SEQ_LENS = (300, 90, 60, 40, 30, 20)
# the long sequence in 3 slices (the tail in a hybrid chunk), the short ones packed
CHUNKS = [[(0, 0, 120)], [(0, 120, 100)], [(0, 220, 80), (1, 0, 90)], [(2, 0, 60), (3, 0, 40), (4, 0, 30), (5, 0, 20)]]
RECOMPUTE = {"none": (0, 0, 0, 0), "partial": (2, 1, 3, 0), "full": (4, 4, 4, 4), "mixed": (4, 0, 4, 2)}
# the executor's per-chunk loss scalars (a few 4-byte tensors alive in the head's backward) are
# not in the cost model; a prediction that is exact otherwise may be under by that much
SCALAR_BYTES = 64


def profiler_config(kind: str = "llama"):
    """The profiler's tiny Llama (or Qwen2) configuration."""
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_LAYERS,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                           tie_word_embeddings=False)
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=False, use_sliding_window=False)


def profiler_model(kind: str = "llama", seed: int = 0):
    """:func:`profiler_config`'s model, from ``seed``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(profiler_config(kind), attn_implementation="sdpa")


def profiler_plan(recompute: tuple[int, ...], layout: StageLayout) -> Plan:
    """The test batch in 4 chunks; ``recompute[c]`` layers per chunk, capped by each stage's."""
    chunks = []
    for i, spec in enumerate(CHUNKS):
        slices = tuple(Slice(*s) for s in spec)
        chunks.append(Chunk(i, ChunkKind.of(slices, SEQ_LENS), slices))
    groups = (tuple(range(len(chunks))),)
    p = layout.num_stages
    rec = tuple(tuple(min(r, layout.num_stage_layers(st)) for r in recompute) for st in range(p))
    return Plan("test", SEQ_LENS, layout, tuple(chunks), groups,
                build_schedule(chunks, groups, p, prefetch=True), rec).validate()


def step_peaks(ex: PipelineExecutor, plan: Plan, ids) -> tuple[int, int]:
    """(executor meter peak, live-tensor peak) of one step; gradients exist beforehand so that
    their accumulation is not counted as activation memory."""
    w = ex.wrapper
    for p in w.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    exclude = [*w.parameters(), *w.buffers(), *(p.grad for p in w.parameters())]
    with LiveTensorMeter(exclude) as live:
        res = ex.run_step(plan, ids)
    return res.peak_activation_bytes, live.peak_bytes


# ---------------------------------------------------------------------------------- a large vocabulary
LARGE_VOCAB = 4096  # large against the activations of short chunks, as a real vocabulary is
LARGE_VOCAB_LAYERS = 2


def large_vocab_config():
    """The 2-layer Llama on :data:`LARGE_VOCAB` tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=LARGE_VOCAB, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=LARGE_VOCAB_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def allocated_step_peak(ex: PipelineExecutor, plan: Plan) -> int:
    """The allocated activation peak of one step on random ids (``.grad`` absent at the start, as
    after ``zero_grad(set_to_none=True)``; parameters, buffers and gradients left out)."""
    w = ex.wrapper
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, LARGE_VOCAB, (n,), generator=g) for n in plan.seq_lens]
    for p in w.parameters():
        p.grad = None
    with AllocationTracker() as t:
        ex.run_step(plan, ids)
    return t.peak_bytes(exclude=[*w.parameters(), *w.buffers(), *(p.grad for p in w.parameters())])
