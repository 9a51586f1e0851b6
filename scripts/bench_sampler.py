"""Times the sampler's pieces on the device at one request bucket (default [256, 128256], the
8B shape at batch 256), each jitted alone on random logits, with the argmax as the baseline:
the random draw, the top-k/top-p/min-p filter, a sort and top_k alone, the logprobs, the
logits processors. Prints a table (median ms of 20 calls). Usage on the device:
  python3 scripts/bench_sampler.py [--rows 256] [--vocab 128256]"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sample import processors, sampler
from jaxllm.sample.logprobs import compute_logprobs
from jaxllm.sample.sampler import ProcessorMetadata, SampleMode, SamplingMetadata, sample


def median_ms(fn, *args, iters: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def with_search_bits(bits: int, fn):
    """fn traced with the filter's search deciding `bits` bits a pass (a variant to time)."""
    def traced(*args):
        saved, sampler._SEARCH_BITS = sampler._SEARCH_BITS, bits
        try:
            return fn(*args)
        finally:
            sampler._SEARCH_BITS = saved
    return traced


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    ns = parser.parse_args()
    R, V = ns.rows, ns.vocab
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((R, V)).astype(np.float32) * 2)
    full = lambda value, dtype: jnp.full((R,), value, dtype)
    seeds = jnp.asarray(np.stack([np.zeros(R), np.arange(R)], -1).astype(np.uint32))
    md = lambda **kw: SamplingMetadata(**{"temperature": full(0.8, jnp.float32), "top_k": full(0, jnp.int32),
                                         "top_p": full(1.0, jnp.float32), "min_p": full(0.0, jnp.float32),
                                         "seeds": seeds, "positions": full(7, jnp.int32), **kw})
    pmd = ProcessorMetadata(full(0.2, jnp.float32), full(0.2, jnp.float32), full(1.1, jnp.float32),
                            full(0, jnp.int32), full(100, jnp.int32), full(True, bool), full(128, jnp.int32),
                            jnp.arange(R, dtype=jnp.int32), jnp.arange(R, dtype=jnp.int32))
    state = processors.zero_state(R, V)
    bitmask = jnp.full((R, (V + 31) // 32), -1, jnp.int32)
    tokens = jnp.zeros(R, jnp.int32)

    rows = [
        ("argmax (greedy)", jax.jit(lambda x: jnp.argmax(x, -1)), (logits,)),
        ("random draw (RANDOM)", jax.jit(lambda x, m: sample(x, m, SampleMode.RANDOM)), (logits, md())),
        ("top-p 0.9 (NUCLEUS)", jax.jit(lambda x, m: sample(x, m, SampleMode.NUCLEUS)), (logits, md(top_p=full(0.9, jnp.float32)))),
        *[(f"top-p 0.9, {bits} bits a pass", jax.jit(with_search_bits(bits, lambda x, m: sample(
            x, m, SampleMode.NUCLEUS))), (logits, md(top_p=full(0.9, jnp.float32)))) for bits in (2, 4, 5)],
        ("top-k 50 (FILTERED)", jax.jit(lambda x, m: sample(x, m, SampleMode.FILTERED)), (logits, md(top_k=full(50, jnp.int32)))),
        ("top-p, top-k, min-p", jax.jit(lambda x, m: sample(x, m, SampleMode.FILTERED)),
         (logits, md(top_p=full(0.9, jnp.float32), top_k=full(50, jnp.int32), min_p=full(0.05, jnp.float32)))),
        ("jnp.sort alone (the filter before)", jax.jit(lambda x: jnp.sort(x, axis=-1)), (logits,)),
        ("lax.top_k k=20", jax.jit(lambda x: jax.lax.top_k(x, 20)), (logits,)),
        ("lax.top_k k=16", jax.jit(lambda x: jax.lax.top_k(x, 16)), (logits,)),
        ("lax.top_k k=8", jax.jit(lambda x: jax.lax.top_k(x, 8)), (logits,)),
        ("logprobs K=20", jax.jit(lambda x, t: compute_logprobs(x, t, 20)), (logits, tokens)),
        ("logprobs K=8", jax.jit(lambda x, t: compute_logprobs(x, t, 8)), (logits, tokens)),
        ("logprobs K=0", jax.jit(lambda x, t: compute_logprobs(x, t, 0)), (logits, tokens)),
        ("log_softmax", jax.jit(jax.nn.log_softmax), (logits,)),
        ("processors", jax.jit(processors.apply_processors), (logits, pmd, state, bitmask)),
        ("count sampled", jax.jit(processors.count_sampled, donate_argnums=(0,)), None),
    ]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, logits [{R}, {V}] float32")
    print(f"{'piece':<36} {'ms':>8}")
    for name, fn, args in rows:
        if args is None:  # donated: a fresh state each call
            ms = median_ms(lambda: fn(processors.zero_state(R, V), pmd, tokens)) - median_ms(
                lambda: processors.zero_state(R, V))
        else:
            ms = median_ms(fn, *args)
        print(f"{name:<36} {ms:>8.3f}")


if __name__ == "__main__":
    main()
