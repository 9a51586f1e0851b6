"""`jaxllm bench spec`: speculative decoding end to end, on prompts whose answer is grounded
in their input (repeat a piece of code: jaxllm's own sources, so nothing is downloaded).

Per batch size B: B chat prompts, each asking to repeat a different piece of code, greedy,
up to `output_len` tokens; output tokens per second with speculation off (the engine's
defaults) and on (`--speculative-config`, default n-gram with 4 draft tokens: made on the device
under asynchronous scheduling, the default, and on the host with `--no-async-scheduling`), the mean
acceptance length (vLLM's: tokens per step of a request with drafts, the one after the
drafts included) and how many requests gave the same tokens both ways (in bfloat16 on a
GPU a batch of another shape may round a near tie the other way). Exits 1 when anything
compiled after warm-up.
"""
import dataclasses
import importlib.resources
import time

from jaxllm.benchmarks.common import report_failures, write_json
from jaxllm.benchmarks.step import batch_sizes

HELP = "speculative decoding end to end: tokens/s with and without, and the mean acceptance length"
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
_LINES = 40  # of code per prompt


def add_cli_args(parser) -> None:
    parser.add_argument("--batch-sizes", type=batch_sizes, default="1,16")
    parser.add_argument("--output-len", type=int, default=256, help="the most tokens a request generates")
    parser.add_argument("--output-json", "--json", dest="json", help="also write the results to this file")


def grounded_prompts(n: int) -> list[list[dict]]:
    """n chat conversations, each asking to repeat _LINES lines of a different jaxllm source file."""
    files = sorted((f for f in importlib.resources.files("jaxllm").iterdir() if f.name.endswith(".py")),
                   key=lambda f: f.name)
    prompts = []
    for i in range(n):
        lines = files[i % len(files)].read_text().splitlines()
        start = _LINES * (i // len(files)) % max(len(lines) - _LINES, 1)
        code = "\n".join(lines[start:start + _LINES])
        prompts.append([{"role": "user", "content": f"Repeat this Python code exactly, with no comment:\n\n{code}"}])
    return prompts


def _spec_counts(llm) -> tuple[int, int]:
    stats = llm.llm_engine.get_stats()
    return stats.get("spec_decode_num_drafts", 0), stats.get("spec_decode_num_accepted_tokens", 0)


def run_spec_bench(engine_args, sizes: list[int], output_len: int) -> dict:
    from jaxllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    spec = engine_args.speculative_config or DEFAULT_SPEC
    runs = {}
    compiles = 0
    for name, args in (("off", dataclasses.replace(engine_args, speculative_config=None)),
                       ("on", dataclasses.replace(engine_args, speculative_config=spec))):
        with LLM(**dataclasses.asdict(args)) as llm:
            llm.chat(grounded_prompts(1), SamplingParams(max_tokens=8), use_tqdm=False)  # first calls off the clock
            before = llm.llm_engine.get_stats()["num_compilations"]
            for batch in sizes:
                drafts, accepted = _spec_counts(llm)
                start = time.perf_counter()
                outs = llm.chat(grounded_prompts(batch), params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                drafts_after, accepted_after = _spec_counts(llm)
                runs[name, batch] = {"seconds": elapsed, "tokens": [o.outputs[0].token_ids for o in outs],
                                     "drafts": drafts_after - drafts, "accepted": accepted_after - accepted}
            compiles += llm.llm_engine.get_stats()["num_compilations"] - before
    rows = []
    for batch in sizes:
        off, on = runs["off", batch], runs["on", batch]
        num_tokens = [sum(map(len, r["tokens"])) for r in (off, on)]
        tok_s = [n / r["seconds"] for n, r in zip(num_tokens, (off, on))]
        rows.append({"batch": batch, "output_tokens_off": num_tokens[0], "output_tokens_on": num_tokens[1],
                     "tok_s_off": round(tok_s[0], 1), "tok_s_on": round(tok_s[1], 1),
                     "speedup": round(tok_s[1] / tok_s[0], 2),
                     "mean_acceptance_length": round(1 + on["accepted"] / on["drafts"], 2) if on["drafts"] else None,
                     "same_tokens": sum(a == b for a, b in zip(off["tokens"], on["tokens"]))})
    return {"speculative_config": spec, "output_len": output_len, "compiles_after_warm_up": compiles,
            "rows": rows, "model": engine_args.model}


def print_table(res: dict) -> None:
    print(f"\nspeculative_config={res['speculative_config']}, up to {res['output_len']} tokens, "
          f"compiles after warm-up: {res['compiles_after_warm_up']}")
    print(f"{'batch':>6} {'tok/s off':>10} {'tok/s on':>10} {'speedup':>8} {'accept len':>11} {'same':>6}")
    for r in res["rows"]:
        print(f"{r['batch']:>6} {r['tok_s_off']:>10} {r['tok_s_on']:>10} {r['speedup']:>8} "
              f"{r['mean_acceptance_length']!s:>11} {r['same_tokens']:>3}/{r['batch']}")


def main(ns, engine_args) -> int:
    sizes = [int(b) for b in ns.batch_sizes.split(",")]
    engine_args = dataclasses.replace(engine_args, max_num_seqs=max(engine_args.max_num_seqs or 1, *sizes))
    result = run_spec_bench(engine_args, sizes, ns.output_len)
    write_json(ns.json, result)
    print_table(result)
    compiles = result["compiles_after_warm_up"]
    return report_failures([f"{compiles} compilations after warm-up"] if compiles else [])
