"""What the benches share: flag types, the random dataset, and the engine settings
each result records."""
import argparse
import json
import math

import numpy as np


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive ints, e.g. "1,64,256"."""
    return [positive_int(item) for item in text.split(",")]


def names_from(choices):
    """An argparse type: a comma-separated list of names, each one of `choices`."""
    def parse(text: str) -> list[str]:
        names = text.split(",")
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(choices)}")
        return names
    return parse


def range_ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def length_bounds(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's random dataset: lengths are uniform integers in [floor(len * (1 - r)),
    ceil(len * (1 + r))], both ends included; e.g. 100 with r=0.5 -> [50, 150]."""
    return math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))


def random_lengths(num_prompts: int, input_len: int, output_len: int, ratio: float,
                   rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of `num_prompts` requests of the random dataset, as
    length_bounds says. Raises ValueError if a length could be 0."""
    in_low, in_high = length_bounds(input_len, ratio)
    out_low, out_high = length_bounds(output_len, ratio)
    if in_low < 1 or out_low < 1:
        name, length = ("input_len", input_len) if in_low < 1 else ("output_len", output_len)
        raise ValueError(f"{name}={length} with random_range_ratio={ratio} allows length 0: "
                         f"{name} * (1 - random_range_ratio) must be >= 1")
    return (rng.integers(in_low, in_high + 1, num_prompts).tolist(),
            rng.integers(out_low, out_high + 1, num_prompts).tolist())


def random_prompt(length: int, vocab_size: int, rng: np.random.Generator) -> dict:
    """A prompt of `length` token ids uniform over the vocabulary."""
    return {"prompt_token_ids": rng.integers(0, vocab_size, length).tolist()}


def random_token_prompts(own_lens: list[int], vocab_size: int, rng: np.random.Generator,
                         prefix_len: int = 0) -> list[list[int]]:
    """vLLM's random dataset with a shared prefix (--random-prefix-len): one prefix of
    `prefix_len` token ids uniform over the vocabulary, the same for every prompt, then
    each prompt's own `own_lens[i]` uniform ids; a prompt has prefix_len + own_lens[i]
    tokens. With no prefix, the draws are those of random_prompt, one prompt after another."""
    prefix = rng.integers(0, vocab_size, prefix_len).tolist() if prefix_len else []
    return [prefix + rng.integers(0, vocab_size, n).tolist() for n in own_lens]


def check_fits(engine, max_total_len: int) -> None:
    """A request longer than max_model_len would stop short of its output length."""
    max_model_len = engine.config.model.max_model_len
    if max_total_len > max_model_len:
        raise ValueError(f"the longest request needs {max_total_len} tokens (prompt + output), "
                         f"more than max_model_len ({max_model_len})")


def engine_settings(engine) -> dict:
    """The engine's resolved settings, for a result to say what it measured."""
    config = engine.config
    return {"model": config.model.path, "load_format": config.model.load_format,
            "dtype": str(np.dtype(config.model.dtype)), "quantization": config.model.quantization and config.model.quantization.method,
            "kv_cache_dtype": str(np.dtype(config.cache.cache_dtype)), "max_model_len": config.model.max_model_len,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "block_size": config.cache.block_size, "tensor_parallel_size": config.parallel.tensor_parallel_size,
            "attention_backend": config.attention_backend, "async_scheduling": config.scheduler.async_scheduling,
            "capacity_scheduler_policy": config.scheduler.capacity_scheduler_policy,
            "batch_invariant": config.batch_invariant,
            "kv_cache": engine.engine_core.description}


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def read_json(path: str) -> dict | None:
    """A result a bench wrote, or None where the run wrote none (or was cut short mid-file)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cell(value, spec: str = ",.0f") -> str:
    """A table's cell: the value formatted, or "-" where nothing was measured."""
    return "-" if value is None else format(value, spec)


def report_failures(failed: list[str]) -> int:
    """Print each failure; the bench's exit status."""
    for failure in failed:
        print(f"FAILED: {failure}")
    return 1 if failed else 0


def print_engine(result: dict) -> None:
    engine = result["engine"]
    print(f"\n{engine['model']} ({engine['dtype']}), startup {result['startup_s']} s; {engine['kv_cache']}")


def check_result(result: dict, during: str) -> int:
    """Fails on wrong output lengths or on compilations `during` the measured calls;
    prints the count and each failure, and returns the bench's exit status."""
    compiles = result["compiles_after_warm_up"]
    print(f"Compilations {during}: {compiles}")
    failed = [] if result["all_lengths_ok"] else ["a request got the wrong number of output tokens"]
    if compiles:
        failed.append(f"{compiles} compilations {during}")
    return report_failures(failed)
