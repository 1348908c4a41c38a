"""The analytic cost model's activation memory against the runtime's, per model family.

``CostModel.from_hf_config`` counts what autograd saves from the config alone
(``src/concertina_hf/planning/activations.py``): the norms' float32 internals, the gated MLP's four
intermediate-width tensors, attention's saved tensors under the kernel the runtime takes, MoE
routing, the final norm and loss on the last stage. Here each family of the test matrix (the tiny
configs of ``scripts/model_support.py``: hidden 64, 4 layers, vocab 96) runs one step on one
stage (embedding, layers, head) through :class:`PipelineExecutor` on CPU, and the step's measured
activation peak (``StepResult.peak_activation_bytes``: every tensor saved for backward or held by
the executor, each storage once) is compared with the model's ``act_memory`` of the chunk.

Bounds, per family and length: measured at most 1.05x predicted and at least 0.85x. The upper
one is the point: a plan within its budget on paper must fit (5% leaves room for what is counted
per token but allocated per call, e.g. MoE index tensors of a few bytes). The lower one keeps the
count honest: what it over-counts (the largest kind of layer for every layer of a model with
dense and MoE layers, upper bounds on the router's small tensors, float32 rotary tables in
bfloat16 models) stays within 15%, so budgets are not spent on memory that is never used.

Under bf16 autocast (float32 weights) the weight copies autocast keeps for the step are static
memory (``static_bytes_per_param``), not activations: the Llama case takes them out of the
measurement. A split sequence (two chunks, the later attending to the earlier's K/V) checks the
kernel's context term, and a whole step's allocation peak (backward included) the simulated peak
at a vocabulary of 4096. About 15 s on one core.

``python tests/runtime/test_analytic_memory.py`` prints measured / predicted for every case.
"""

from __future__ import annotations

import copy
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts"))

import pytest  # noqa: E402
import torch  # noqa: E402

import model_support  # noqa: E402
from concertina_hf.planning import (  # noqa: E402
    Chunk, ChunkKind, CostModel, DeviceSpec, Plan, Slice, StageLayout, build_schedule)
from concertina_hf.planning.activations import SINKS, SOFTCAPPED_ATTENTION  # noqa: E402
from concertina_hf.runtime import PipelineExecutor, PipelineWrapper  # noqa: E402
from concertina_hf.runtime.attention.kernels import choose_kernel  # noqa: E402

torch.set_num_threads(1)

#: the families of the test matrix: dense (Llama, Mistral, Qwen2/3, Granite, Phi-3's fused
#: projections, StableLM's LayerNorm, Cohere's parallel blocks, OLMo2's post-norms, nanochat),
#: Gemma-style norms (Gemma, Gemma2's soft-capped eager attention, Gemma3's two rotaries), MoE
#: (Mixtral, Qwen2-MoE's gated shared expert, Qwen3-MoE, gpt-oss's sinks and clamped experts) and
#: MLA (DeepSeek-V3: MoE with a dense first layer)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "stablelm", "cohere", "olmo2", "nanochat",
            "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
LENGTHS = (64, 256, 1024)
#: bfloat16 weights (RMSNorm's float32 copies and the compute-dtype tensors differ)
BF16 = ("llama", "qwen3", "gemma", "gemma2", "olmo2", "mixtral", "deepseek_v3")
LOW, HIGH = 0.85, 1.05


def _model(model_type: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no model type {model_type!r}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_support.tiny_config(model_type)).to(dtype)


def kernel_of(config, dtype: torch.dtype) -> str:
    """The kernel the runtime takes for this model on CPU (what the trainer passes the model)."""
    kind = config.model_type
    cap = getattr(config, "attn_logit_softcapping", None) if kind in SOFTCAPPED_ATTENTION else None
    return choose_kernel(torch.device("cpu"), dtype, softcap=cap, sink=kind in SINKS)


def _plan(layout: StageLayout, lens: tuple[int, ...], spec) -> Plan:
    chunks = []
    for i, sl in enumerate(spec):
        slices = tuple(Slice(*s) for s in sl)
        chunks.append(Chunk(i, ChunkKind.of(slices, lens), slices))
    groups = (tuple(range(len(chunks))),)
    return Plan("t", lens, layout, tuple(chunks), groups, build_schedule(chunks, groups, 1, prefetch=True),
                ((0,) * len(chunks),)).validate()


