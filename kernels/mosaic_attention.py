"""Prefill chunks of ragged paged attention for Hopper, in Pallas' Mosaic GPU
dialect (`plgpu`): TMA copies, wgmma and warp specialization, where the Triton
lowering (pallas_attention) is a plain FlashAttention-2 loop. Same signature and
cache layout as `reference.ragged_paged_attention`; only requests with more than
one new token are computed here (`prefill_attention`), and `ragged_paged_attention`
runs the decode tokens through pallas_attention into the same output.

A program is one q head x one q block of up to 128 new tokens of one request
(`pallas_attention.schedule`), run by three warpgroups:
  wg 0, 1  compute: 64 q rows each. Per KV tile: S = Q K^T (wgmma), online
           softmax in exp2, O += P V (wgmma). A rendezvous barrier between the two
           makes one's softmax overlap the other's matmuls (FlashAttention-3's
           ping-pong).
  wg 2     memory: copies K and V tiles of `tile` tokens into a ring of `stages`
           shared-memory slots, one TMA copy per cache block piece, the block ids
           read from the block table; it waits until both compute warpgroups have
           released a slot before refilling it.
Tiles wholly below a warpgroup's causal diagonal skip the masks; tiles outside its
range (a shorter causal reach, a sliding window, an empty half) are released
unread, so both warpgroups pass the same barriers in the same order.
A q block may end mid-tile and the next request's tokens follow: the q tile is read
whole (rows outside the block are computed and dropped), and the output is stored
through an unswizzled staging buffer by TMA copies of 64, 32, ..., 1 rows, so no
row outside the block is written.
Heads 64 and 128, bf16 and fp16, no soft cap (`supports`); programs run longest
first.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import pallas_attention

_ROWS = 64         # q rows of one compute warpgroup: one wgmma M
_BLOCK_Q = 2 * _ROWS
_MASKED = -1e30
_LOG2E = math.log2(math.e)


def supports(dtype, head_dim, block_size, soft_cap) -> bool:
    """Whether `prefill_attention` serves these shapes (`paged_attention` falls back
    to pallas_attention otherwise)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim in (64, 128) and block_size & (block_size - 1) == 0
            and soft_cap is None)


def is_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "").startswith("9.")


