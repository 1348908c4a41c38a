"""Which causal-LM model types of the installed transformers ConcertinaTrainer trains as HF does.

For every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny config (4 decoder layers,
hidden 64, 4 heads / 2 KV heads, vocab 96, every layer type of the default config in turn,
``sliding_window`` 16, dropout 0, ``initializer_range`` 0.2: realistic weight scales, since with
tiny weights soft-capping and logit scaling are nearly the identity and a wrong model passes;
embedding multipliers, logit scales and final soft-capping at values far from the identity
wherever the config has the attribute),
then one of:

- **refused**: :func:`concertina_hf.runtime.families.inspect_model` (what ``ConcertinaTrainer``
  runs at construction) raises, and the message is reported;
- **supported**: the runtime's own stage functions give HF's loss and gradients on a batch of
  4 sequences (30, 9, 7, 5 tokens) planned as a split chunk, a hybrid chunk (the long sequence's
  later slices with its earlier K/V, one packed with a short sequence) and a packed chunk, one
  layer recomputed: once through ``PipelineExecutor`` on one stage, once as a 2-stage layout
  (2 layers each) run stage after stage in this process. The reference is the HF model (eager
  attention, ``use_cache=False``) on each sequence alone, with ``num_items_in_batch`` = the
  batch's label count, float32. Bounds: loss 1e-5 and gradients 1e-4 relative;
- **MISMATCH** / **CRASH**: a bug (to fix, or a refusal to add); the script exits with status 1;
- **does not build**: the tiny config or the model cannot be built on this CPU (reason given).

A composite type of :data:`concertina_hf.runtime.composite.COMPOSITE_TYPES` (Gemma3's vision tower
and language model) is checked as ``ConcertinaTrainer`` trains it: its language model
(:func:`~concertina_hf.runtime.composite.text_view`) built from the tiny config of its text type
(less the logit work the composite's forward does not do, which the view refuses) beside a
one-layer vision tower, against the composite's own forward.

Each type runs in a worker process (restarted after a type that times out or kills it).
Usage::

    PYTHONPATH=src python scripts/model_support.py [--out docs/supported_models.md] [TYPE ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import select
import subprocess
import sys
import time
import warnings

SEQ_LENS = (30, 9, 7, 5)
#: (seq, start, length) per chunk: split, hybrid (tail + a whole sequence), hybrid, packed
CHUNKS = (((0, 0, 12),), ((0, 12, 10),), ((0, 22, 8), (1, 0, 9)), ((2, 0, 7), (3, 0, 5)))
VOCAB = 96
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
TIMEOUT_S = 90
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=48,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
             q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             max_position_embeddings=256, sliding_window=16, initializer_range=0.2, first_k_dense_replace=1,
             n_group=1, topk_group=1, num_experts_per_topk=2, vocab_size_per_layer_input=VOCAB,
             hidden_size_per_layer_input=8)
#: per-layer configs (``config.per_layer_config``, Gemma 4): the attributes a default config varies
#: per layer, at these values on the layers of the type the default varies (16 / 2 elsewhere): layers
#: of different head sizes and K/V heads
PER_LAYER_SIZES = dict(head_dim=32, num_key_value_heads=1, num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=16)
#: work outside the decoder layers, at values far from the identity (set wherever the config has the
#: attribute, even when its default is None: a model that does not use it then shows as a mismatch)
OUTSIDE = dict(embedding_multiplier=4.0, logit_scale=0.5, logits_scaling=3.0, final_logit_softcapping=2.0,
               # inside the attention: at these scales the scores are ~1, so a cap of 50 would be the identity
               attn_logit_softcapping=1.0)
#: a composite's vision tower, as small as it builds (never run: only its language model is checked)
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                   patch_size=4, head_dim=8, depth=1, num_heads=2)
#: attributes set even when the default config leaves them None (rotary code needs a head size, MoE
#: layers their sizes)
ALWAYS = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size",
          *OUTSIDE)


#: a Mamba2 mixer's sizes at hidden 64 (mamba_expand 2: 4 heads of 32)
MAMBA2_SIZES = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16)
#: settings of a type whose default config would leave a feature idle at the tiny sizes: Llama 4's
#: chunks of 8 tokens (below the batch's lengths, not dividing its slice boundaries 12 and 22),
#: rotary / chunked and NoPE / full layers alternating as its config derives them, and the NoPE
#: layers' temperature growing within the sequences (floor_scale 4, not 8192)
TINY_TYPE_SETTINGS = {"llama4_text": dict(attention_chunk_size=8, no_rope_layers=[1, 0, 1, 0],
                                          layer_types=["chunked_attention", "full_attention"] * 2,
                                          moe_layers=[0, 1, 2, 3], floor_scale=4, attn_scale=0.5),
                      # Kimi Delta Attention: 2 heads of 16 (the defaults, 32 of 128, take minutes on the CPU);
                      # MiniMax's lightning attention in blocks of 16 (the batch's slices cross block edges)
                      "kimi_linear": dict(linear_num_heads=2, linear_head_dim=16),
                      "minimax": dict(block_size=16),
                      # indexed attention: the top 8 keys of up to 30 (selection changes across slices), 8
                      # indexer heads (with 2, many scores are exact zeros: ties topk breaks by row length)
                      "deepseek_v32": dict(index_topk=8, index_head_dim=16, index_n_heads=8),
                      # GLM's "shared" layers reuse the previous "full" layer's selection (each stage of 2
                      # layers starts at a "full" one)
                      "glm_moe_dsa": dict(index_topk=8, index_head_dim=16, index_n_heads=8,
                                          indexer_types=["full", "shared"] * 2),
                      # Mamba2 layers beside attention layers: 4 heads of 32 in 2 groups, scan chunks of 16 (the
                      # split slices start off a chunk's edge); Bamba's layer types derive from attn_layer_indices
                      "bamba": dict(attn_layer_indices=[1, 3], **MAMBA2_SIZES),
                      "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2, **MAMBA2_SIZES),
                      # Falcon-H1: a Mamba2 beside the attention in every layer; its mup multipliers not 1
                      "falcon_h1": dict(mamba_d_ssm=128, ssm_multipliers=[0.5, 2.0, 1.5, 0.7, 3.0], ssm_in_multiplier=0.8,
                                        lm_head_multiplier=0.5, key_multiplier=1.3, attention_in_multiplier=0.9,
                                        ssm_out_multiplier=1.2, attention_out_multiplier=0.7, **MAMBA2_SIZES),
                      # Nemotron-H: the same sizes under its names; its default layers Mamba2, MoE, attention, MLP
                      "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2,
                                         chunk_size=16),
                      # Jamba: Mamba (1) at layers 0 and 2, attention (and MoE) at 1 and 3; dt rank 8
                      "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                    expert_layer_offset=1, mamba_dt_rank=8)}

#: the layer kinds of model types whose default config does not name each of them (LFM2's default
#: has only attention layers, LFM2-MoE's none: its layers would not build)
TINY_LAYER_KINDS = {"lfm2": ["conv", "full_attention"], "lfm2_moe": ["conv", "full_attention"]}


def tiny_config(model_type: str, **overrides):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    spec = cfg.__dict__.get("_heterogeneity_spec")  # a per-layer config: its attributes set globally first
    if spec is not None:
        cfg.allow_global_per_layer_attribute_access = True
    default_types = getattr(cfg, "layer_types", None)
    default_types = list(default_types) if isinstance(default_types, (list, tuple)) else []

    def put(name, value):
        try:
            setattr(cfg, name, value)
        except Exception:  # a property without a setter: the config derives it
            pass

    for k, v in {**SIZES, **OUTSIDE}.items():
        if hasattr(cfg, k) and (getattr(cfg, k, None) is not None or k in ALWAYS):
            put(k, v)
    for k in list(vars(cfg)):
        value = getattr(cfg, k, None)
        if ("dropout" in k or "pdrop" in k or "jitter" in k) and isinstance(value, float):
            put(k, 0.0)
        if k.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            put(k, 0)
    if getattr(cfg, "qk_rope_head_dim", None):  # multi-head latent attention: rotary on qk_rope_head_dim,
        put("head_dim", cfg.qk_rope_head_dim)  # as many key/value heads as query heads
        put("num_key_value_heads", cfg.num_attention_heads)
        if hasattr(cfg, "qk_head_dim"):
            put("qk_head_dim", cfg.qk_rope_head_dim + cfg.qk_nope_head_dim)
    default_types = TINY_LAYER_KINDS.get(model_type, default_types)
    if default_types:  # every layer type of the default config, in turn
        kinds = list(dict.fromkeys(default_types))
        put("layer_types", [kinds[i % len(kinds)] for i in range(cfg.num_hidden_layers)])
    for k in list(vars(cfg)):  # other per-layer lists (DeepSeek-V3.2's mlp_layer_types): the tiny model's
        value = getattr(cfg, k, None)  # layers, as built (save_pretrained validates their length)
        if k != "layer_types" and k.endswith("layer_types") and isinstance(value, list) and (
                len(value) > cfg.num_hidden_layers):
            put(k, value[:cfg.num_hidden_layers])
    for k, v in {**TINY_TYPE_SETTINGS.get(model_type, {}), **overrides}.items():
        setattr(cfg, k, v)
    if spec is not None:
        _tiny_per_layer(cfg, spec, default_types)
    return cfg


def _tiny_per_layer(cfg, spec, default_types) -> None:
    """The per-layer attributes of a default per-layer config at :data:`PER_LAYER_SIZES` on the tiny
    layers of the type the default varies (odd layers without layer types)."""
    first = min(spec.per_layer_overrides, default=None)
    kind = default_types[first] if first is not None and first < len(default_types) else None
    types = list(getattr(cfg, "layer_types", None) or [])
    layers = [i for i in range(cfg.num_hidden_layers) if (types[i] == kind if kind and types else i % 2 == 1)]
    attrs = {a: PER_LAYER_SIZES[a] for a in spec.per_layer_attributes if a in PER_LAYER_SIZES}
    cfg.per_layer_config = {i: dict(attrs) for i in layers}
    cfg.allow_global_per_layer_attribute_access = False


def tiny_composite_config(model_type: str, **overrides):
    """A composite config: :func:`tiny_config` of its text type (without the logit work the
    composite's forward does not do), :data:`TINY_VISION`, one image as 4 tokens."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    no_logit_work = dict(final_logit_softcapping=None, logit_scale=None, logits_scaling=None)
    cfg.text_config = tiny_config(cfg.get_text_config().model_type, **{**no_logit_work, **overrides})
    for k, v in TINY_VISION.items():
        if hasattr(cfg.vision_config, k):
            setattr(cfg.vision_config, k, v)
    if hasattr(cfg, "mm_tokens_per_image"):
        cfg.mm_tokens_per_image = 4
    for k in list(vars(cfg)):
        value = getattr(cfg, k, None)
        if k.endswith(("token_id", "token_index")) and isinstance(value, int) and value >= VOCAB:
            setattr(cfg, k, 0)
    return cfg


def batch():
    import torch

    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in SEQ_LENS]
    labels = [t.clone() for t in ids]
    labels[1][2:4] = -100
    labels[0][11:14] = -100  # across the first slice boundary
    return ids, labels


