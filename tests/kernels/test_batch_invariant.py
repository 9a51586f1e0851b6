"""The batch-invariant kernels (kernels/batch_invariant.py) against plain JAX in float64, and
each row's result the same bits whatever rows share its call."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import batch_invariant, reference
from tests.kernels.ragged_batch import make_batch

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("m, k, n", [(1, 64, 128), (17, 96, 48), (64, 128, 256), (130, 64, 96)])
def test_matmul_matches_float64_and_a_rows_bits_do_not_depend_on_the_others(m, k, n):
    rng = np.random.default_rng(m)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    y = np.asarray(jax.jit(batch_invariant.matmul)(x, w))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    alone = np.asarray(jax.jit(batch_invariant.matmul)(x[:1], w))
    assert np.array_equal(alone[0], y[0])


def test_matmul_gradients_are_plain_jnps():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((20, 64)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))
    got = jax.grad(loss(batch_invariant.matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jnp.dot), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


def test_rms_normalize_matches_float64_and_its_rows_are_batch_invariant():
    x = np.random.default_rng(1).standard_normal((37, 3, 64)).astype(np.float32)
    y = np.asarray(jax.jit(batch_invariant.rms_normalize, static_argnums=1)(x, 1e-5))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(y, x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5), rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.asarray(batch_invariant.rms_normalize(x[:2], 1e-5)), y[:2])


@pytest.mark.parametrize("attention", ["reference_attention", "pallas_attention"])
def test_the_invariant_attentions_match_the_reference(attention):
    rng = np.random.default_rng(2)
    batch = make_batch(rng, ctx_lens=[0, 20, 5], q_lens=[9, 1, 4], num_q_heads=4, num_kv_heads=2, head_dim=16,
                       block_size=8, extra_tokens=3, extra_reqs=1)
    kwargs = dict(scale=0.25)
    want = np.asarray(reference.ragged_paged_attention(*batch.args, **kwargs))[:batch.num_real_tokens]
    got = np.asarray(getattr(batch_invariant, attention)(*batch.args, **kwargs))[:batch.num_real_tokens]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_gpu_tiles_keep_64_rows_a_tile_and_divide_every_weight(monkeypatch):
    """16-row tiles (mma.sync) moved a logprob by one ulp on an H200 where wgmma's 64 rows kept the bits."""
    monkeypatch.setattr(batch_invariant, "_interpret", lambda: False)
    for n in (4096, 6144, 28672, 128256, 1000):
        for m in (16, 32, 64, 128, 256, 512, 8192):
            t = batch_invariant.tiles(m, n)
            assert t.block_m >= 64 and n % t.block_n == 0, (m, n, t)


@pytest.mark.parametrize("fields, message", [((64, 24, 4, 3), "block_n must be a power of two"),
                                             ((4, 64, 4, 3), "block_m must be a power of two >= 8"),
                                             ((64, 64, 3, 3), "num_warps in 2, 4, 8")])
def test_bad_matmul_tiles_name_their_field(fields, message):
    with pytest.raises(ValueError, match=message):
        batch_invariant.MatmulTiles(*fields)


def test_a_call_of_fewer_rows_than_a_tile_pads_nothing_and_gives_the_padded_calls_bits():
    """A bucket of 16 tokens against the GPU's 64-row tiles: the kernel masks the missing rows (no
    padded copy of x for every Linear, and none of its zero rows read by every program)."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((16, 128)).astype(np.float32), rng.standard_normal((128, 64)).astype(np.float32)
    t = batch_invariant.MatmulTiles(64, 32, 4, 3)
    call = lambda a: batch_invariant.pallas_matmul(a, w, t, jnp.float32)
    assert "pad" not in {e.primitive.name for e in jax.make_jaxpr(call)(x).jaxpr.eqns}
    y = np.asarray(jax.jit(call)(x))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    assert np.array_equal(y, np.asarray(jax.jit(call)(np.pad(x, ((0, 48), (0, 0)))))[:16])
