"""Ragged paged attention: the reference against a float64 oracle, the Pallas kernel
(interpret mode) against the reference over the input space, and both GPU kernels
against the reference on a GPU.

The Pallas interpreter fills outputs with NaN before the kernel runs, so a real
row that no program writes fails the comparison (test_unwritten_rows_stay_poisoned
checks that this poison is in place). Rows of padding tokens are unspecified and
never compared.
"""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import latent_attention, mosaic_attention, pallas_attention, reference, triton_attention
from tests.kernels.ragged_batch import HEADS, assert_matches, make_batch, random_requests, relative_error

HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)


def oracle(batch, scale, sliding_window=None, soft_cap=None):
    """Naive float64 attention, one request and one token at a time."""
    q, k_cache, v_cache, qsl, seq_lens, tables, _ = (np.asarray(a) for a in batch.args)
    q, k_cache, v_cache = (x.astype(np.float64) for x in (q, k_cache, v_cache))
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = np.zeros((batch.num_real_tokens, *q.shape[1:]))
    for i, (ctx, n) in enumerate(zip(batch.ctx_lens, batch.q_lens)):
        slots = np.arange(ctx + n)
        k = k_cache[tables[i, slots // block_size], slots % block_size]  # [seq, kv, dim]
        v = v_cache[tables[i, slots // block_size], slots % block_size]
        for j in range(n):
            t, pos = qsl[i] + j, ctx + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                s = k[lo:pos + 1, h // group] @ q[t, h] * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[t, h] = p @ v[lo:pos + 1, h // group] / p.sum()
    return out


def run_pallas(batch, **kwargs):
    return pallas_attention.paged_attention(*batch.args, interpret=True, **kwargs)


# -- the reference ---------------------------------------------------------------

@pytest.mark.parametrize("seed,window,cap", [(0, None, None), (1, 5, None), (2, None, 3.0)])
def test_reference_matches_float64_oracle(seed, window, cap):
    rng = np.random.default_rng(seed)
    ctx_lens, q_lens = random_requests(rng, 4)
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, num_q_heads=4, num_kv_heads=2,
                       head_dim=16, block_size=8, extra_tokens=3, extra_reqs=2)
    ref = reference.ragged_paged_attention(*batch.args, scale=0.25, sliding_window=window,
                                           soft_cap=cap)
    np.testing.assert_allclose(ref[:batch.num_real_tokens], oracle(batch, 0.25, window, cap),
                               atol=1e-5, rtol=1e-5)


def test_write_kv_stores_each_token_at_its_slot_and_drops_padding():
    rng = np.random.default_rng(3)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 4, 2, 8, 10
    k_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim), np.float32)
    v_cache = rng.standard_normal(k_cache.shape, np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim), np.float32)
    v = rng.standard_normal(k.shape, np.float32)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    slots[[2, 7]] = -1  # padding tokens
    new_k, new_v = reference.write_kv(jnp.asarray(k_cache), jnp.asarray(v_cache),
                                      jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = k[t]
            want_v[slot // block_size, slot % block_size] = v[t]
    np.testing.assert_array_equal(new_k, want_k)
    np.testing.assert_array_equal(new_v, want_v)


def test_write_kv_casts_to_the_cache_dtype():
    rng = np.random.default_rng(4)
    k_cache = jnp.asarray(rng.standard_normal((2, 4, 1, 8)), jnp.bfloat16)
    k = rng.standard_normal((3, 1, 8)).astype(np.float32)
    new_k, _ = reference.write_kv(k_cache, k_cache, jnp.asarray(k), jnp.asarray(k),
                                  jnp.asarray([5, 0, 7], jnp.int32))
    assert new_k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(new_k[1, 1], jnp.asarray(k[0], jnp.bfloat16))


@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_write_kv_saturates_an_8_bit_cache(cache_dtype):
    """kv_cache_dtype "fp8": values past the format's range are stored as its largest finite
    value (a plain cast gives NaN or inf), the others rounded to the nearest."""
    largest = float(jnp.finfo(cache_dtype).max)
    k = jnp.asarray([[[1e6, -1e6, 0.3, -2.5, largest, 1.0, 0.0, 7.0]]], jnp.bfloat16)
    cache = jnp.zeros((1, 4, 1, 8), cache_dtype)
    new_k, _ = reference.write_kv(cache, cache, k, k, jnp.asarray([2], jnp.int32))
    assert new_k.dtype == cache_dtype
    got = np.asarray(new_k[0, 2, 0], np.float32)
    assert got[0] == largest and got[1] == -largest
    np.testing.assert_array_equal(got[2:], np.asarray(k[0, 0, 2:].astype(cache_dtype), np.float32))


def test_an_8_bit_cache_stays_close_to_the_16_bit_one():
    """The accuracy kv_cache_dtype="fp8" (e4m3) costs: attention over the e4m3 copy of a bf16
    cache is within 6% (relative) of attention over the cache itself; e4m3 rounds to 3 bits."""
    rng = np.random.default_rng(5)
    ctx_lens, q_lens = random_requests(rng, 6)
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, num_q_heads=4, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=jnp.bfloat16)
    q, k, v, *rest = batch.args
    fp8 = (q, k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn), *rest)
    n = batch.num_real_tokens
    exact = reference.ragged_paged_attention(*batch.args, scale=0.125)[:n]
    err = relative_error(reference.ragged_paged_attention(*fp8, scale=0.125)[:n], exact)
    assert 1e-3 < err < 0.06  # above 1e-3: the cache really was rounded


# -- the Pallas kernel against the reference ----------------------------------------

def sweep_case(i):
    """Case i of the seeded sweep: cycles through head dims, block sizes and GQA
    ratios (so 12 cases cover every one of each), with a window, a soft cap and
    16-bit dtypes on some."""
    num_q_heads, num_kv_heads = HEADS[i % len(HEADS)]
    return dict(head_dim=HEAD_DIMS[i % 3], block_size=BLOCK_SIZES[i % 4],
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                sliding_window=(None, 17, None, 40)[i % 4] if i % 3 else None,
                soft_cap=20.0 if i % 5 == 3 else None,
                dtype=(jnp.float32, jnp.float32, jnp.bfloat16, jnp.float16)[i % 4])


@pytest.mark.parametrize("i", range(12))
def test_pallas_matches_reference_on_mixed_batches(i):
    case = sweep_case(i)
    rng = np.random.default_rng(100 + i)
    ctx_lens, q_lens = random_requests(rng, int(rng.integers(1, 5)))
    window, cap, dtype = case.pop("sliding_window"), case.pop("soft_cap"), case["dtype"]
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, extra_tokens=int(rng.integers(0, 5)),
                       extra_reqs=int(rng.integers(0, 3)), **case)
    scale = float(rng.uniform(0.05, 0.3))
    out = run_pallas(batch, scale=scale, sliding_window=window, soft_cap=cap)
    ref = reference.ragged_paged_attention(*batch.args, scale=scale, sliding_window=window,
                                           soft_cap=cap)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_matches(out, ref, batch, dtype)


