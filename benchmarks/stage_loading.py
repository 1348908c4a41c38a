"""Loading and saving by stage: peak host memory per rank against the checkpoint's size.

Generates a float32 Llama checkpoint (sharded, ``save_pretrained(max_shard_size=...)``) in a
temporary directory, then launches ``--pp`` CPU ranks (``torchrun``) twice: ``ConcertinaTrainer``
given the directory by name (loading by stage) and given ``AutoModelForCausalLM.from_pretrained``
of it as an object (today's path). Each rank reports its peak resident memory (``VmHWM`` of
``/proc/self/status``) after construction and after ``save_model``, above the peak of a process
that only imports torch, transformers and concertina_hf; the saved directory of the by-name run
is compared with the checkpoint tensor for tensor (one file at a time) and loaded by
``AutoModelForCausalLM.from_pretrained`` (meta device: the names, shapes and files it accepts).
``--train-steps N`` also trains N steps after the save and reports the losses.

    python benchmarks/stage_loading.py              # pp=4, ~1.3 GB checkpoint
    python benchmarks/stage_loading.py --quick      # pp=4, ~0.44 GB
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
BOUND_CONSTRUCT, BOUND_SAVE = 0.35, 0.45
SIZES = {  # name: (vocab, hidden, intermediate, layers, heads)
    # many layers, as real models have (a 2-layer probe and the embeddings are then a small share)
    "1gb": (16000, 768, 2048, 40, 12),
    # the test's: large enough that each rank's fixed ~10-20 MiB (the meta model's modules, the
    # process group, Trainer's state) stays a small share beside a stage of ~0.25x
    "small": (4000, 512, 1024, 40, 8),
}


def vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def llama_config(size: str):
    from transformers import LlamaConfig

    vocab, hidden, inter, layers, heads = SIZES[size]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=False,
                       max_position_embeddings=512)


def generate(size: str, out: str, shard: str) -> int:
    """The checkpoint (float32, sharded); its bytes of tensors."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(size), dtype=torch.float32)
    model.save_pretrained(out, max_shard_size=shard)
    with open(os.path.join(out, "model.safetensors.index.json")) as fh:
        return int(json.load(fh)["metadata"]["total_size"])


def baseline(imports: str = "from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments") -> int:
    """The peak RSS of a process that only imports torch, transformers and concertina_hf (by
    default its trainer, as the workers do: ``import concertina_hf`` alone is lazy and leaves out
    ``transformers.Trainer``'s ~200 MiB of modules)."""
    code = (f"import torch, transformers\n{imports}\n"
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:')))")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=env).stdout.split()[-1])


# --- worker
def worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from concertina_hf import ConcertinaTrainer, ConcertinaTrainingArguments

    rank = int(os.environ.get("RANK", "0"))
    model = args.checkpoint if args.mode == "name" else AutoModelForCausalLM.from_pretrained(args.checkpoint)
    rng = random.Random(0)
    data = None
    if args.train_steps:
        import datasets

        vocab = SIZES[args.size][0]
        data = datasets.Dataset.from_list([{"input_ids": [rng.randrange(vocab) for _ in range(rng.choice([9, 30, 60]))]}
                                           for _ in range(4 * args.train_steps)])
    targs = ConcertinaTrainingArguments(
        output_dir=os.path.join(args.work, "run"), use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, concertina_pipeline_size=args.pp, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=max(1, args.train_steps), logging_steps=1, learning_rate=1e-3,
        seed=3, concertina_max_tokens_per_chunk=64, concertina_self_check=not args.no_self_check)
    trainer = ConcertinaTrainer(model=model, args=targs, train_dataset=data)
    del model
    built = vm_hwm()
    trainer.save_model(args.saved)
    saved = vm_hwm()
    losses = []
    if args.train_steps:
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    record = {"rank": rank, "stage": trainer.topology.stage, "construct_hwm": built, "save_hwm": saved,
              "stage_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
              "layers": list(trainer.layout.layer_ranges[trainer.topology.stage]), "losses": losses}
    with open(os.path.join(args.work, f"{args.mode}-rank{rank}.json"), "w") as fh:
        json.dump(record, fh)
    trainer.end()


def launch(mode: str, pp: int, checkpoint: str, saved: str, work: str, size: str, train_steps: int,
           no_self_check: bool = False) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from _helpers import free_port, worker_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(pp), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(pathlib.Path(__file__)), "--worker", "--mode", mode,
           "--checkpoint", checkpoint, "--saved", saved, "--work", work, "--pp", str(pp), "--size", size,
           "--train-steps", str(train_steps)] + (["--no-self-check"] if no_self_check else [])
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=3000)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} workers failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.load(open(os.path.join(work, f"{mode}-rank{r}.json"))) for r in range(pp)]


def compare_dirs(a: str, b: str) -> list[str]:
    """Tensors that differ between two HF directories (names, dtypes, shapes, values), read one at a time."""
    import torch
    from safetensors import safe_open

    def index(d):
        p = os.path.join(d, "model.safetensors.index.json")
        if os.path.isfile(p):
            return json.load(open(p))["weight_map"]
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as fh:
            return {k: "model.safetensors" for k in fh.keys()}

    ia, ib = index(a), index(b)
    bad = sorted(set(ia) ^ set(ib))
    for k in sorted(set(ia) & set(ib)):
        with safe_open(os.path.join(a, ia[k]), "pt") as fa, safe_open(os.path.join(b, ib[k]), "pt") as fb:
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or not torch.equal(x, y):
                bad.append(k)
    return bad


