"""Expanded latent attention's parts (kernels/mla_prefill.py) against a float64 oracle that expands
every head's keys and values over each request's whole sequence: the step part, the reference's
context part (context_only, return_lse) over a shuffled latent cache, and their merge, on ragged
batches of fresh prompts, later chunks, decodes and one-token sequences beside padding tokens and
request slots. The step part's Pallas kernel (in the interpreter, which fills outputs with NaN
first, so a row no program writes fails) against the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import pallas_mla_prefill, reference
from jaxllm.kernels.mla_prefill import KEY_TILE, merge_attention, step_attention
from jaxllm.kernels.pallas_mla_prefill import StepTiles
from tests.kernels.ragged_batch import make_batch, random_requests, relative_error

HEADS, NOPE, ROPE, RANK, V_DIM, BLOCK_SIZE, SCALE = 4, 8, 4, 12, 6, 8, 0.3


def mla_batch(seed: int, max_chunk: int):
    """A ragged batch with each request's latents [c, k_pe] in the cache at all its positions (this
    step's too, as the model writes them first) and its step's latents as fresh inputs."""
    rng = np.random.default_rng(seed)
    ctx_lens, q_lens = random_requests(rng, 6, max_ctx=40, max_chunk=max_chunk)
    ctx_lens[0], q_lens[0] = 0, max_chunk  # a fresh prompt: no context at all
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, num_q_heads=HEADS, num_kv_heads=1,
                       head_dim=RANK + ROPE, block_size=BLOCK_SIZE, extra_tokens=5, extra_reqs=2)
    _, cache, _, qsl, seq_lens, tables, num_seqs = batch.args
    cache, tables, qsl = np.array(cache), np.asarray(tables), np.asarray(qsl)
    num_tokens = batch.args[0].shape[0]
    fresh = rng.standard_normal((num_tokens, RANK + ROPE)).astype(np.float32)  # padding rows: junk
    latents = []
    for i, (ctx, n) in enumerate(zip(ctx_lens, q_lens)):
        seq = np.concatenate([rng.standard_normal((ctx, RANK + ROPE)).astype(np.float32), fresh[qsl[i]:qsl[i] + n]])
        pos = np.arange(ctx + n)
        cache[tables[i, pos // BLOCK_SIZE], pos % BLOCK_SIZE, 0] = seq
        latents.append(seq)
    weights = rng.standard_normal((RANK, HEADS, NOPE + V_DIM)).astype(np.float32) / np.sqrt(RANK)
    q = rng.standard_normal((num_tokens, HEADS, NOPE + ROPE)).astype(np.float32)
    metadata = (jnp.asarray(qsl), seq_lens, jnp.asarray(tables), num_seqs)
    return batch, q, jnp.asarray(cache), fresh, weights, latents, metadata


def oracle(batch, q, weights, latents):
    """float64: each real token over its request's positions up to its own, every head's keys
    [c W_UK, k_pe] and values c W_UV -> (out [tokens, heads, v], context lse, step lse [tokens, heads])."""
    q, w = q.astype(np.float64), weights.astype(np.float64)
    n_real = batch.num_real_tokens
    out, lse_context, lse_step = np.zeros((n_real, HEADS, V_DIM)), np.zeros((n_real, HEADS)), np.zeros((n_real, HEADS))
    token = 0
    for ctx, n, seq in zip(batch.ctx_lens, batch.q_lens, latents):
        seq = seq.astype(np.float64)
        k = np.concatenate([np.einsum("sr,rhn->shn", seq[:, :RANK], w[..., :NOPE]),
                            np.broadcast_to(seq[:, None, RANK:], (len(seq), HEADS, ROPE))], -1)
        v = np.einsum("sr,rhv->shv", seq[:, :RANK], w[..., NOPE:])
        for j in range(n):
            s = np.einsum("hd,shd->hs", q[token], k[:ctx + j + 1]) * SCALE
            p = np.exp(s - s.max(-1, keepdims=True))
            out[token] = np.einsum("hs,shv->hv", p / p.sum(-1, keepdims=True), v[:ctx + j + 1])
            lse_context[token] = np.log(np.exp(s[:, :ctx]).sum(-1)) if ctx else -np.inf
            lse_step[token] = np.log(np.exp(s[:, ctx:]).sum(-1))
            token += 1
    return out, lse_context, lse_step


@pytest.mark.parametrize("seed, max_chunk", [(0, 12), (1, KEY_TILE + 9)])  # chunks within one key tile, across two
def test_step_and_context_parts_merged_equal_attention_over_every_heads_expanded_keys(seed, max_chunk):
    batch, q, cache, fresh, w, latents, metadata = mla_batch(seed, max_chunk)
    w_uk, w_uv = jnp.asarray(w[..., :NOPE]), jnp.asarray(w[..., NOPE:])
    step, step_lse = step_attention(*step_inputs(batch, q, fresh, w, metadata), scale=SCALE)
    q_abs = jnp.concatenate([jnp.einsum("thn,rhn->thr", q[..., :NOPE], w_uk), q[..., NOPE:]], -1)
    context, context_lse = reference.ragged_paged_attention(q_abs, cache, cache, *metadata, scale=SCALE,
                                                            context_only=True, return_lse=True)
    context = jnp.einsum("thr,rhv->thv", context[..., :RANK], w_uv)
    out = np.asarray(merge_attention(step, step_lse, context, context_lse))

    want, want_context_lse, want_step_lse = oracle(batch, q, w, latents)
    n = batch.num_real_tokens
    np.testing.assert_allclose(out[:n], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(context_lse[:n]), want_context_lse, rtol=1e-5, atol=1e-5)  # -inf: none
    np.testing.assert_allclose(np.asarray(step_lse[:n]), want_step_lse, rtol=1e-5, atol=1e-5)
    assert (out[n:] == 0).all() and (np.asarray(step_lse[n:]) == -np.inf).all()  # padding: zeros, not NaN
    assert (np.asarray(context_lse[n:]) == -np.inf).all()


def step_inputs(batch, q, fresh, w, metadata, dtype=jnp.float32):
    """step_attention's arguments for an mla_batch."""
    c, k_pe = jnp.asarray(fresh[:, :RANK], dtype), jnp.asarray(fresh[:, RANK:], dtype)
    w = jnp.asarray(w, dtype)
    qsl, _, _, num_seqs = metadata
    return (jnp.asarray(q, dtype), jnp.einsum("tr,rhn->thn", c, w[..., :NOPE]), k_pe,
            jnp.einsum("tr,rhv->thv", c, w[..., NOPE:]), qsl, num_seqs)


