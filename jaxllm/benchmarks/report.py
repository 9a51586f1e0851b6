"""`jaxllm bench report PART --dir DIR`: the table a part of scripts/gpu_run.sh prints last,
from the JSON its benches wrote into DIR (a result that is missing shows as "-" or "not run").

  prefix  `bench throughput` with the prefix cache off and on (prefix_{no-,}enable-prefix-caching.json):
          throughput of each, their ratio and the cache's hit rate.
  serve   the server against the offline engine: `bench throughput` (offline.json), `bench
          latency --batch-size 1` (latency.json) and `bench serve` at each --concurrencies
          (serve_c{C}.json in --raw-dir, copied into DIR without their per-request lists):
          output tok/s, TTFT and TPOT per run, then served / offline at the highest concurrency
          (target >= 0.90) and TPOT at the lowest minus the offline batch-1 step (target <= 0.5 ms).
  multi   the multi-GPU configurations ({config}-{step,long,short}.json): the batch-1 step and its
          collectives' share, throughput at 1000/1000 and 2048/128, start-up, and each
          configuration's 1000/1000 throughput over tp1's.
"""
import json
import os

from jaxllm.benchmarks.common import cell, positive_ints, read_json

HELP = "the table of a scripts/gpu_run.sh part, from the JSON results in a folder"
# bench serve's per-request lists: 1000 x 1000 ITLs would pass what a device call brings back.
PER_REQUEST_KEYS = ("generated_texts", "itls", "ttfts", "input_lens", "output_lens")


def add_cli_args(parser) -> None:
    parser.add_argument("part", choices=("prefix", "serve", "multi"))
    parser.add_argument("--dir", required=True, help="the folder of the part's JSON results")
    parser.add_argument("--raw-dir", help="serve: the folder of bench serve's own JSON (default --dir)")
    parser.add_argument("--concurrencies", type=positive_ints, default="256,1,64,16",
                        help="serve: the --max-concurrency values run")
    parser.add_argument("--configs", nargs="+", default=[], help="multi: the configurations run, NAME[:MODES]")


def prefix_table(out: str) -> None:
    results = {name: r for mode, name in (("no-enable-prefix-caching", "off"), ("enable-prefix-caching", "on"))
               if (r := read_json(os.path.join(out, f"prefix_{mode}.json"))) is not None}
    print("\n| prefix caching | requests/s | total tok/s | output tok/s | elapsed (s) | hit rate | start-up (s) "
          "| compiles |")
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
        print(f"| {name} | {r['requests_per_second']:.2f} | {r['tokens_per_second']:,.0f} "
              f"| {r['output_tokens_per_second']:,.0f} | {r['elapsed_time']:.1f} | {rate} | {r['startup_s']} "
              f"| {r['compiles_after_warm_up']} |")
    if "on" in results and "off" in results:
        print(f"\non / off throughput: {results['on']['tokens_per_second'] / results['off']['tokens_per_second']:.2f}x")
        w = results["on"]
        print(f"workload: {w['num_requests']} requests, prefix {w['prefix_len']} + {w['input_len']} own tokens, "
              f"{w['output_len']} out; lengths ok: off {results['off']['all_lengths_ok']}, on {w['all_lengths_ok']}")


def serve_table(out: str, raw: str, concurrencies: list[int]) -> None:
    served = {}
    for c in sorted(concurrencies):
        r = read_json(os.path.join(raw, f"serve_c{c}.json"))
        if r is None:
            continue
        r["distinct_errors"] = sorted({e for e in r.pop("errors", []) if e})[:5]
        for key in PER_REQUEST_KEYS:
            r.pop(key, None)
        with open(os.path.join(out, f"serve_c{c}.json"), "w") as f:
            json.dump(r, f, indent=1)
        served[c] = r
    offline, latency = read_json(os.path.join(out, "offline.json")), read_json(os.path.join(out, "latency.json"))
    print("\n| run | prompts | output tok/s | TTFT mean (ms) | TTFT p99 (ms) | TPOT mean (ms) | TPOT p99 (ms) "
          "| failed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    if offline:
        print(f"| offline bench throughput | {offline['num_requests']} | {offline['output_tokens_per_second']:,.0f} "
              f"| - | - | - | - | {'0' if offline['all_lengths_ok'] else 'wrong lengths'} |")
    if latency:
        print(f"| offline batch 1 (bench latency) | 1 | {cell(latency['decode_tok_s'], ',.0f')} | - | - "
              f"| {cell(latency['decode_step_ms'], '.2f')} (step) | - | - |")
    for c in sorted(concurrencies):
        r = served.get(c)
        if r is None:
            print(f"| served c={c} | - | - | - | - | - | - | not run |")
            continue
        print(f"| served c={c} | {r['num_prompts']} | {r['output_throughput']:,.0f} | {r['mean_ttft_ms']:.1f} "
              f"| {r['p99_ttft_ms']:.1f} | {r['mean_tpot_ms']:.2f} | {r['p99_tpot_ms']:.2f} | {r['failed']} |")
    if offline and served:
        top = max(served)
        ratio = served[top]["output_throughput"] / offline["output_tokens_per_second"]
        print(f"\nserved c={top} / offline output tok/s: {ratio:.3f} (target >= 0.90)")
    if latency and latency.get("decode_step_ms") and min(concurrencies) in served:
        c, step = min(concurrencies), latency["decode_step_ms"]
        tpot = served[c]["mean_tpot_ms"]
        print(f"TPOT at c={c} - offline batch-1 step: {tpot:.2f} - {step:.2f} = {tpot - step:+.2f} ms "
              f"(target <= 0.5 ms)")
    for c, r in sorted(served.items()):
        for e in r["distinct_errors"]:
            print(f"c={c} error: {e[:200]}")


def multi_table(out: str, configs: list[str]) -> None:
    names = [c.split(":")[0] for c in configs]

    def step_cells(r) -> tuple[str, str]:
        if r is None:
            return "-", "-"
        row = r["rows"][0]
        share = (row.get("profile") or {}).get("collective_share")
        return f"{row['decode_step_ms']}", "-" if share is None else f"{100 * share:.0f}%"

    def tput(r) -> str:
        return "-" if r is None else f"{r['output_tokens_per_second']:,.0f}"

    print("\n| config | batch-1 step (ms) | collectives | 1000/1000 output tok/s | 2048/128 output tok/s "
          "| start-up (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    long_tput = {}
    for name in names:
        step, share = step_cells(read_json(os.path.join(out, f"{name}-step.json")))
        long, short = (read_json(os.path.join(out, f"{name}-{mode}.json")) for mode in ("long", "short"))
        startup = next((r["startup_s"] for r in (long, short) if r is not None and "startup_s" in r), "-")
        if long is not None:
            long_tput[name] = long["output_tokens_per_second"]
        print(f"| {name} | {step} | {share} | {tput(long)} | {tput(short)} | {startup} |")
    for name, value in long_tput.items():
        if name != "tp1" and "tp1" in long_tput:
            print(f"{name} / tp1 throughput (1000/1000): {value / long_tput['tp1']:.2f}x")


def main(ns) -> int:
    if ns.part == "prefix":
        prefix_table(ns.dir)
    elif ns.part == "serve":
        serve_table(ns.dir, ns.raw_dir or ns.dir, ns.concurrencies)
    else:
        multi_table(ns.dir, ns.configs)
    return 0
