"""The W4A16 kernel (kernels/w4a16.py) in the interpreter and its plain-JAX reference, both
against float64 numpy on the published dequantization w = (q - zero) * scale."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import w4a16

pytestmark = pytest.mark.timeout(300)


def random_int4(rng, k, n, group):
    """(q [K, N] ints 0..15, zeros [K / G, N] 0..16, scales [K / G, N] float16) and the packed layout."""
    q = rng.integers(0, 16, (k, n))
    zeros = rng.integers(0, 17, (k // group, n))
    scales = (rng.uniform(0.5, 1.5, (k // group, n)) / 16).astype(np.float16)
    halves = q.reshape(k // group, 2, group // 2, n)
    packed = (halves[:, 0] | halves[:, 1] << 4).reshape(k // 2, n).astype(np.uint8)
    return q, zeros, scales, (jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(zeros.astype(np.uint8)))


def float64_weight(q, zeros, scales, group):
    return (q - np.repeat(zeros, group, axis=0)) * np.repeat(scales.astype(np.float64), group, axis=0)


@pytest.mark.parametrize("m, k, n, group", [(1, 256, 48, 128), (17, 192, 80, 64), (130, 128, 320, 32),
                                            (300, 384, 96, 128)])
def test_the_kernel_and_the_reference_match_float64(m, k, n, group):
    rng = np.random.default_rng(m)
    q, zeros, scales, layout = random_int4(rng, k, n, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ float64_weight(q, zeros, scales, group)
    np.testing.assert_array_equal(np.asarray(w4a16.dequantize(*layout)), float64_weight(q, zeros, scales, group))
    got = jax.jit(w4a16.pallas_matmul, static_argnums=4, static_argnames="interpret")(
        jnp.asarray(x), *layout, w4a16.tiles(m, n), interpret=True)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(w4a16.reference_matmul(jnp.asarray(x), *layout)), want, atol=1e-5 * scale)


def test_bf16_activations_accumulate_in_float32():
    """bf16 x and a bf16-rounded weight, as on the GPU: within bf16's output rounding of float64."""
    rng = np.random.default_rng(7)
    q, zeros, scales, layout = random_int4(rng, 256, 64, 128)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.bfloat16)
    w = np.asarray(jnp.asarray(float64_weight(q, zeros, scales, 128), jnp.bfloat16), np.float64)
    want = np.asarray(x, np.float64) @ w
    got = w4a16.pallas_matmul(x, *layout, w4a16.W4A16Tiles(16, 32), interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-7, atol=2**-7 * np.abs(want).max())


@pytest.mark.parametrize("fields, message", [((16, 24), "block_n must be a power of two"),
                                             ((8, 64), "block_m must be a power of two >= 16"),
                                             ((16, 64, 3), "num_warps in 2, 4, 8")])
def test_bad_tiles_name_their_field(fields, message):
    with pytest.raises(ValueError, match=message):
        w4a16.W4A16Tiles(*fields)


def test_tiles_that_do_not_divide_the_columns_are_refused():
    layout = random_int4(np.random.default_rng(0), 128, 48, 128)[3]
    with pytest.raises(ValueError, match="block_n=32 must divide the weight's 48 columns"):
        w4a16.pallas_matmul(jnp.zeros((4, 128)), *layout, w4a16.W4A16Tiles(16, 32), interpret=True)


# -- on a GPU ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 100, 512])
@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096)])
def test_gpu_kernel_matches_float64(m, k, n):
    """The compiled kernel with the tiles `tiles` picks, bf16 activations and scales: within bf16's
    rounding of the dequantized weight and of the output (relative L2 error under 1e-2)."""
    rng = np.random.default_rng(m)
    q, zeros, scales, (packed, _, zero) = random_int4(rng, k, n, 128)
    scales = jnp.asarray(scales, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = np.asarray(jax.jit(w4a16.matmul)(x, packed, scales, zero), np.float64)
    want = np.asarray(x, np.float64) @ float64_weight(q, zeros, np.asarray(scales, np.float64), 128)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
