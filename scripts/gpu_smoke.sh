#!/usr/bin/env bash
# The engine's GPU smoke run (one device call; carry .whl, made by scripts/gpu_wheels.sh):
# sets up as scripts/gpu_setup.sh does, then runs `jaxllm bench step` (128 in / 128 out)
# on the tiny Llama at batch 1 and 256 and on a Llama-3.1-8B-shaped model with random bf16
# weights at batch 1, 64 and 256, each with asynchronous scheduling on and off. Each bench
# exits 1 on wrong output lengths or a recompile, and so does this script. Each bench also
# profiles 32 steps in mid-decode (traces under /tmp/profile; the summaries in the JSON).
# (The embedded SmolLM2's 98 MB wheel exceeds what a device call can carry.)
# Usage on the device: bash scripts/gpu_smoke.sh [attention backend, default: automatic]
set -eo pipefail
BACKEND=${1:+--attention-backend $1}
source "$(dirname "$0")/gpu_setup.sh"
export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla  # the second run of a model reuses the first's executables
status=0
for sched in async-scheduling no-async-scheduling; do
  python3 -m jaxllm.cli bench step --model tests/fixtures/tiny/llama --skip-tokenizer-init $BACKEND --$sched \
    --batch-sizes 1,256 --input-len 128 --output-len 128 --max-model-len 512 --max-num-batched-tokens 8192 --num-gpu-blocks-override 8192 --json "$OUT/tiny-$sched.json" --profile-dir /tmp/profile/tiny-$sched || status=1
done
for sched in async-scheduling no-async-scheduling; do
  python3 -m jaxllm.cli bench step --model llama-3.1-8b --load-format dummy --dtype bfloat16 $BACKEND --$sched \
    --max-model-len 2048 --max-num-batched-tokens 8192 --batch-sizes 1,64,256 --input-len 128 --output-len 128 \
    --json "$OUT/llama8b-$sched.json" --profile-dir /tmp/profile/llama8b-$sched || status=1
done
exit $status