def make_plan(layout):
    from concertina_hf.planning import Chunk, ChunkKind, Plan, Slice, build_schedule

    chunks = []
    for i, spec in enumerate(CHUNKS):
        slices = tuple(Slice(*s) for s in spec)
        chunks.append(Chunk(i, ChunkKind.of(slices, SEQ_LENS), slices))
    groups = (tuple(range(len(chunks))),)
    # the hybrid chunk's first layer of each stage recomputed in backward
    recompute = tuple(tuple(1 if c == 2 else 0 for c in range(len(chunks))) for _ in range(layout.num_stages))
    return Plan(strategy="model-support", seq_lens=SEQ_LENS, layout=layout, chunks=tuple(chunks), groups=groups,
                schedule=build_schedule(chunks, groups, layout.num_stages), recompute=recompute).validate()


def reference(model, ids, labels):
    """HF on each sequence alone: summed loss (token-weighted over the batch) and gradients."""
    ref = copy.deepcopy(model)
    n = sum(int((lab[1:] != -100).sum()) for lab in labels)
    total = 0.0
    for t, lab in zip(ids, labels):
        loss = ref(input_ids=t[None], labels=lab[None], num_items_in_batch=n, use_cache=False).loss
        loss.backward()
        total += float(loss.detach())
    return total, {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}


