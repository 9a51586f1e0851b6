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


def test_kernel_gives_the_references_context_part_and_log_sum_exp():
    """context_only and return_lse (expanded latent attention's context part): each token over its
    request's positions before this step, none for a fresh prompt (log-sum-exp -inf, output zeros)."""
    rng = np.random.default_rng(3)
    ctx_lens, q_lens = random_requests(rng, 6, max_ctx=60)
    ctx_lens[0] = 0  # a prompt's first chunk: no context
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, num_q_heads=20, num_kv_heads=1, head_dim=24,
                       block_size=16, extra_tokens=3, extra_reqs=2)
    q, cache, _, *rest = batch.args
    out, lse = latent_paged_attention(q, cache, *rest, scale=0.3, tiles=LatentTiles(block_h=16, tile=16),
                                      interpret=True, context_only=True, return_lse=True)
    want, want_lse = reference.ragged_paged_attention(q, cache, cache, *rest, scale=0.3, context_only=True,
                                                      return_lse=True)
    assert_matches(out, want, batch, jnp.float32)
    n = batch.num_real_tokens
    np.testing.assert_allclose(lse[:n], want_lse[:n], rtol=1e-5, atol=1e-5)
    assert (lse[:q_lens[0]] == -np.inf).all() and (out[:q_lens[0]] == 0).all()


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
@pytest.mark.parametrize("context_only", [False, True])  # True: the expanded prefill's context part, with its LSE
def test_gpu_kernel_matches_the_reference_at_deepseeks_shapes(num_heads, cache_dtype, context_only):
    """Compiled by Triton: bf16 queries over 576-wide latents (512 + 64), long contexts, mixed batches."""
    rng = np.random.default_rng(num_heads)
    ctx_lens, q_lens = random_requests(rng, 24, max_ctx=3000, max_chunk=200)
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, num_q_heads=num_heads, num_kv_heads=1, head_dim=576,
                       block_size=16, dtype=jnp.bfloat16, cache_dtype=cache_dtype, extra_tokens=5, extra_reqs=3)
    q, cache, _, *rest = batch.args
    options = dict(scale=576 ** -0.5, context_only=context_only, return_lse=context_only)
    out = latent_paged_attention(q, cache, *rest, **options)
    want = reference.ragged_paged_attention(q, cache, cache, *rest, **options)
    if context_only:
        (out, lse), (want, want_lse) = out, want
        n = batch.num_real_tokens
        np.testing.assert_allclose(lse[:n], want_lse[:n], rtol=1e-2, atol=1e-2)
    assert_matches(out, want, batch, jnp.bfloat16)


def test_launch_shapes_that_triton_cannot_take_are_a_clear_error():
    with pytest.raises(ValueError, match="LatentTiles.tile must be a power of two >= 16"):
        LatentTiles(tile=24)