@pytest.mark.parametrize("dtype,cache_dtype", [(jnp.float32, jnp.float8_e4m3fn),
                                               (jnp.bfloat16, jnp.float8_e4m3fn),
                                               (jnp.bfloat16, jnp.float8_e5m2)])
def test_pallas_reads_an_8_bit_cache_as_the_reference_does(dtype, cache_dtype):
    """kv_cache_dtype "fp8": the kernel widens each K/V tile after loading it (to q's dtype, to
    float16 beside a bfloat16 q), as the reference widens the cache, over prefill chunks (two
    launches) and split-K decodes."""
    [launch] = pallas_attention.plan(16, 16, 8, 2, 64, jnp.dtype(dtype).itemsize, 1)
    assert launch.tile == 128  # the same bytes a tile, twice the tokens
    rng = np.random.default_rng(150)
    ctx_lens, q_lens = random_requests(rng, 5)
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, num_q_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=dtype, cache_dtype=cache_dtype,
                       extra_tokens=2, extra_reqs=1)
    ref = reference.ragged_paged_attention(*batch.args, scale=0.15)
    assert_matches(run_pallas(batch, scale=0.15), ref, batch, dtype)
    decodes = make_batch(rng, ctx_lens=[90, 3, 40], q_lens=[1, 1, 1], num_q_heads=8,
                         num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                         cache_dtype=cache_dtype, extra_reqs=2)
    ref = reference.ragged_paged_attention(*decodes.args, scale=0.15)
    assert_matches(run_pallas(decodes, scale=0.15, num_splits=4, tile=16), ref, decodes, dtype)