@pytest.mark.parametrize("seed, max_chunk, block_q, tile", [
    (0, 12, 16, 16),   # query blocks that cut requests, a tile for each
    (1, 73, 32, 16),   # a chunk over several query blocks and tiles; blocks that start mid-request
])
def test_pallas_step_kernel_matches_the_reference(seed, max_chunk, block_q, tile):
    batch, q, _, fresh, w, _, metadata = mla_batch(seed, max_chunk)
    args = step_inputs(batch, q, fresh, w, metadata)
    out, lse = pallas_mla_prefill.step_attention(*args, scale=SCALE, tiles=StepTiles(block_q=block_q, tile=tile),
                                                 interpret=True)
    want, want_lse = step_attention(*args, scale=SCALE)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)  # padding rows too: zeros
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)  # and -inf


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("num_heads", [16, 128])  # V2-Lite's heads, V3's
def test_gpu_step_kernel_matches_the_reference_at_deepseeks_shapes(num_heads):
    """Compiled by Triton: bf16, nope 128, rope 64, v 128, ragged prompts and decodes in 2048 tokens."""
    rng = np.random.default_rng(num_heads)
    q_lens = [700, 1, 300, 1, 1, 900, 17]
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * 2]), jnp.int32)
    t = 2048
    q, k_nope, v = (jnp.asarray(rng.standard_normal((t, num_heads, d)), jnp.bfloat16) for d in (192, 128, 128))
    k_pe = jnp.asarray(rng.standard_normal((t, 64)), jnp.bfloat16)
    args = (q, k_nope, k_pe, v, qsl, jnp.asarray([len(q_lens)], jnp.int32))
    out, lse = pallas_mla_prefill.step_attention(*args, scale=192 ** -0.5)
    want, want_lse = step_attention(*args, scale=192 ** -0.5)
    n = sum(q_lens)
    assert np.isfinite(np.asarray(out[:n])).all()
    assert relative_error(out[:n], want[:n]) < 1e-2
    np.testing.assert_allclose(lse[:n], want_lse[:n], rtol=1e-2, atol=1e-2)


def test_a_part_of_no_keys_leaves_the_other_exactly_and_padding_rows_are_zeros():
    rng = np.random.default_rng(0)
    out_a, out_b = (jnp.asarray(rng.standard_normal((3, 2, 5)), jnp.float32) for _ in range(2))
    lse_a = jnp.asarray([[0.5, -3.0], [40.0, 2.0], [-jnp.inf, -jnp.inf]])
    lse_b = jnp.asarray([[-jnp.inf, -jnp.inf], [-jnp.inf, 1.0], [-jnp.inf, -jnp.inf]])
    out_b = out_b.at[2].set(0.0)  # a part of no keys comes back as zeros
    merged = np.asarray(merge_attention(out_a, lse_a, out_b, lse_b))
    np.testing.assert_array_equal(merged[0], out_a[0])
    np.testing.assert_array_equal(merged[1, 0], out_a[1, 0])
    w = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
    np.testing.assert_allclose(merged[1, 1], w[0] * out_a[1, 1] + w[1] * out_b[1, 1], rtol=1e-6, atol=1e-6)
    assert np.isfinite(merged).all() and (merged[2] == 0).all()
