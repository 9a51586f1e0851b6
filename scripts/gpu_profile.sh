#!/usr/bin/env bash
# Issue 9's profile run, in one device call (carry .whl, made by scripts/gpu_wheels.sh), on the
# Llama-3.1-8B shape with random bf16 weights:
#   1. scripts/bench_fp8.py: which FP8 matmul forms XLA makes fast, against bf16 (~90 s);
#   2. `jaxllm bench step --batch-sizes 1,256 --input-len 1000 --output-len 96 --profile-dir`:
#      the decode step at context ~1k, with a trace of 32 mid-decode steps read back into the
#      kernels' time by kind and the longest-running kernels (cold start-up ~50 s + ~60 s);
#   3. start-up, cold and then warm (scripts/gpu_startup.py twice, its own compilation cache):
#      weights / KV cache / compile, the compile split into loading stored executables, tracing
#      and lowering, waiting on XLA and the first runs; the two starts' outputs must agree (~90 s);
#   4. `jaxllm bench throughput` at 128/128 (part "tput") and at 1000/1000 (part "tput1000", not
#      run by default) with MAX_SEQS (default 1024) sequences and 16384 batched tokens, vLLM's
#      defaults on this class of GPU (~120 s and ~150 s).
#   5. part "tput2048": throughput at 2048/128 (~120 s); part "qwen": the Qwen3-0.6B shape, 1000 prompts
#      of uniform 100-1024 in and out, under the profiler: tok/s and the device's idle share (~150 s);
#   6. part "check": the gpu-marked attention kernel tests, 8-bit caches included (~120 s).
# QUANT=fp8 runs the engine's parts with --quantization fp8, KV=fp8 with --kv-cache-dtype fp8. PARTS picks the parts: PARTS="step startup" bash scripts/gpu_profile.sh. A part that would not fit
# in the time left is skipped. Each prints its tail; the JSONs land in $OUT.
#
# Usage on the device: bash scripts/gpu_profile.sh
# CPU dry run (the tiny Llama, small counts, this checkout's .venv, no set-up):
#   JAXLLM_DRY_RUN=1 bash scripts/gpu_profile.sh
set -o pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
BUDGET_S=${BUDGET_S:-560}
if [ -n "$JAXLLM_DRY_RUN" ]; then
  PY=${PY:-.venv/bin/python}; OUT=${OUT:-/tmp/out-profile}; mkdir -p "$OUT"
  ENGINE=(--model tests/fixtures/tiny/llama --skip-tokenizer-init --max-model-len 512)
  STEP=(--batch-sizes 1,16 --input-len 64 --output-len 40); SEQS=64; BATCHED=1024; PROMPTS=64
  STARTUP_MODEL="tests/fixtures/tiny/llama 512"; LONG=(--max-model-len 400); LONG_IN=256
  SMALL=("${ENGINE[@]}"); SMALL_IN=(--input-len 40 --output-len 40)
  export FP8_BATCHES=1 JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla-dry
else
  PY=python3
  source scripts/gpu_setup.sh
  ENGINE=(--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 2048)
  STEP=(--batch-sizes 1,256 --input-len 1000 --output-len 96); SEQS=${MAX_SEQS:-1024}; BATCHED=16384; PROMPTS=1000
  LONG=(--max-model-len 2176); LONG_IN=2048
  SMALL=(--model qwen3-0.6b --load-format dummy --dtype bfloat16 --max-model-len 2048)
  SMALL_IN=(--input-len 562 --output-len 562 --random-range-ratio 0.82)  # uniform in [102, 1022]
  export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla
fi
# QUANT=fp8: every run with FP8 weights and activations; KV=fp8: with an e4m3 KV cache
NUMERICS=(${QUANT:+--quantization "$QUANT"} ${KV:+--kv-cache-dtype "$KV"})
ENGINE+=("${NUMERICS[@]}")
export PYTHONUNBUFFERED=1
source scripts/gpu_steps.sh  # left, step
# Every part's whole output also goes to $OUT/log.txt, which comes back even when a part times out.
quiet() { tr '\r' '\n' | tee -a "$OUT/log.txt" | grep -v -e Warning -e "Processed prompts" -e Compiling -e "it/s]" -e cuda_timer -e "Delay kernel"; }

PARTS=${PARTS:-fp8 step startup tput}  # which of the parts below to run
has() { [[ " $PARTS " == *" $1 "* ]]; }
# CHECK=float8: only the tests whose name has it (pytest -k)
has check && step 120 "kernel checks" timeout 240 "$PY" -m pytest -q -m gpu ${CHECK:+-k "$CHECK"} tests/kernels/test_attention.py \
  tests/kernels/test_mosaic_attention.py 2>&1 | quiet | tail -8
has fp8 && step 90 fp8 "$PY" scripts/bench_fp8.py 2>&1 | quiet | tail -70
has step && step 150 "bench step" "$PY" -m jaxllm.cli bench step "${ENGINE[@]}" --max-num-seqs 256 \
  --max-num-batched-tokens 8192 "${STEP[@]}" --profile-dir /tmp/profile --output-json "$OUT/step.json" 2>&1 | quiet | tail -40
if has startup; then  # a cold start (a fresh cache), then a warm one
  for start in cold warm; do
    step 90 "$start start-up" env JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-startup "$PY" scripts/gpu_startup.py $STARTUP_MODEL 2>&1 | quiet | tail -2
  done
fi
has tput && step 120 "throughput 128/128" "$PY" -m jaxllm.cli bench throughput "${ENGINE[@]}" --max-num-seqs "$SEQS" \
  --max-num-batched-tokens "$BATCHED" --input-len 128 --output-len 128 --num-prompts "$PROMPTS" \
  --output-json "$OUT/throughput.json" 2>&1 | quiet | tail -6
has tput1000 && step 150 "throughput 1000/1000" "$PY" -m jaxllm.cli bench throughput "${ENGINE[@]}" --max-num-seqs "$SEQS" \
  --max-num-batched-tokens "$BATCHED" --input-len 1000 --output-len 1000 --num-prompts "$PROMPTS" \
  --output-json "$OUT/throughput1000.json" 2>&1 | quiet | tail -6
has tput2048 && step 120 "throughput 2048/128" "$PY" -m jaxllm.cli bench throughput "${ENGINE[@]}" "${LONG[@]}" \
  --max-num-seqs "$SEQS" --max-num-batched-tokens "$BATCHED" --input-len "$LONG_IN" --output-len 128 \
  --num-prompts "$PROMPTS" --output-json "$OUT/throughput2048.json" 2>&1 | quiet | tail -6
has qwen && step 150 "Qwen3-0.6B, uniform 100-1024, profiled" "$PY" -m jaxllm.cli bench throughput "${SMALL[@]}" \
  "${NUMERICS[@]}" --max-num-seqs "$SEQS" \
  --max-num-batched-tokens "$BATCHED" "${SMALL_IN[@]}" --num-prompts "$PROMPTS" --profile-dir /tmp/profile-qwen \
  --output-json "$OUT/qwen.json" 2>&1 | quiet | tail -7
echo "done in $(( SECONDS - T0 )) s"
