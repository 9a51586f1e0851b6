"""`jaxllm bench startup`: one start of the engine, timed: the wall time of `LLM(...)` and the
engine's own split of it (weights / KV cache / compile, and within compile: executables loaded
from the store, tracing and lowering, waiting on XLA, first runs), then a digest of 8 outputs
(64-token prompts, 16 tokens each, ignore_eos, sampled at SamplingParams' default temperature
1.0 from the engine's --seed, so the same on every start).

Run it twice against one compilation cache (JAXLLM_COMPILATION_CACHE) for a cold and a warm
start: with --expect-outputs the cold start's JSON, the warm one exits 1 unless its outputs
are the same, as they must be on every start.
"""
import dataclasses
import hashlib
import json
import time

from jaxllm.benchmarks.common import report_failures, write_json

HELP = "one engine start-up, timed and split into its phases, with a digest of its first outputs"
NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 8, 64, 16


def add_cli_args(parser) -> None:
    parser.add_argument("--output-json", help="write the result to this file")
    parser.add_argument("--expect-outputs", metavar="JSON",
                        help="an earlier start's --output-json: fail unless this start's outputs are the same")


def run_startup_bench(engine_args) -> dict:
    from jaxllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args), show_progress=False)
    startup_s = time.perf_counter() - start
    try:
        engine = llm.llm_engine
        vocab = engine.config.model.arch.vocab_size
        prompts = [{"prompt_token_ids": [(100 * i + j) % vocab for j in range(1, PROMPT_LEN + 1)]}
                   for i in range(NUM_PROMPTS)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True), use_tqdm=False)
        description = engine.engine_core.description
    finally:
        llm.shutdown()
    digest = hashlib.sha256(json.dumps([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:16]
    return {"startup_s": round(startup_s, 3), "outputs": digest, "description": description}


def main(ns, engine_args) -> int:
    expected = None
    if ns.expect_outputs:
        with open(ns.expect_outputs) as f:
            expected = json.load(f)["outputs"]
    result = run_startup_bench(engine_args)
    write_json(ns.output_json, result)
    print(json.dumps(result))
    if expected is not None and result["outputs"] != expected:
        return report_failures([f"the outputs differ from {ns.expect_outputs}'s: {result['outputs']} "
                                f"against {expected}"])
    return 0
