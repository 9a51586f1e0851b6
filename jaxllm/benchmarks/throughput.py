"""`jaxllm bench throughput`: offline throughput, measured as vLLM's `vllm bench throughput`.

The random dataset: `num_prompts` prompts of random token ids, each prompt's length
uniform in [input_len * (1 - r), input_len * (1 + r)] and its output length likewise
around output_len (r = --random-range-ratio; --seed seeds the dataset and the engine,
as in vLLM). --prefix-len N puts one shared prefix of N random token ids before every
prompt (vLLM's: a prompt is then N + its own input length), for the prefix cache to
find; the result reports the prefix cache's hit rate over the timed call (its prompt
tokens found in the cache over those looked up). Every request samples at temperature 1.0, top_p 1.0 with ignore_eos, so it
generates exactly its output length. One `LLM.generate` call over all of them is timed (with
--runner pooling, one `LLM.embed` call: each prompt's vector, no output tokens; prompts/s is
requests_per_second),
after the engine is built and warmed up; total_num_tokens counts prompt and output
tokens. Exits 1 if a request got the wrong number of tokens or anything compiled
during the timed call.

With --profile-dir, the engine core records a jax.profiler trace of the timed call
(started before the clock, stopped after it), and the result's "profile" says how the
device spent the run (jaxllm.profiling): its busy time (the union of its kernels) and idle
time (the rest of the span from the first kernel to the last) in total, the idle share of
that span (the host on the critical path), and the kernels' and host phases' ms per step.
Tracing slows the host a little, so a profiled run's tokens/s is a bound from below.
"""
import dataclasses
import time

import numpy as np

from jaxllm.benchmarks.common import (check_fits, check_result, engine_settings, non_negative_int, positive_int,
                                      print_engine, random_lengths, random_token_prompts, range_ratio, write_json)

HELP = "offline throughput over random prompts (vLLM's definitions)"


def add_cli_args(parser) -> None:
    parser.add_argument("--input-len", type=positive_int, required=True,
                        help="prompt length of each request (after the shared prefix, if any)")
    parser.add_argument("--prefix-len", type=non_negative_int, default=0,
                        help="random token ids shared by every prompt, before its own --input-len ones")
    parser.add_argument("--output-len", type=positive_int, default=128, help="output length of each request")
    parser.add_argument("--num-prompts", type=positive_int, default=1000)
    parser.add_argument("--random-range-ratio", type=range_ratio, default=0.0,
                        help="lengths uniform in [len * (1 - r), len * (1 + r)], r in [0, 1)")
    parser.add_argument("--output-json", help="write the results to this file")
    parser.add_argument("--profile-dir",
                        help="record a jax.profiler trace of the timed call here and report the device's busy and "
                             "idle time; tracing slows the host a little, so tokens/s is then a bound from below")


def _prefix_cache_stats(engine) -> tuple[int, int] | None:
    """The engine's prefix-cache counters since start-up, (queries, hits) in prompt tokens,
    or None from an engine that does not count them."""
    stats = getattr(engine, "prefix_cache_stats", None)
    return tuple(stats()) if stats is not None else None


def device_profile(trace_dir: str) -> dict:
    """The device's time over the run that `trace_dir`'s latest trace recorded: busy and idle
    ms in total and the idle share of the span from the first kernel to the last, with
    summarize_trace's ms per step by kernel kind and host phase."""
    from jaxllm.profiling import latest_trace, summarize_trace
    path = latest_trace(trace_dir)
    summary = summarize_trace(path)
    keys = ("steps", "total_busy_ms", "total_idle_ms", "device_idle_share")
    return {**{key: summary[key] for key in keys}, "kernel_ms_per_step": summary["kernel_ms"],
            "host_ms_per_step": summary["host_ms"], "trace": path}


