#!/usr/bin/env bash
# gpu_check's CPU smoke run in a virtual environment with the GPU machine's image versions:
# Python 3.12, torch 2.11.0, transformers 5.17.0, accelerate 1.15.0, peft, tokenizers 0.23.2,
# safetensors 0.8.0, huggingface_hub 1.33.0, numpy 2.5.2 -- and without datasets, pulp, trl,
# flash-attn, wandb (absent there), the package not installed (gpu_check puts src/ on sys.path).
#
#   scripts/gpu_image_smoke.sh [VENV]       # VENV default /tmp/venv_gpuimg; built when missing
#
# Building it downloads torch 2.11's CUDA build (several GB; it runs on the CPU). PYTHON names a
# Python 3.12 interpreter (default python3.12), OUT the results folder (default: a new temporary
# one). Exit status: gpu_check's --strict (1 when a check that the CPU run holds to failed or a
# section raised), or 1 when the venv holds a package the GPU image lacks.
set -euo pipefail
VENV=${1:-/tmp/venv_gpuimg}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3.12}" -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.11.0
  "$VENV/bin/pip" install -q transformers==5.17.0 accelerate==1.15.0 tokenizers==0.23.2 safetensors==0.8.0 \
    huggingface_hub==1.33.0 numpy==2.5.2 peft tqdm xxhash pyyaml pytest pytest-timeout hypothesis
fi
for mod in datasets pulp trl flash_attn wandb concertina_hf; do
  if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$mod') is None)"; then
    echo "$mod is importable in $VENV; the GPU image has no $mod: use another venv" >&2
    exit 1
  fi
done
"$VENV/bin/python" -c "import sys, torch, transformers, accelerate; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
cd "$ROOT"
OUT=${OUT:-$(mktemp -d)}
env -u PYTHONPATH HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  "$VENV/bin/python" benchmarks/gpu_check.py --cpu-smoke --strict --out "$OUT"
echo "gpu_check CPU smoke passed on the GPU image's versions: $OUT/gpu_check.md"