def measure(model_type: str, tokens: int, mode: str = "fp32", split: bool = False) -> tuple[int, float]:
    """``(measured, predicted)`` activation peak of one step of one stage on CPU: a whole sequence
    of ``tokens``, or (``split``) one in two chunks. ``mode``: ``fp32``, ``bf16`` (bfloat16
    weights) or ``amp`` (float32 weights under bf16 autocast)."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model = _model(model_type, dtype)
    n = model.config.num_hidden_layers
    layout = StageLayout.even(n, 1)
    wrapper = PipelineWrapper(copy.deepcopy(model), layout, 0)
    half = tokens // 2
    spec = [[(0, 0, half)], [(0, half, tokens - half)]] if split else [[(0, 0, tokens)]]
    plan = _plan(layout, (tokens,), spec)
    ids = [torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))]
    copies = 0
    if mode == "amp":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = PipelineExecutor(wrapper).run_step(plan, ids)
        # the weight copies of every Linear (autocast's cache, saved by the matmuls): static memory
        copies = sum(2 * m.weight.numel() for m in wrapper.modules() if isinstance(m, torch.nn.Linear))
    else:
        res = PipelineExecutor(wrapper).run_step(plan, ids)
    compute = 2 if mode != "fp32" else 4
    cost = CostModel.from_hf_config(model.config, DeviceSpec.cpu(), dtype_bytes=4 if mode != "bf16" else 2,
                                    compute_dtype_bytes=compute,
                                    attention_kernel=kernel_of(model.config, torch.bfloat16 if compute == 2 else dtype))
    predicted = sum(cost.act_memory(layout, 0, c) for c in plan.chunks)
    return res.peak_activation_bytes - copies, predicted


CASES = [(f, t, "fp32") for f in FAMILIES for t in LENGTHS] + [(f, 256, "bf16") for f in BF16] + [
    ("llama", t, "amp") for t in (64, 1024)]


@pytest.mark.parametrize("family, tokens, mode", CASES)
def test_measured_activations_within_bounds_of_the_analytic_count(family, tokens, mode):
    got, predicted = measure(family, tokens, mode)
    assert LOW * predicted <= got <= HIGH * predicted, (family, tokens, mode, got, predicted, got / predicted)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "deepseek_v3"])
def test_a_split_sequence_within_bounds(family):
    """Two chunks of one sequence in flight (the later slice attends to the earlier one's K/V):
    the CPU kernel saves the earlier slice's leaves, alive in the store anyway, and no copy."""
    got, predicted = measure(family, 512, split=True)
    assert LOW * predicted <= got <= HIGH * predicted, (family, got, predicted, got / predicted)


def step_peak(model_type: str, tokens: int, vocab: int = 4096) -> tuple[int, float]:
    """``(measured, predicted)`` allocation peak of a whole step (forward and backward, gradients
    in flight, the LM head's weight gradient) at a real vocabulary's scale against the analytic
    model's simulated peak less static memory, one stage on CPU, as ``test_memory_model.py``
    counts it for the profiled model."""
    from transformers import AutoModelForCausalLM

    from concertina_hf.planning import simulate
    from concertina_hf.runtime.memory import AllocationTracker

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_support.tiny_config(model_type, vocab_size=vocab))
    layout = StageLayout.even(model.config.num_hidden_layers, 1)
    wrapper = PipelineWrapper(copy.deepcopy(model), layout, 0)
    plan = _plan(layout, (tokens,), [[(0, 0, tokens)]])
    ids = [torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(1))]
    with AllocationTracker() as tracker:
        PipelineExecutor(wrapper).run_step(plan, ids)
    got = tracker.peak_bytes(exclude=[*wrapper.parameters(), *wrapper.buffers(),
                                      *(p.grad for p in wrapper.parameters())])
    cost = CostModel.from_hf_config(model.config, DeviceSpec.cpu(), dtype_bytes=4,
                                    attention_kernel=kernel_of(model.config, torch.float32))
    return got, simulate(plan, cost).peak_memory_bytes[0] - cost.static_memory(layout, 0)


@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral", "deepseek_v3", "gpt_oss"])
def test_a_whole_step_allocates_within_bounds_of_the_simulated_peak(family):
    """The step's peak is a backward's: the activations still held plus the head's gradients of
    the logits (float32, twice the vocabulary per token) or a layer's gradients (the eager
    formula's of its score block: ``bwd_transient_bytes_per_pair``)."""
    got, predicted = step_peak(family, 256)
    assert LOW * predicted <= got <= HIGH * predicted, (family, got, predicted, got / predicted)


if __name__ == "__main__":
    print("| family | mode | tokens | measured KiB | predicted KiB | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for fam, tok, mode in CASES + [(f, 512, "split") for f in ("llama", "qwen3", "mixtral", "deepseek_v3")]:
        m, p = measure(fam, tok, "fp32", split=True) if mode == "split" else measure(fam, tok, mode)
        print(f"| {fam} | {mode} | {tok} | {m / 1024:.0f} | {p / 1024:.0f} | {m / p:.3f} |", flush=True)
    for fam in ("llama", "gemma2", "mixtral", "deepseek_v3", "gpt_oss"):
        m, p = step_peak(fam, 256)
        print(f"| {fam} | whole step, vocab 4096 | 256 | {m / 1024:.0f} | {p / 1024:.0f} | {m / p:.3f} |", flush=True)
