#!/usr/bin/env bash
# Issue 11's H200 run, in one device call (carry .whl, made by scripts/gpu_wheels.sh): the
# server against the offline engine on the same workload, Llama-3.1-8B shape with random
# bf16 weights, 1000 in / 1000 out, ignore_eos, temperature 1.0:
#   1. `jaxllm bench throughput`, 1000 prompts (offline: one LLM.generate);
#   2. `jaxllm bench latency --batch-size 1`: the offline batch-1 decode step;
#   3. `jaxllm serve` with the same engine flags, in the background on 127.0.0.1, then
#      `jaxllm bench serve` at request rate inf with --max-concurrency 256, 1, 64 and 16;
# and prints a table last: per concurrency the prompts, output tok/s, TTFT and TPOT mean and
# p99, then served c=256 / offline (target >= 0.90) and TPOT at c=1 minus the offline batch-1
# step (target <= 0.5 ms). Every result's JSON lands in $OUT (bench serve's without its
# per-token lists); so does the server log's tail. A step that fails or would not fit in the
# time left is reported and skipped; the table shows what there is.
#
# Time (budget BUDGET_S=540 s of the device call's 600), from docs/benchmarks.md's figures:
#   set-up (wheels, editable install)                    ~15 s
#   offline: start-up 40-90 s cold + 1000 x 1000 tokens at ~9,000 tok/s = 110 s   ~150-200 s
#   batch 1: start-up ~20 s (executables from the compilation cache) + 3 generate
#            calls x 1000 steps x ~5-6.6 ms                                       ~40 s
#   server start-up (cache again)                                                 ~20-40 s
#   c=256: 1000 prompts, 1M tokens at >= 8,000 tok/s                              ~125 s
#   c=1:   4 prompts x 1000 steps x ~5-6.6 ms                                     ~25 s
#   c=64:  256 prompts = 4 waves x 1000 steps x ~10 ms                            ~40 s
#   c=16:  64 prompts = 4 waves x 1000 steps x ~6 ms                              ~25 s
#   total ~440-510 s. c=256 runs first among the served ones: it is the one compared with
#   the offline figure; then c=1, the other target.
#
# Usage on the device: bash scripts/gpu_serve.sh
# CPU dry run (the tiny Llama, small counts, this checkout's .venv, no set-up):
#   JAXLLM_DRY_RUN=1 bash scripts/gpu_serve.sh
set -o pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
BUDGET_S=${BUDGET_S:-540}
PORT=${PORT:-8765}
if [ -n "$JAXLLM_DRY_RUN" ]; then
  PY=${PY:-.venv/bin/python}; OUT=${OUT:-/tmp/out-serve}; mkdir -p "$OUT"
  MODEL=tests/fixtures/tiny/llama; IN=64; OUTLEN=64; MAXLEN=512; OFFLINE_PROMPTS=64; SEQS=64; BATCHED=1024
  CONC=(256 1 64 16); PROMPTS=(64 2 32 16); EST=(60 20 30 20); OFFLINE_EST=90; LAT_EST=60; START_EST=60
  LOAD=(); export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla-dry
else
  PY=python3
  source scripts/gpu_setup.sh
  MODEL=llama-3.1-8b; IN=1000; OUTLEN=1000; MAXLEN=2048; OFFLINE_PROMPTS=1000; SEQS=256; BATCHED=8192
  CONC=(256 1 64 16); PROMPTS=(1000 4 256 64); EST=(140 30 50 30); OFFLINE_EST=150; LAT_EST=45; START_EST=40
  LOAD=(--load-format dummy --dtype bfloat16); export JAXLLM_COMPILATION_CACHE=/tmp/jaxllm-xla
fi
export PYTHONUNBUFFERED=1
TOK=/tmp/wordtok
RAW=/tmp/serve-raw; mkdir -p "$RAW"
source scripts/gpu_steps.sh  # left, step

# A word-level tokenizer with one token per id of the model's vocabulary: every generated id
# decodes to text (" w123"), so each streamed chunk has text and bench serve times every token
# (random weights sample over the whole vocabulary; a byte tokenizer would leave most unknown).
"$PY" - "$MODEL" "$TOK" <<'EOF' || exit 1
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers
model, folder = sys.argv[1:]
config = os.path.join(model, "config.json") if os.path.isdir(model) else f"models/configs/{model}.json"
with open(config) as f:
    vocab_size = json.load(f)["vocab_size"]
tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
os.makedirs(folder, exist_ok=True)
tokenizer.save(os.path.join(folder, "tokenizer.json"))
with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
print(f"tokenizer: {vocab_size} word tokens in {folder}")
EOF

ENGINE=(--model "$MODEL" "${LOAD[@]}" --tokenizer "$TOK" --max-model-len "$MAXLEN" --max-num-seqs "$SEQS"
        --max-num-batched-tokens "$BATCHED")
step "$OFFLINE_EST" "offline bench throughput" "$PY" -m jaxllm.cli bench throughput "${ENGINE[@]}" \
  --num-prompts "$OFFLINE_PROMPTS" --input-len "$IN" --output-len "$OUTLEN" --output-json "$OUT/offline.json" \
  2>&1 | tr '\r' '\n' | grep -v -e Warning -e "Processed prompts" | tail -8
