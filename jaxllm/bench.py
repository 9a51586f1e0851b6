"""`jaxllm bench step`: engine step time at fixed batch sizes (decode-dominated).

For each batch size B: B requests of `input_len` random tokens each generate
`output_len` tokens (ignore_eos). Every engine step is timed on the host clock
(the step returns sampled ids, so it includes the device work); decode steps,
where all B requests decode one token, give the median step time and the
throughput. Also checks that no XLA compilation happened after warm-up.
"""
import dataclasses
import json
import time

import numpy as np


def run_step_bench(engine_args, batch_sizes: list[int], input_len: int, output_len: int, seed: int = 0) -> list[dict]:
    from jaxllm import SamplingParams, compilation
    from jaxllm.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args)
    startup_s = time.perf_counter() - start
    runner = engine.engine_core.core.runner
    vocab = engine.config.model.arch.vocab_size
    rng = np.random.default_rng(seed)
    compiles_after_warm_up = compilation.num_compilations()
    rows = []
    for batch in batch_sizes:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for i in range(batch):
            prompt = {"prompt_token_ids": rng.integers(0, vocab, input_len).tolist()}
            engine.add_request(f"b{batch}-{i}", prompt, params)
        decode_s, prefill_s, outputs = [], [], {}
        while engine.has_unfinished_requests():
            scheduler = engine.engine_core.core.scheduler
            decoding = len(scheduler.running) == batch and not scheduler.waiting and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in scheduler.running)
            t0 = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
            (decode_s if decoding else prefill_s).append(time.perf_counter() - t0)
        tokens = [o.outputs[0].token_ids for o in outputs.values()]
        step_ms = 1e3 * float(np.median(decode_s)) if decode_s else float("nan")
        rows.append({
            "batch": batch, "input_len": input_len, "output_len": output_len,
            "decode_step_ms": round(step_ms, 3),
            "decode_tok_s": round(batch / step_ms * 1e3, 1) if decode_s else None,
            "prefill_s": round(sum(prefill_s), 3),
            "all_lengths_ok": all(len(t) == output_len for t in tokens) and len(tokens) == batch,
            "distinct_tokens": len({t for seq in tokens for t in seq}),
        })
    return [{"model": engine.config.model.path, "dtype": str(np.dtype(engine.config.model.dtype)),
             "attention_backend": engine.config.attention_backend, "startup_s": round(startup_s, 1),
             "kv_cache": runner.describe(),
             "compiles_after_warm_up": compilation.num_compilations() - compiles_after_warm_up,
             "rows": rows}]


def print_table(results: list[dict]) -> None:
    for res in results:
        print(f"\n{res['model']} ({res['dtype']}, attention={res['attention_backend']}), "
              f"startup {res['startup_s']} s, compiles after warm-up: {res['compiles_after_warm_up']}")
        print(f"{'batch':>6} {'in':>6} {'out':>5} {'step ms':>9} {'tok/s':>9} {'prefill s':>10} {'ok':>4}")
        for r in res["rows"]:
            print(f"{r['batch']:>6} {r['input_len']:>6} {r['output_len']:>5} {r['decode_step_ms']:>9} "
                  f"{r['decode_tok_s']!s:>9} {r['prefill_s']:>10} {str(r['all_lengths_ok']):>4}")


def main(ns, engine_args) -> int:
    batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
    engine_args = dataclasses.replace(engine_args, max_num_seqs=max(engine_args.max_num_seqs, max(batch_sizes)))
    results = run_step_bench(engine_args, batch_sizes, ns.input_len, ns.output_len)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)
    return 0