def _rendezvous(barrier):
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _kernel(meta_ref, q_ref, k_ref, v_ref, tables_ref, o_ref, q_smem, k_smem, v_smem, o_smem,
            q_full, k_full, v_full, k_free, v_free, turn, p_smem=None, *, scale, sliding_window, group,
            tile, stages, num_programs):
    num_tokens, _, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    head, wg = lax.axis_index("heads"), lax.axis_index("wg")
    prog = num_programs - 1 - lax.axis_index("prog")  # longest blocks first
    req, q_start, q_end, offset = (meta_ref[prog, i] for i in range(4))
    kv_end = q_end + offset  # one past the last position the block attends to
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.maximum(q_start + offset - sliding_window + 1, 0) // tile
    hi = pl.cdiv(kv_end, tile)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        start = q_start + wg * _ROWS
        num_rows = jnp.clip(q_end - start, 0, _ROWS)
        first = jnp.minimum(start, num_tokens - _ROWS)  # the q tile stays in bounds
        # TMA into tiled shared memory wants tile-aligned rows: the q tile, which
        # starts anywhere, goes through the (untiled) output buffer.
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first, _ROWS), head], o_smem.at[wg],
                                q_full.at[wg])
        pos0 = start + offset  # position of the block's first row
        my_hi = jnp.where(num_rows > 0, pl.cdiv(pos0 + num_rows, tile), lo)
        if sliding_window is None:
            my_lo, mid = lo, jnp.clip((pos0 + 1) // tile, lo, my_hi)
        else:
            my_lo = jnp.clip(jnp.maximum(pos0 - sliding_window + 1, 0) // tile, lo, my_hi)
            mid = my_lo
        plgpu.barrier_wait(q_full.at[wg])
        q_smem.at[wg][...] = plgpu.layout_cast(o_smem.at[wg][...], plgpu.Layout.WGMMA)
        plgpu.commit_smem()

        def step(t, carry, masked):
            acc, m, l = carry
            slot = lax.rem(t - lo, stages)
            plgpu.barrier_wait(k_full.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                _rendezvous(turn)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((_ROWS, tile), jnp.float32)) * (scale * _LOG2E)
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                row = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                q_pos, k_pos = row + (first + offset), col + t * tile
                mask = k_pos <= q_pos
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
                s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            if masked:
                p = jnp.where(mask, p, 0.0)
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(q_ref.dtype)
            acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
            plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may multiply
            plgpu.barrier_wait(v_full.at[slot])
            plgpu.barrier_wait(turn)

            if p_smem is None:  # P from registers, accumulated into acc itself
                acc = pl.run_state(lambda r: plgpu.wgmma(r, p, v_smem.at[slot]))(
                    plgpu.ACC.init(acc))
            else:  # the interpreter: P through shared memory, no run_state
                p_smem.at[wg][...] = p
                plgpu.commit_smem()
                acc += pl.run_scoped(
                    lambda r: (plgpu.wgmma(r, p_smem.at[wg], v_smem.at[slot]), r[...])[1],
                    plgpu.ACC((_ROWS, head_dim), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def skip(t, carry):
            slot = lax.rem(t - lo, stages)
            plgpu.barrier_wait(k_full.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            _rendezvous(turn)
            plgpu.barrier_wait(v_full.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            _rendezvous(turn)
            return carry

        wgmma = plgpu.Layout.WGMMA
        carry = (plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), wgmma),
                 plgpu.layout_cast(jnp.full((_ROWS,), _MASKED, jnp.float32), wgmma.reduce(1)),
                 plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), wgmma.reduce(1)))
        pl.when(wg == 1)(lambda: _rendezvous(turn))  # offsets the two by half a step
        carry = lax.fori_loop(lo, my_lo, skip, carry)
        carry = lax.fori_loop(my_lo, mid, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(mid, my_hi, functools.partial(step, masked=True), carry)
        acc, _, l = lax.fori_loop(my_hi, hi, skip, carry)
        pl.when(wg == 0)(lambda: _rendezvous(turn))

        l = jnp.where(l > 0, l, 1.0)
        out = o_smem.at[wg]
        out[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_ref.dtype)
        plgpu.commit_smem()
        # Store rows [start, start + num_rows) with static-size copies: 64, 32, ..., 1.
        done, size = jnp.int32(0), _ROWS
        while size:
            piece = num_rows & size

            @pl.when(piece != 0)
            def _store(done=done, size=size):
                src = out.at[pl.ds(start - first + done, size)]
                plgpu.copy_smem_to_gmem(src, o_ref.at[pl.ds(start + done, size), head])
            done, size = done + piece, size // 2
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = head // group
        rows = min(tile, block_size)
        last_block = (kv_end - 1) // block_size

        def load(t, _):
            slot = lax.rem(t - lo, stages)
            for cache, smem, full, free in ((k_ref, k_smem, k_full, k_free),
                                            (v_ref, v_smem, v_full, v_free)):
                pl.when(t - lo >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                for j in range(tile // rows):
                    kpos = t * tile + j * rows
                    # Pieces past the context read its last block instead: masked anyway.
                    block = tables_ref[req, jnp.minimum(kpos // block_size, last_block)]
                    first = 0 if rows == block_size else pl.multiple_of(kpos % block_size, rows)
                    plgpu.copy_gmem_to_smem(
                        cache.at[block, pl.ds(first, rows), kv_head],
                        smem.at[slot, pl.ds(j * rows, rows)], full.at[slot])
        lax.fori_loop(lo, hi, load, None)

        def drain(t, _):  # the last releases, so that every phase is observed
            slot = lax.rem(t - lo, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
        lax.fori_loop(jnp.maximum(hi - stages, lo), hi, drain, None)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "tile", "stages",
                                             "interpret"))
def prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                      *, scale, sliding_window=None, tile=128, stages=2, interpret=False):
    """Attention of the tokens of requests with more than one new token (arguments as
    `reference.ragged_paged_attention`). Rows of other tokens are left unspecified."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if not supports(q.dtype, head_dim, block_size, None):
        raise ValueError(f"mosaic prefill: unsupported {q.dtype}, head_dim {head_dim}, "
                         f"block_size {block_size}")
    padded = max(num_tokens, _ROWS)
    if padded > num_tokens:
        q = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    num_programs = seq_lens.shape[0] + num_tokens // _BLOCK_Q
    meta = pallas_attention.schedule(query_start_loc, seq_lens, num_seqs, _BLOCK_Q,
                                     num_programs, only="prefill")
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kv = plgpu.SMEM((stages, tile, head_dim), q.dtype, transforms=swizzled)
    kv_loads = tile // min(tile, block_size)  # TMA copies per tile, one arrival each
    kernel = functools.partial(
        _kernel, scale=float(scale), sliding_window=sliding_window,
        group=num_q_heads // num_kv_heads, tile=tile, stages=stages,
        num_programs=num_programs)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=(
            plgpu.SMEM((2, _ROWS, head_dim), q.dtype, transforms=swizzled),
            kv, kv,
            plgpu.SMEM((2, _ROWS, head_dim), q.dtype),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=kv_loads, num_barriers=stages),
            plgpu.Barrier(num_arrivals=kv_loads, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            *([plgpu.SMEM((2, _ROWS, tile), q.dtype, transforms=swizzled)] if interpret else []),
        ),
        grid=(num_q_heads, num_programs),
        grid_names=("heads", "prog"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="mosaic_prefill_attention",
    )(meta, q, k_cache, v_cache, block_tables)
    return out[:num_tokens]


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret"))
def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                    *, scale, sliding_window=None, soft_cap=None, interpret=False):
    """Prefill chunks here, then the decode tokens through pallas_attention into the
    same output. A decode bucket (no more tokens than request slots) and shapes this
    kernel does not serve go to pallas_attention whole."""
    kwargs = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  interpret=interpret)
    args = (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs)
    if (q.shape[0] <= seq_lens.shape[0]
            or not supports(q.dtype, q.shape[2], k_cache.shape[1], soft_cap)):
        return pallas_attention.paged_attention(*args, **kwargs)
    out = prefill_attention(*args, scale=scale, sliding_window=sliding_window,
                            interpret=interpret)
    return pallas_attention.decode_into(out, *args, **kwargs)


def ragged_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                           num_seqs, *, scale, sliding_window=None, soft_cap=None):
    """The "mosaic" backend (see reference.ragged_paged_attention): Hopper GPUs only;
    elsewhere it is the Pallas backend."""
    args = (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs)
    kwargs = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if not is_hopper():
        return pallas_attention.ragged_paged_attention(*args, **kwargs)
    return paged_attention(*args, **kwargs)
