"""Cases of the Gated DeltaNet tests (``runtime/linear_attention.py``), shared by the one-process
test (``tests/runtime/test_linear_attention.py``, pp=1) and the launch (``tests/launch/test_linear_attention_launch.py``, pp=2).

A tiny model per Gated DeltaNet class (:data:`MODELS`: Qwen3-Next with dense MLPs, Qwen3.5,
Qwen3.5-MoE, OLMo Hybrid with rotary embeddings and without (its released checkpoints), Lara-Mini
with a sliding and a global layer; 4 decoder layers, linear attention at layers 0 and 2, 2 key
heads for 4 value heads, float32, ``initializer_range`` 0.2, convolution width 4: each token reads
3 earlier inputs) and 5 sequences of 150, 9, 7, 5 and 3 tokens. Sequence 0 is longer than two scan chunks (HF's
``chunk_size`` 64) and split at tokens 50, 52 and 101, none a multiple of 64; its second slice
(2 tokens) is shorter than the convolution's 3-token window, so the third slice's window reaches
two slices back. Chunks: three split chunks, a hybrid chunk (the tail plus sequence 1 whole) and a
packed chunk (sequences 2, 3, 4). Recompute: none, partial (the first half of each stage's
layers) or full, in every chunk.

The reference is HF on the right-padded batch (attention mask, labels -100 on the padding): for
these models each row then equals its sequence alone. Bounds: loss 1e-5 and every parameter's
gradient 1e-4 (relative, floored at 1e-3 of the largest gradient's norm), those of the other
families' tests; the Gated DeltaNet's ``A_log``, ``dt_bias`` and convolution weights are
reported by name.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import torch  # noqa: E402

import model_support  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
SEQ_LENS = (150, 9, 7, 5, 3)
#: (seq, start, length) per chunk: split, split (shorter than the convolution window), split, hybrid, packed
CHUNKS = (((0, 0, 50),), ((0, 50, 2),), ((0, 52, 49),), ((0, 101, 49), (1, 0, 9)),
          ((2, 0, 7), (3, 0, 5), (4, 0, 3)))
RECOMPUTE = ("none", "partial", "full")
#: the linear layers' own parameters every case reports by name
MIXER_PARAMS = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight")
SIZES = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2)
#: case name -> (model type, config overrides): one per Gated DeltaNet class (and OLMo Hybrid without RoPE)
MODELS = {
    "qwen3_next": ("qwen3_next", dict(num_experts=0)),
    "qwen3_5_text": ("qwen3_5_text", {}),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {}),
    "olmo_hybrid": ("olmo_hybrid", dict(linear_allow_neg_eigval=True)),
    "olmo_hybrid_nope": ("olmo_hybrid", dict(linear_allow_neg_eigval=True, rope_parameters=None)),
    "lara_mini": ("lara_mini", dict(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                                 "full_attention"])),
}


#: a looser gradient bound where HF against itself differs by more than half of GRAD_TOL once the scan
#: runs in other chunks (HF's ``torch_chunk_gated_delta_rule`` with ``chunk_size`` 16 instead of 64 on
#: :func:`batch`: 1.1e-4 on this MoE model's conv1d weights, float32 rounding through its routers), as
#: a plan's slices do
GRAD_TOL_OF = {"qwen3_5_moe_text": 2e-4}


def build_model(name: str = "qwen3_next"):
    return build_model_with(name)


def build_model_with(name: str, **more):
    """:func:`build_model` with the config overrides ``more`` on top of the case's."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = MODELS[name]
    cfg = model_support.tiny_config(model_type, **{**SIZES, **overrides, **more})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().train()
    assert (model.model.rotary_emb is None) == (name == "olmo_hybrid_nope")
    return model


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, model_support.VOCAB, (n,), generator=g) for n in SEQ_LENS]
    labels = [t.clone() for t in ids]
    labels[0][49:53] = -100  # across the first two slice boundaries
    return ids, labels


def num_items(labels) -> int:
    return sum(int((lab[1:] != -100).sum()) for lab in labels)


