"""Dual-batch overlap (vLLM's enable_dbo): a step's token axis cut in two halves at its middle, and
each decoder layer run on the first half, then on the second, inside one jitted function. The halves
are independent but for the KV cache, so XLA's scheduler may run one half's collectives (the
tensor-parallel all-reduces after o_proj and down_proj, expert parallelism's all-to-alls) while the
other half computes; on one device it is the same work in two pieces.

A request may straddle the middle. Its tokens in the first half attend as a prefill chunk ending
there; its tokens in the second half read the first half's KV, which the first half's run of the
same layer has just written (the KV arrays thread through both halves, in order). Each half's
attention metadata is the step's with the query ranges clipped to the half:

    query_start_loc [0, 5, 12, 12], seq_lens [5, 20, 0] (2 requests), middle 8:
    first half  query_start_loc [0, 5, 8, 8], seq_lens [5, 16, 0]: request 1's last 4 tokens cut off
    second half query_start_loc [0, 0, 4, 4], seq_lens [5, 20, 0]: request 0 has no token here

A token's numbers are the one-pass forward's but for the order of a matmul's rows, which a GEMM
may block differently for fewer rows: the tests check tokens equal and logprobs close.
"""
import dataclasses

import jax.numpy as jnp

from jaxllm.kernels.attention import AttentionMetadata


def split_metadata(md: AttentionMetadata, middle: int) -> tuple[AttentionMetadata, AttentionMetadata]:
    """The attention metadata of tokens [0, middle) and [middle, num_tokens) of a step (all KV cache groups)."""
    qsl = md.query_start_loc
    first_qsl = jnp.minimum(qsl, middle)
    cut = jnp.diff(qsl) - jnp.diff(first_qsl)  # a request's tokens past the middle
    first = dataclasses.replace(md, slot_mapping=md.slot_mapping[:, :middle], query_start_loc=first_qsl,
                                seq_lens=jnp.maximum(md.seq_lens - cut, 0))
    second = dataclasses.replace(md, slot_mapping=md.slot_mapping[:, middle:],
                                 query_start_loc=jnp.maximum(qsl - middle, 0))
    return first, second


def in_halves(num_tokens: int) -> bool:
    """Whether decode_two_halves cuts a step of num_tokens tokens (one token runs whole)."""
    return num_tokens >= 2


def decode_two_halves(model, x, positions, kv_caches, md: AttentionMetadata, attn_fn, layers: range):
    """model.decode_layers over `layers` (LlamaForCausalLM's interface), each layer on the first half of the
    tokens then on the second. x [num_tokens, hidden_size]; positions [num_tokens] int32. Returns (x after
    the layers, kv_caches as a list). A step of one token (the one-token bucket) runs whole."""
    if not in_halves(x.shape[0]):
        x, kv_caches, _ = model.decode_layers(x, positions, kv_caches, md, attn_fn, layers)
        return x, list(kv_caches)
    middle = x.shape[0] // 2
    first_md, second_md = split_metadata(md, middle)
    halves = [[x[:middle], positions[:middle], first_md], [x[middle:], positions[middle:], second_md]]
    kv_caches = list(kv_caches)
    for i in layers:
        for half in halves:
            half[0], kv_caches, _ = model.decode_layers(half[0], half[1], kv_caches, half[2], attn_fn, range(i, i + 1))
    return jnp.concatenate([halves[0][0], halves[1][0]]), kv_caches
