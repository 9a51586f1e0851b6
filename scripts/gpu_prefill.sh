#!/usr/bin/env bash
# Prefill-heavy engine run on the GPU (one device call; carry .whl, made by
# scripts/gpu_wheels.sh): `jaxllm bench step` on a Llama-3.1-8B-shaped model with
# random bf16 weights, 2048-token prompts in 2048-token steps, for each attention
# backend given (default: the platform's automatic choice, then pallas).
# Usage on the device: bash scripts/gpu_prefill.sh [backend ...]
set -eo pipefail
source "$(dirname "$0")/gpu_setup.sh"
export JAXLLM_COMPILATION_CACHE=off
backends=("$@"); [ ${#backends[@]} -gt 0 ] || backends=(auto pallas)
for backend in "${backends[@]}"; do
  flag=(); [ "$backend" = auto ] || flag=(--attention-backend "$backend")
  timeout ${RUN_S:-280} python3 -m jaxllm.cli \
    bench step --model llama-3.1-8b --load-format dummy --dtype bfloat16 "${flag[@]}" \
    --max-model-len 4096 --max-num-batched-tokens 2048 --batch-sizes 1,16 --input-len 2048 \
    --output-len 32 --json "$OUT/prefill_$backend.json" 2>&1 | grep -v Warning | tail -8
done
