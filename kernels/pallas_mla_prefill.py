"""Expanded latent attention's step part (kernels/mla_prefill.py's step_attention, its signature and
contract) in Pallas (Triton lowering): varlen causal flash attention over the step's own tokens.

Grid (cdiv(num_tokens, block_q), num_heads): one program is block_q consecutive tokens and one head.
It walks the keys in tiles of `tile` tokens from the first token of the earliest request among its
rows to its last real row, so a tile of other requests' tokens before that is never read (the
reference computes the whole masked rectangle); a tile inside that range still masks each pair to
the row's own request and causally. Each program reads its head's k_nope and v, and the shared k_pe.
Triton's blocks are powers of two of 16 or more: each dimension (nope, rope, v) is loaded padded up
to one, the padding masked to zeros (DeepSeek's 128, 64, 128 need none).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.reference import log_sum_exp, token_requests
from jaxllm.kernels.tiling import check_tiles

_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class StepTiles:
    """A launch's shape: query tokens a program, key tokens a loop step."""
    block_q: int = 64
    tile: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tiles(self, ("block_q", "tile"))


def _pow2(n: int) -> int:
    """n's padded width: a power of two, at least 16 (Triton's smallest dot)."""
    return max(16, 1 << (n - 1).bit_length())


def _kernel(first_ref, q_ref, k_nope_ref, k_pe_ref, v_ref, o_ref, lse_ref, *, scale, block_q, tile, dims,
            precision):
    """first_ref [T] (each token's request's first token; T for padding); q_ref [T, H, nope + rope];
    k_nope_ref [T, H, nope]; k_pe_ref [T, rope]; v_ref, o_ref [T, H, v]; lse_ref [T, H]."""
    num_tokens = q_ref.shape[0]
    nope, rope, v_dim = dims
    head = pl.program_id(1)
    rows = pl.program_id(0) * block_q + jnp.arange(block_q)
    row_ok = rows < num_tokens
    first = plgpu.load(first_ref.at[rows], mask=row_ok, other=num_tokens)
    real = first <= rows  # a padding row's first is past it
    dn, dr, dv = (jnp.arange(_pow2(n)) for n in dims)
    q_nope = plgpu.load(q_ref.at[rows[:, None], head, dn[None, :]], mask=row_ok[:, None] & (dn < nope)[None, :],
                        other=0)
    q_pe = plgpu.load(q_ref.at[rows[:, None], head, nope + dr[None, :]], mask=row_ok[:, None] & (dr < rope)[None, :],
                      other=0)

    def body(j, carry):
        m, l, acc = carry
        keys = j * tile + jnp.arange(tile)
        key_ok = (keys < num_tokens)[:, None]
        k_nope = plgpu.load(k_nope_ref.at[keys[:, None], head, dn[None, :]], mask=key_ok & (dn < nope)[None, :],
                            other=0)
        k_pe = plgpu.load(k_pe_ref.at[keys[:, None], dr[None, :]], mask=key_ok & (dr < rope)[None, :], other=0)
        v = plgpu.load(v_ref.at[keys[:, None], head, dv[None, :]], mask=key_ok & (dv < v_dim)[None, :], other=0)
        s = (plgpu.dot(q_nope, k_nope, trans_b=True, precision=precision)
             + plgpu.dot(q_pe, k_pe, trans_b=True, precision=precision)) * scale  # [block_q, tile]
        ok = (keys[None, :] >= first[:, None]) & (keys[None, :] <= rows[:, None])
        s = jnp.where(ok, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return m_new, l * alpha + p.sum(axis=1), acc

    lo = jnp.min(jnp.where(real, first, num_tokens))  # the earliest key any row attends to
    hi = jnp.max(jnp.where(real, rows, -1))           # the last (-1: no real row, no step)
    carry = (jnp.full((block_q,), _MASKED, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, dv.shape[0]), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo // tile, hi // tile + 1, body, carry)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref.at[rows[:, None], head, dv[None, :]], out, mask=row_ok[:, None] & (dv < v_dim)[None, :])
    plgpu.store(lse_ref.at[rows, head], log_sum_exp(m, l), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def step_attention(q, k_nope, k_pe, v, query_start_loc, num_seqs, *, scale, tiles: StepTiles = StepTiles(),
                   interpret=False):
    """mla_prefill.step_attention's contract: (out [T, H, v] float32, lse [T, H] float32)."""
    num_tokens, num_heads, _ = q.shape
    nope, rope, v_dim = k_nope.shape[-1], k_pe.shape[-1], v.shape[-1]
    req, valid = token_requests(query_start_loc, num_seqs, num_tokens)
    first = jnp.where(valid, query_start_loc[req], num_tokens)
    kernel = functools.partial(_kernel, scale=float(scale), block_q=tiles.block_q, tile=tiles.tile,
                               dims=(nope, rope, v_dim),
                               precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, tiles.block_q), num_heads),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, num_heads, v_dim), jnp.float32),
                   jax.ShapeDtypeStruct((num_tokens, num_heads), jnp.float32)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name="mla_step_attention",
    )(first, q, k_nope, k_pe, v)
