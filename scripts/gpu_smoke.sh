#!/usr/bin/env bash
# The engine's GPU smoke run (one device call; carry .whl, made by scripts/gpu_wheels.sh):
# installs the wheels the image lacks and jaxllm itself, runs the gpu-marked tests,
# then `jaxllm bench step` at batch 1 and 64 on a tiny Llama and on a Llama-3.1-8B-shaped
# model with random bf16 weights, and the embedded SmolLM2 through `jaxllm generate`.
# Usage on the device: bash scripts/gpu_smoke.sh [attention backend, default pallas]
set -eo pipefail
BACKEND=${1:-pallas}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site .
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAXLLM_COMPILATION_CACHE=off
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -5 || true
jl() { python3 -c "import sys; from jaxllm.cli import main; sys.exit(main())" "$@"; }
jl generate --max-tokens 32 --attention-backend "$BACKEND" --max-num-batched-tokens 256 --max-model-len 1024 \
  | tee "$OUT/smollm2.txt" | tail -12
jl bench step --model tests/fixtures/tiny/llama --skip-tokenizer-init --attention-backend "$BACKEND" \
  --batch-sizes 1,64 --input-len 128 --output-len 64 --max-model-len 512 --json "$OUT/tiny.json"
jl bench step --model llama-3.1-8b --load-format dummy --dtype bfloat16 --attention-backend "$BACKEND" \
  --max-model-len 2048 --max-num-batched-tokens 512 --batch-sizes 1,64 --input-len 128 --output-len 128 \
  --json "$OUT/llama8b.json"