step "$LAT_EST" "offline batch-1 step (bench latency)" "$PY" -m jaxllm.cli bench latency "${ENGINE[@]}" \
  --batch-size 1 --input-len "$IN" --output-len "$OUTLEN" --num-iters-warmup 1 --num-iters 2 \
  --output-json "$OUT/latency.json" 2>&1 | tr '\r' '\n' | grep -v -e Warning -e "Processed prompts" | tail -4

SERVER_PID=
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -INT "$SERVER_PID" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    pkill -KILL -P "$SERVER_PID" 2>/dev/null  # its engine core, if it is still there
    kill -KILL "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=
  grep -v "Received request" /tmp/server.log | tail -n 80 > "$OUT/server_log_tail.txt" 2>/dev/null
}
trap stop_server EXIT
trap 'exit 130' INT TERM

serving=0
if [ "$(( $(left) - 20 ))" -ge "$(( START_EST + EST[0] ))" ]; then
  echo "== jaxllm serve ($(( SECONDS - T0 )) s in)"
  "$PY" -m jaxllm.cli serve "${ENGINE[@]}" --host 127.0.0.1 --port "$PORT" --uvicorn-log-level warning \
    --max-log-len 8 > /tmp/server.log 2>&1 &
  SERVER_PID=$!
  deadline=$(( SECONDS + ${START_TIMEOUT_S:-240} ))
  while [ $SECONDS -lt $deadline ] && [ "$(left)" -gt 60 ]; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "FAILED: the server exited during start-up"; break; fi
    if "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
      serving=1; echo "server ready after $(( SECONDS - T0 )) s"; break
    fi
    sleep 1
  done
  [ $serving = 1 ] || { echo "FAILED: no /health from the server"; tail -n 30 /tmp/server.log; }
else
  echo "SKIPPED jaxllm serve: $(left) s left"
fi

if [ $serving = 1 ]; then
  for i in "${!CONC[@]}"; do
    c=${CONC[$i]}; n=${PROMPTS[$i]}
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "FAILED: the server is gone"; break; }
    step "${EST[$i]}" "bench serve c=$c, $n prompts" "$PY" -m jaxllm.cli bench serve \
      --base-url "http://127.0.0.1:$PORT" --num-prompts "$n" --random-input-len "$IN" \
      --random-output-len "$OUTLEN" --ignore-eos --temperature 1.0 --request-rate inf --max-concurrency "$c" \
      --output-json "$RAW/serve_c$c.json" 2>&1 | tail -22
  done
  stop_server
fi

# Bench serve's JSON without its per-request lists (1000 x 1000 ITLs would pass what $OUT
# can bring back), then the table.
"$PY" - "$RAW" "$OUT" "${CONC[@]}" <<'EOF'
import json, os, sys
raw, out, conc = sys.argv[1], sys.argv[2], sorted(map(int, sys.argv[3:]))

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

served = {}
for c in conc:
    r = load(os.path.join(raw, f"serve_c{c}.json"))
    if r is None:
        continue
    errors = sorted({e for e in r.pop("errors", []) if e})
    for key in ("generated_texts", "itls", "ttfts", "input_lens", "output_lens"):
        r.pop(key, None)
    r["distinct_errors"] = errors[:5]
    with open(os.path.join(out, f"serve_c{c}.json"), "w") as f:
        json.dump(r, f, indent=1)
    served[c] = r
offline, latency = load(os.path.join(out, "offline.json")), load(os.path.join(out, "latency.json"))

def num(value, fmt):
    return format(value, fmt) if value is not None else "-"

print("\n| run | prompts | output tok/s | TTFT mean (ms) | TTFT p99 (ms) | TPOT mean (ms) | TPOT p99 (ms) | failed |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
if offline:
    print(f"| offline bench throughput | {offline['num_requests']} | {offline['output_tokens_per_second']:,.0f} "
          f"| - | - | - | - | {'0' if offline['all_lengths_ok'] else 'wrong lengths'} |")
if latency:
    print(f"| offline batch 1 (bench latency) | 1 | {num(latency['decode_tok_s'], ',.0f')} | - | - "
          f"| {num(latency['decode_step_ms'], '.2f')} (step) | - | - |")
for c in conc:
    r = served.get(c)
    if r is None:
        print(f"| served c={c} | - | - | - | - | - | - | not run |")
        continue
    print(f"| served c={c} | {r['num_prompts']} | {r['output_throughput']:,.0f} | {r['mean_ttft_ms']:.1f} "
          f"| {r['p99_ttft_ms']:.1f} | {r['mean_tpot_ms']:.2f} | {r['p99_tpot_ms']:.2f} | {r['failed']} |")
top = max(served) if served else None
if offline and top is not None:
    ratio = served[top]["output_throughput"] / offline["output_tokens_per_second"]
    print(f"\nserved c={top} / offline output tok/s: {ratio:.3f} (target >= 0.90)")
if latency and latency.get("decode_step_ms") and min(conc) in served:
    r = served[min(conc)]
    print(f"TPOT at c={min(conc)} - offline batch-1 step: {r['mean_tpot_ms']:.2f} - {latency['decode_step_ms']:.2f} = "
          f"{r['mean_tpot_ms'] - latency['decode_step_ms']:+.2f} ms (target <= 0.5 ms)")
for c, r in sorted(served.items()):
    for e in r["distinct_errors"]:
        print(f"c={c} error: {e[:200]}")
EOF
echo "done in $(( SECONDS - T0 )) s"
