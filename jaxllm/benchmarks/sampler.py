"""`jaxllm bench sampler`: the sampler's pieces on the device at one request bucket (default
[256, 128256], the 8B's vocabulary at batch 256), each jitted alone on random float32 logits,
with the argmax (greedy) as the baseline: the random draw, the top-k / top-p / min-p filters
(and on a GPU the top-p filter's search at other bits a pass; a CPU's searches one bit a pass),
a sort and lax.top_k alone, the logprobs, the logits processors (the token mask, logit bias,
min_tokens and the penalties) and counting the sampled ids.

Timing: the host's clock around each call and its block_until_ready, the median of --iters
calls after one warm-up (device_timing.median_s); each figure includes the call's dispatch
(about 0.1 ms on a GPU). Prints the table last.
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import positive_int, write_json
from jaxllm.benchmarks.device_timing import median_s

HELP = "the sampler's pieces (draw, filters, logprobs, processors) against the argmax, at one bucket"


def add_cli_args(parser) -> None:
    parser.add_argument("--rows", type=positive_int, default=256, help="requests in the bucket")
    parser.add_argument("--vocab", type=positive_int, default=128256, help="the vocabulary's size")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed calls, the median taken")
    parser.add_argument("--output-json", help="write the table to this file")


def with_search_bits(bits: int, fn):
    """fn traced with the top-p filter's search deciding `bits` bits a pass on a GPU (a variant to time)."""
    from jaxllm.sample import sampler

    def traced(*args):
        saved, sampler._SEARCH_BITS = sampler._SEARCH_BITS, bits
        try:
            return fn(*args)
        finally:
            sampler._SEARCH_BITS = saved
    return traced


def pieces(rows: int, vocab: int) -> list[tuple]:
    """(name, call, offset) of each piece: call() runs it once, jitted; offset, where not None,
    is a call whose time the piece's includes and the table leaves out."""
    from jaxllm.sample import processors
    from jaxllm.sample.logprobs import compute_logprobs
    from jaxllm.sample.sampler import ProcessorMetadata, SampleMode, SamplingMetadata, sample

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((rows, vocab)).astype(np.float32) * 2)

    def full(value, dtype):
        return jnp.full((rows,), value, dtype)

    seeds = jnp.asarray(np.stack([np.zeros(rows), np.arange(rows)], -1).astype(np.uint32))

    def md(**fields):
        return SamplingMetadata(**{"temperature": full(0.8, jnp.float32), "top_k": full(0, jnp.int32),
                                   "top_p": full(1.0, jnp.float32), "min_p": full(0.0, jnp.float32),
                                   "seeds": seeds, "positions": full(7, jnp.int32), **fields})

    def sampled(name, mode, metadata, bits=None):
        fn = lambda x, m: sample(x, m, mode)  # noqa: E731
        fn = jax.jit(fn if bits is None else with_search_bits(bits, fn))
        return name, lambda: fn(logits, metadata), None

    def alone(name, fn, *args):
        fn = jax.jit(fn)
        return name, lambda: fn(*args), None

    pmd = ProcessorMetadata(full(0.2, jnp.float32), full(0.2, jnp.float32), full(1.1, jnp.float32),
                            full(0, jnp.int32), full(100, jnp.int32), full(True, bool), full(128, jnp.int32),
                            jnp.arange(rows, dtype=jnp.int32), jnp.arange(rows, dtype=jnp.int32), full(-1, jnp.int32),
                            jnp.arange(rows, dtype=jnp.int32))
    bitmask = jnp.full((rows, (vocab + 31) // 32), -1, jnp.int32)
    tokens = jnp.zeros(rows, jnp.int32)
    top_p = md(top_p=full(0.9, jnp.float32))
    count = jax.jit(processors.count_sampled, donate_argnums=(0,))

    def fresh_state():  # count_sampled donates its state: a fresh one each call, its making left out
        return processors.zero_state(rows, vocab)

    return [
        alone("argmax (greedy)", lambda x: jnp.argmax(x, -1), logits),
        sampled("random draw (RANDOM)", SampleMode.RANDOM, md()),
        sampled("top-p 0.9 (NUCLEUS)", SampleMode.NUCLEUS, top_p),
        *[sampled(f"top-p 0.9, {bits} bits a pass", SampleMode.NUCLEUS, top_p, bits) for bits in (2, 4, 5)],
        sampled("top-k 50 (FILTERED)", SampleMode.FILTERED, md(top_k=full(50, jnp.int32))),
        sampled("top-p, top-k, min-p", SampleMode.FILTERED,
                md(top_p=full(0.9, jnp.float32), top_k=full(50, jnp.int32), min_p=full(0.05, jnp.float32))),
        alone("jnp.sort alone (the filter before)", lambda x: jnp.sort(x, axis=-1), logits),
        *[alone(f"lax.top_k k={k}", lambda x, k=k: jax.lax.top_k(x, k), logits) for k in (20, 16, 8)],
        *[alone(f"logprobs K={k}", lambda x, t, k=k: compute_logprobs(x, t, k), logits, tokens) for k in (20, 8, 0)],
        alone("log_softmax", jax.nn.log_softmax, logits),
        alone("processors", processors.apply_processors, logits, pmd, fresh_state(), bitmask),
        ("count sampled", lambda: count(fresh_state(), pmd, tokens), fresh_state),
    ]


def main(ns) -> int:
    def ms(call) -> float:
        return 1e3 * median_s(lambda: jax.block_until_ready(call()), warmup=1, iters=ns.iters)

    table = {name: round(ms(call) - (ms(offset) if offset else 0.0), 3)
             for name, call, offset in pieces(ns.rows, ns.vocab)}
    device = jax.devices()[0].device_kind
    write_json(ns.output_json, {"device": device, "rows": ns.rows, "vocab": ns.vocab, "ms": table})
    print(f"jax {jax.__version__} on {device}, logits [{ns.rows}, {ns.vocab}] float32")
    print(f"{'piece':<36} {'ms':>8}")
    for name, value in table.items():
        print(f"{name:<36} {value:>8.3f}")
    return 0
