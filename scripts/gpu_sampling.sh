#!/usr/bin/env bash
# What the sampling features cost on the device (issue 10), in one device call (carry .whl,
# made by scripts/gpu_wheels.sh): `jaxllm bench step` on the Llama-3.1-8B shape (random
# bf16 weights) at batch 256, 128 in / 128 out, three ways: greedy; every feature on
# (temperature 0.8, top-p 0.9, repetition/presence/frequency penalties, logprobs=5); and that
# with 64 of the 256 requests JSON-constrained (a byte-level tokenizer: scripts/byte_tokenizer.py).
# Each profiles 32 mid-decode steps (traces under /tmp/profile; summaries in $OUT's JSON).
# Usage on the device: bash scripts/gpu_sampling.sh
set -eo pipefail
source "$(dirname "$0")/gpu_setup.sh"
export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla  # the later runs reuse the first's forward executables
python3 scripts/byte_tokenizer.py /tmp/bytetok
common=(--model llama-3.1-8b --load-format dummy --dtype bfloat16 --tokenizer /tmp/bytetok --max-model-len 2048
        --max-num-batched-tokens 8192 --batch-sizes 256 --input-len 128 --output-len 128)
status=0
python3 -m jaxllm.cli bench step "${common[@]}" --json "$OUT/greedy.json" --profile-dir /tmp/profile/greedy || status=1
python3 -m jaxllm.cli bench step "${common[@]}" --sampling all --json "$OUT/all.json" \
  --profile-dir /tmp/profile/all || status=1
python3 -m jaxllm.cli bench step "${common[@]}" --sampling all --structured-requests 64 --json "$OUT/all-json.json" \
  --profile-dir /tmp/profile/all-json || status=1
exit $status
