#!/usr/bin/env bash
# Issue 9's comparison run, in one device call (carry .whl, made by scripts/gpu_wheels.sh; with
# PLOT=1 there it holds matplotlib too, in .whl/plot/, and the PNG is made on the device):
# Llama-3.1-8B shape, random bf16 weights, 128 in / 128 out, greedy, ignore_eos.
#   1. the device's ceilings, in this run: copy bandwidth (2 GiB, read + write) and the bf16
#      matmul rate (8192^3), through JAX and through torch (scripts/bench_bounds.py ceilings);
#   2. `jaxllm bench step --batch-sizes 1,8,32,64,128,256`: the decode step per batch size;
#   3. HF transformers' fastest plain path, after jaxllm has exited (the GPU to itself):
#      generate with a static cache and its torch.compile (reduce-overhead), batch 1, 64, 256
#      (scripts/bench_hf.py; a batch that would not fit in the time left is skipped);
#   4. `jaxllm bench throughput --num-prompts 1000`, if the time left allows;
# then prints the table last: per batch, jaxllm's and HF's step and tokens/s beside the memory
# and compute bounds (weights + KV bytes over the copy rate; FLOPs over the matmul rate) and
# jaxllm's share of the bound; writes $OUT/bench.json (the table's data) and, where
# matplotlib is, $OUT/bench_decode_tok_s.png (tokens/s against batch, log-log). Without it:
#   python scripts/bench_bounds.py plot --summary <OUT>/bench.json --png docs/bench_decode_tok_s.png
# Every step's JSON and its log's tail land in $OUT too. A step that fails or would not fit in
# the time left is reported and skipped; the table shows what there is.
#
# Time (budget BUDGET_S=540 s of the device call's 600), from docs/benchmarks.md's figures:
#   set-up (wheels, editable install)                                         ~15 s
#   ceilings: two processes, each an import and ~50 short runs                ~15 s each
#   bench step: start-up 40-90 s cold, 6 batches x (prefill + 128 steps + replay) ~120 s
#   HF: build ~20 s; a torch.compile of the decode forward ~60-90 s at batch 1 and again
#       at 64 (the batch dimension turns dynamic then; 256 reuses that graph); 8 generates
#       per batch (7.3 / 14.2 / 35.6 ms a step)                               ~200-280 s
#   throughput: start-up (the compilation cache) ~30-80 s + 128k tokens at ~12k tok/s ~90 s
#   total ~450-540 s; the throughput run is the first to go.
#
# Usage on the device: bash scripts/gpu_bench.sh
# CPU dry run (the tiny Llama, small counts, this checkout's .venv; HF under $HF_PY, which
# needs torch and transformers, default python3.11):
#   JAXLLM_DRY_RUN=1 bash scripts/gpu_bench.sh
set -o pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
BUDGET_S=${BUDGET_S:-540}
if [ -n "$JAXLLM_DRY_RUN" ]; then
  PY=${PY:-.venv/bin/python}; HF_PY=${HF_PY:-python3.11}; OUT=${OUT:-/tmp/out-bench}; mkdir -p "$OUT"
  MODEL=tests/fixtures/tiny/llama; CONFIG=$MODEL; LOAD=(--skip-tokenizer-init --dtype bfloat16)
  BATCHES=1,4,16; HF_BATCHES=1,16; IN=32; OUTLEN=16; PROMPTS=64; SEQS=16; BATCHED=1024; MAXLEN=512
  CEILING_ARGS=(--copy-bytes $((64 << 20)) --matmul-n 1024)
  EST_CEIL=20; EST_STEP=60; EST_HF=60; EST_TPUT=60
  export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla-dry
else
  PY=python3; HF_PY=python3
  source scripts/gpu_setup.sh
  if ls .whl/plot/*.whl > /dev/null 2>&1; then  # its own folder: the other runs' set-up leaves it out
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/plot-site \
      .whl/plot/*.whl && PLOT_PATH=/tmp/plot-site
  fi
  MODEL=llama-3.1-8b; CONFIG=models/configs/llama-3.1-8b.json; LOAD=(--load-format dummy --dtype bfloat16)
  BATCHES=1,8,32,64,128,256; HF_BATCHES=1,64,256; IN=128; OUTLEN=128; PROMPTS=1000; SEQS=256; BATCHED=8192; MAXLEN=2048
  CEILING_ARGS=()
  EST_CEIL=30; EST_STEP=120; EST_HF=120; EST_TPUT=90
  export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla  # the throughput run reuses bench step's executables
fi
export PYTHONUNBUFFERED=1
LOGS=/tmp/bench-logs; mkdir -p "$LOGS"
source scripts/gpu_steps.sh  # left, step
# The log's tail into $OUT, and the lines worth seeing here.
keep() {
  tr '\r' '\n' | tee "$LOGS/$1.log" | grep -v -i -e warning -e "Processed prompts" -e "^Compiling:" -e "^Loading weights" -e "^$" | tail -"$2"
  tail -n 150 "$LOGS/$1.log" > "$OUT/$1_log_tail.txt"
}

step "$EST_CEIL" "ceilings (JAX)" env XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" scripts/bench_bounds.py ceilings \
  --framework jax "${CEILING_ARGS[@]}" --output-json "$OUT/ceilings_jax.json" 2>&1 | keep ceilings_jax 4
step "$EST_CEIL" "ceilings (torch)" $HF_PY scripts/bench_bounds.py ceilings --framework torch "${CEILING_ARGS[@]}" \
  --output-json "$OUT/ceilings_torch.json" 2>&1 | keep ceilings_torch 4

ENGINE=(--model "$MODEL" "${LOAD[@]}" --max-model-len "$MAXLEN" --max-num-seqs "$SEQS" --max-num-batched-tokens "$BATCHED")
step "$EST_STEP" "jaxllm bench step" "$PY" -m jaxllm.cli bench step "${ENGINE[@]}" --batch-sizes "$BATCHES" \
  --input-len "$IN" --output-len "$OUTLEN" --output-json "$OUT/step.json" 2>&1 | keep step 12

# HF stops starting batches 10 s before the timeout, so what it measured is written.
step "$EST_HF" "HF transformers (static cache, torch.compile)" $HF_PY scripts/bench_hf.py --config "$CONFIG" \
  --batch-sizes "$HF_BATCHES" --input-len "$IN" --output-len "$OUTLEN" --budget-s $(( $(left) - 30 )) \
  --output-json "$OUT/hf.json" 2>&1 | keep hf 12

step "$EST_TPUT" "jaxllm bench throughput" "$PY" -m jaxllm.cli bench throughput "${ENGINE[@]}" \
  --num-prompts "$PROMPTS" --input-len "$IN" --output-len "$OUTLEN" --output-json "$OUT/throughput.json" \
  2>&1 | keep throughput 8

PYTHONPATH=${PLOT_PATH:+$PLOT_PATH:}$PYTHONPATH "$PY" scripts/bench_bounds.py table --dir "$OUT" --config "$CONFIG" \
  --input-len "$IN" --output-len "$OUTLEN" --batch-sizes "$BATCHES" --png "$OUT/bench_decode_tok_s.png"
echo "done in $(( SECONDS - T0 )) s"