def padded_reference(model, ids, labels):
    """HF on the right-padded batch: (loss, {name: gradient}); the loss is the batch's token sum
    divided by :func:`num_items`, as the executor's."""
    import copy

    ref = copy.deepcopy(model)
    width = max(len(t) for t in ids)
    x = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    y = torch.full((len(ids), width), -100, dtype=torch.long)
    for i, (t, lab) in enumerate(zip(ids, labels)):
        x[i, :len(t)], mask[i, :len(t)], y[i, :len(t)] = t, 1, lab
    loss = ref(input_ids=x, attention_mask=mask, labels=y, num_items_in_batch=num_items(labels), use_cache=False).loss
    loss.backward()
    return float(loss.detach()), {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}


def make_plan(layout, recompute: str, chunks=CHUNKS, seq_lens=SEQ_LENS):
    from concertina_hf.planning import Chunk, ChunkKind, Plan, Slice, build_schedule

    built = []
    for i, spec in enumerate(chunks):
        slices = tuple(Slice(*s) for s in spec)
        built.append(Chunk(i, ChunkKind.of(slices, seq_lens), slices))
    groups = (tuple(range(len(built))),)
    per_stage = []
    for a, b in layout.layer_ranges:
        r = {"none": 0, "partial": (b - a) // 2, "full": b - a}[recompute]
        per_stage.append(tuple(r for _ in built))
    return Plan(strategy="linear-attention-test", seq_lens=seq_lens, layout=layout, chunks=tuple(built),
                groups=groups, schedule=build_schedule(built, groups, layout.num_stages),
                recompute=tuple(per_stage)).validate()


def gradient_errors(params, ref_grads) -> dict[str, float]:
    """Relative difference of each parameter's gradient (``params``: ``(name, parameter)``; floored
    at 1e-3 of the largest reference gradient's norm; a missing gradient is ``inf``)."""
    floor = 1e-3 * max(float(g.norm()) for g in ref_grads.values())
    out = {}
    for name, p in params:
        ref = ref_grads.get(name)
        if ref is None:
            ref = ref_grads.get("model.embed_tokens.weight") if name == "lm_head.weight" else None
        if ref is None or not p.requires_grad:
            continue
        if p.grad is None:
            out[name] = float("inf")
            continue
        out[name] = float((p.grad - ref).norm()) / max(float(ref.norm()), floor)
    return out


def check_case(name: str, loss: float, ref_loss: float, errors: dict[str, float],
               grad_tol: float = GRAD_TOL, mixer_params: tuple[str, ...] = MIXER_PARAMS) -> tuple[dict, list[str]]:
    """A case's figures (loss difference, worst gradient, the mixer parameters', ``mixer_params``
    naming them by suffix) and its failures."""
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    mixer = {k: v for k, v in errors.items() if any(k.endswith(m) for m in mixer_params)}
    row = {"case": name, "loss": loss_err, "grad": max(errors.values()), "mixer": max(mixer.values(), default=None),
           "mixer_params": len(mixer)}
    failures = []
    if not loss_err < LOSS_TOL:
        failures.append(f"{name}: loss differs by {loss_err:.2e}")
    bad = {k: v for k, v in errors.items() if not v < grad_tol}
    if bad:
        failures.append(f"{name}: gradients differ: {sorted(bad.items(), key=lambda kv: -kv[1])[:5]}")
    return row, failures


#: the Trainer settings of the trainer runs (pp=2: the linear-attention launch; pp=2 x sp=2: the Ulysses one)
COMMON = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3, learning_rate=2e-3,
              logging_steps=1, report_to=[], disable_tqdm=True, seed=3, save_strategy="no")
LENGTHS = (5, 9, 17, 40, 70)


def dataset(n=12, seed=0):
    import random

    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_list([{"input_ids": [rng.randrange(model_support.VOCAB)
                                                      for _ in range(rng.choice(LENGTHS))]} for _ in range(n)])


def padded(rows):
    """Right padding, labels -100 on it: HF's Qwen3-Next then computes each row as its sequence alone."""
    import torch

    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        t = torch.tensor(r["input_ids"])
        ids[i, :len(t)], mask[i, :len(t)], labels[i, :len(t)] = t, 1, t
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lora_model():
    """:func:`build_model` with LoRA (r 4) on the Gated DeltaNet's and the attention's projections."""
    import peft

    model = build_model()
    torch.manual_seed(2)  # LoRA A is drawn at random
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        "in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "v_proj"]))
