"""The SSD scan's two per-chunk terms (kernels/ssd.py) as one Pallas kernel: a program per (chunk,
head) holds the chunk's Q tokens in its tiles and computes

    within:  y_i = sum_{j <= i, same request} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j      [Q, P]
    own:     U   = sum_{j of the last token's request} exp(cum_last - cum_j) dt_j x_j B_j^T   [P, N]

as three small matmuls ([Q, N] x [N, Q], [Q, Q] x [Q, P], [P, Q] x [Q, N]) with the decay applied
to the [Q, Q] tile in between, so the [chunks, Q, Q, heads] decay and score tensors that the
plain-JAX form (ssd.chunk_terms) writes to memory stay in the program. The chunk-to-chunk scan
and the terms from earlier chunks' state stay in ssd.ssd_chunk_scan. A head reads its group's B
and C (heads / groups heads a group) straight from the [chunks, groups, Q, N] arrays, and the
chunk's [Q] segment ids (each token's request) for the same-request mask.

Triton wants each tile dimension a power of two (Q, P and N: 256, 64 and 128 for Mamba2-2.7B);
the interpreter (CPU tests) takes any.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _chunk_kernel(x_ref, dt_ref, cum_ref, to_end_ref, b_ref, c_ref, segment_ref, y_ref, own_ref, *, precision):
    x, dt, cum, to_end = x_ref[...], dt_ref[...], cum_ref[...], to_end_ref[...]  # [Q, P], [Q] x 3
    b, c = b_ref[...], c_ref[...]  # [Q, N]
    segment = segment_ref[...]  # [Q]
    q = x.shape[0]
    same = (jnp.arange(q)[:, None] >= jnp.arange(q)[None, :]) & (segment[:, None] == segment[None, :])
    decay = jnp.exp(jnp.where(same, cum[:, None] - cum[None, :], -jnp.inf))  # 0 above the diagonal, across requests
    scores = plgpu.dot(c, b, trans_b=True, precision=precision) * decay * dt[None, :]
    y_ref[...] = plgpu.dot(scores, x, precision=precision)
    own_ref[...] = plgpu.dot(x * to_end[:, None], b, trans_a=True, precision=precision)


@functools.partial(jax.jit, static_argnames=("interpret",))
def chunk_terms(xc, dtc, cum, bc, cc, segment, interpret=False):
    """ssd.chunk_terms's contract: xc [c, Q, H, P], dtc and cum [c, Q, H], bc and cc [c, Q, G, N],
    float32, segment [c, Q] int32 -> (y within each window [c, Q, H, P], its last token's request's
    state term [c, H, P, N])."""
    num_chunks, q, num_heads, p = xc.shape
    groups, n = bc.shape[2:]
    per_group = num_heads // groups
    to_end = jnp.where((segment == segment[:, -1:])[..., None], jnp.exp(cum[:, -1:] - cum) * dtc, 0.0)
    x = xc.transpose(0, 2, 1, 3)                                     # [c, H, Q, P]
    dt, cum, to_end = (a.transpose(0, 2, 1) for a in (dtc, cum, to_end))  # [c, H, Q]
    b, c = bc.transpose(0, 2, 1, 3), cc.transpose(0, 2, 1, 3)        # [c, G, Q, N]
    head_block = pl.BlockSpec((None, None, q), lambda i, h: (i, h, 0))
    group_block = pl.BlockSpec((None, None, q, n), lambda i, h: (i, h // per_group, 0, 0))
    y, own = pl.pallas_call(
        functools.partial(_chunk_kernel, precision=jax.lax.Precision.HIGHEST),
        grid=(num_chunks, num_heads),
        in_specs=[pl.BlockSpec((None, None, q, p), lambda i, h: (i, h, 0, 0)), head_block, head_block, head_block,
                  group_block, group_block, pl.BlockSpec((None, q), lambda i, h: (i, 0))],
        out_specs=[pl.BlockSpec((None, None, q, p), lambda i, h: (i, h, 0, 0)),
                   pl.BlockSpec((None, None, p, n), lambda i, h: (i, h, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_chunks, num_heads, q, p), jnp.float32),
                   jax.ShapeDtypeStruct((num_chunks, num_heads, p, n), jnp.float32)],
        interpret=interpret,
        name="ssd_chunk_terms",
    )(x, dt, cum, to_end, b, c, segment)
    return y.transpose(0, 2, 1, 3), own


def _update_kernel(slots_ref, write_ref, has_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, states_ref, y_ref, out_ref, *,
                   per_group: int):
    """One (request, head): the state read from its slot (zeros without one), y = S' C and S' written
    back in place, with S' = exp(dt A) S + dt x B^T. A padding request (write slot out of range)
    reads and writes no state."""
    r, h = pl.program_id(0), pl.program_id(1)
    write = write_ref[r]

    @pl.when(write < states_ref.shape[0])
    def _():
        state = states_ref[slots_ref[r], h].astype(jnp.float32)                  # [P, N]
        state = jnp.where(has_ref[r] != 0, state, 0.0)
        dt, b, c = dt_ref[r, h], b_ref[r, h // per_group], c_ref[r, h // per_group]  # (), [N], [N]
        decay = jnp.exp(dt * a_ref[h])
        dtx = dt * x_ref[...]                                                    # [P]
        y_ref[...] = decay * jnp.sum(state * c[None, :], axis=1) + dtx * jnp.sum(b * c)
        out_ref[write, h] = (decay * state + dtx[:, None] * b[None, :]).astype(out_ref.dtype)

    @pl.when(write >= states_ref.shape[0])
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("states",))
def state_update(x, dt, A, B, C, states, slots, has_state, write_slots, interpret=False):
    """ssd.ssd_update on the cache in place: x [R, H, P], dt [R, H], A [H], B, C [R, G, N] (float32);
    states [S, H, P, N] (any float dtype, donated); slots, write_slots [R] int32 (request i reads
    states[slots[i]], zeros where not has_state[i], and writes states[write_slots[i]]; a write slot
    out of range: a padding request, none read or written); has_state [R] bool.
    Returns (y [R, H, P] float32, the cache with the requests' new states).

    A program per (request, head) reads its [P, N] state once and writes it once: at Mamba2-2.7B's
    shape (80 heads of 64 x 128) a request's state is 1.3 MB a layer in bfloat16, and a padding
    request costs nothing, where the plain form's gather, update and scatter each pass over every
    request of the bucket."""
    num_reqs, num_heads, p = x.shape
    per_group = num_heads // B.shape[1]
    row, whole = pl.BlockSpec((None, None, p), lambda r, h: (r, h, 0)), pl.BlockSpec()  # x and y: the program's
    y, states = pl.pallas_call(
        functools.partial(_update_kernel, per_group=per_group),
        grid=(num_reqs, num_heads),
        in_specs=[whole] * 3 + [row] + [whole] * 5,
        out_specs=[row, whole],
        out_shape=[jax.ShapeDtypeStruct((num_reqs, num_heads, p), jnp.float32),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)],
        input_output_aliases={8: 1},
        interpret=interpret,
        name="ssd_state_update",
    )(slots, write_slots, has_state.astype(jnp.int32), x, dt, A, B, C, states)
    return y, states
