#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md and docs/kernels.md, in one runner: it sets up, runs
# the named parts in order under one time budget, prints each part's table last, and keeps
# every result (each bench's JSON, traces' summaries, the tables) in an output folder.
#
# Usage: bash scripts/gpu_run.sh [OPTIONS] PART...
#   --wheels DIR   first install the wheels in DIR into /tmp/site (scripts/gpu_wheels.sh downloads
#                  those an image lacks) and jaxllm itself, editable; without it the runner takes
#                  jaxllm and the GPU extras as installed (pip install -e '.[cuda13,serve]')
#   --out DIR      the results, one folder per part (default $OUT, else /tmp/out); log.txt holds
#                  every command's whole output
#   --budget-s S   the run's time budget (default 540: a 600 s device call less set-up): a command
#                  whose estimate does not fit in the time left is SKIPPED, and each runs under a
#                  timeout of what is left, keeping 20 s for the tables
#   --dry-run      print each part's commands and run nothing
#   --tiny         the tiny Llama on this machine's CPU (this checkout's .venv), small counts: a
#                  check of the runner itself, not a measurement
# Exits 1 if a command failed (a skipped one does not count).
#
# Parts (the Llama-3.1-8B shape is `--model llama-3.1-8b --load-format dummy --dtype bfloat16`):
#   smoke       bench step 128/128: the tiny Llama at batch 1, 256 and the 8B shape at 1, 64, 256,
#               asynchronous scheduling on and off, 32 mid-decode steps profiled; BACKEND=NAME
#               picks the attention backend
#   step        bench step on the 8B shape at batch 1 and 256, context ~1k, profiled
#   tput tput1000 tput2048
#               bench throughput, 1000 prompts at 128/128, 1000/1000 and 2048/128, MAX_SEQS
#               sequences (default 1024) and 16384 batched tokens (CAPACITY=guaranteed_no_evict: the
#               admission that never preempts)
#   qwen        bench throughput on the Qwen3-0.6B shape, in and out uniform in about 100-1024, profiled
#   startup     bench startup twice against a fresh compilation cache: cold, then warm, whose
#               outputs must be the cold start's
#   fp8         bench fp8: FP8 matmul forms against bf16 (FP8_FORMS, FP8_BATCHES pick)
#   fp8-fused   the fused FP8 kernels (JAXLLM_FP8_FUSED, kernels/fp8_fused.py): their gpu-marked tests, then
#               the step part's bench step with FP8 weights and an e4m3 KV cache, the switch off, then on
#   prefix      bench throughput, 1000 requests sharing a 1024-token prefix, the prefix cache off
#               and on; bench report prefix
#   prefill     bench step on 2048-token prompts in 2048-token steps, per attention backend
#               (PREFILL_BACKENDS, default "auto pallas")
#   serve       the server against the offline engine, 1000/1000: bench throughput, bench latency
#               at batch 1, then jaxllm serve and bench serve at concurrency 256, 1, 64 and 16;
#               bench report serve
#   sampling    bench step at batch 256: greedy, every sampling feature, and that with 64 of the
#               256 requests JSON-constrained (a byte-level tokenizer)
#   hf-compare  the device's ceilings (bench bounds ceilings, JAX and PyTorch), bench step at batch
#               1-256, bench hf (HF transformers' static cache + torch.compile, in the time left),
#               bench throughput 128/128; bench bounds table, with the plot where matplotlib is
#               (its wheels in the wheel folder's plot/)
#   kernels     the gpu-marked kernel tests, then bench attention (ATTENTION_ARGS adds flags:
#               "--tune", "--skip-check --sections prefill")
#   long        bench step on the 8B shape at batch 1 and contexts LONG_LENS (default "1000 32000 100000"),
#               without and with the one-token bucket (JAXLLM_SINGLE_TOKEN_BUCKET=0 / 1; LONG_BUCKETS="1": with it only)
#   check       the gpu-marked kernel tests alone (CHECK=WORD: those whose name has it)
#   hybrid      the gpu-marked check of the hybrid KV cache and prefix hits through each backend
#   weights     bench weights on the 8B shape at half the device's memory (the trainer's half
#               stays free), in the default mode and with --batch-invariant
#   invariant   the batch-invariant mode's cost: bench invariant-matmul (its matmul against XLA's dot,
#               and its bits across row counts), then on the 8B shape bench step at batch 1, 64, 256 and
#               bench throughput 128/128 with and without --batch-invariant, and bench weights
#               --batch-invariant (a request alone and among 255 others, bit for bit)
#   spec        bench step on the 8B shape at batch 1, 8 and 64 with 0, 1, 2, 4 and 7 draft tokens per
#               request (the cost of verifying them); then bench spec, n-gram drafts end to end on
#               the embedded SmolLM2 (SMOLLM2_GGUF=PATH: that .gguf file) at batch 1 and 16, made on the
#               device (asynchronous scheduling), then on the host (synchronous)
#   draft       the draft model's tests on the GPU, then bench step on the 8B shape at batch 1, 8 and 64,
#               without drafts and with a dummy Llama-3.2-1B drafting k = DRAFT_TOKENS (default "2 4")
#   eagle       bench step on the 8B shape at batch 1, 8 and 64 without drafts, then with a random-weight
#               EAGLE-3 head of the 8B's published shape drafting k = DRAFT_TOKENS (default "2 4"), under
#               asynchronous scheduling (the draft model's too in the draft part): the cost of a step
#   moe-matmul  the grouped GEMM's gpu-marked tests, then bench moe-matmul at Qwen3-30B-A3B's experts (ragged_dot,
#               the Pallas and Mosaic kernels, bf16 and FP8; MOE_MATMUL_ARGS adds flags: "--tokens 1,256 --variants
#               pallas,dense", "--tiles m128x128x64x4x1,...")
#   ssd         the SSD scan's Pallas kernels: their gpu-marked tests, then bench ssd (Mamba2-2.7B's heads:
#               the decode update plain and in place at batch 1, 64 and 256; the prefill scan, plain JAX
#               and the kernel, beside an attention layer over the same prompt)
#   lora        bench serve 1000/1000 on the 8B shape: the base model on a server without LoRA, then 8
#               random rank-16 adapters mixed uniformly on a server with them (the throughput ratio, and
#               each server's start-up); LORA_PROMPTS requests (default 500)
#   embed       bench throughput --runner pooling on the 8B shape: 1000 prompts of 512 tokens embedded
#   tools       a server with --enable-auto-tool-choice --tool-call-parser hermes on the 8B shape: bench serve
#               of chat requests (512 in, 128 out) at concurrency 1 and 64, without tools and with
#               NUM_TOOLS (default 8) function tools in each: what tool calling costs a request
#   models      for each of MODELS (default "qwen3-30b-a3b llama-3.1-8b"; any bundled config, e.g.
#               deepseek-v2-lite, mamba2-2.7b) bench step at batch 1, 64 and 256 (128/128) and bench
#               throughput 128/128 at MAX_SEQS sequences (default 1024) and BATCHED batched tokens (default
#               16384; a Mamba model holds a state slot per sequence), PROMPTS prompts (default 1000)
#               (LONG=1: 1000/1000 too),
#               each beside its bounds (bench bounds table, the JAX ceilings measured first); PROFILE=1
#               profiles each batch's decode steps and prints the summary
#   kv-dtype    bench kv-dtype: decode attention over bf16 and e4m3 caches
#   quant       the quantized checkpoints' kernels: their gpu-marked tests (W4A16, block FP8), then
#               bench quant-matmul at the 8B's shapes (QUANT_ARGS adds flags: "--w4-tiles ...")
#   sampler     bench sampler: the sampler's pieces at [256, 128256]
#   multi-gpu   on 2-8 GPUs, each configuration of MULTI (default "tp1 tp2"): NAME[:MODES], NAME
#               one of tp1 tp2 tp4 tp8, dp2 dp4 dp8 (the 8B shape), 70b-tp4 70b-tp8 (the 70B
#               shape), tp2-ll tp2-ll128 tp2-simple (TP 2 with NCCL_PROTO forced), tp2-combine
#               (TP 2 with XLA's all-reduce combining and async collectives); MODES of step (bench
#               step at batch 1, profiled: the collectives' share), long (throughput 1000/1000),
#               short (2048/128), default all three; bench report multi. NVLink multicast stays
#               off. Parts that fit a 600 s call: x2 "tp1 tp2", then "dp2 tp2-ll:step
#               tp2-ll128:step tp2-simple:step tp2-combine:step"; x4 "tp4 dp4", then "70b-tp4";
#               x8 "tp8 dp8", then "70b-tp8"
#   profile     = fp8 step startup tput
# QUANT=fp8 runs the step, tput* and qwen parts with FP8 weights, KV=fp8 with an e4m3 KV cache.
set -o pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -o/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
PARTS=() WHEELS="" OUT=${OUT:-/tmp/out} BUDGET_S=${BUDGET_S:-540} DRY=0 TINY=0
while [ $# -gt 0 ]; do
  case $1 in
    --wheels) WHEELS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --budget-s) BUDGET_S=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --tiny) TINY=1; shift ;;
    -h|--help) usage ;;
    -*) echo "unknown option $1" >&2; usage 2 >&2 ;;
    *) PARTS+=("$1"); shift ;;
  esac
