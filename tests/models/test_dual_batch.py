"""Dual-batch overlap's split of a step (models/dual_batch.py): the two halves' attention, each over its
own clipped metadata, is the whole step's, a request straddling the middle included."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.attention import AttentionMetadata
from jaxllm.kernels.reference import ragged_paged_attention
from jaxllm.models.dual_batch import split_metadata


def test_the_halves_attend_as_the_whole_step():
    block_size, num_blocks, kv_heads, q_heads, head_dim = 4, 16, 2, 4, 8
    context, query = np.array([0, 5, 9]), np.array([5, 7, 2])  # request 1 straddles the middle (8)
    num_tokens, max_reqs, max_blocks = 16, 4, 4
    qsl = np.full(max_reqs + 1, query.sum(), np.int32)
    qsl[:4] = np.concatenate([[0], np.cumsum(query)])
    seq_lens = np.zeros(max_reqs, np.int32)
    seq_lens[:3] = context + query
    tables = np.zeros((1, max_reqs, max_blocks), np.int32)
    tables[0, :3] = np.random.default_rng(0).permutation(num_blocks)[:12].reshape(3, 4)
    md = AttentionMetadata(slot_mapping=jnp.full((1, num_tokens), -1, jnp.int32), query_start_loc=jnp.asarray(qsl),
                           seq_lens=jnp.asarray(seq_lens), block_tables=jnp.asarray(tables),
                           num_seqs=jnp.asarray([3], jnp.int32))
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (num_tokens, q_heads, head_dim))
    k_cache, v_cache = (jax.random.normal(k, (num_blocks, block_size, kv_heads, head_dim)) for k in keys[1:])

    def attend(q, md):
        g = md.group(0)
        return ragged_paged_attention(q, k_cache, v_cache, g.query_start_loc, g.seq_lens, g.block_tables, g.num_seqs,
                                      scale=head_dim ** -0.5)

    first, second = split_metadata(md, 8)
    np.testing.assert_array_equal(first.query_start_loc, [0, 5, 8, 8, 8])
    np.testing.assert_array_equal(first.seq_lens, [5, 8, 9, 0])  # request 1 without its last 4 tokens, 2 without its 2
    np.testing.assert_array_equal(second.query_start_loc, [0, 0, 4, 6, 6])
    whole = attend(q, md)[:query.sum()]
    halves = jnp.concatenate([attend(q[:8], first), attend(q[8:], second)])[:query.sum()]
    np.testing.assert_allclose(halves, whole, rtol=1e-6, atol=1e-6)