@pytest.mark.parametrize("head_major,prefetch", [(False, False), (True, False), (False, True)])
def test_pallas_launch_order_and_prefetch_leave_the_result(head_major, prefetch):
    """The decode launch runs head-major with its page ids prefetched; each alone, or neither,
    on both launches (decodes and prefill chunks, a sliding window), gives the same rows."""
    assert pallas_attention.plan(4, 4, 8, 2, 64, 4)[0].head_major
    rng = np.random.default_rng(170)
    batch = make_batch(rng, ctx_lens=[70, 0, 33, 5], q_lens=[1, 20, 1, 9], num_q_heads=8,
                       num_kv_heads=2, head_dim=64, block_size=16, extra_tokens=3, extra_reqs=1)
    for window in (None, 24):
        out = run_pallas(batch, scale=0.12, sliding_window=window, head_major=head_major,
                         prefetch=prefetch)
        ref = reference.ragged_paged_attention(*batch.args, scale=0.12, sliding_window=window)
        assert_matches(out, ref, batch, jnp.float32)


@pytest.mark.parametrize("block_m,tile", [(16, 16), (32, 64)])
def test_pallas_q_blocks_cut_long_chunks_and_tiles_cut_blocks(block_m, tile):
    """Chunks longer than one q block, tiles smaller and larger than a cache block."""
    rng = np.random.default_rng(200 + block_m)
    batch = make_batch(rng, ctx_lens=[45, 0, 3], q_lens=[37, 29, 1], num_q_heads=4,
                       num_kv_heads=2, head_dim=64, block_size=32, extra_tokens=2)
    out = run_pallas(batch, scale=0.2, block_m=block_m, tile=tile)
    assert_matches(out, reference.ragged_paged_attention(*batch.args, scale=0.2), batch,
                   jnp.float32)


@pytest.mark.parametrize("num_splits,window", [(3, None), (4, 50)])
def test_pallas_split_k_matches_reference(num_splits, window):
    """Split-K on decodes and a prefill chunk, including splits left empty. As many
    request slots as tokens: a decode bucket, served by one launch."""
    rng = np.random.default_rng(300 + num_splits)
    batch = make_batch(rng, ctx_lens=[300, 7, 130], q_lens=[1, 1, 9], num_q_heads=8,
                       num_kv_heads=2, head_dim=64, block_size=16, extra_reqs=8)
    assert len(pallas_attention.plan(11, 11, 8, 2, 64, 4, num_splits=num_splits)) == 1
    out = run_pallas(batch, scale=0.1, sliding_window=window, num_splits=num_splits, tile=16)
    ref = reference.ragged_paged_attention(*batch.args, scale=0.1, sliding_window=window)
    assert_matches(out, ref, batch, jnp.float32)