def run_sequential(wrappers, plan, ids, labels, divisor):
    """The stages of ``plan`` one after the other in this process, with the runtime's stage
    functions (as :class:`~concertina_hf.runtime.PipelineExecutor` runs them on each rank):
    every chunk forward through all stages in plan order, then backward in reverse order, each
    chunk's non-final slices' K/V receiving the gradient their later slices put on its leaves."""
    import torch

    from concertina_hf.runtime import ChunkAttentionContext, KVStore, SliceSpec

    stores = [KVStore() for _ in wrappers]
    specs = []
    for c in plan.chunks:
        off, out = 0, []
        for s in c.slices:
            out.append(SliceSpec(s.seq, s.start, s.length, off, s.end == plan.seq_lens[s.seq]))
            off += s.length
        specs.append(out)
    outputs, inputs = {}, {}
    loss_sum = 0.0
    for c in range(len(plan.chunks)):
        x = None
        for st, w in enumerate(wrappers):
            ctx = ChunkAttentionContext(specs[c], stores[st], "cpu", requires_grad=True)
            if w.is_first:
                x = w.embed(torch.cat([ids[s.seq][s.start:s.start + s.length] for s in specs[c]]))
            else:
                x = x.detach().requires_grad_(True)
                inputs[(st, c)] = x
            y = w.run_layers(x, ctx, plan.recompute[st][c])
            if w.is_last:
                tgt = []
                for s in specs[c]:
                    t = labels[s.seq][s.start + 1:s.start + s.length + 1]
                    tgt.append(torch.cat([t, t.new_full((s.length - t.shape[0],), -100)]))
                loss = w.head_loss_sum(y, torch.cat(tgt))
                loss_sum += float(loss.detach())
                outputs[(st, c)] = loss / divisor
            else:
                outputs[(st, c)] = y
            x = y
    for c in reversed(range(len(plan.chunks))):
        grad = None
        for st in reversed(range(len(wrappers))):
            tensors, grads = [outputs.pop((st, c))], [grad]
            for s in specs[c]:
                if s.final:
                    continue
                for e in stores[st].entries(s.seq, s.start):
                    for t, leaf in ((e.k, e.k_leaf), (e.v, e.v_leaf)):
                        if leaf.grad is not None:
                            tensors.append(t)
                            grads.append(leaf.grad)
            torch.autograd.backward(tensors, grads)
            for s in specs[c]:
                if not s.final:
                    stores[st].free_slice(s.seq, s.start)
            grad = inputs.pop((st, c)).grad if st > 0 else None
    return loss_sum / divisor


