"""The SSD scan's two per-chunk terms (kernels/ssd.py) as one Pallas kernel: a program per (chunk,
head) holds the chunk's Q tokens in its tiles and computes

    within:  y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j      [Q, P]
    own:     U   = sum_j exp(cum_last - cum_j) dt_j x_j B_j^T                 [P, N]

as three small matmuls ([Q, N] x [N, Q], [Q, Q] x [Q, P], [P, Q] x [Q, N]) with the decay applied
to the [Q, Q] tile in between, so the [chunks, Q, Q, heads] decay and score tensors that the
plain-JAX form (ssd.chunk_terms) writes to memory stay in the program. The chunk-to-chunk scan
and the terms from earlier chunks' state stay in ssd.ssd_chunk_scan. A head reads its group's B
and C (heads / groups heads a group) straight from the [chunks, groups, Q, N] arrays.

Triton wants each tile dimension a power of two (Q, P and N: 256, 64 and 128 for Mamba2-2.7B);
the interpreter (CPU tests) takes any.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _chunk_kernel(x_ref, dt_ref, cum_ref, to_end_ref, b_ref, c_ref, y_ref, own_ref, *, precision):
    x, dt, cum, to_end = x_ref[...], dt_ref[...], cum_ref[...], to_end_ref[...]  # [Q, P], [Q] x 3
    b, c = b_ref[...], c_ref[...]  # [Q, N]
    q = x.shape[0]
    causal = jnp.arange(q)[:, None] >= jnp.arange(q)[None, :]
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))  # 0 above the diagonal
    scores = plgpu.dot(c, b, trans_b=True, precision=precision) * decay * dt[None, :]
    y_ref[...] = plgpu.dot(scores, x, precision=precision)
    own_ref[...] = plgpu.dot(x * to_end[:, None], b, trans_a=True, precision=precision)


@functools.partial(jax.jit, static_argnames=("interpret",))
def chunk_terms(xc, dtc, cum, bc, cc, interpret=False):
    """ssd.chunk_terms's contract: xc [c, Q, H, P], dtc and cum [c, Q, H], bc and cc [c, Q, G, N],
    float32 -> (y within each chunk [c, Q, H, P], each chunk's own state term [c, H, P, N])."""
    num_chunks, q, num_heads, p = xc.shape
    groups, n = bc.shape[2:]
    per_group = num_heads // groups
    to_end = jnp.exp(cum[:, -1:] - cum) * dtc
    x = xc.transpose(0, 2, 1, 3)                                     # [c, H, Q, P]
    dt, cum, to_end = (a.transpose(0, 2, 1) for a in (dtc, cum, to_end))  # [c, H, Q]
    b, c = bc.transpose(0, 2, 1, 3), cc.transpose(0, 2, 1, 3)        # [c, G, Q, N]
    head_block = pl.BlockSpec((None, None, q), lambda i, h: (i, h, 0))
    group_block = pl.BlockSpec((None, None, q, n), lambda i, h: (i, h // per_group, 0, 0))
    y, own = pl.pallas_call(
        functools.partial(_chunk_kernel, precision=jax.lax.Precision.HIGHEST),
        grid=(num_chunks, num_heads),
        in_specs=[pl.BlockSpec((None, None, q, p), lambda i, h: (i, h, 0, 0)), head_block, head_block, head_block,
                  group_block, group_block],
        out_specs=[pl.BlockSpec((None, None, q, p), lambda i, h: (i, h, 0, 0)),
                   pl.BlockSpec((None, None, p, n), lambda i, h: (i, h, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_chunks, num_heads, q, p), jnp.float32),
                   jax.ShapeDtypeStruct((num_chunks, num_heads, p, n), jnp.float32)],
        interpret=interpret,
        name="ssd_chunk_terms",
    )(x, dt, cum, to_end, b, c)
    return y.transpose(0, 2, 1, 3), own