done
ALL_PARTS=" smoke step tput tput1000 tput2048 qwen startup fp8 fp8-fused prefix prefill serve sampling hf-compare kernels"
ALL_PARTS+=" long check hybrid weights invariant spec draft eagle moe-matmul ssd lora embed tools models kv-dtype quant sampler"
ALL_PARTS+=" multi-gpu "
[ ${#PARTS[@]} -gt 0 ] || { echo "name at least one part" >&2; usage 2 >&2; }
expanded=()
for part in "${PARTS[@]}"; do
  if [ "$part" = profile ]; then expanded+=(fp8 step startup tput); continue; fi
  [[ "$ALL_PARTS" == *" $part "* ]] || { echo "unknown part $part (parts:$ALL_PARTS)" >&2; exit 2; }
  expanded+=("$part")
done
PARTS=("${expanded[@]}")

T0=$SECONDS
exec 3>&1  # step's own lines pass the pipes that keep a command's tail
FAILED=$(mktemp)
trap 'rm -f "$FAILED"' EXIT
trap 'exit 130' INT TERM
export PYTHONUNBUFFERED=1
if [ $TINY = 1 ]; then
  PY=${PY:-.venv/bin/python}
  export JAXLLM_COMPILATION_CACHE=${JAXLLM_COMPILATION_CACHE:-/tmp/jaxllm-xla-tiny}
  MODEL8=tests/fixtures/tiny/llama WEIGHTS8=()
  M8=(--model "$MODEL8" --skip-tokenizer-init)  # it has no tokenizer: token-id prompts
  M70=("${M8[@]}") QWEN=("${M8[@]}") TINY_LLAMA=("${M8[@]}")
  CONFIG8=tests/fixtures/tiny/llama
else
  PY=${PY:-python3}
  export JAXLLM_COMPILATION_CACHE=${JAXLLM_COMPILATION_CACHE:-/tmp/jaxllm-xla}  # later runs reuse earlier executables
  MODEL8=llama-3.1-8b WEIGHTS8=(--load-format dummy --dtype bfloat16)
  M8=(--model "$MODEL8" "${WEIGHTS8[@]}")
  M70=(--model llama-3.1-70b --load-format dummy --dtype bfloat16)
  QWEN=(--model qwen3-0.6b --load-format dummy --dtype bfloat16)
  TINY_LLAMA=(--model tests/fixtures/tiny/llama --skip-tokenizer-init)
  CONFIG8=models/configs/llama-3.1-8b.json
fi
JAXLLM=("$PY" -m jaxllm.cli)
NUMERICS=(${QUANT:+--quantization "$QUANT"} ${KV:+--kv-cache-dtype "$KV"})

left() { echo $(( BUDGET_S - (SECONDS - T0) )); }
# show CMD...: the command as one would type it (an argument quoted only where it needs to be).
show() {
  local arg line='$'
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then line+=" $arg"; else line+=" $(printf %q "$arg")"; fi
  done
  echo "$line"
}
# run CMD...: a command of the set-up or a table, shown (and not run) in a dry run.
run() {
  if [ $DRY = 1 ]; then show "$@" >&3; return 0; fi
  "$@" && return 0
  echo "FAILED: $*" >&3; echo "$1" >> "$FAILED"; return 1
}
# step EST NAME CMD...: CMD if its estimate EST (s) fits in the time left, less 20 s for the
# tables, under a timeout of that; says SKIPPED or FAILED rather than stopping the run.
step() {
  local est=$1 name=$2; shift 2
  if [ $DRY = 1 ]; then show "$@" >&3; return 0; fi
  local rest=$(( $(left) - 20 ))
  if [ "$rest" -lt "$est" ] || [ "$rest" -lt 1 ]; then
    echo "SKIPPED $name: ${rest} s left, it needs ~${est} s" >&3; return 1
  fi
  echo "== $name ($(( SECONDS - T0 )) s in, ${rest} s left)" >&3
  timeout -k 20 "$rest" "$@"
  local status=$?
  if [ $status != 0 ]; then echo "FAILED $name (exit $status)" >&3; echo "$name" >> "$FAILED"; fi
  return $status
}
# quiet N: a command's output into log.txt, and its last N lines worth seeing here.
quiet() {
  if [ $DRY = 1 ]; then cat > /dev/null; return; fi
  tr '\r' '\n' | tee -a "$OUT/log.txt" | grep -v -i -e warning -e "Processed prompts" -e "^Compiling" \
    -e "it/s]" -e cuda_timer -e "Delay kernel" -e "^Loading weights" -e "^$" | tail -"$1"
}
folder() { D=$OUT/$1; [ $DRY = 1 ] || mkdir -p "$D"; }

setup() {
  [ $DRY = 1 ] || mkdir -p "$OUT"
  [ $TINY = 1 ] && return
  if [ -n "$WHEELS" ]; then
    run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WHEELS"/*.whl
    run "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    if ls "$WHEELS"/plot/*.whl > /dev/null 2>&1; then  # matplotlib, for hf-compare's plot only
      run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/plot-site \
        "$WHEELS"/plot/*.whl && PLOT_PATH=/tmp/plot-site
    fi
  elif [ $DRY = 0 ] && ! "$PY" -c "import jaxllm" 2> /dev/null; then
    echo "jaxllm does not import here: pip install -e '.[cuda13,serve]', or pass --wheels DIR" >&2; exit 2
  fi
  [ $DRY = 1 ] || nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
}

part_smoke() {
  local backend=(${BACKEND:+--attention-backend "$BACKEND"}) sched
  local big=(--batch-sizes 1,64,256 --input-len 128 --output-len 128)
  local tiny=(--batch-sizes 1,256 --input-len 128 --output-len 128)
  [ $TINY = 1 ] && big=(--batch-sizes 1,16 --input-len 16 --output-len 16) tiny=("${big[@]}")
  for sched in async-scheduling no-async-scheduling; do
    step 60 "smoke: tiny Llama, --$sched" "${JAXLLM[@]}" bench step "${TINY_LLAMA[@]}" "${backend[@]}" --$sched "${tiny[@]}" \
      --max-model-len 512 --max-num-batched-tokens 8192 --num-gpu-blocks-override 8192 --output-json "$D/tiny-$sched.json" \
      --profile-dir "/tmp/profile/tiny-$sched" 2>&1 | quiet 12
  done
  for sched in async-scheduling no-async-scheduling; do
    step 90 "smoke: 8B shape, --$sched" "${JAXLLM[@]}" bench step "${M8[@]}" "${backend[@]}" --$sched --max-model-len 2048 \
      --max-num-batched-tokens 8192 "${big[@]}" --output-json "$D/llama8b-$sched.json" \
      --profile-dir "/tmp/profile/llama8b-$sched" 2>&1 | quiet 12
  done
}

# step_1k NAME [VAR=VALUE...] [FLAG...]: bench step on the 8B shape at batch 1 and 256, context ~1k, profiled
# (into /tmp/profile and NAME less "step"), the variables set, into $D/NAME.json.
step_1k() {
  local name=$1 len=2048 shape=(--batch-sizes 1,256 --input-len 1000 --output-len 96) envs=(); shift
  while [[ "${1:-}" == *=* ]]; do envs+=("$1"); shift; done
  [ $TINY = 1 ] && len=512 shape=(--batch-sizes 1,16 --input-len 64 --output-len 40)
  step 150 "bench step, context ~1k, profiled ($name)" env "${envs[@]}" "${JAXLLM[@]}" bench step "${M8[@]}" "$@" \
    --max-model-len $len --max-num-seqs 256 --max-num-batched-tokens 8192 "${shape[@]}" \
    --profile-dir "/tmp/profile${name#step}" --output-json "$D/$name.json" 2>&1 | quiet 40
}
part_step() { step_1k step "${NUMERICS[@]}"; }

part_fp8-fused() {
  local fused
  step 60 "fused FP8 kernel tests" timeout 240 "$PY" -m pytest -q -m gpu tests/kernels/test_fp8_fused.py 2>&1 | quiet 25
  for fused in 0 1; do
    step_1k "step_fused$fused" JAXLLM_FP8_FUSED=$fused --quantization fp8 --kv-cache-dtype fp8
  done
}

# A lone request's decode step at long contexts, with and without the one-token bucket (whose
# attention splits the context over every SM): the long-context targets' figures.
part_long() {
  local lens=${LONG_LENS:-1000 32000 100000} len single
  [ $TINY = 1 ] && lens="64 400"
  for len in $lens; do
    for single in ${LONG_BUCKETS:-0 1}; do
      step 75 "bench step, batch 1, context $len, one-token bucket $single" env JAXLLM_SINGLE_TOKEN_BUCKET=$single \
        "${JAXLLM[@]}" bench step "${M8[@]}" "${NUMERICS[@]}" --max-model-len $(( len + 1024 )) --max-num-seqs 16 \
        --max-num-batched-tokens 8192 --batch-sizes 1 --input-len "$len" --output-len 64 \
        --output-json "$D/step_${len}_single$single.json" 2>&1 | quiet 6
    done
  done
}

# throughput EST IN OUT MAX_MODEL_LEN: bench throughput at MAX_SEQS sequences and 16384 batched tokens.
throughput() {
  local est=$1 in=$2 out=$3 max_len=$4 seqs=${MAX_SEQS:-1024} prompts=1000 batched=16384
  [ $TINY = 1 ] && seqs=64 prompts=64 batched=1024 max_len=512 in=$(( in > 256 ? 256 : in )) out=$(( out > 40 ? 40 : out ))
  step "$est" "throughput $2/$3" "${JAXLLM[@]}" bench throughput "${M8[@]}" "${NUMERICS[@]}" \
    ${CAPACITY:+--capacity-scheduler-policy "$CAPACITY"} --max-model-len "$max_len" \
    --max-num-seqs "$seqs" --max-num-batched-tokens "$batched" --input-len "$in" --output-len "$out" \
    --num-prompts "$prompts" --output-json "$D/throughput.json" 2>&1 | quiet 6
}
part_tput() { throughput 120 128 128 2048; }
part_tput1000() { throughput 150 1000 1000 2048; }
part_tput2048() { throughput 120 2048 128 2176; }

part_ssd() {
  local ssd=()
  [ $TINY = 1 ] && ssd=(--lengths 64 --chunk-sizes 16 --num-heads 4 --head-dim 16 --state-size 16 --decode-batches 2
                        --num-slots 8 --layers 2)
  step 60 "SSD kernel tests" timeout 120 "$PY" -m pytest -q -m gpu tests/kernels/test_ssd.py 2>&1 | quiet 5
  # (its Pallas kernel took 8.7 ms for a 1,024-token prompt on an H100, and the 4,096-token run
  # outlasted a 400 s call: the bench gets 180 s)
  step 120 "bench ssd" timeout 180 "${JAXLLM[@]}" bench ssd "${ssd[@]}" --output-json "$D/ssd.json" 2>&1 | quiet 14
}

part_embed() {
  local prompts=1000 in=512 batched=16384 max_len=1024
  [ $TINY = 1 ] && prompts=64 in=64 batched=1024 max_len=512
  step 120 "embeddings, $in-token prompts" "${JAXLLM[@]}" bench throughput "${M8[@]}" --runner pooling \
    --max-model-len "$max_len" --max-num-seqs 256 --max-num-batched-tokens "$batched" --input-len "$in" \
    --num-prompts "$prompts" --output-json "$D/embed.json" 2>&1 | quiet 4
}

part_qwen() {
  local lens=(--input-len 562 --output-len 562 --random-range-ratio 0.82) seqs=${MAX_SEQS:-1024} prompts=1000 batched=16384
  [ $TINY = 1 ] && lens=(--input-len 40 --output-len 40) seqs=64 prompts=64 batched=1024
  step 150 "Qwen3-0.6B shape, uniform 100-1024, profiled" "${JAXLLM[@]}" bench throughput "${QWEN[@]}" "${NUMERICS[@]}" \
    --max-model-len 2048 --max-num-seqs "$seqs" --max-num-batched-tokens "$batched" "${lens[@]}" --num-prompts "$prompts" \
    --profile-dir /tmp/profile-qwen --output-json "$D/qwen.json" 2>&1 | quiet 7
}

part_startup() {
  local cache=/tmp/jaxllm-startup-$$ max_len=2048
  [ $TINY = 1 ] && max_len=512
  local engine=(--model "$MODEL8" --load-format dummy --dtype bfloat16 --max-model-len "$max_len" --max-num-seqs 256
                --max-num-batched-tokens 8192 --skip-tokenizer-init)
  step 90 "cold start-up" env JAXLLM_COMPILATION_CACHE="$cache" "${JAXLLM[@]}" bench startup "${engine[@]}" \
    --output-json "$D/cold.json" 2>&1 | quiet 2
  step 90 "warm start-up" env JAXLLM_COMPILATION_CACHE="$cache" "${JAXLLM[@]}" bench startup "${engine[@]}" \
    --expect-outputs "$D/cold.json" --output-json "$D/warm.json" 2>&1 | quiet 2
}

part_weights() {
  local engine=(--max-model-len 2048 --gpu-memory-utilization 0.5) others=255 mode
  [ $TINY = 1 ] && engine=(--max-model-len 512) others=15
  for mode in no-batch-invariant batch-invariant; do
    step 120 "bench weights, --$mode" "${JAXLLM[@]}" bench weights "${M8[@]}" "${engine[@]}" --$mode \
      --num-others "$others" --output-json "$D/weights_$mode.json" 2>&1 | quiet 16
  done
}

part_invariant() {
  local engine=(--max-model-len 2048 --gpu-memory-utilization 0.5) prompts=1000 mm=() mode
  [ $TINY = 1 ] && engine=(--max-model-len 512) prompts=64 mm=(--shapes 64x128 --rows 2,16)
  step 120 "bench invariant-matmul" "${JAXLLM[@]}" bench invariant-matmul "${mm[@]}" \
    --output-json "$D/invariant_matmul.json" 2>&1 | quiet 26
  for mode in batch-invariant no-batch-invariant; do
    step 120 "bench step, --$mode" "${JAXLLM[@]}" bench step "${M8[@]}" "${engine[@]}" --$mode \
      --batch-sizes 1,64,256 --input-len 128 --output-len 128 --output-json "$D/step_$mode.json" 2>&1 | quiet 8
  done
  for mode in batch-invariant no-batch-invariant; do
    step 60 "throughput 128/128, --$mode" "${JAXLLM[@]}" bench throughput "${M8[@]}" "${engine[@]}" --$mode \
      --input-len 128 --output-len 128 --num-prompts "$prompts" --output-json "$D/throughput_$mode.json" 2>&1 | quiet 6
  done
  step 100 "bench weights, --batch-invariant" "${JAXLLM[@]}" bench weights "${M8[@]}" "${engine[@]}" \
    --batch-invariant --num-others 255 --output-json "$D/weights_bi.json" 2>&1 | quiet 16
}

part_spec() {
  local shape=(--batch-sizes 1,8,64 --input-len 128 --output-len 64 --draft-tokens 0,1,2,4,7) e2e=(--batch-sizes 1,16)
  [ $TINY = 1 ] && shape=(--batch-sizes 1,8 --input-len 16 --output-len 16 --draft-tokens 0,2) e2e=(--batch-sizes 1 --output-len 16)
  step 150 "bench step, k draft tokens" "${JAXLLM[@]}" bench step "${M8[@]}" --max-model-len 2048 \
    --gpu-memory-utilization 0.5 "${shape[@]}" --output-json "$D/step_drafts.json" 2>&1 | quiet 20
  step 150 "bench spec, SmolLM2" "${JAXLLM[@]}" bench spec ${SMOLLM2_GGUF:+--model "$SMOLLM2_GGUF"} --max-model-len 2048 \
    "${e2e[@]}" --output-json "$D/spec.json" 2>&1 | quiet 8
  step 150 "bench spec, SmolLM2, host drafts" "${JAXLLM[@]}" bench spec ${SMOLLM2_GGUF:+--model "$SMOLLM2_GGUF"} \
    --max-model-len 2048 --no-async-scheduling "${e2e[@]}" --output-json "$D/spec_host.json" 2>&1 | quiet 8
}

part_draft() {
  local shape=(--batch-sizes 1,8,64 --input-len 128 --output-len 64) draft=llama-3.2-1b len=2048 k
  [ $TINY = 1 ] && shape=(--batch-sizes 1,8 --input-len 16 --output-len 16) draft=$MODEL8 len=512
  step 90 "draft model tests" timeout 240 "$PY" -m pytest -q tests/engine/test_draft_model.py 2>&1 | quiet 5
  step 90 "bench step, no drafts" "${JAXLLM[@]}" bench step "${M8[@]}" --max-model-len $len \
    --gpu-memory-utilization 0.5 "${shape[@]}" --output-json "$D/step_plain.json" 2>&1 | quiet 8
  for k in ${DRAFT_TOKENS:-2 4}; do
    step 150 "bench step, draft model, k=$k" "${JAXLLM[@]}" bench step "${M8[@]}" --max-model-len $len \
      --gpu-memory-utilization 0.5 "${shape[@]}" --output-json "$D/step_draft$k.json" --speculative-config \
      "{\"method\": \"draft_model\", \"model\": \"$draft\", \"num_speculative_tokens\": $k}" 2>&1 | quiet 8
  done
}

# An EAGLE-3 head's config.json of the 8B's shape (EAGLE3-LLaMA3.1-Instruct-8B's): with
# --load-format dummy, the engine draws its weights at random (as the target's).
eagle3_head() {
  local folder=$1 hidden=4096 inter=14336 heads=32 kv=8 vocab=128256 draft_vocab=32000
  [ $TINY = 1 ] && hidden=64 inter=128 heads=4 kv=2 vocab=256 draft_vocab=64
  [ $DRY = 1 ] && return
  mkdir -p "$folder"
  cat > "$folder/config.json" <<JSON
{"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": $hidden, "intermediate_size": $inter,
 "num_hidden_layers": 1, "num_attention_heads": $heads, "num_key_value_heads": $kv, "vocab_size": $vocab,
 "draft_vocab_size": $draft_vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048,
 "hidden_act": "silu", "tie_word_embeddings": false}
JSON
}

part_eagle() {
  local shape=(--batch-sizes 1,8,64 --input-len 128 --output-len 64) len=2048 head=/tmp/eagle3-head method=eagle3 k
  # The tiny Llama's 2 layers are too few for EAGLE-3's three: an EAGLE-1 head of its shape.
  [ $TINY = 1 ] && shape=(--batch-sizes 1,8 --input-len 16 --output-len 16) len=512 method=eagle
  eagle3_head "$head"
  step 90 "bench step, no drafts" "${JAXLLM[@]}" bench step "${M8[@]}" --max-model-len $len --async-scheduling \
    --gpu-memory-utilization 0.5 "${shape[@]}" --output-json "$D/step_plain.json" 2>&1 | quiet 8
  for k in ${DRAFT_TOKENS:-2 4}; do
    step 150 "bench step, $method head, k=$k" "${JAXLLM[@]}" bench step "${M8[@]}" --load-format dummy --max-model-len $len \
      --gpu-memory-utilization 0.5 "${shape[@]}" --output-json "$D/step_${method}_$k.json" --speculative-config \
      "{\"method\": \"$method\", \"model\": \"$head\", \"num_speculative_tokens\": $k}" 2>&1 | quiet 8
  done
}

part_moe-matmul() {
  local mm=()
  [ $TINY = 1 ] && mm=(--experts 8 --top-k 2 --hidden-size 64 --intermediate-size 32 --tokens 1,64)
  [ $TINY = 1 ] || step 60 "grouped GEMM tests" timeout 180 "$PY" -m pytest -q -m gpu tests/kernels/test_grouped_matmul.py 2>&1 | quiet 20
  step 120 "bench moe-matmul" "${JAXLLM[@]}" bench moe-matmul "${mm[@]}" ${MOE_MATMUL_ARGS:-} \
    --output-json "$D/moe_matmul.json" 2>&1 | quiet 30
}

part_models() {
  local models=${MODELS:-qwen3-30b-a3b llama-3.1-8b} engine=(--max-model-len 2048) prompts=${PROMPTS:-1000} model
  local shape=(--batch-sizes 1,64,256 --input-len 128 --output-len 128)
  local tput=(--max-num-seqs "${MAX_SEQS:-1024}" --max-num-batched-tokens "${BATCHED:-16384}")
  local ceiling=()
  [ $TINY = 1 ] && models=${MODELS:-tests/fixtures/tiny/qwen3_moe} engine=(--max-model-len 512) prompts=64 tput=() \
    shape=(--batch-sizes 1,16 --input-len 16 --output-len 16) ceiling=(--copy-bytes $((64 << 20)) --matmul-n 1024)
  step 30 "ceilings (JAX)" env XLA_PYTHON_CLIENT_PREALLOCATE=false "${JAXLLM[@]}" bench bounds ceilings \
    "${ceiling[@]}" --output-json "$D/ceilings_jax.json" 2>&1 | quiet 4
  for model in $models; do
    local weights=(--load-format dummy --dtype bfloat16) name=${model##*/}
    [ $TINY = 1 ] && weights=(--skip-tokenizer-init)
    mkdir -p "$D/$name" && cp "$D/ceilings_jax.json" "$D/$name/" 2> /dev/null
    local profile=() shown=8
    [ "${PROFILE:-0}" = 1 ] && profile=(--profile-dir "/tmp/profile-$name") shown=60
    step 150 "bench step, $name" "${JAXLLM[@]}" bench step --model "$model" "${weights[@]}" "${engine[@]}" \
      "${shape[@]}" "${profile[@]}" --output-json "$D/$name/step.json" 2>&1 | quiet $shown
    step 120 "throughput 128/128, $name" "${JAXLLM[@]}" bench throughput --model "$model" "${weights[@]}" "${engine[@]}" \
      "${tput[@]}" --input-len 128 --output-len 128 --num-prompts "$prompts" --output-json "$D/$name/throughput.json" \
      2>&1 | quiet 6
    # The bounds beside the steps (at batch 1 a mixture of experts reads its top-k experts alone).
    run "${JAXLLM[@]}" bench bounds table --dir "$D/$name" --config "$model" "${shape[@]}"
    if [ "${LONG:-0}" = 1 ]; then
      step 200 "throughput 1000/1000, $name" "${JAXLLM[@]}" bench throughput --model "$model" "${weights[@]}" \
        "${engine[@]}" "${tput[@]}" --input-len 1000 --output-len 1000 --num-prompts "$prompts" \
        --output-json "$D/$name/throughput1000.json" 2>&1 | quiet 6
    fi
  done
}

part_fp8() {
  local batches=${FP8_BATCHES:-}
  [ $TINY = 1 ] && batches=${batches:-1}
  step 90 "bench fp8" "${JAXLLM[@]}" bench fp8 ${FP8_FORMS:+--forms "$FP8_FORMS"} ${batches:+--batches "$batches"} \
    --output-json "$D/fp8.json" 2>&1 | quiet 70
}

part_prefix() {
  local engine=(--max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192)
  local work=(--prefix-len 1024 --input-len 128 --output-len 128 --num-prompts 1000) mode
  [ $TINY = 1 ] && engine=(--max-model-len 512 --max-num-seqs 16 --max-num-batched-tokens 256) \
    work=(--prefix-len 64 --input-len 16 --output-len 16 --num-prompts 64)
  for mode in no-enable-prefix-caching enable-prefix-caching; do
    step 30 "prefix caching: --$mode" timeout -k 20 200 "${JAXLLM[@]}" bench throughput "${M8[@]}" "${engine[@]}" \
      "${work[@]}" "--$mode" --output-json "$D/prefix_$mode.json" 2>&1 | quiet 8
  done
  run "${JAXLLM[@]}" bench report prefix --dir "$D"
}

part_prefill() {
  local backend flag
  for backend in ${PREFILL_BACKENDS:-auto pallas}; do
    flag=(); [ "$backend" = auto ] || flag=(--attention-backend "$backend")
    step 60 "prefill, attention $backend" env JAXLLM_COMPILATION_CACHE=off timeout 280 "${JAXLLM[@]}" bench step \
      "${M8[@]}" "${flag[@]}" --max-model-len 4096 --max-num-batched-tokens 2048 --batch-sizes 1,16 --input-len 2048 \
      --output-len 32 --output-json "$D/prefill_$backend.json" 2>&1 | quiet 8
  done
}

part_serve() {
  local in=1000 out=1000 max_len=2048 offline_prompts=1000 seqs=256 batched=8192 port=${PORT:-8765}
  local conc=(256 1 64 16) prompts=(1000 4 256 64) est=(140 30 50 30) offline_est=150 latency_est=45 start_est=40
  [ $TINY = 1 ] && in=64 out=64 max_len=512 offline_prompts=64 seqs=64 batched=1024 prompts=(64 2 32 16) \
    est=(60 20 30 20) offline_est=90 latency_est=60 start_est=60
  local raw=/tmp/serve-raw tok=/tmp/wordtok
  [ $DRY = 1 ] || mkdir -p "$raw"
  run "$PY" -m jaxllm.benchmarks.dummy_tokenizer word "$tok" --model "$MODEL8" || return 1
  local engine=(--model "$MODEL8" "${WEIGHTS8[@]}" --tokenizer "$tok" --max-model-len "$max_len" --max-num-seqs "$seqs"
                --max-num-batched-tokens "$batched")
  step "$offline_est" "offline bench throughput" "${JAXLLM[@]}" bench throughput "${engine[@]}" \
    --num-prompts "$offline_prompts" --input-len "$in" --output-len "$out" --output-json "$D/offline.json" 2>&1 | quiet 8
  step "$latency_est" "offline batch-1 step (bench latency)" "${JAXLLM[@]}" bench latency "${engine[@]}" --batch-size 1 \
    --input-len "$in" --output-len "$out" --num-iters-warmup 1 --num-iters 2 --output-json "$D/latency.json" 2>&1 | quiet 4
  local server=("${JAXLLM[@]}" serve "${engine[@]}" --host 127.0.0.1 --port "$port" --uvicorn-log-level warning
                --max-log-len 8)
  local i
  if [ $DRY = 1 ]; then
    show "${server[@]}" >&3
    for i in "${!conc[@]}"; do serve_bench "$i"; done
  elif [ "$(( $(left) - 20 ))" -lt "$(( start_est + est[0] ))" ]; then
    echo "SKIPPED jaxllm serve: $(left) s left"
  elif start_server; then
    for i in "${!conc[@]}"; do
      kill -0 "$SERVER_PID" 2> /dev/null || { echo "FAILED: the server is gone"; echo serve >> "$FAILED"; break; }
      serve_bench "$i"
    done
    stop_server
  fi
  run "${JAXLLM[@]}" bench report serve --dir "$D" --raw-dir "$raw" --concurrencies "$(IFS=,; echo "${conc[*]}")"
}
part_lora() {
  local in=1000 out=1000 max_len=2048 prompts=${LORA_PROMPTS:-500} conc=256 seqs=256 batched=8192 port=${PORT:-8766}
  local rank=16 num=8
  [ $TINY = 1 ] && in=32 out=32 max_len=512 prompts=32 conc=16 seqs=16 batched=512 rank=4 num=2
  local tok=/tmp/wordtok adapters=/tmp/lora-adapters modules="" names=() mode
  run "$PY" -m jaxllm.benchmarks.dummy_tokenizer word "$tok" --model "$MODEL8" || return 1
  if [ $DRY = 1 ]; then  # what the writer prints: NAME=PATH of each adapter
    show "$PY" -m jaxllm.benchmarks.lora_adapters "$adapters" --model "$MODEL8" --num $num --rank $rank >&3
    for i in $(seq 0 $(( num - 1 ))); do modules+="lora$i=$adapters/lora$i "; done
  else
    modules=$("$PY" -m jaxllm.benchmarks.lora_adapters "$adapters" --model "$MODEL8" --num $num --rank $rank) || return 1
  fi
  for module in $modules; do names+=("${module%%=*}"); done
  local engine=(--model "$MODEL8" "${WEIGHTS8[@]}" --tokenizer "$tok" --max-model-len "$max_len" --max-num-seqs "$seqs"
                --max-num-batched-tokens "$batched")
  # The base model on a server without LoRA, then the adapters mixed uniformly on one with them all.
  for mode in base lora; do
    local server=("${JAXLLM[@]}" serve "${engine[@]}" --host 127.0.0.1 --port "$port" --uvicorn-log-level warning
                  --max-log-len 8) pick=()
    [ $mode = lora ] && server+=(--enable-lora --max-loras $num --max-lora-rank $rank --lora-modules $modules) \
      pick=(--lora-modules "${names[@]}")
    local bench=("${JAXLLM[@]}" bench serve --base-url "http://127.0.0.1:$port" --num-prompts "$prompts"
                 --random-input-len "$in" --random-output-len "$out" --ignore-eos --temperature 1.0
                 --max-concurrency "$conc" "${pick[@]}" --output-json "$D/serve_$mode.json")
    if [ $DRY = 1 ]; then
      show "${server[@]}" >&3; show "${bench[@]}" >&3
    elif [ "$(( $(left) - 20 ))" -lt 150 ]; then
      echo "SKIPPED the $mode server: $(left) s left"
    elif start_server; then
      grep -m1 -o "start-up: .*" /tmp/server.log
      step 120 "bench serve, $mode" "${bench[@]}" 2>&1 | tail -22
      stop_server
    fi
  done
  [ $DRY = 1 ] || "$PY" -c "import json, os; r = {m: json.load(open(f'$D/serve_{m}.json'))['output_throughput']
    for m in ('base', 'lora') if os.path.exists(f'$D/serve_{m}.json')}; print('output tok/s', r,
    'LoRA / base: %.3f' % (r['lora'] / r['base']) if len(r) == 2 else '')"
}