def compare(got_loss, ref_loss, params, ref_grads):
    """(relative loss difference, worst relative gradient difference over parameters). A
    parameter's difference is relative to its reference norm, floored at 1e-3 of the largest
    (a gradient that is nearly 0, e.g. a key bias's, compares float noise)."""
    loss_diff = abs(got_loss - ref_loss) / max(abs(ref_loss), 1e-30)
    floor = 1e-3 * max((float(g.norm()) for g in ref_grads.values()), default=0.0)
    worst = 0.0
    for name, p in params:
        ref = ref_grads.get(name)
        if ref is None:
            ref = ref_grads.get("model.embed_tokens.weight") if name == "lm_head.weight" else None
        if p.grad is None or ref is None:
            if p.requires_grad and (ref is not None and float(ref.norm()) > floor):
                return loss_diff, float("inf")
            continue
        worst = max(worst, float((p.grad - ref).norm()) / max(float(ref.norm()), floor, 1e-30))
    return loss_diff, worst


def check_type(model_type: str, **overrides) -> dict:
    """One row of the table (see the module docstring); ``overrides``: config attributes."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from concertina_hf.planning import CostModel, StageLayout
    from concertina_hf.runtime import PipelineExecutor, PipelineWrapper
    from concertina_hf.training.run_setup import check_model_family
    from concertina_hf.runtime.composite import COMPOSITE_TYPES, text_view
    from concertina_hf.runtime.families import UnsupportedModelError, check_config

    row = {"type": model_type, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}
    composite = COMPOSITE_TYPES.get(model_type)
    try:
        cfg = tiny_composite_config(model_type, **overrides) if composite else tiny_config(model_type, **overrides)
    except Exception as exc:
        return dict(row, verdict="does not build", note=f"config: {type(exc).__name__}: {exc}")
    try:
        if composite is None:
            check_config(cfg)  # composite configs are refused before their (large) sub-models are built
    except UnsupportedModelError as exc:
        return dict(row, verdict="refused", note=str(exc))
    try:
        torch.manual_seed(0)
        if composite:  # the composite class (AutoModelForCausalLM may build the text model alone)
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager").float()
            row["class"] = type(model).__name__
        else:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    except Exception as exc:
        return dict(row, verdict="does not build", note=f"model: {type(exc).__name__}: {exc}")
    whole = model  # the reference: a composite's own forward
    try:
        model = text_view(model) if composite else model  # what ConcertinaTrainer trains of a composite
        check_model_family(model)  # ConcertinaTrainer's first check
    except UnsupportedModelError as exc:
        return dict(row, verdict="refused", note=str(exc))
    try:  # ConcertinaTrainer plans with the analytic cost model of the config
        CostModel.from_hf_config(model.config, dtype_bytes=4)
    except Exception as exc:
        return dict(row, verdict="CRASH", note=f"CostModel.from_hf_config: {type(exc).__name__}: {exc}")
    ids, labels = batch()
    n = sum(int((lab[1:] != -100).sum()) for lab in labels)
    try:
        whole.train()
        ref_loss, ref_grads = reference(whole, ids, labels)
        if composite:  # the composite's names -> its language model's (model.X, lm_head.X)
            names = {composite.text_key(k): k for k in ref_grads}
            ref_grads = {t: ref_grads[k] for t, k in names.items() if t is not None}
    except Exception as exc:
        return dict(row, verdict="does not build", note=f"HF reference: {type(exc).__name__}: {exc}")
    try:
        num_layers = len(model.model.layers)
        one = PipelineWrapper(copy.deepcopy(model), StageLayout.even(num_layers, 1), 0)
        res = PipelineExecutor(one).run_step(make_plan(one.layout), ids, labels, num_items_in_batch=n)
        row["pp1"] = compare(res.loss, ref_loss, list(one.named_parameters()), ref_grads)
        layout = StageLayout.even(num_layers, 2)
        stages = [PipelineWrapper(copy.deepcopy(model), layout, s) for s in range(2)]
        loss = run_sequential(stages, make_plan(layout), ids, labels, float(n))
        params = [(k, p) for w in stages for k, p in w.named_parameters()]
        tied = stages[0].tied_weight
        if tied is not None:  # the two copies' gradients summed, as sync_tied_gradients does
            tied.grad = tied.grad + stages[1].tied_weight.grad
            params = [(k, p) for k, p in params if p is not stages[1].tied_weight]
        row["pp2"] = compare(loss, ref_loss, params, ref_grads)
    except UnsupportedModelError as exc:
        return dict(row, verdict="refused", note=str(exc))
    except Exception as exc:
        return dict(row, verdict="CRASH", note=f"{type(exc).__name__}: {exc}")
    ok = all(l < LOSS_TOL and g < GRAD_TOL for l, g in (row["pp1"], row["pp2"]))
    if not ok:
        return dict(row, verdict="MISMATCH", note="")
    from concertina_hf.training.self_check import SelfCheckError, check_model

    try:  # what ConcertinaTrainer runs at construction must agree (concertina_self_check=True)
        check_model(model)
    except SelfCheckError as exc:
        return dict(row, verdict="MISMATCH", note=f"the self-check refuses it: {exc}")
    return dict(row, verdict="supported", note="")


def worker(types: list[str]) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    for t in types:
        t0 = time.perf_counter()
        try:
            row = check_type(t)
        except Exception as exc:
            row = {"type": t, "verdict": "CRASH", "note": f"{type(exc).__name__}: {exc}"}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print("RESULT " + json.dumps(row), flush=True)


def run_all(types: list[str], timeout: float) -> list[dict]:
    """Each type in a worker process; a type that hangs or kills its worker is reported as such
    and the worker restarted on the next type."""
    rows: dict[str, dict] = {}
    todo = list(types)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    while todo:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", *todo], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)
        t0 = time.time()
        while todo:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.1, timeout - (time.time() - t0)))
            if not ready:
                proc.kill()
                proc.wait()
                rows[todo[0]] = {"type": todo[0], "verdict": "does not build",
                                 "note": f"the tiny model did not build and run within {timeout:.0f} s"}
                print(f"{todo[0]}: timeout", file=sys.stderr, flush=True)
                todo.pop(0)
                break
            line = proc.stdout.readline()
            if not line:  # the worker died on todo[0]
                proc.wait()
                rows[todo[0]] = {"type": todo[0], "verdict": "CRASH",
                                 "note": f"the worker process died (exit status {proc.returncode})"}
                todo.pop(0)
                break
            if not line.startswith("RESULT "):
                continue
            row = json.loads(line[7:])
            rows[row["type"]] = row
            print(f"{row['type']}: {row['verdict']} {row.get('pp1', '')} {row.get('pp2', '')}", file=sys.stderr,
                  flush=True)
            todo.remove(row["type"])
            t0 = time.time()
        else:
            proc.wait()
    return [rows[t] for t in types]


def _fmt(pair) -> str:
    if not pair:
        return ""
    loss, grad = pair
    return f"{loss:.1e} / {grad:.1e}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def table(rows: list[dict], command: str) -> str:
    import torch
    import transformers

    from concertina_hf.runtime.families import SUPPORTED_LAYOUT

    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    lines = [
        "# Supported models",
        "",
        f"Every causal-LM model type of transformers {transformers.__version__} "
        f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {len(rows)} types; torch {torch.__version__}), checked by",
        "",
        "```",
        command,
        "```",
        "",
        "A tiny config per type (4 decoder layers, hidden 64, vocab 96, every layer type of the default config in "
        "turn, sliding window 16, dropout and router jitter 0, `initializer_range` 0.2; wherever the config has them: "
        "`embedding_multiplier` 4, `logit_scale` 0.5, `logits_scaling` 3, `final_logit_softcapping` 2, "
        "`attn_logit_softcapping` 1), then: **refused** (the message "
        "`ConcertinaTrainer` gives at construction), or **supported**: the runtime's stage functions give HF's loss "
        "and gradients (HF: eager attention, each sequence alone, `use_cache=False`, float32) on 4 sequences "
        "(30, 9, 7, 5 tokens) planned as split, hybrid and packed chunks with one layer recomputed, through "
        "`PipelineExecutor` on one stage (pp=1) and as 2 stages run one after the other (pp=2). Figures: relative "
        "loss difference / worst relative gradient difference over the parameters (bounds 1e-5 / 1e-4). "
        "**does not build**: the tiny config or model cannot be built on the CPU (not a verdict on the model). "
        "Every supported type also passes the trainer's own self-check (`concertina_self_check`). A composite type "
        "of `src/concertina_hf/runtime/composite.py` is checked on its language model (its text type's tiny config, "
        "a one-layer vision tower) against the composite's forward. Each refusal "
        "message ends with the supported layout, left out of the table: \"" + SUPPORTED_LAYOUT + "\". See "
        "`src/concertina_hf/runtime/families.py` for what is reproduced and what is refused, and why.",
        "",
        "Totals: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ".",
        "",
        "| model type | class | verdict | pp=1 loss / grad | pp=2 loss / grad | message |",
        "|---|---|---|---|---|---|",
    ]
    order = {"supported": 0, "MISMATCH": 1, "CRASH": 1, "refused": 2, "does not build": 3}
    for r in sorted(rows, key=lambda r: (order.get(r["verdict"], 9), r["type"])):
        note = r.get("note", "").replace(". " + SUPPORTED_LAYOUT, "")  # said once, above the table
        lines.append(f"| {r['type']} | {r.get('class', '')} | {r['verdict']} | {_fmt(r.get('pp1'))} | "
                     f"{_fmt(r.get('pp2'))} | {_cell(note)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: all causal-LM types)")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per model type")
    args = parser.parse_args()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    t0 = time.time()
    rows = run_all(types, args.timeout)
    command = "PYTHONPATH=src python scripts/model_support.py --out docs/supported_models.md"
    text = table(rows, command)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    else:
        print(text)
    print(f"{len(rows)} types in {time.time() - t0:.0f} s", file=sys.stderr)
    return 1 if any(r["verdict"] in ("MISMATCH", "CRASH") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
