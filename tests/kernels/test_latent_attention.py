"""The Pallas latent attention kernel (interpret mode) against the reference, which
tests/kernels/test_attention.py checks against float64: random ragged batches of prefill chunks and
decode tokens over one latent cache (K and V alike), and the tiny DeepSeek models against HF's logits
with the kernel as their attention. The interpreter fills outputs with NaN first, so a real row that
no program writes fails."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import latent_attention, reference
from jaxllm.kernels.latent_attention import LatentTiles, latent_paged_attention, split_dim
from tests.kernels.ragged_batch import assert_matches, make_batch, random_requests
from tests.models.test_llama import assert_logits_match_hf, load_fixture


@pytest.mark.parametrize("num_heads, dim, block_size, tile, dtype, cache_dtype", [
    (8, 24, 16, 16, jnp.float32, None),             # the tiny DeepSeek's 16 + 8; one head block, padded to 16 rows
    (20, 80, 32, 16, jnp.float32, None),            # 64 + 16; a second head block, partly masked; tiles cut blocks
    (16, 48, 16, 32, jnp.bfloat16, jnp.float8_e4m3fn),  # 32 + 16; tiles span blocks; an 8-bit cache widened
])
def test_kernel_matches_the_reference_on_mixed_batches(num_heads, dim, block_size, tile, dtype, cache_dtype):
    rng = np.random.default_rng(num_heads)
    ctx_lens, q_lens = random_requests(rng, 6, max_ctx=90)
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, num_q_heads=num_heads, num_kv_heads=1, head_dim=dim,
                       block_size=block_size, dtype=dtype, cache_dtype=cache_dtype, extra_tokens=3, extra_reqs=2)
    q, cache, _, *rest = batch.args
    out = latent_paged_attention(q, cache, *rest, scale=0.3, tiles=LatentTiles(block_h=16, tile=tile), interpret=True)
    assert_matches(out, reference.ragged_paged_attention(q, cache, cache, *rest, scale=0.3), batch, dtype)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_the_tiny_deepseek_models_match_hf_with_the_kernel_as_their_attention(name):
    config, model, golden = load_fixture(name)
    assert_logits_match_hf(name, config, model, golden, attn_fn=latent_attention.ragged_paged_attention)


def test_a_latent_of_two_powers_of_two_loads_in_two_parts_and_another_is_refused():
    assert split_dim(576) == (512, 64) and split_dim(24) == (16, 8) and split_dim(512) == (512, 0)
    with pytest.raises(ValueError, match="two powers of two; 44 = 32 \\+ 12"):
        split_dim(44)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("num_heads", [16, 128])  # V2-Lite's heads, V3's
@pytest.mark.parametrize("cache_dtype", [None, jnp.float8_e4m3fn])
def test_gpu_kernel_matches_the_reference_at_deepseeks_shapes(num_heads, cache_dtype):
    """Compiled by Triton: bf16 queries over 576-wide latents (512 + 64), long contexts, mixed batches."""
    rng = np.random.default_rng(num_heads)
    ctx_lens, q_lens = random_requests(rng, 24, max_ctx=3000, max_chunk=200)
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, num_q_heads=num_heads, num_kv_heads=1, head_dim=576,
                       block_size=16, dtype=jnp.bfloat16, cache_dtype=cache_dtype, extra_tokens=5, extra_reqs=3)
    q, cache, _, *rest = batch.args
    out = latent_paged_attention(q, cache, *rest, scale=576 ** -0.5)
    assert_matches(out, reference.ragged_paged_attention(q, cache, cache, *rest, scale=576 ** -0.5), batch,
                   jnp.bfloat16)


def test_launch_shapes_that_triton_cannot_take_are_a_clear_error():
    with pytest.raises(ValueError, match="LatentTiles.tile must be a power of two >= 16"):
        LatentTiles(tile=24)
