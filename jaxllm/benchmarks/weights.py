"""`jaxllm bench weights`: the engine inside a training loop (docs/jax.md), timed: weights
replaced from params already on the device and from host numpy arrays, the KV cache (and the
weights) freed by sleep and made again by wake_up with the memory the device reports, and
whether a request's numbers depend on its batch: one greedy request alone and among
--num-others random ones, with the first token and the largest logprob where they differ
(batch_invariant=True: none, bit for bit).

The engine runs in this process (the params are device arrays). Each time is the median of
--repeats calls, synchronized. Exits 1 if an update, a sleep or a wake compiled anything.
"""
import dataclasses
import statistics
import time

import jax
import numpy as np

from jaxllm.benchmarks.common import engine_settings, positive_int, print_engine, report_failures, write_json

HELP = "update_weights, sleep / wake_up and batch invariance, timed in one process"


def add_cli_args(parser) -> None:
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--num-others", type=positive_int, default=255,
                        help="requests beside the one whose outputs are compared")
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--output-json", help="write the results to this file")


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _device_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use")


def _invariance(llm, num_others: int, output_len: int) -> dict:
    """The first token where a greedy request among others leaves its solo run (None: never),
    the largest difference of their sampled tokens' logprobs, and that of the solo run's against
    the plain forward's (llm.get_logprobs_fn: 0 in batch-invariant mode)."""
    from jaxllm import SamplingParams
    vocab = llm.llm_engine.config.model.arch.vocab_size
    rng = np.random.default_rng(0)
    target = {"prompt_token_ids": rng.integers(0, vocab, 128).tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=0)
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0]
    others = [{"prompt_token_ids": rng.integers(0, vocab, int(rng.integers(16, 256))).tolist()}
              for _ in range(num_others)]
    together = llm.generate(others[:num_others // 2] + [target] + others[num_others // 2:], params,
                            use_tqdm=False)[num_others // 2].outputs[0]
    diverged = next((i for i, (a, b) in enumerate(zip(alone.token_ids, together.token_ids)) if a != b), None)
    agree = diverged if diverged is not None else output_len
    lp = lambda c: [d[t].logprob for d, t in zip(c.logprobs[:agree], c.token_ids[:agree])]
    sequence = np.asarray(target["prompt_token_ids"] + list(alone.token_ids), np.int32)
    plain = np.asarray(jax.jit(llm.get_logprobs_fn())(llm.get_params(), sequence))[len(target["prompt_token_ids"]) - 1:]
    engine = [d[t].logprob for d, t in zip(alone.logprobs, alone.token_ids)]
    return {"num_others": num_others, "first_divergent_token": diverged,
            "max_logprob_diff": float(max(abs(a - b) for a, b in zip(lp(alone), lp(together)))) if agree else 0.0,
            "plain_forward_max_diff": float(np.max(np.abs(plain - np.asarray(engine, np.float32))))}


def main(ns, engine_args) -> int:
    from jaxllm import LLM

    start = time.perf_counter()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:engine_args.tensor_parallel_size]).reshape(1, -1),
                             ("data", "model"))
    llm = LLM(**dataclasses.asdict(dataclasses.replace(engine_args, enable_multiprocessing=None)), mesh=mesh)
    engine = llm.llm_engine
    compiles = lambda: engine.get_stats()["num_compilations"]
    result = {"engine": engine_settings(engine), "startup_s": round(time.perf_counter() - start, 1),
              "invariance": _invariance(llm, ns.num_others, ns.output_len)}
    on_device = jax.block_until_ready(jax.tree.map(lambda x: x + 0, llm.get_params()))  # a trainer's own copy
    on_host = jax.device_get(on_device)
    before = compiles()
    synced = lambda source: jax.block_until_ready((llm.update_weights(source), llm.get_params()))
    result["update_from_device_s"] = _timed(lambda: synced(on_device), ns.repeats)
    result["update_from_host_s"] = _timed(lambda: synced(on_host), ns.repeats)
    del on_device
    memory = {"held": _device_bytes()}
    for level in (1, 2):
        start = time.perf_counter()
        llm.sleep(level)
        result[f"sleep_{level}_s"] = time.perf_counter() - start
        memory[f"after_sleep_{level}"] = _device_bytes()
        start = time.perf_counter()
        if level == 2:
            llm.update_weights(on_host)  # weights given in memory come back through update_weights
        llm.wake_up(["kv_cache"])
        result[f"wake_up_{level}_s"] = time.perf_counter() - start
    if memory["held"] is not None:
        result["memory_gib"] = {k: round(v / 2**30, 3) for k, v in memory.items()}
    result["compiles"] = compiles() - before
    result["invariance_after_wake"] = _invariance(llm, ns.num_others, ns.output_len)
    llm.shutdown()
    print_engine(result)
    for key in ("update_from_device_s", "update_from_host_s", "sleep_1_s", "wake_up_1_s", "sleep_2_s", "wake_up_2_s"):
        print(f"{key}: {result[key]:.4f}")
    print("memory (GiB):", result.get("memory_gib"), "| compilations:", result["compiles"])
    print("invariance:", result["invariance"], "after wake:", result["invariance_after_wake"])
    write_json(ns.output_json, result)
    failures = [f"{result['compiles']} compilations in the updates, sleeps and wakes"] if result["compiles"] else []
    if engine.config.batch_invariant and result["invariance"]["plain_forward_max_diff"]:
        failures.append("batch-invariant, yet the plain forward's logprobs are not the engine's bit for bit")
    return report_failures(failures)