@pytest.mark.parametrize("ctx", [0, 700, 3000])
@pytest.mark.parametrize("window", [None, 256])
def test_a_lone_decode_splits_its_context_over_every_program_past_the_holes_left_of_its_window(ctx, window):
    """The one-token bucket's shape (one token, one request slot): plan splits the context as far as
    it goes (64 pieces), pieces of a few tokens or none at short contexts. With a sliding window the
    blocks wholly left of it hold an out-of-range id, as once freed: holes the output must not depend on."""
    rng = np.random.default_rng(500 + ctx)
    batch = make_batch(rng, ctx_lens=[ctx], q_lens=[1], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    [launch] = pallas_attention.plan(1, 1, 8, 2, 32, 4)
    assert launch.num_splits == 64
    if window is not None:
        tables = np.array(batch.args[5])
        tables[0, :max(0, ctx + 1 - window) // 16] = tables.max() + 1000
        batch.args = (*batch.args[:5], jnp.asarray(tables), *batch.args[6:])
    out = run_pallas(batch, scale=0.2, sliding_window=window)
    ref = reference.ragged_paged_attention(*batch.args, scale=0.2, sliding_window=window)
    assert_matches(out, ref, batch, jnp.float32)


def test_pallas_decode_bucket_picks_split_k_and_matches_reference():
    rng = np.random.default_rng(400)
    batch = make_batch(rng, ctx_lens=[200, 1, 64], q_lens=[1, 1, 1], num_q_heads=4,
                       num_kv_heads=1, head_dim=128, block_size=16, extra_tokens=1,
                       extra_reqs=1, dtype=jnp.bfloat16)
    num_tokens, max_num_reqs = batch.args[0].shape[0], batch.args[4].shape[0]
    [launch] = pallas_attention.plan(num_tokens, max_num_reqs, 4, 1, 128, 2)
    assert launch.num_splits > 1
    out = pallas_attention.ragged_paged_attention(*batch.args, scale=0.09)
    assert_matches(out, reference.ragged_paged_attention(*batch.args, scale=0.09), batch,
                   jnp.bfloat16)


def test_unwritten_rows_stay_poisoned():
    """The interpreter's NaN fill reaches the output: padding rows, which no program
    writes, come back NaN (so an unwritten real row would fail assert_matches)."""
    rng = np.random.default_rng(500)
    batch = make_batch(rng, ctx_lens=[5], q_lens=[3], num_q_heads=2, num_kv_heads=1,
                       head_dim=64, block_size=16, extra_tokens=4)
    out = np.asarray(run_pallas(batch, scale=0.3))
    assert np.isnan(out[batch.num_real_tokens:]).all()
    assert np.isfinite(out[:batch.num_real_tokens]).all()


def test_schedule_covers_every_real_token_once():
    rng = np.random.default_rng(600)
    batch = make_batch(rng, ctx_lens=[4, 0, 9, 2], q_lens=[13, 1, 8, 1], num_q_heads=1,
                       num_kv_heads=1, head_dim=8, block_size=4, extra_tokens=5, extra_reqs=3)
    _, _, _, qsl, seq_lens, _, num_seqs = batch.args
    num_tokens, block_q = batch.args[0].shape[0], 4
    meta = np.asarray(pallas_attention.schedule(qsl, seq_lens, num_seqs, block_q,
                                                num_tokens // block_q + seq_lens.shape[0]))
    covered = np.concatenate([np.arange(s, e) for _, s, e, _ in meta])
    np.testing.assert_array_equal(np.sort(covered), np.arange(batch.num_real_tokens))
    for req, start, end, offset in meta[meta[:, 2] > meta[:, 1]]:
        assert qsl[req] <= start < end <= qsl[req + 1] and end - start <= block_q
        assert offset + qsl[req + 1] == seq_lens[req]  # last new token sits at seq_len - 1


def test_backends_share_the_reference_signature():
    """The latent kernel's whole; the others' without the two options only latent attention takes."""
    want = inspect.signature(reference.ragged_paged_attention)
    assert inspect.signature(latent_attention.ragged_paged_attention) == want
    latent_only = ("context_only", "return_lse")
    want = want.replace(parameters=[p for name, p in want.parameters.items() if name not in latent_only])
    assert inspect.signature(pallas_attention.ragged_paged_attention) == want
    assert inspect.signature(triton_attention.ragged_paged_attention) == want
    assert inspect.signature(mosaic_attention.ragged_paged_attention) == want


# -- on a GPU ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("backend", ["pallas", "triton"])
@pytest.mark.parametrize("cache_dtype", [None, jnp.float8_e4m3fn])  # None: q's dtype
@pytest.mark.parametrize("i", range(6))  # every head dim, block size, GQA ratio and dtype
def test_gpu_kernel_matches_reference(backend, cache_dtype, i):
    if backend == "triton":
        pytest.importorskip("jax_triton")
    module = pallas_attention if backend == "pallas" else triton_attention
    case = sweep_case(i)
    rng = np.random.default_rng(700 + i)
    ctx_lens, q_lens = random_requests(rng, int(rng.integers(1, 40)), max_ctx=3000,
                                       max_chunk=300)
    window, cap, dtype = case.pop("sliding_window"), case.pop("soft_cap"), case["dtype"]
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, extra_tokens=7, extra_reqs=3,
                       cache_dtype=cache_dtype, **case)
    for num_splits in (None, 4):
        out = module.paged_attention(*batch.args, scale=0.1, sliding_window=window,
                                     soft_cap=cap, num_splits=num_splits)
        with jax.default_matmul_precision("highest"):  # XLA's f32 default on GPU is TF32
            ref = reference.ragged_paged_attention(*batch.args, scale=0.1,
                                                   sliding_window=window, soft_cap=cap)
        assert_matches(out, ref, batch, dtype)
