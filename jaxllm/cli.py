"""The `jaxllm` command: `jaxllm generate` runs offline generation.

Engine flags are EngineArgs' fields, spelled as in vLLM (--max-model-len, ...).
"""
import argparse
import dataclasses
import sys
import time
import typing

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain in one sentence what a GPU is.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from jaxllm.config import EngineArgs
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        if base is bool:  # --flag / --no-flag
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
            continue
        parser.add_argument(flag, type=base, default=field.default)


def engine_args_from(ns: argparse.Namespace):
    from jaxllm.config import EngineArgs
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxllm import LLM, SamplingParams

    start = time.perf_counter()
    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    print(f"engine ready in {time.perf_counter() - start:.1f} s: {llm.llm_engine.engine_core.description}")
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens,
                            seed=ns.sampling_seed, ignore_eos=ns.ignore_eos)
    prompts = ns.prompt or DEFAULT_PROMPTS
    start = time.perf_counter()
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        print(f"\n--- {prompt!r}\n{c.text!r}\n({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s: "
          f"{n_out / elapsed:.1f} output tokens/s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation over a few prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: a few built-in ones")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    step = bench_sub.add_parser("step", help="engine step time at fixed batch sizes")
    add_engine_args(step)
    step.add_argument("--batch-sizes", default="1,64")
    step.add_argument("--input-len", type=int, default=128)
    step.add_argument("--output-len", type=int, default=128)
    step.add_argument("--json", help="also write the results to this file")
    ns = parser.parse_args(argv)
    if ns.command == "generate":
        return cmd_generate(ns)
    from jaxllm import bench as bench_mod
    return bench_mod.main(ns, engine_args_from(ns))


if __name__ == "__main__":
    sys.exit(main())