def run_throughput_bench(engine_args, num_prompts: int, input_len: int, output_len: int,
                         random_range_ratio: float = 0.0, prefix_len: int = 0, profile_dir: str | None = None) -> dict:
    from jaxllm import LLM, SamplingParams

    rng = np.random.default_rng(engine_args.seed)
    pooling = engine_args.runner == "pooling"  # each prompt's one vector: no output tokens
    own_lens, output_lens = random_lengths(num_prompts, input_len, output_len, random_range_ratio, rng)
    output_lens = [0] * num_prompts if pooling else output_lens
    prompt_lens = [prefix_len + n for n in own_lens]
    start = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args))
    startup_s = time.perf_counter() - start
    try:
        engine = llm.llm_engine
        check_fits(engine, max(map(sum, zip(prompt_lens, output_lens))))
        vocab = engine.config.model.arch.vocab_size
        prompts = [{"prompt_token_ids": ids} for ids in random_token_prompts(own_lens, vocab, rng, prefix_len)]
        params = None if pooling else [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n)
                                       for n in output_lens]

        stats_before = engine.get_stats()
        cache_before = _prefix_cache_stats(engine)
        if profile_dir:
            llm.start_profile(profile_dir)
        try:
            start = time.perf_counter()
            outputs = llm.embed(prompts, use_tqdm=False) if pooling else llm.generate(prompts, params)
            elapsed_time = time.perf_counter() - start
        finally:
            if profile_dir:  # writing the trace out is left off the clock
                llm.stop_profile()
        stats_after = engine.get_stats()
        compiles = stats_after["num_compilations"] - stats_before["num_compilations"]
        # Requests sent back to waiting when the KV blocks ran out (recomputed later); None where not counted.
        preemptions = (stats_after["num_preemptions"] - stats_before["num_preemptions"]
                       if "num_preemptions" in stats_after else None)
        cache_after = _prefix_cache_stats(engine)
        settings = engine_settings(engine)
    finally:
        llm.shutdown()

    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = 0 if pooling else sum(len(o.outputs[0].token_ids) for o in outputs)
    if pooling:  # each vector the width of the model's hidden states
        lengths_ok = all(len(o.outputs.embedding) == engine.config.model.arch.hidden_size for o in outputs)
    else:
        lengths_ok = all(len(o.outputs[0].token_ids) == n for o, n in zip(outputs, output_lens))
    queries = hits = hit_rate = None
    if cache_before is not None and cache_after is not None:
        queries, hits = cache_after[0] - cache_before[0], cache_after[1] - cache_before[1]
        hit_rate = hits / queries if queries else 0.0
    result = {
        "elapsed_time": elapsed_time,
        "num_requests": len(outputs),
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(outputs) / elapsed_time,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed_time,
        "output_tokens_per_second": output_tokens / elapsed_time,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "input_len": input_len, "output_len": output_len, "random_range_ratio": random_range_ratio,
        "prefix_len": prefix_len,
        # Over the timed call, in prompt tokens; None from an engine that does not count them.
        "prefix_cache_queries": queries, "prefix_cache_hits": hits, "prefix_cache_hit_rate": hit_rate,
        "seed": engine_args.seed,
        "prompt_lens": prompt_lens,
        "output_lens": output_lens,
        "all_lengths_ok": lengths_ok,
        "compiles_after_warm_up": compiles,
        "num_preemptions": preemptions,
        "startup_s": round(startup_s, 1),
        "engine": settings,
    }
    if profile_dir:
        try:
            result["profile"] = device_profile(profile_dir)
        # No trace written, or one with no kernels, steps or host plane: the timings still stand.
        except (ValueError, FileNotFoundError, KeyError) as e:
            result["profile_error"] = str(e)
    return result


def main(ns, engine_args) -> int:
    result = run_throughput_bench(engine_args, ns.num_prompts, ns.input_len, ns.output_len, ns.random_range_ratio,
                                  ns.prefix_len, ns.profile_dir)
    write_json(ns.output_json, result)
    elapsed = result["elapsed_time"]
    print_engine(result)
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} "
          f"total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s ({elapsed:.2f} s)")
    if "profile" in result:
        p = result["profile"]
        print(f"Device idle share: {100 * p['device_idle_share']:.1f}% (busy {p['total_busy_ms'] / 1e3:.2f} s, "
              f"idle {p['total_idle_ms'] / 1e3:.2f} s over {p['steps']} steps)")
    elif "profile_error" in result:
        print(f"Device idle share: n/a ({result['profile_error']})")
    print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
    print(f"Total num output tokens:  {result['total_output_tokens']}")
    if result["num_preemptions"] is not None:
        print(f"Preemptions: {result['num_preemptions']}")
    if result["prefix_cache_hit_rate"] is None:
        print("Prefix cache hit rate: n/a (this engine does not count prefix-cache hits)")
    else:
        print(f"Prefix cache hit rate: {100 * result['prefix_cache_hit_rate']:.1f}% "
              f"({result['prefix_cache_hits']} of {result['prefix_cache_queries']} prompt tokens)")
    return check_result(result, "during the timed run")
