"""Random ragged paged-attention batches for the kernel tests: fresh random data,
block tables that scatter each request over a shuffled cache, and bucket padding
(tokens and request slots) filled with junk that a correct kernel never reads."""
import dataclasses

import jax.numpy as jnp
import numpy as np

# (num_q_heads, num_kv_heads) the kernel tests cycle through: MHA, GQA 2/3/4, MQA.
HEADS = ((2, 2), (4, 2), (6, 2), (4, 1), (8, 1))


@dataclasses.dataclass
class Batch:
    args: tuple           # positional arguments of ragged_paged_attention
    num_real_tokens: int  # rows [0, num_real_tokens) are real; the rest is padding
    ctx_lens: list        # cached context per real request
    q_lens: list          # new tokens per real request


def make_batch(rng, *, ctx_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size,
               dtype=jnp.float32, cache_dtype=None, extra_tokens=0, extra_reqs=0, spare_blocks=3):
    """A batch whose request i has ctx_lens[i] cached tokens and q_lens[i] new ones.

    Padding: `extra_tokens` junk query rows after the real ones and `extra_reqs` empty
    request slots (repeated last offset, seq_len 0, junk block table). Unused block
    table entries hold an out-of-range block id, so reading one is a bug. cache_dtype:
    the KV cache's (None: dtype), as the engine's kv_cache_dtype would store it.
    """
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    max_blocks = max(blocks_per_req) + 1
    num_reqs = len(seq_lens) + extra_reqs
    bad_block = num_blocks + 1000
    tables = np.full((num_reqs, max_blocks), bad_block, np.int32)
    perm = rng.permutation(num_blocks)
    used = 0
    for i, n in enumerate(blocks_per_req):
        tables[i, :n] = perm[used:used + n]
        used += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_real_tokens = int(qsl[-1])
    qsl = np.concatenate([qsl, np.full(extra_reqs, num_real_tokens, np.int32)])
    lens = np.array(seq_lens + [0] * extra_reqs, np.int32)
    num_tokens = num_real_tokens + extra_tokens

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    q = rand(num_tokens, num_q_heads, head_dim)
    k_cache = rand(num_blocks, block_size, num_kv_heads, head_dim).astype(cache_dtype or dtype)
    v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim).astype(cache_dtype or dtype)
    args = (q, k_cache, v_cache, jnp.asarray(qsl), jnp.asarray(lens), jnp.asarray(tables),
            jnp.asarray([len(seq_lens)], jnp.int32))
    return Batch(args, num_real_tokens, list(ctx_lens), list(q_lens))


def random_requests(rng, num_reqs, max_ctx=150, max_chunk=24):
    """A mix of decodes (one new token), prefill chunks with and without cached
    context, and length-1 sequences."""
    ctx_lens, q_lens = [], []
    for _ in range(num_reqs):
        kind = rng.integers(4)
        if kind == 0:    # decode
            ctx, n = int(rng.integers(1, max_ctx)), 1
        elif kind == 1:  # first chunk of a prompt
            ctx, n = 0, int(rng.integers(2, max_chunk))
        elif kind == 2:  # a later chunk: the cached context ends mid-block
            ctx, n = int(rng.integers(1, max_ctx)), int(rng.integers(2, max_chunk))
        else:            # a whole sequence of one token
            ctx, n = 0, 1
        ctx_lens.append(ctx)
        q_lens.append(n)
    return ctx_lens, q_lens


def relative_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def assert_matches(out, ref, batch, dtype):
    """Real rows finite (so written: interpreters fill outputs with NaN) and close."""
    n = batch.num_real_tokens
    out, ref = np.asarray(out[:n], np.float32), np.asarray(ref[:n], np.float32)
    assert np.isfinite(out).all(), "unwritten or non-finite rows among real tokens"
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    else:
        assert relative_error(out, ref) < 1.5e-2
