"""Latent attention (DeepSeek's MLA, absorbed: models/deepseek.py) over the paged latent cache, in
Pallas (Triton lowering). The signature is reference.ragged_paged_attention's, for a cache of one
KV head whose values are its keys (v_cache is k_cache):

  q       [num_tokens, num_heads, dim]           the absorbed queries, dim = kv_lora_rank + rope
  cache   [num_blocks, block_size, 1, dim]       one latent a token (K and V alike)
  returns [num_tokens, num_heads, dim]           each head's softmax-weighted sum of latents

Grid (num_tokens, num_heads // block_h): one program is one token and block_h of its heads. It
walks the token's context in tiles of `tile` positions gathered through its block table, and every
head of the block shares each tile it loads, so a decode step reads each latent num_heads / block_h
times (once for V2-Lite's 16 heads, twice for V3's 128) where the heads' own K and V would be read
per head. A prefill chunk's tokens each walk their context alone: correct, not fast. With
context_only (the expanded prefill's context part, kernels/mla_prefill.py) a token walks only the
positions cached before this step, and return_lse adds each head's log-sum-exp [num_tokens,
num_heads] for the merge with the step's part. Triton's blocks are powers of two: the latent is
loaded as two parts, [dim_a] then [dim_b], dim = dim_a + dim_b with dim_a the largest power of two
below dim (DeepSeek: 512 + 64).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.reference import context_positions, log_sum_exp, token_positions
from jaxllm.kernels.tiling import check_tiles

_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class LatentTiles:
    """A launch's shape: heads a program (at least 16, Triton's smallest dot), positions a loop step."""
    block_h: int = 64
    tile: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tiles(self, ("block_h", "tile"))


def split_dim(dim: int) -> tuple[int, int]:
    """dim as (dim_a, dim_b): the largest power of two below it, and the rest, a power of two too."""
    dim_a = 1 << (dim.bit_length() - 1)
    dim_b = dim - dim_a
    if dim_b & (dim_b - 1):
        raise ValueError(f"latent attention loads its dimension as two powers of two; {dim} = {dim_a} + {dim_b}")
    return dim_a, dim_b


def _kernel(req_ref, pos_ref, q_ref, cache_ref, tables_ref, o_ref, lse_ref=None, *, scale, block_h, tile, block_size,
            dims, precision):
    """q_ref, o_ref [num_tokens, num_heads, dim]; cache_ref [slots, dim]; tables_ref [max_num_reqs, max_blocks];
    lse_ref [num_tokens, num_heads] float32 (with return_lse)."""
    num_heads = q_ref.shape[1]
    token, first_head = pl.program_id(0), pl.program_id(1) * block_h
    req, pos = req_ref[token], pos_ref[token]  # pos -1: a padding token, which attends to nothing
    head = first_head + jnp.arange(block_h)[:, None]
    head_ok = head < num_heads
    parts = [jnp.arange(dims[0])[None, :]] + ([dims[0] + jnp.arange(dims[1])[None, :]] if dims[1] else [])
    qs = [plgpu.load(q_ref.at[token, head, d], mask=head_ok, other=0) for d in parts]

    def body(t, carry):
        m, l, *accs = carry
        kpos = t * tile + jnp.arange(tile)
        ok = kpos <= pos
        page = plgpu.load(tables_ref.at[req, kpos // block_size], mask=ok, other=0)
        slot = (page * block_size + kpos % block_size)[:, None]
        latents = [plgpu.load(cache_ref.at[slot, d], mask=ok[:, None], other=0.0).astype(qs[0].dtype) for d in parts]
        s = sum(plgpu.dot(q, k, trans_b=True, precision=precision) for q, k in zip(qs, latents)) * scale
        s = jnp.where(ok[None, :], s, _MASKED)  # [block_h, tile]
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        accs = [acc * alpha[:, None] + plgpu.dot(p.astype(k.dtype), k, precision=precision)
                for acc, k in zip(accs, latents)]
        return (m_new, l * alpha + p.sum(axis=1), *accs)

    carry = (jnp.full((block_h,), _MASKED, jnp.float32), jnp.zeros((block_h,), jnp.float32),
             *[jnp.zeros((block_h, n), jnp.float32) for n in dims if n])
    m, l, *accs = jax.lax.fori_loop(0, (pos + tile) // tile, body, carry)
    norm = jnp.where(l > 0, l, 1.0)[:, None]
    for acc, d in zip(accs, parts):
        plgpu.store(o_ref.at[token, head, d], (acc / norm).astype(o_ref.dtype), mask=head_ok)
    if lse_ref is not None:
        plgpu.store(lse_ref.at[token, head[:, 0]], log_sum_exp(m, l), mask=head_ok[:, 0])


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret", "context_only", "return_lse"))
def latent_paged_attention(q, cache, query_start_loc, seq_lens, block_tables, num_seqs, *, scale,
                           tiles: LatentTiles = LatentTiles(), interpret=False, context_only=False, return_lse=False):
    """The kernel on one latent cache (module docstring); rows of padding tokens come back as zeros.
    context_only, return_lse: as reference.ragged_paged_attention's (each token over its request's
    context before this step; also the log-sum-exp [num_tokens, num_heads] float32, -inf for none)."""
    num_tokens, num_heads, dim = q.shape
    num_blocks, block_size = cache.shape[:2]
    if cache.shape[2:] != (1, dim):
        raise ValueError(f"latent attention reads one latent of {dim} a token; the cache is {cache.shape}")
    req, pos, valid = token_positions(query_start_loc, seq_lens, num_seqs, num_tokens)
    if context_only:
        pos = context_positions(query_start_loc, seq_lens, req)
    block_h = min(tiles.block_h, max(16, 1 << (num_heads - 1).bit_length()))
    kernel = functools.partial(_kernel, scale=float(scale), block_h=block_h, tile=tiles.tile, block_size=block_size,
                               dims=split_dim(dim),
                               precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if return_lse:
        out_shape = (out_shape, jax.ShapeDtypeStruct((num_tokens, num_heads), jnp.float32))
    return pl.pallas_call(
        kernel,
        grid=(num_tokens, pl.cdiv(num_heads, block_h)),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name="latent_paged_attention",
    )(req, jnp.where(valid, pos, -1), q, cache.reshape(num_blocks * block_size, dim), block_tables)


def ragged_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs, *, scale,
                           sliding_window=None, soft_cap=None, context_only=False, return_lse=False):
    """The reference's signature over a latent cache (v_cache is k_cache; no window, no cap).
    Off GPU it runs in the Pallas interpreter: correct, but slow."""
    if v_cache is not k_cache or sliding_window is not None or soft_cap is not None:
        raise ValueError("latent attention takes one latent cache as K and V, without a window or soft-cap")
    return latent_paged_attention(q, k_cache, query_start_loc, seq_lens, block_tables, num_seqs, scale=scale,
                                  interpret=jax.default_backend() != "gpu", context_only=context_only,
                                  return_lse=return_lse)
