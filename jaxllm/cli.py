"""The `jaxllm` command: `jaxllm generate` runs offline generation, `jaxllm serve` an
OpenAI-compatible server, `jaxllm bench ...` the benchmarks (jaxllm/benchmarks: the engine's
throughput, latency, step, start-up and weight updates, a running server, the kernels and the
device's ceilings), `jaxllm convert` writes a model as an orbax checkpoint that restores
straight into the mesh's shardings (docs/models.md).

Engine flags are EngineArgs' fields, spelled as in vLLM (--max-model-len, ...). A user's
mistake (a flag's value, a model file, a prompt) prints one line, `jaxllm: error: ...`,
and exits 2, as argparse does; any other exception is a crash and keeps its traceback.
"""
import argparse
import contextlib
import dataclasses
import json
import sys
import time
import typing

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain in one sentence what a GPU is.",
]
# vLLM's short spellings of the parallelism flags.
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp", "pipeline_parallel_size": "-pp"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from jaxllm.config import EngineArgs
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        flags = [SHORT_FLAGS[field.name]] if field.name in SHORT_FLAGS else []
        flags.append("--" + field.name.replace("_", "-"))
        kind = hints[field.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        if base is bool:  # --flag / --no-flag
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=field.default)
            continue
        if typing.get_origin(base) is list:  # names: --logits-processors mod:A mod:B
            parser.add_argument(*flags, nargs="+", default=field.default)
            continue
        if typing.get_origin(base) is dict:  # JSON, as vLLM's: --speculative-config '{"method": "ngram", ...}'
            parser.add_argument(*flags, type=_json_object, default=field.default)
            continue
        parser.add_argument(*flags, type=base, default=field.default)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


class UserError(Exception):
    """A bad flag value, model file or prompt: main prints it as one line and exits 2."""


@contextlib.contextmanager
def user_errors():
    """ValueError, TypeError and FileNotFoundError from the boundaries called inside
    (SamplingParams; the engine's start: EngineArgs.create_config and the model loader;
    LLM.generate's prompt checks) are the user's. Only those calls are wrapped, so a
    bug elsewhere keeps its traceback."""
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UserError(" ".join(str(e).splitlines())) from e


def engine_args_from(ns: argparse.Namespace):
    from jaxllm.config import EngineArgs
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxllm import LLM, SamplingParams

    with user_errors():  # before the engine: a bad sampling flag fails at once, not after the model loads
        params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                                max_tokens=ns.max_tokens, seed=ns.sampling_seed, ignore_eos=ns.ignore_eos)
    start = time.perf_counter()
    with user_errors():
        llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    with llm:  # the engine stops here, not in the interpreter's teardown
        print(f"engine ready in {time.perf_counter() - start:.1f} s: {llm.llm_engine.engine_core.description}")
        prompts = ns.prompt or DEFAULT_PROMPTS
        start = time.perf_counter()
        with user_errors():
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


