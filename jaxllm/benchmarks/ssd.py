"""`jaxllm bench ssd`: Mamba2's prefill scan (kernels/ssd.py, ragged_ssd) at a model's SSM shape, its
per-chunk terms in plain JAX ("reference") and as the Pallas kernel (kernels/pallas_ssd.py), beside
an attention layer's prefill over the same number of tokens (the platform's default attention
backend, Llama-3.1-8B's 32 query and 8 KV heads of 128): what one layer of each costs a prompt.

One request's prompt of L tokens, from a zero state, at each chunk size. The Pallas variant is
checked against the reference (relative L2 error over 1e-3: the bench exits 1), then each is timed
on the device (device_timing.median_loop_s, two input sets in rotation). The table (last) gives
each one's ms, its tokens/s and its time over the attention layer's at that L.

And a decode step's state update (kernels/ssd.py, ragged_ssd_in_slots with decodes_only) over a
cache of --num-slots bfloat16 states: each of --decode-batches real requests in a bucket of at
least 16 (the rest padding), plain JAX (a gather, the update, a scatter) against the Pallas kernel
that writes the cache in place (JAXLLM_SSD_UPDATE=pallas). Each is timed as --layers updates of
one cache in a loop on the device (the cache carried, as a step's layers update theirs), after a
check that both leave the same states; the second table gives ms per layer.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import positive_int, positive_ints, write_json
from jaxllm.benchmarks.device_timing import median_loop_s, median_s

HELP = ("Mamba2's prefill scan, plain JAX and the Pallas kernel, beside an attention layer over the same tokens; "
        "its decode update, plain JAX and in place")
MAX_ERROR = 1e-3
ATTENTION_SCALE = 128 ** -0.5  # the attention layer's head dim's


def add_cli_args(parser) -> None:
    parser.add_argument("--lengths", type=positive_ints, default="1024,4096,16384", help="prompt lengths L")
    parser.add_argument("--chunk-sizes", type=positive_ints, default="32,64",
                        help="the scan's windows (kernels/ssd.py window_size: at most MAX_WINDOW)")
    parser.add_argument("--num-heads", type=positive_int, default=80, help="SSM heads (default: Mamba2-2.7B's 80)")
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--state-size", type=positive_int, default=128)
    parser.add_argument("--groups", type=positive_int, default=1)
    parser.add_argument("--decode-batches", type=positive_ints, default="1,64,256",
                        help="real requests of the decode update's steps")
    parser.add_argument("--num-slots", type=positive_int, default=256, help="the decode update's state slots")
    parser.add_argument("--layers", type=positive_int, default=64, help="updates a timed decode loop runs")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed loops, the median taken")
    parser.add_argument("--output-json", help="write the rows to this file")


def _ssd_inputs(key, length: int, heads: int, head_dim: int, state: int, groups: int):
    keys = jax.random.split(key, 5)
    x = jax.random.normal(keys[0], (length, heads, head_dim))
    dt = jax.nn.softplus(jax.random.normal(keys[1], (length, heads)) - 2.0)
    B, C = (jax.random.normal(k, (length, groups, state)) for k in keys[2:4])
    return x, dt, B, C


def _attention_inputs(key, length: int):
    from jaxllm.benchmarks.attention import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS
    pages = -(-length // BLOCK_SIZE)
    keys = jax.random.split(key, 3)
    q = jax.random.normal(keys[0], (length, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(k, (pages, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16) for k in keys[1:])
    meta = (jnp.array([0, length], jnp.int32), jnp.array([length], jnp.int32),
            jnp.arange(pages, dtype=jnp.int32)[None], jnp.array([1], jnp.int32))
    return (q, k, v, *meta)


def _decode_rows(ns, A, interpret: bool, failed: list) -> list[dict]:
    """The decode update's rows: plain JAX and the Pallas kernel at each batch (see the docstring)."""
    from jaxllm.kernels import pallas_ssd
    from jaxllm.kernels.ssd import ragged_ssd_in_slots
    rows = []
    for batch in ns.decode_batches:
        bucket = max(16, 1 << (batch - 1).bit_length())
        x, dt, B, C = _ssd_inputs(jax.random.key(20), bucket, ns.num_heads, ns.head_dim, ns.state_size, ns.groups)
        slots = np.arange(bucket, dtype=np.int32) % ns.num_slots
        write = np.where(np.arange(bucket) < batch, slots, ns.num_slots).astype(np.int32)
        qsl = np.minimum(np.arange(bucket + 1), batch).astype(np.int32)
        has_state, num_seqs = np.ones(bucket, bool), np.array([batch], np.int32)
        kernel = functools.partial(pallas_ssd.state_update, interpret=interpret)
        finals = {}
        for name, update in (("reference", None), ("pallas", kernel)):
            @functools.partial(jax.jit, donate_argnums=0)
            def layers(states, update=update):
                def layer(_, carry):
                    states, total = carry
                    y, states = ragged_ssd_in_slots(x, dt, A, B, C, states, slots, has_state, write, qsl, num_seqs,
                                                    ns.chunk_sizes[0], decodes_only=True, update=update)
                    return states, total + y[0, 0, 0]
                return jax.lax.fori_loop(0, ns.layers, layer, (states, 0.0))
            states = jnp.zeros((ns.num_slots, ns.num_heads, ns.head_dim, ns.state_size), jnp.bfloat16)
            try:
                states, _ = jax.block_until_ready(layers(states))
            except Exception as err:  # a lowering this device lacks: said
                print(f"decode batch={batch} {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                continue
            finals[name] = np.asarray(states[:batch].astype(jnp.float32))
            cache = [states]  # donated each call: the next call takes what this one returned

            def run(layers=layers, cache=cache):
                cache[0] = jax.block_until_ready(layers(cache[0])[0])
            layer_s = median_s(run, warmup=0, iters=ns.repeats) / ns.layers
            error = None
            if name != "reference" and "reference" in finals:
                want = finals["reference"]
                error = float(np.linalg.norm(finals[name] - want) / max(np.linalg.norm(want), 1e-30))
                if error > 1e-2:  # bfloat16 states, rounded at every layer
                    failed.append(f"decode batch={batch} {name}: relative error {error:.2e}")
            rows.append({"batch": batch, "bucket": bucket, "variant": name, "ms": 1e3 * layer_s, "error": error})
            print(*rows[-1].values(), flush=True)
    return rows


def main(ns) -> int:
    from jaxllm.kernels import pallas_ssd
    from jaxllm.kernels.attention import default_backend, get_attention_fn
    from jaxllm.kernels.ssd import chunk_terms, ragged_ssd
    from jaxllm.sharding import make_mesh

    device = jax.devices()[0].device_kind
    print(device, jax.__version__)
    interpret = jax.default_backend() != "gpu"
    A = -jnp.exp(jax.random.normal(jax.random.key(9), (ns.num_heads,)) * 0.5)
    num_seqs = jnp.array([1], jnp.int32)
    attention = get_attention_fn(default_backend(), make_mesh(1))
    rows, failed = [], []
    decode = _decode_rows(ns, A, interpret, failed)  # first: the prefill kernel's long runs may outlast a call
    for length in ns.lengths:
        states = jnp.zeros((1, ns.num_heads, ns.head_dim, ns.state_size))
        qsl = jnp.array([0, length], jnp.int32)
        sets = [_ssd_inputs(jax.random.key(i), length, ns.num_heads, ns.head_dim, ns.state_size, ns.groups)
                for i in range(2)]
        attn_sets = [_attention_inputs(jax.random.key(10 + i), length) for i in range(2)]
        attn_s = median_loop_s(lambda q, k, v, *m: attention(q, k, v, *m, scale=ATTENTION_SCALE), attn_sets,
                               reps=ns.repeats)
        rows.append({"length": length, "variant": "attention", "chunk": None, "ms": 1e3 * attn_s, "error": None})
        for chunk in ns.chunk_sizes:
            want = None
            for name, terms in (("reference", chunk_terms),
                                ("pallas", functools.partial(pallas_ssd.chunk_terms, interpret=interpret))):
                def scan(x, dt, B, C, terms=terms, chunk=chunk, states=states, qsl=qsl):
                    return ragged_ssd(x, dt, A, B, C, states, qsl, num_seqs, chunk, terms)[0]
                try:
                    got = np.asarray(jax.jit(scan)(*sets[0]), np.float32)
                except Exception as err:  # a lowering this device lacks (a tile Triton will not take): said
                    print(f"L={length} chunk={chunk} {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                    continue
                error = None
                if want is None:
                    want = got
                else:
                    error = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
                    if error > MAX_ERROR:
                        failed.append(f"L={length} chunk={chunk} {name}: relative error {error:.2e}")
                s = median_loop_s(scan, sets, reps=ns.repeats)
                rows.append({"length": length, "variant": name, "chunk": chunk, "ms": 1e3 * s, "error": error})
                print(*rows[-1].values(), flush=True)  # as it comes, in case the call is cut short
    write_json(ns.output_json, {"device": device, "num_heads": ns.num_heads, "head_dim": ns.head_dim,
                                "state_size": ns.state_size, "groups": ns.groups, "rows": rows,
                                "decode_rows": decode})
    print(f"\nSSM: {ns.num_heads} heads of {ns.head_dim} x {ns.state_size}, {ns.groups} group(s); attention: "
          "32 q / 8 KV heads of 128, bf16")
    print(f"{'L':>6} {'variant':>9} {'chunk':>5} {'ms':>9} {'Mtok/s':>7} {'vs attn':>7}")
    attn = {r["length"]: r["ms"] for r in rows if r["variant"] == "attention"}
    for r in rows:
        print(f"{r['length']:>6} {r['variant']:>9} {r['chunk'] or '-':>5} {r['ms']:>9.3f} "
              f"{r['length'] / r['ms'] / 1e3:>7.2f} {r['ms'] / attn[r['length']]:>7.2f}")
    print(f"\ndecode update, {ns.num_slots} bfloat16 state slots, ms per layer")
    print(f"{'batch':>6} {'bucket':>6} {'variant':>9} {'ms':>9}")
    for r in decode:
        print(f"{r['batch']:>6} {r['bucket']:>6} {r['variant']:>9} {r['ms']:>9.4f}")
    for line in failed:
        print("wrong:", line)
    return 1 if failed else 0