def measure(size: str, pp: int, shard: str, train_steps: int = 0, keep: str | None = None,
            no_self_check: bool = False) -> dict:
    with tempfile.TemporaryDirectory(dir=keep) as tmp:
        ckpt = os.path.join(tmp, "checkpoint")
        total = generate(size, ckpt, shard)
        base = baseline()
        plain = baseline("import concertina_hf")
        out: dict = {"size": size, "pp": pp, "self_check": not no_self_check, "checkpoint_bytes": total,
                     "baseline_hwm": base, "baseline_plain_import_hwm": plain,
                     "checkpoint_files": sorted(os.listdir(ckpt))}
        for mode in ("name", "object"):
            saved = os.path.join(tmp, f"saved-{mode}")
            ranks = launch(mode, pp, ckpt, saved, tmp, size, train_steps, no_self_check)
            for r in ranks:
                r["construct_x"] = (r["construct_hwm"] - base) / total
                r["save_x"] = (r["save_hwm"] - base) / total
            out[mode] = ranks
            if mode == "name":
                out["saved_files"] = sorted(os.listdir(saved))
                out["saved_differs"] = compare_dirs(ckpt, saved)
                out["saved_loads_with_hf"] = _hf_load_check(saved, ckpt)
            import shutil

            shutil.rmtree(saved, ignore_errors=True)
        return out


def _hf_load_check(saved: str, ckpt: str) -> bool:
    """``from_pretrained`` of the saved directory in a fresh process (no concertina_hf import):
    every tensor equals the checkpoint's (compared one tensor at a time)."""
    code = f"""
import sys, json, os, torch
from transformers import AutoModelForCausalLM
from safetensors import safe_open
m = AutoModelForCausalLM.from_pretrained({saved!r})
assert 'concertina_hf' not in sys.modules
idx = json.load(open(os.path.join({ckpt!r}, 'model.safetensors.index.json')))['weight_map']
sd = m.state_dict()
for k, f in idx.items():
    with safe_open(os.path.join({ckpt!r}, f), 'pt') as fh:
        assert torch.equal(sd[k], fh.get_tensor(k)), k
print('ok')
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return proc.returncode == 0 and proc.stdout.strip().endswith("ok")


def table(rec: dict) -> str:
    gb = rec["checkpoint_bytes"] / 1e9
    lines = [f"# Loading and saving by stage (pp={rec['pp']}, float32 checkpoint of {gb:.2f} GB, "
             f"{len(rec['checkpoint_files']) - 2} shards)", "",
             f"Peak RSS (VmHWM) of each rank above a process importing torch, transformers and concertina_hf "
             f"and its trainer ({rec['baseline_hwm'] / 2**20:.0f} MiB; a bare `import concertina_hf` peaks at "
             f"{rec['baseline_plain_import_hwm'] / 2**20:.0f} MiB), as a multiple of the checkpoint; self-check "
             f"{'on' if rec['self_check'] else 'off'}. Bounds: construction "
             f"<= {BOUND_CONSTRUCT}x, after save_model <= {BOUND_SAVE}x (by name).", "",
             "| path | rank | layers | stage weights (x ckpt) | after construction (x) | after save_model (x) |",
             "|---|---|---|---|---|---|"]
    for mode, label in (("name", "by name (stage loading)"), ("object", "model object (today's path)")):
        for r in rec[mode]:
            lines.append(f"| {label} | {r['rank']} | {r['layers'][0]}-{r['layers'][1] - 1} | "
                         f"{r['stage_bytes'] / rec['checkpoint_bytes']:.3f} | {r['construct_x']:.3f} | "
                         f"{r['save_x']:.3f} |")
    lines += ["", f"Saved directory (by name): {len(rec['saved_files'])} files "
              f"({', '.join(f for f in rec['saved_files'] if 'safetensors' in f)}); tensors differing from the "
              f"checkpoint: {len(rec['saved_differs'])}; AutoModelForCausalLM.from_pretrained in a process without "
              f"concertina_hf loads it equal to the checkpoint: {rec['saved_loads_with_hf']}."]
    if rec["name"][0]["losses"]:
        lines.append(f"Losses by name {rec['name'][0]['losses']}, as an object {rec['object'][0]['losses']}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="name")
    p.add_argument("--checkpoint")
    p.add_argument("--saved")
    p.add_argument("--work")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--size", default="1gb", choices=sorted(SIZES))
    p.add_argument("--shard", default="300MB", help="max_shard_size of the generated checkpoint")
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--no-self-check", action="store_true", help="concertina_self_check=False (its probe on "
                   "rank 0 has a fixed cost that dominates on a small checkpoint)")
    p.add_argument("--quick", action="store_true", help="pp=4 on the small checkpoint")
    p.add_argument("--out", default=str(HERE / "results" / "stage_loading"))
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, str(HERE))
    from _results import Run, write_results

    run = Run(__file__, argv)
    if args.quick:
        args.pp, args.size, args.shard = 4, "small", "120MB"
    rec = measure(args.size, args.pp, args.shard, args.train_steps, no_self_check=args.no_self_check)
    worst_c = max(r["construct_x"] for r in rec["name"])
    worst_s = max(r["save_x"] for r in rec["name"])
    rec["bounds"] = {"construct": BOUND_CONSTRUCT, "save": BOUND_SAVE, "worst_construct": worst_c,
                     "worst_save": worst_s,
                     "met": worst_c <= BOUND_CONSTRUCT and worst_s <= BOUND_SAVE and not rec["saved_differs"]
                     and rec["saved_loads_with_hf"]}
    write_results(args.out, table(rec), rec, run)
    return 0 if rec["bounds"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
