"""Worker of ``tests/launch/test_pipeline_memory.py``: four pipeline stages (gloo, one process each) run plans
of one long sequence in many slices under an ``AllocationTracker``; each rank writes its stage's
allocated activation peak next to the profiled cost model's prediction.

The layout is ``measured_sp.py``'s at pp=4 (8 layers: 1, 3, 3, 1 a stage; the embedding on the
one-layer first stage, the head on the one-layer last), the model a tiny Llama with its head
shape ratios (4 query heads, 2 K/V heads). Rows in each rank's report (``<outdir>/rank<r>.json``,
``rows``): ``[plan, stage, allocated, predicted]``.
"""

from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _helpers import gloo_rank  # noqa: E402

LAYERS = ((0, 1), (1, 4), (4, 7), (7, 8))
VOCAB = 1024
TOKENS = 2048


def memory_model():
    """A Llama of hidden size 64 (4 heads of 16, 2 K/V heads), 8 layers, a 1024-token
    vocabulary; fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * TOKENS,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def memory_profile() -> dict:
    """The profiled cost model of ``memory_model`` (one process, three layers)."""
    from concertina_hf.runtime.profiler import profile_cost_model

    return profile_cost_model(memory_model(), repeats=1, warmup=0, num_layers=3, max_tokens=512).to_dict()


def slicings() -> dict[str, list[tuple[int, int]]]:
    """``(start, length)`` slices of the one sequence: 32 equal ones, and 24 shrinking ones
    (equal attention work, as the planner cuts: later slices attend to more context)."""
    equal = [(i * 64, 64) for i in range(TOKENS // 64)]
    k = 24
    cuts = [round(TOKENS * math.sqrt(i / k)) for i in range(k + 1)]
    shrinking = [(a, b - a) for a, b in zip(cuts, cuts[1:])]
    return {"equal": equal, "shrinking": shrinking}


def worker(outdir: str, profile: dict) -> None:
    gloo_rank(outdir, lambda report: _run(profile, report["rows"]), timeout_s=300, rows=[])


def _run(profile: dict, rows: list) -> None:
    from _runtime_cases import allocated_activation_peak, make_plan
    from concertina_hf.planning import CostModel, StageLayout
    from concertina_hf.planning.simulate import simulate
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper

    rank = dist.get_rank()
    layout = StageLayout(8, LAYERS)
    cost = CostModel.from_dict(profile)
    w = PipelineWrapper(memory_model(), layout, rank)
    ex = PipelineExecutor(w)
    ids = [torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1))]
    for name, slices in slicings().items():
        plan = make_plan([TOKENS], [[(0, a, n)] for a, n in slices], layout, "none")
        peak = allocated_activation_peak(ex, plan, ids)  # the first step: backward writes .grad
        predicted = simulate(plan, cost).peak_memory_bytes[rank] - cost.static_memory(layout, rank)
        rows.append([name, rank, peak, predicted])
