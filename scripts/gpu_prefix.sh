#!/usr/bin/env bash
# Issue 12's H200 run, in one device call (carry .whl, made by scripts/gpu_wheels.sh): 1000
# requests sharing a 1024-token prefix, each with 128 tokens of its own and 128 out, on the
# Llama-3.1-8B shape with random bf16 weights: `jaxllm bench throughput --prefix-len 1024
# --input-len 128 --output-len 128 --num-prompts 1000` with --no-enable-prefix-caching, then
# with --enable-prefix-caching, same engine flags otherwise. Prints a table last: throughput
# off and on, their ratio, and the prefix cache's hit rate (tokens found over tokens looked
# up in the timed call). The two JSONs land in $OUT.
#
# Time: set-up ~15 s; off: start-up 40-90 s cold + 1.15M prompt tokens to prefill (about
# 30k tok/s on this shape, docs/benchmarks.md's 2048/128 run) and 128 decode steps a wave,
# ~50 s; on: start-up ~20 s (the compilation cache) + ~128k prompt tokens of their own and
# the decode, ~20 s. About 3-4 minutes in all.
#
# Usage on the device: bash scripts/gpu_prefix.sh
# CPU dry run (the tiny Llama, small counts, this checkout's .venv, no set-up):
#   JAXLLM_DRY_RUN=1 bash scripts/gpu_prefix.sh
set -o pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
if [ -n "$JAXLLM_DRY_RUN" ]; then
  PY=${PY:-.venv/bin/python}; OUT=${OUT:-/tmp/out-prefix}; mkdir -p "$OUT"
  ENGINE=(--model tests/fixtures/tiny/llama --skip-tokenizer-init --max-model-len 512 --max-num-seqs 64
          --max-num-batched-tokens 1024)
  WORK=(--prefix-len 64 --input-len 16 --output-len 16 --num-prompts 64)
  export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla-dry
else
  PY=python3
  source scripts/gpu_setup.sh
  ENGINE=(--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256
          --max-num-batched-tokens 8192)
  WORK=(--prefix-len 1024 --input-len 128 --output-len 128 --num-prompts 1000)
  export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla  # the second run reuses the first's executables
fi
export PYTHONUNBUFFERED=1
for mode in no-enable-prefix-caching enable-prefix-caching; do
  echo "== --$mode ($(( SECONDS - T0 )) s in)"
  timeout -k 20 "${RUN_S:-200}" "$PY" -m jaxllm.cli bench throughput "${ENGINE[@]}" "${WORK[@]}" "--$mode" \
    --output-json "$OUT/prefix_$mode.json" 2>&1 | tr '\r' '\n' | grep -v -e Warning -e "Processed prompts" | tail -8 \
    || echo "FAILED --$mode"
done

"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
results = {}
for mode, name in (("no-enable-prefix-caching", "off"), ("enable-prefix-caching", "on")):
    try:
        with open(os.path.join(out, f"prefix_{mode}.json")) as f:
            results[name] = json.load(f)
    except (OSError, ValueError):
        pass
print("\n| prefix caching | requests/s | total tok/s | output tok/s | elapsed (s) | hit rate | start-up (s) | compiles |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for name in ("off", "on"):
    r = results.get(name)
    if r is None:
        print(f"| {name} | - | - | - | - | - | - | not run |")
        continue
    rate = r.get("prefix_cache_hit_rate")
    if rate is None:
        rate = "n/a"
    elif not r["prefix_cache_queries"]:
        rate = "nothing looked up"
    else:
        rate = f"{100 * rate:.1f}% ({r['prefix_cache_hits']:,} of {r['prefix_cache_queries']:,} tokens)"
    print(f"| {name} | {r['requests_per_second']:.2f} | {r['tokens_per_second']:,.0f} | {r['output_tokens_per_second']:,.0f} "
          f"| {r['elapsed_time']:.1f} | {rate} | {r['startup_s']} | {r['compiles_after_warm_up']} |")
if "on" in results and "off" in results:
    ratio = results["on"]["tokens_per_second"] / results["off"]["tokens_per_second"]
    print(f"\non / off throughput: {ratio:.2f}x")
    w = results["on"]
    print(f"workload: {w['num_requests']} requests, prefix {w['prefix_len']} + {w['input_len']} own tokens, "
          f"{w['output_len']} out; lengths ok: off {results['off']['all_lengths_ok']}, on {w['all_lengths_ok']}")
EOF
echo "done in $(( SECONDS - T0 )) s"
