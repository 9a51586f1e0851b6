"""`jaxllm bench latency`: the latency of one batch, measured as vLLM's `vllm bench latency`.

Each iteration is one `LLM.generate` call over `batch_size` prompts of `input_len`
random token ids, each generating `output_len` tokens (temperature 1.0, top_p 1.0,
ignore_eos); --num-iters-warmup untimed iterations come first. The result is the mean,
standard deviation and percentiles of the timed iterations' latencies, and the decode
step time: each request's interval from its first to its last token on the engine
core's clock (RequestOutput.metrics), over its output_len - 1 steps (vLLM's time per
output token), the median over the requests of all timed iterations. Every iteration
draws fresh prompts, so a prefix cache cannot shorten the later ones. max_num_seqs is
raised to the batch size, so the batch runs as one. Exits 1 if a request got the
wrong number of tokens or anything compiled after the engine's warm-up (the warm-up
iterations included).
"""
import dataclasses
import time

import numpy as np

from jaxllm.benchmarks.common import (check_fits, check_result, engine_settings, non_negative_int, positive_int,
                                      print_engine, random_prompt, write_json)

HELP = "latency of one batch, end to end, and its decode step time"
PERCENTAGES = [10, 25, 50, 75, 90, 99]


def add_cli_args(parser) -> None:
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--input-len", type=positive_int, default=32)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--num-iters-warmup", type=non_negative_int, default=10)
    parser.add_argument("--num-iters", type=positive_int, default=30)
    parser.add_argument("--output-json", help="write the results to this file")


def run_latency_bench(engine_args, batch_size: int, input_len: int, output_len: int,
                      num_iters_warmup: int, num_iters: int) -> dict:
    from jaxllm import LLM, SamplingParams

    engine_args = dataclasses.replace(engine_args, max_num_seqs=max(engine_args.max_num_seqs or batch_size, batch_size))
    start = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args))
    startup_s = time.perf_counter() - start
    try:
        engine = llm.llm_engine
        check_fits(engine, input_len + output_len)
        vocab = engine.config.model.arch.vocab_size
        rng = np.random.default_rng(engine_args.seed)
        params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
        compiles_before = engine.get_stats()["num_compilations"]
        latencies, step_s, lengths_ok = [], [], True
        for i in range(num_iters_warmup + num_iters):
            prompts = [random_prompt(input_len, vocab, rng) for _ in range(batch_size)]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            latency = time.perf_counter() - start
            complete = [o for o in outputs if len(o.outputs[0].token_ids) == output_len]
            lengths_ok &= len(complete) == batch_size
            if i < num_iters_warmup:
                continue
            latencies.append(latency)
            if output_len > 1:
                step_s += [(o.metrics.last_token_time - o.metrics.first_token_time) / (output_len - 1)
                           for o in complete]
        compiles = engine.get_stats()["num_compilations"] - compiles_before
        settings = engine_settings(engine)
    finally:
        llm.shutdown()

    step_ms = 1e3 * float(np.median(step_s)) if step_s else None
    return {
        "avg_latency": float(np.mean(latencies)),
        "std_latency": float(np.std(latencies)),
        "latencies": latencies,
        "percentiles": dict(zip(PERCENTAGES, np.percentile(latencies, PERCENTAGES).tolist())),
        "decode_step_ms": step_ms,
        "decode_tok_s": batch_size / step_ms * 1e3 if step_ms else None,
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "num_iters_warmup": num_iters_warmup, "num_iters": num_iters, "seed": engine_args.seed,
        "all_lengths_ok": lengths_ok,
        "compiles_after_warm_up": compiles,
        "startup_s": round(startup_s, 1),
        "engine": settings,
    }


def main(ns, engine_args) -> int:
    result = run_latency_bench(engine_args, ns.batch_size, ns.input_len, ns.output_len,
                               ns.num_iters_warmup, ns.num_iters)
    write_json(ns.output_json, result)
    print_engine(result)
    print(f"batch {result['batch_size']}, {result['input_len']} in / {result['output_len']} out, "
          f"{result['num_iters']} iterations after {result['num_iters_warmup']} warm-up")
    print(f"Avg latency: {result['avg_latency']:.4f} s")
    print(f"Std latency: {result['std_latency']:.4f} s")
    for percentage, latency in result["percentiles"].items():
        print(f"{percentage}% percentile latency: {latency:.4f} s")
    if result["decode_step_ms"] is not None:
        print(f"Decode step: {result['decode_step_ms']:.3f} ms ({result['decode_tok_s']:.1f} output tok/s)")
    return check_result(result, "after warm-up")