part_tools() {
  local in=512 out=128 max_len=2048 seqs=256 batched=8192 port=${PORT:-8767} tools=${NUM_TOOLS:-8} conc=(1 64)
  local prompts=(16 256) tok=/tmp/wordtok i n
  [ $TINY = 1 ] && in=32 out=16 max_len=512 seqs=16 batched=512 prompts=(4 16) conc=(1 8)
  run "$PY" -m jaxllm.benchmarks.dummy_tokenizer word "$tok" --model "$MODEL8" || return 1
  local server=("${JAXLLM[@]}" serve --model "$MODEL8" "${WEIGHTS8[@]}" --tokenizer "$tok" --max-model-len "$max_len"
                --max-num-seqs "$seqs" --max-num-batched-tokens "$batched" --host 127.0.0.1 --port "$port"
                --uvicorn-log-level warning --max-log-len 8 --enable-auto-tool-choice --tool-call-parser hermes)
  if [ $DRY = 0 ] && [ "$(( $(left) - 20 ))" -lt 150 ]; then
    echo "SKIPPED the tools server: $(left) s left"; return 1
  fi
  [ $DRY = 1 ] && show "${server[@]}" >&3
  [ $DRY = 1 ] || start_server || return 1
  for i in "${!conc[@]}"; do
    for n in 0 "$tools"; do
      step 60 "bench serve chat c=${conc[$i]}, $n tools" "${JAXLLM[@]}" bench serve --base-url "http://127.0.0.1:$port" \
        --endpoint /v1/chat/completions --num-prompts "${prompts[$i]}" --random-input-len "$in" \
        --random-output-len "$out" --ignore-eos --temperature 1.0 --max-concurrency "${conc[$i]}" --num-tools "$n" \
        --output-json "$D/chat_c${conc[$i]}_tools$n.json" 2>&1 | tail -22
    done
  done
  [ $DRY = 1 ] && return 0
  stop_server
  "$PY" -c "import glob, json, numpy as np
print(f\"{'concurrency':>11} {'tools':>5} {'prompt':>6} {'TTFT ms':>8} {'TPOT ms':>8} {'E2EL ms':>8} {'out tok/s':>9}\")
for path in sorted(glob.glob('$D/chat_c*_tools*.json')):
    r = json.load(open(path))
    print(f\"{r['max_concurrency']:>11} {r['num_tools']:>5} {np.mean(r['input_lens']):>6.0f} {r['mean_ttft_ms']:>8.1f} \"
          f\"{r['mean_tpot_ms']:>8.2f} {r['mean_e2el_ms']:>8.1f} {r['output_throughput']:>9.0f}\")"
}

# serve_bench I: bench serve at part_serve's I-th concurrency (its settings).
serve_bench() {
  local c=${conc[$1]} n=${prompts[$1]}
  step "${est[$1]}" "bench serve c=$c, $n prompts" "${JAXLLM[@]}" bench serve --base-url "http://127.0.0.1:$port" \
    --num-prompts "$n" --random-input-len "$in" --random-output-len "$out" --ignore-eos --temperature 1.0 \
    --request-rate inf --max-concurrency "$c" --output-json "$raw/serve_c$c.json" 2>&1 | tail -22
}
start_server() {
  echo "== jaxllm serve ($(( SECONDS - T0 )) s in)"
  "${server[@]}" > /tmp/server.log 2>&1 &
  SERVER_PID=$!
  trap 'stop_server; rm -f "$FAILED"' EXIT
  local deadline=$(( SECONDS + ${START_TIMEOUT_S:-240} ))
  while [ $SECONDS -lt $deadline ] && [ "$(left)" -gt 60 ]; do
    kill -0 "$SERVER_PID" 2> /dev/null || break
    if "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2> /dev/null; then
      echo "server ready after $(( SECONDS - T0 )) s"; return 0
    fi
    sleep 1
  done
  echo "FAILED: the server did not answer /health"; echo serve >> "$FAILED"; tail -n 30 /tmp/server.log
  stop_server
  return 1
}
stop_server() {
  [ -n "${SERVER_PID:-}" ] || return 0
  if kill -0 "$SERVER_PID" 2> /dev/null; then
    kill -INT "$SERVER_PID" 2> /dev/null
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2> /dev/null || break; sleep 0.5; done
    pkill -KILL -P "$SERVER_PID" 2> /dev/null  # its engine core, if it is still there
    kill -KILL "$SERVER_PID" 2> /dev/null
  fi
  SERVER_PID=
  grep -v "Received request" /tmp/server.log | tail -n 80 > "$D/server_log_tail.txt" 2> /dev/null
}

part_sampling() {
  local shape=(--batch-sizes 256 --input-len 128 --output-len 128) max_len=2048
  [ $TINY = 1 ] && shape=(--batch-sizes 16 --input-len 16 --output-len 16) max_len=512
  run "$PY" -m jaxllm.benchmarks.dummy_tokenizer byte /tmp/bytetok || return 1
  local common=(--model "$MODEL8" "${WEIGHTS8[@]}" --tokenizer /tmp/bytetok --max-model-len "$max_len"
                --max-num-batched-tokens 8192 "${shape[@]}")
  step 90 "sampling: greedy" "${JAXLLM[@]}" bench step "${common[@]}" --output-json "$D/greedy.json" \
    --profile-dir /tmp/profile/greedy 2>&1 | quiet 12
  step 90 "sampling: every feature" "${JAXLLM[@]}" bench step "${common[@]}" --sampling all \
    --output-json "$D/all.json" --profile-dir /tmp/profile/all 2>&1 | quiet 12
  if [ $TINY = 1 ]; then  # grammars need the byte tokenizer's 257 tokens
    echo "SKIPPED sampling, JSON-constrained: the tiny Llama's vocabulary has 256 tokens" >&3; return
  fi
  step 90 "sampling: every feature, 64 JSON-constrained" "${JAXLLM[@]}" bench step "${common[@]}" --sampling all \
    --structured-requests 64 --output-json "$D/all-json.json" --profile-dir /tmp/profile/all-json 2>&1 | quiet 12
}

part_hf-compare() {
  local batches=1,8,32,64,128,256 hf_batches=1,64,256 in=128 out=128 prompts=1000 seqs=256 batched=8192 max_len=2048
  local ceiling=() est_ceil=30 est_step=120 est_hf=120 est_tput=90
  [ $TINY = 1 ] && batches=1,4,16 hf_batches=1,16 in=32 out=16 prompts=64 seqs=16 batched=1024 max_len=512 \
    ceiling=(--copy-bytes $((64 << 20)) --matmul-n 1024) est_ceil=20 est_step=60 est_hf=60 est_tput=60
  step "$est_ceil" "ceilings (JAX)" env XLA_PYTHON_CLIENT_PREALLOCATE=false "${JAXLLM[@]}" bench bounds ceilings \
    --framework jax "${ceiling[@]}" --output-json "$D/ceilings_jax.json" 2>&1 | quiet 4
  step "$est_ceil" "ceilings (torch)" "${JAXLLM[@]}" bench bounds ceilings --framework torch "${ceiling[@]}" \
    --output-json "$D/ceilings_torch.json" 2>&1 | quiet 4
  local engine=("${M8[@]}" --max-model-len "$max_len" --max-num-seqs "$seqs" --max-num-batched-tokens "$batched")
  step "$est_step" "jaxllm bench step" "${JAXLLM[@]}" bench step "${engine[@]}" --batch-sizes "$batches" \
    --input-len "$in" --output-len "$out" --output-json "$D/step.json" 2>&1 | quiet 12
  # HF, after jaxllm has exited (the GPU to itself), stops starting batches 10 s before its timeout.
  step "$est_hf" "HF transformers (static cache, torch.compile)" "${JAXLLM[@]}" bench hf --config "$CONFIG8" \
    --batch-sizes "$hf_batches" --input-len "$in" --output-len "$out" --budget-s $(( $(left) - 30 )) \
    --output-json "$D/hf.json" 2>&1 | quiet 12
  step "$est_tput" "jaxllm bench throughput" "${JAXLLM[@]}" bench throughput "${engine[@]}" --num-prompts "$prompts" \
    --input-len "$in" --output-len "$out" --output-json "$D/throughput.json" 2>&1 | quiet 8
  local plot=()  # matplotlib's folder on the path, where set-up installed it
  [ -n "${PLOT_PATH:-}" ] && plot=(env PYTHONPATH="$PLOT_PATH${PYTHONPATH:+:$PYTHONPATH}")
  run "${plot[@]}" "${JAXLLM[@]}" bench bounds table --dir "$D" \
    --config "$CONFIG8" --input-len "$in" --output-len "$out" --batch-sizes "$batches" --png "$D/bench_decode_tok_s.png"
}

# kernel_tests NAME PYTEST_FLAGS...: the gpu-marked attention kernel tests, under 240 s.
kernel_tests() {
  local name=$1; shift
  step 120 "$name" timeout 240 "$PY" -m pytest -q -m gpu "$@" tests/kernels/test_attention.py \
    tests/kernels/test_mosaic_attention.py 2>&1 | quiet 25
}
part_kernels() {
  local extra
  read -ra extra <<< "${ATTENTION_ARGS:-}"
  [ $TINY = 1 ] && extra=(--interpret --kernels pallas --sections decode --decode-batches 2 --decode-contexts 64
                          "${extra[@]}")
  kernel_tests "kernel tests" -x
  # The bench runs even when a test failed: it reports which kernels fail its own check.
  step 120 "bench attention" timeout 330 "${JAXLLM[@]}" bench attention "${extra[@]}" --output-json "$D/attention.json" \
    2>&1 | quiet 100
}
part_check() { kernel_tests "kernel checks" ${CHECK:+-k "$CHECK"}; }
part_hybrid() {
  step 60 "hybrid KV cache through the GPU backends" timeout 240 "$PY" -m pytest -q -m gpu -k gpu_backend \
    tests/engine/test_prefix_caching.py 2>&1 | quiet 12
}
part_kv-dtype() {
  if [ $TINY = 1 ]; then echo "SKIPPED kv-dtype: it needs a GPU" >&3; return; fi
  step 120 "bench kv-dtype" "${JAXLLM[@]}" bench kv-dtype --output-json "$D/kv_dtype.json" 2>&1 | quiet 70
}

part_quant() {
  local extra
  read -ra extra <<< "${QUANT_ARGS:-}"
  [ $TINY = 1 ] && extra=(--shapes 128x96 --rows 2,16 --group-size 64 --block 32 "${extra[@]}")
  step 60 "quant kernel tests" timeout 240 "$PY" -m pytest -q -m gpu tests/kernels/test_w4a16.py \
    tests/kernels/test_fp8_block.py 2>&1 | quiet 25
  step 150 "bench quant-matmul" "${JAXLLM[@]}" bench quant-matmul "${extra[@]}" --output-json "$D/quant_matmul.json" \
    2>&1 | quiet 70
}
part_sampler() {
  local shape=()
  [ $TINY = 1 ] && shape=(--rows 4 --vocab 512)
  step 60 "bench sampler" "${JAXLLM[@]}" bench sampler "${shape[@]}" --output-json "$D/sampler.json" 2>&1 | quiet 20
}

part_multi-gpu() {
  local configs=${MULTI:-tp1 tp2} config name modes mode
  local common=(--max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 8192)
  local long=(--input-len 1000 --output-len 1000 --num-prompts 1000) short=(--input-len 2048 --output-len 128 --num-prompts 1000)
  local step_shape=(--input-len 128 --output-len 128) envs=(NCCL_NVLS_ENABLE=0) xla=${XLA_FLAGS:-}
  if [ $TINY = 1 ]; then
    common=(--max-model-len 512 --max-num-seqs 16 --max-num-batched-tokens 256)
    long=(--input-len 32 --output-len 32 --num-prompts 16) short=(--input-len 64 --output-len 8 --num-prompts 16)
    step_shape=(--input-len 16 --output-len 80) envs+=(JAX_PLATFORMS=cpu)
    xla="${xla:+$xla }--xla_force_host_platform_device_count=8"
  else
    run nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  fi
  for config in $configs; do
    name=${config%%:*} modes=step,long,short
    [ "$config" != "$name" ] && modes=${config#*:}
    for mode in ${modes//,/ }; do multi_run "$name" "$mode"; done
  done
  run "${JAXLLM[@]}" bench report multi --dir "$D" --configs $configs
}
# multi_run NAME MODE: one bench of one configuration (part_multi-gpu's settings), its JSON to NAME-MODE.json.
multi_run() {
  local name=$1 mode=$2 model=("${M8[@]}") par=() extra=(${xla:+XLA_FLAGS="$xla"}) bench
  case $name in
    tp[1248]) par=(-tp "${name#tp}") ;;
    dp[248]) par=(-dp "${name#dp}") ;;
    70b-tp[48]) model=("${M70[@]}"); par=(-tp "${name#70b-tp}") ;;
    tp2-ll) par=(-tp 2); extra+=(NCCL_PROTO=LL) ;;
    tp2-ll128) par=(-tp 2); extra+=(NCCL_PROTO=LL128) ;;
    tp2-simple) par=(-tp 2); extra+=(NCCL_PROTO=Simple) ;;
    tp2-combine) par=(-tp 2); extra=("XLA_FLAGS=${xla:+$xla }--xla_gpu_enable_async_collectives=true \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728") ;;
    *) echo "unknown configuration $name" >&3; echo "$name" >> "$FAILED"; return 1 ;;
  esac
  case $mode in
    step) bench=(step --batch-sizes 1 "${step_shape[@]}" --profile-dir "/tmp/prof-$name") ;;
    long) bench=(throughput "${long[@]}") ;;
    short) bench=(throughput "${short[@]}") ;;
    *) echo "unknown mode $mode" >&3; echo "$name:$mode" >> "$FAILED"; return 1 ;;
  esac
  step 30 "$name $mode" env "${envs[@]}" "${extra[@]}" "${JAXLLM[@]}" bench "${bench[@]}" "${model[@]}" "${common[@]}" \
    "${par[@]}" --output-json "$D/$name-$mode.json" 2>&1 | quiet 4
}

echo "parts: ${PARTS[*]}; budget ${BUDGET_S} s; results in $OUT$([ $DRY = 1 ] && echo "; dry run")"
setup
for part in "${PARTS[@]}"; do
  echo "==== $part"
  folder "$part"
  "part_$part"
done
echo "done in $(( SECONDS - T0 )) s"
if [ -s "$FAILED" ]; then echo "failed: $(sort -u "$FAILED" | tr '\n' ' ')"; exit 1; fi
