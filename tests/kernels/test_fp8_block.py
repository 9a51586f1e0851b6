"""The block-scaled FP8 kernel (kernels/fp8_block.py) in the interpreter and its plain-JAX
reference against float64 numpy on the dequantized operands."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import fp8_block
from jaxllm.models.fp8 import quantize_rows

pytestmark = pytest.mark.timeout(300)


def random_operands(rng, m, k, n, block):
    bn, bk = block
    x = rng.standard_normal((m, k)).astype(np.float32)
    x8, x_scale = quantize_rows(jnp.asarray(x), bk)
    w8 = jnp.asarray(np.clip(rng.standard_normal((n, k)) * 100, -448, 448), jnp.float8_e4m3fn)  # e4m3fn: NaN past 448
    w_scale = jnp.asarray(rng.uniform(1e-4, 1e-3, (n // bn, k // bk)), jnp.float32)
    return x8, x_scale, w8, w_scale


def float64_product(x8, x_scale, w8, w_scale):
    (bn, bk) = w8.shape[0] // w_scale.shape[0], w8.shape[1] // w_scale.shape[1]
    x = np.asarray(x8, np.float64) * np.repeat(np.asarray(x_scale, np.float64), bk, axis=1)
    w = np.asarray(w8, np.float64) * np.repeat(np.repeat(np.asarray(w_scale, np.float64), bn, 0), bk, 1)
    return x @ w.T


@pytest.mark.parametrize("m, k, n, block", [(1, 256, 384, (128, 128)), (17, 384, 640, (128, 128)),
                                            (130, 96, 64, (32, 32)), (200, 64, 48, (16, 16))])
def test_the_kernel_and_the_reference_match_float64(m, k, n, block):
    operands = random_operands(np.random.default_rng(m), m, k, n, block)
    want = float64_product(*operands)
    scale = np.abs(want).max()
    got = fp8_block.pallas_matmul(*operands, fp8_block.tiles(m, block[0]), interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(fp8_block.reference_matmul(*operands)), want, atol=1e-5 * scale)


def test_e4m3_operands_give_the_widened_operands_product():
    operands = random_operands(np.random.default_rng(3), 20, 128, 64, (32, 32))
    widened = fp8_block.pallas_matmul(*operands, fp8_block.Fp8BlockTiles(16, 32), interpret=True)
    e4m3 = fp8_block.pallas_matmul(*operands, fp8_block.Fp8BlockTiles(16, 32, mma="e4m3"), interpret=True)
    np.testing.assert_allclose(np.asarray(e4m3), np.asarray(widened), rtol=1e-6, atol=1e-6 * np.abs(widened).max())


@pytest.mark.parametrize("fields, message", [((16, 24), "block_n must be a power of two"),
                                             ((16, 32, 4, 3, "int8"), "mma must be one of")])
def test_bad_tiles_name_their_field(fields, message):
    with pytest.raises(ValueError, match=message):
        fp8_block.Fp8BlockTiles(*fields)


def test_tiles_wider_than_a_scale_block_are_refused():
    operands = random_operands(np.random.default_rng(0), 4, 64, 64, (16, 16))
    with pytest.raises(ValueError, match="block_n=32 must divide the scale block's 16 rows"):
        fp8_block.pallas_matmul(*operands, fp8_block.Fp8BlockTiles(16, 32), interpret=True)


# -- on a GPU ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("mma", ["bfloat16", "e4m3"])
@pytest.mark.parametrize("m", [1, 16, 100, 512])
@pytest.mark.parametrize("k, n", [(4096, 6144), (12288, 4096)])
def test_gpu_kernel_matches_float64(mma, m, k, n):
    """The compiled kernel, its e4m3 tiles widened to bf16 or on FP8 tensor cores: the products
    are exact either way, so only float32 sums differ."""
    operands = random_operands(np.random.default_rng(m), m, k, n, (128, 128))
    tiles = fp8_block.tiles(m, 128)
    got = jax.jit(fp8_block.pallas_matmul, static_argnums=4)(*operands, fp8_block.Fp8BlockTiles(
        tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages, mma))
    want = float64_product(*operands)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4 * np.abs(want).max())
