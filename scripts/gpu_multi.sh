#!/usr/bin/env bash
# Issue 14's runs on 2, 4 and 8 H200s (kinds nvidia-h200-x2, -x4, -x8; carry .whl from
# scripts/gpu_wheels.sh). A device call holds 600 s, so the runs come in parts, each one
# call; a part is a list of configurations, each run through:
#   step  `jaxllm bench step --batch-sizes 1` with a profile: the batch-1 decode step and the
#         share of the device's busy time in collectives (jaxllm.profiling)
#   long  `jaxllm bench throughput` 1000 prompts, 1000 in / 1000 out
#   short `jaxllm bench throughput` 1000 prompts, 2048 in / 128 out
# (each bench's JSON keeps its start-up time). A configuration is NAME[:MODES], NAME one of
#   tp1 tp2 tp4 tp8            Llama-3.1-8B shape, tensor parallel
#   dp2 dp4 dp8                Llama-3.1-8B shape, data parallel (one GPU per replica)
#   70b-tp4 70b-tp8            Llama-3.1-70B shape, tensor parallel
#   tp2-ll tp2-ll128 tp2-simple  TP = 2 with NCCL_PROTO forced (the small-batch all-reduce)
#   tp2-combine                TP = 2 with XLA's all-reduce combining and async collectives on
# and MODES a comma list of step,long,short (default all three). The table comes last.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as those machines require.
#
# Parts that fit a call (about 150-200 s per 8B throughput pair once compiled, 60-90 s start-up):
#   x2: "tp1 tp2"   then "dp2 tp2-ll:step tp2-ll128:step tp2-simple:step tp2-combine:step"
#   x4: "tp4 dp4"   then "70b-tp4"
#   x8: "tp8 dp8"   then "70b-tp8"
# Usage on the device: bash scripts/gpu_multi.sh "tp1 tp2"
# CPU dry run (the tiny Llama on 8 forced host devices, tiny counts, this checkout's .venv):
#   JAXLLM_DRY_RUN=1 bash scripts/gpu_multi.sh "tp1 tp2:step,short tp4:step dp2:short"
set -o pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
BUDGET_S=${BUDGET_S:-560}
CONFIGS=${1:?"usage: gpu_multi.sh \"CONFIG ...\" (see the header)"}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -n "$JAXLLM_DRY_RUN" ]; then
  PY=${PY:-.venv/bin/python}; OUT=${OUT:-/tmp/out-multi}; mkdir -p "$OUT"
  export XLA_FLAGS="--xla_force_host_platform_device_count=8" JAX_PLATFORMS=cpu
  export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla-dry
  MODEL8=(--model tests/fixtures/tiny/llama --skip-tokenizer-init); MODEL70=("${MODEL8[@]}")
  COMMON=(--max-model-len 512 --max-num-seqs 16 --max-num-batched-tokens 256)
  LONG=(--input-len 32 --output-len 32 --num-prompts 16); SHORT=(--input-len 64 --output-len 8 --num-prompts 16)
  STEP=(--input-len 16 --output-len 80)
else
  PY=python3
  source scripts/gpu_setup.sh
  export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla
  MODEL8=(--model llama-3.1-8b --load-format dummy --dtype bfloat16)
  MODEL70=(--model llama-3.1-70b --load-format dummy --dtype bfloat16)
  COMMON=(--max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 8192)
  LONG=(--input-len 1000 --output-len 1000 --num-prompts 1000); SHORT=(--input-len 2048 --output-len 128 --num-prompts 1000)
  STEP=(--input-len 128 --output-len 128)
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
fi
left() { echo $(( BUDGET_S - (SECONDS - T0) )); }

# run CONFIG MODE: one bench, under a timeout of the time left, its JSON to $OUT/CONFIG-MODE.json.
run() {
  local name=$1 mode=$2 model=("${MODEL8[@]}") par=() envs=()
  case $name in
    tp[1248]) par=(-tp "${name#tp}") ;;
    dp[248]) par=(-dp "${name#dp}") ;;
    70b-tp[48]) model=("${MODEL70[@]}"); par=(-tp "${name#70b-tp}") ;;
    tp2-ll) par=(-tp 2); envs=(NCCL_PROTO=LL) ;;
    tp2-ll128) par=(-tp 2); envs=(NCCL_PROTO=LL128) ;;
    tp2-simple) par=(-tp 2); envs=(NCCL_PROTO=Simple) ;;
    tp2-combine) par=(-tp 2); envs=("XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_enable_async_collectives=true \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728") ;;
    *) echo "unknown configuration $name"; return 1 ;;
  esac
  local json="$OUT/$name-$mode.json" rest=$(( $(left) - 15 ))
  if [ "$rest" -lt 30 ]; then echo "SKIPPED $name $mode: ${rest} s left"; return 1; fi
  echo "== $name $mode ($(( SECONDS - T0 )) s in, ${rest} s left)"
  local bench
  case $mode in
    step) bench=(step --batch-sizes 1 "${STEP[@]}" --profile-dir "/tmp/prof-$name") ;;
    long) bench=(throughput "${LONG[@]}") ;;
    short) bench=(throughput "${SHORT[@]}") ;;
    *) echo "unknown mode $mode"; return 1 ;;
  esac
  env "${envs[@]}" timeout -k 20 "$rest" "$PY" -m jaxllm.cli bench "${bench[@]}" "${model[@]}" "${COMMON[@]}" \
    "${par[@]}" --output-json "$json" 2>&1 | tr '\r' '\n' | grep -v -e Compiling -e "Processed prompts" | tail -4 \
    || echo "FAILED $name $mode"
}

for config in $CONFIGS; do
  name=${config%%:*}; modes=step,long,short
  [ "$config" != "$name" ] && modes=${config#*:}
  for mode in ${modes//,/ }; do run "$name" "$mode"; done
done

"$PY" - "$OUT" $CONFIGS <<'EOF'
import json, os, sys
out, configs = sys.argv[1], [c.split(":")[0] for c in sys.argv[2:]]
def load(name, mode):
    try:
        with open(os.path.join(out, f"{name}-{mode}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
def step_row(r):
    if r is None:
        return "-", "-"
    row = r["rows"][0]
    share = (row.get("profile") or {}).get("collective_share")
    return f"{row['decode_step_ms']}", "-" if share is None else f"{100 * share:.0f}%"
print("\n| config | batch-1 step (ms) | collectives | 1000/1000 output tok/s | 2048/128 output tok/s | start-up (s) |")
print("| --- | --- | --- | --- | --- | --- |")
base = {}
for name in configs:
    step, share = step_row(load(name, "step"))
    long, short = load(name, "long"), load(name, "short")
    tput = lambda r: "-" if r is None else f"{r['output_tokens_per_second']:,.0f}"
    startup = next((r["startup_s"] for r in (long, short) if r is not None and "startup_s" in r), "-")
    if long is not None:
        base[name] = long["output_tokens_per_second"]
    print(f"| {name} | {step} | {share} | {tput(long)} | {tput(short)} | {startup} |")
for name, value in base.items():
    if name != "tp1" and "tp1" in base:
        print(f"{name} / tp1 throughput (1000/1000): {value / base['tp1']:.2f}x")
EOF
echo "done in $(( SECONDS - T0 )) s"
