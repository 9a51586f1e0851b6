"""Plain-JAX ragged paged attention: the oracle the kernels are tested against,
and the backend used wherever no GPU kernel applies (CPU, tests).

Layout shared by every backend:
  q              [num_tokens, num_q_heads, head_dim]   all scheduled tokens, flattened
  k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]
  query_start_loc [max_num_reqs + 1] int32   request i owns tokens [qsl[i], qsl[i+1]);
                                             padded requests repeat the last offset
  seq_lens        [max_num_reqs] int32       cached context + new tokens (0 when padded)
  block_tables    [max_num_reqs, max_blocks_per_seq] int32
  num_seqs        [1] int32                  real requests; the rest is bucket padding

Token t of request i sits at position seq_lens[i] - (qsl[i+1] - t) and attends to
every cached position <= its own (causal within the new tokens), optionally only
the last `sliding_window` of them. Rows of padding tokens come back as zeros.

The loop walks KV blocks with an online softmax, so memory stays
O(num_tokens * block_size) whatever the context length.
"""
import jax
import jax.numpy as jnp

_MASKED = -1e30


def token_positions(query_start_loc, seq_lens, num_seqs, num_tokens):
    """Per token: its request index, its position in that request, and whether it
    is a real token. Each of shape [num_tokens]."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    req, valid = token_requests(query_start_loc, num_seqs, num_tokens)
    q_end = query_start_loc[req + 1]
    pos = seq_lens[req] - (q_end - token)
    return req, pos, valid


def token_requests(query_start_loc, num_seqs, num_tokens):
    """Per token: its request index, and whether it is a real token. Each of shape [num_tokens]."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    num_reqs = query_start_loc.shape[0] - 1
    # compare_all: one fused comparison; the default binary search is a loop of small launches on GPU.
    req = jnp.searchsorted(query_start_loc[1:], token, side="right", method="compare_all").astype(jnp.int32)
    req = jnp.minimum(req, num_reqs - 1)
    valid = token < query_start_loc[jnp.reshape(num_seqs, ())]
    return req, valid


def context_positions(query_start_loc, seq_lens, req):
    """Per token of requests req [num_tokens]: the last position its request had cached before this
    step, seq_len - query_len - 1 (-1: none, a prompt's first chunk)."""
    return seq_lens[req] - (query_start_loc[req + 1] - query_start_loc[req]) - 1


def ragged_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                           num_seqs, *, scale, sliding_window=None, soft_cap=None, context_only=False,
                           return_lse=False):
    """Attention of every scheduled token over its request's paged KV.

    Returns [num_tokens, num_q_heads, head_dim] in q's dtype. Two options only the latent
    backends take (kernels/attention.py; expanded latent attention's context part, models/deepseek.py):
    context_only: each token over its request's context cached before this step alone (positions
    < seq_len - query_len, context_positions), none for a prompt's first chunk. return_lse: also
    each (token, head)'s log-sum-exp of its scaled scores, [num_tokens, num_q_heads] float32,
    -inf where the token attends to nothing (padding, no context).
    """
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_seqs, q.shape[0])
    if context_only:
        pos = context_positions(query_start_loc, seq_lens, req)
    return attend(q, k_cache, v_cache, block_tables[req], pos, valid, scale=scale, sliding_window=sliding_window,
                  soft_cap=soft_cap, return_lse=return_lse)


def attend(q, k_cache, v_cache, tables, pos, valid, *, scale, sliding_window=None, soft_cap=None,
           every_block=False, return_lse=False):
    """Attention of tokens q [num_tokens, num_q_heads, head_dim], each over its request's blocks
    tables [num_tokens, max_blocks_per_seq] up to its position pos [num_tokens] (valid: a real
    token). Blocks past a token's own are masked to exact zeros, so its result does not depend
    on the other tokens'. every_block: walk all max_blocks_per_seq blocks, a loop of static
    length that reverse-mode differentiation can go through (the same numbers, more work).
    return_lse: (out, log-sum-exp [num_tokens, num_q_heads] float32, -inf for no key)."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * scale
    num_blocks = jnp.max(jnp.where(valid, pos // block_size + 1, 0))
    if sliding_window is not None:
        first_block = jnp.min(jnp.where(valid, jnp.maximum(pos - sliding_window + 1, 0), 2**30)) // block_size
        first_block = jnp.minimum(first_block, num_blocks)
    else:
        first_block = 0

    def body(j, carry):
        m, l, acc = carry
        blocks = tables[:, j]
        k = k_cache[blocks].astype(jnp.float32)  # [num_tokens, block_size, kv_heads, head_dim]
        v = v_cache[blocks].astype(jnp.float32)
        s = jnp.einsum("tkgd,tskd->tkgs", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = j * block_size + jnp.arange(block_size)
        mask = (k_pos[None, :] <= pos[:, None]) & valid[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > (pos - sliding_window)[:, None]
        mask = mask[:, None, None, :]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgs,tskd->tkgd", p, v)
        return m_new, l, acc

    init = (jnp.full((num_tokens, num_kv_heads, group), _MASKED, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    if every_block:
        first_block, num_blocks = 0, tables.shape[1]
    m, l, acc = jax.lax.fori_loop(first_block, num_blocks, body, init)
    out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
    if not return_lse:
        return out
    return out, log_sum_exp(m, l).reshape(num_tokens, num_q_heads)


def log_sum_exp(m, l):
    """An online softmax's log-sum-exp from its running max m and sum l (of exp(s - m)): -inf where l is 0."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store new tokens' K/V at their slots (block * block_size + offset).

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int32,
    negative for padding tokens, whose writes are dropped.
    """
    return write_slots(k_cache, k, slot_mapping), write_slots(v_cache, v, slot_mapping)


def scatter_index(index, keep, size: int):
    """index [n] where keep, else a place of its own past `size`, which a scatter with mode="drop"
    drops: the scatter may then promise unique_indices (the kept ones must be distinct). XLA's GPU
    scatter stores the updates of unique indices; without the promise it updates every element by
    an atomic read-modify-write."""
    return jnp.where(keep, index, size + jnp.arange(index.shape[0], dtype=index.dtype))


def write_slots(cache, x, slot_mapping):
    """cache [num_blocks, block_size, heads, dim] with new tokens' x [num_tokens, heads, dim] at their
    slots (a negative slot: a padding token's, dropped; the others distinct)."""
    num_blocks, block_size = cache.shape[:2]
    slot = scatter_index(slot_mapping, slot_mapping >= 0, num_blocks * block_size)
    return cache.at[slot // block_size, slot % block_size].set(to_cache_dtype(x, cache.dtype), mode="drop",
                                                               unique_indices=True)


def to_cache_dtype(x, dtype):
    """x in the cache's dtype. An 8-bit float cache (kv_cache_dtype "fp8", scale 1 as in vLLM
    without calibrated scales) saturates at its largest finite value: a plain cast would make
    e4m3's overflow NaN and e5m2's inf."""
    if jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        largest = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -largest, largest)
    return x.astype(dtype)