def cmd_serve(ns: argparse.Namespace) -> int:
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise UserError(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    try:
        from jaxllm.entrypoints.openai.api_server import configure_logging, run_server
    except ImportError as e:
        raise UserError(f"jaxllm serve needs the serve extra (pip install 'jaxllm[serve]'): {e}") from e
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.chat_utils import load_chat_template
    from jaxllm.entrypoints.openai.cli_args import ChatFeatures, served_model_names
    from jaxllm.entrypoints.openai.reasoning_parsers import reasoning_end_token_id
    from jaxllm.entrypoints.openai.serving_models import ServingModels

    configure_logging()
    start = time.perf_counter()
    with user_errors():  # the chat template file, the tool and reasoning flags, the engine's start
        chat_template = load_chat_template(ns.chat_template)
        features = ChatFeatures(ns.tool_call_parser, ns.enable_auto_tool_choice,
                                max_stored_responses=ns.max_stored_responses)
        if ns.lora_modules and not ns.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        engine = AsyncLLM.from_engine_args(engine_args_from(ns))
    if ns.reasoning_parser is not None:
        try:  # its tags must be tokens of the vocabulary
            end_id = reasoning_end_token_id(engine.tokenizer, ns.reasoning_parser)
        except ValueError as e:
            engine.shutdown()
            raise UserError(str(e)) from e
        features = dataclasses.replace(features, reasoning_parser=ns.reasoning_parser, reasoning_end_token_id=end_id)
    names = served_model_names(ns, engine.config.model.path)
    try:  # the adapters' names and files, checked before the server starts
        ServingModels(engine, names, ns.lora_modules)
    except ValueError as e:
        engine.shutdown()
        raise UserError(f"--lora-modules: {e}") from e
    print(f"engine ready in {time.perf_counter() - start:.1f} s: {engine.engine_core.description}", flush=True)
    run_server(engine, names, ns.host, ns.port, ns.api_key,
               chat_template, ns.max_log_len, ns.uvicorn_log_level, ns.max_request_body_bytes,
               ns.max_seqs_per_request, ns.shutdown_timeout, features, ns.lora_modules)
    return 0


def cmd_convert(ns: argparse.Namespace) -> int:
    """SRC (an HF folder, a .gguf file or a hub id) -> DST: config.json, the tokenizer's
    files and the params as an orbax checkpoint (models/orbax_checkpoint.py)."""
    import json
    import os
    import shutil

    import jax.numpy as jnp

    from jaxllm.config import EngineArgs
    from jaxllm.dtypes import resolve_dtype
    from jaxllm.models.loader import create_model, iter_weights
    from jaxllm.models.orbax_checkpoint import save_model
    from jaxllm.sharding import make_mesh
    from jaxllm.tokenizer import get_tokenizer

    if os.path.exists(ns.dst) and (not os.path.isdir(ns.dst) or os.listdir(ns.dst)):
        raise UserError(f"{ns.dst!r} exists and is not an empty folder: convert into a new one")
    with user_errors():
        mc = EngineArgs(model=ns.src, revision=ns.revision, download_dir=ns.download_dir).create_config().model
        if mc.format not in ("hf", "gguf"):
            raise ValueError(f"convert reads an HF folder, a .gguf file or a hub id; {ns.src!r} is {mc.format}")
        if mc.quantization is not None:
            raise ValueError(f"convert saves unquantized params; {ns.src!r} is a {mc.quantization.method} checkpoint")
        # "auto": the dtype the engine serves the checkpoint in on GPU, even when converting on CPU.
        dtype = jnp.dtype(resolve_dtype(ns.dtype, mc.hf_config, platform="gpu"))
        start = time.perf_counter()
        model = create_model(mc.arch, dtype=dtype, mesh=make_mesh(1), weights=iter_weights(mc.path, mc.format))
        try:
            tokenizer = get_tokenizer(mc)
        except ValueError as e:  # a folder without tokenizer files: convert the weights all the same
            print(f"{ns.src} has no tokenizer, so {ns.dst} holds none ({e.__class__.__name__})")
            tokenizer = None
    os.makedirs(ns.dst, exist_ok=True)
    save_model(model, ns.dst)
    config = {k: v for k, v in mc.hf_config.items() if k != "torch_dtype"}
    with open(os.path.join(ns.dst, "config.json"), "w") as f:
        json.dump({**config, "dtype": dtype.name}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(ns.dst)  # for a GGUF: the tokenizer built from its metadata, chat template too
    if mc.format == "hf" and os.path.isfile(os.path.join(mc.path, "generation_config.json")):
        shutil.copy(os.path.join(mc.path, "generation_config.json"), ns.dst)
    print(f"converted {ns.src} to {ns.dst} ({dtype.name}) in {time.perf_counter() - start:.1f} s")
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
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
                           description="Serve MODEL (default: the embedded SmolLM2-135M-Instruct) over "
                                       "OpenAI's HTTP API; see docs/serving.md.")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (as --model)")
    add_engine_args(serve)
    from jaxllm.entrypoints.openai.cli_args import add_server_args
    add_server_args(serve)
    convert = sub.add_parser("convert", help="write a model as an orbax checkpoint (fast sharded restore)",
                             description=cmd_convert.__doc__)
    convert.add_argument("src", metavar="SRC", help="an HF folder, a .gguf file or a Hugging Face hub id")
    convert.add_argument("dst", metavar="DST", help="a new folder for the checkpoint")
    convert.add_argument("--dtype", default="auto",
                         help="the params' dtype; auto: the checkpoint's own, float32 as bfloat16")
    convert.add_argument("--revision", default=None, help="of a hub id: a branch, tag or commit")
    convert.add_argument("--download-dir", default=None, help="of a hub id: the cache folder")
    worker = sub.add_parser("worker", help="host 1 .. num_hosts - 1 of a multi-host engine",
                            description="Follow host 0 of a multi-host engine (--num-hosts, --host-rank, "
                                        "--coordinator-address, the same engine flags as host 0's).")
    add_engine_args(worker)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from jaxllm.benchmarks import ENGINE_BENCHES, OTHER_BENCHES
    for name, module in {**ENGINE_BENCHES, **OTHER_BENCHES}.items():
        bench_parser = bench_sub.add_parser(name, help=module.HELP, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter)
        if name in ENGINE_BENCHES:
            add_engine_args(bench_parser)
        module.add_cli_args(bench_parser)
    ns = parser.parse_args(argv)
    try:
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "serve":
            return cmd_serve(ns)
        if ns.command == "convert":
            return cmd_convert(ns)
        if ns.command == "worker":
            from jaxllm.executor.multihost import run_worker
            with user_errors():
                return run_worker(engine_args_from(ns))
        with user_errors():  # the engine's start and its checks of a bench's requests; a bench's checks of its flags
            if ns.bench in ENGINE_BENCHES:
                return ENGINE_BENCHES[ns.bench].main(ns, engine_args_from(ns))
            return OTHER_BENCHES[ns.bench].main(ns)
    except UserError as e:
        print(f"jaxllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
