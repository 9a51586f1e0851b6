"""Prefill chunks of ragged paged attention for Hopper, in Pallas' Mosaic GPU
dialect (`plgpu`): TMA copies, wgmma and warp specialization, where the Triton
lowering (pallas_attention) is a plain FlashAttention-2 loop. Same signature and
cache layout as `reference.ragged_paged_attention`; only requests with more than
one new token are computed here (`prefill_attention`), and `ragged_paged_attention`
runs the decode tokens through pallas_attention into the same output.

A work item is one q head x one q block of up to 128 new tokens of one request
(`pallas_attention.schedule`). CTA c serves items c, c + num_ctas, ... (longest
blocks first); by default one each (persistent CTAs, `num_ctas` = the SM count,
measured slower: docs/kernels.md). Three warpgroups:
  wg 0, 1  compute: 64 q rows each. Per KV tile: S = Q K^T (wgmma), online
           softmax in exp2, O += P V (wgmma). A rendezvous barrier between the two
           makes one's softmax overlap the other's matmuls (FlashAttention-3's
           ping-pong).
  wg 2     memory: per item, the two q tiles, then K and V tiles of `tile` tokens
           into a ring of `stages` shared-memory slots (one TMA copy per cache block
           piece, block ids read from the block table); it refills a slot once both
           compute warpgroups have released it, running ahead into the next item.
Tiles wholly below a warpgroup's causal diagonal skip the masks; tiles outside its
range (a shorter causal reach, a sliding window, an empty half) are released
unread, so both warpgroups pass the same barriers in the same order.
TMA into the swizzled tiles wgmma reads needs tile-aligned rows, and a q block
starts anywhere: q tiles land in an untiled buffer and are re-laid by the compute
warpgroups. A block may end mid-tile with the next request's tokens behind it: the
tile is read whole (rows outside the block are computed and dropped), and the
output goes out through an untiled buffer by TMA copies of 64, 32, ..., 1 rows, so
no row outside the block is written.
Heads 64 and 128, bf16 and fp16, no soft cap (`supports`). Like the reference, a
masked score weighs its V row by exactly 0, so cache slots past a request's end must
hold finite values (they do unless a model wrote inf/NaN there).
The interpreter (`interpret=True`, CPU tests) has no wgmma from registers and no
`run_state`: there, and only there, P goes through shared memory (`p_smem`) and the
P V product is added to the accumulator rather than accumulated in place.
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


def supports(dtype, head_dim, block_size, soft_cap, cache_dtype=None) -> bool:
    """Whether `prefill_attention` serves these shapes (`paged_attention` falls back
    to pallas_attention otherwise). cache_dtype: the KV cache's (None: `dtype`); wgmma
    reads K and V from shared memory as they land, so an 8-bit cache, which would need
    q in 8 bits too, is left to pallas_attention."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and jnp.dtype(cache_dtype or dtype) == jnp.dtype(dtype)
            and head_dim in (64, 128) and block_size & (block_size - 1) == 0
            and soft_cap is None)


def is_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "").startswith("9.")


def _rendezvous(barrier):
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _item(meta_ref, cta, i, *, num_ctas, num_programs, num_q_heads, tile, sliding_window):
    """The work item a CTA serves i-th: (q head, request, q block [q_start, q_end),
    position offset, KV end, KV tile range [lo, hi)). Items go longest block first,
    the q heads of one block side by side (they share its K/V tiles in L2)."""
    item = cta + i * num_ctas
    head = lax.rem(item, num_q_heads)
    prog = num_programs - 1 - item // num_q_heads
    req, q_start, q_end, offset = (meta_ref[prog, j] for j in range(4))
    kv_end = q_end + offset  # one past the last position the block attends to
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.maximum(q_start + offset - sliding_window + 1, 0) // tile
    return head, req, q_start, q_end, offset, kv_end, lo, pl.cdiv(kv_end, tile)


def _first_row(start, num_tokens):
    """First row of the 64-row q tile holding rows from `start`: moved back at the
    end of the array so that the tile stays in bounds."""
    return jnp.minimum(start, num_tokens - _ROWS)


def _kernel(meta_ref, q_ref, k_ref, v_ref, tables_ref, o_ref, q_smem, q_stage, k_smem, v_smem,
            o_smem, q_full, q_free, k_full, v_full, k_free, v_free, turn, p_smem=None, *, scale,
            sliding_window, group, tile, stages, num_programs, num_ctas):
    num_tokens, num_q_heads, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    num_items = pl.cdiv(num_q_heads * num_programs - cta, num_ctas)
    c = scale * _LOG2E  # softmax in exp2
    item = functools.partial(_item, meta_ref, cta, num_ctas=num_ctas, num_programs=num_programs,
                             num_q_heads=num_q_heads, tile=tile, sliding_window=sliding_window)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        def serve(i, carry):
            """Item i. step0 counts the K/V tiles of the earlier items (the ring
            position); `info` is item i's, loaded one item ahead."""
            step0, info = carry
            nxt = item(jnp.minimum(i + 1, num_items - 1))
            head, _, q_start, q_end, offset, _, lo, hi = info
            start = q_start + wg * _ROWS
            num_rows = jnp.clip(q_end - start, 0, _ROWS)
            first = _first_row(start, num_tokens)
            pos0 = start + offset  # position of the block's first row
            my_hi = jnp.where(num_rows > 0, pl.cdiv(pos0 + num_rows, tile), lo)
            if sliding_window is None:
                my_lo, mid = lo, jnp.clip((pos0 + 1) // tile, lo, my_hi)
            else:
                my_lo = jnp.clip(jnp.maximum(pos0 - sliding_window + 1, 0) // tile, lo, my_hi)
                mid = my_lo
            # The q tile, staged by the memory warpgroup, into the swizzled layout wgmma reads.
            plgpu.barrier_wait(q_full.at[wg])
            q_smem.at[wg][...] = plgpu.layout_cast(q_stage.at[wg][...], plgpu.Layout.WGMMA)
            plgpu.commit_smem()
            plgpu.barrier_arrive(q_free)

            def step(t, carry, masked):
                acc, m, l = carry
                slot = lax.rem(step0 + t - lo, stages)
                plgpu.barrier_wait(k_full.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    _rendezvous(turn)
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((_ROWS, tile), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    layout = plgpu.Layout.WGMMA
                    row = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=layout)
                    col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=layout)
                    q_pos, k_pos = row + (first + offset), col + t * tile
                    mask = k_pos <= q_pos
                    if sliding_window is not None:
                        mask &= k_pos > q_pos - sliding_window
                    s = jnp.where(mask, s, _MASKED)
                # m is kept unscaled: exp2(s * c - m * c) is one FMA a score.
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2((m - m_new) * c)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new * c, s.shape, [0]))
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
                slot = lax.rem(step0 + t - lo, stages)
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
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's output left
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
            return step0 + hi - lo, nxt

        lax.fori_loop(0, num_items, serve, (jnp.int32(0), item(0)))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        rows = min(tile, block_size)

        def serve(i, step0):
            head, req, q_start, _, _, kv_end, lo, hi = item(i)
            kv_head = head // group
            last_block = (kv_end - 1) // block_size
            # The two q tiles, once the compute warpgroups have taken the last ones.
            pl.when(i > 0)(lambda: plgpu.barrier_wait(q_free))
            for half in range(2):
                first = _first_row(q_start + half * _ROWS, num_tokens)
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first, _ROWS), head], q_stage.at[half],
                                        q_full.at[half])

            def load(t, _):
                ring = step0 + t - lo
                slot = lax.rem(ring, stages)
                for cache, smem, full, free in ((k_ref, k_smem, k_full, k_free),
                                                (v_ref, v_smem, v_full, v_free)):
                    pl.when(ring >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                    for j in range(tile // rows):
                        kpos = t * tile + j * rows
                        # Pieces past the context read its last block instead: masked anyway.
                        block = tables_ref[req, jnp.minimum(kpos // block_size, last_block)]
                        first = 0 if rows == block_size else pl.multiple_of(kpos % block_size, rows)
                        plgpu.copy_gmem_to_smem(
                            cache.at[block, pl.ds(first, rows), kv_head],
                            smem.at[slot, pl.ds(j * rows, rows)], full.at[slot])
            lax.fori_loop(lo, hi, load, None)
            return step0 + hi - lo

        steps = lax.fori_loop(0, num_items, serve, jnp.int32(0))
        plgpu.barrier_wait(q_free)  # the last release, so that every phase is observed

        def drain(ring, _):  # the last releases, so that every phase is observed
            slot = lax.rem(ring, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
        lax.fori_loop(jnp.maximum(steps - stages, 0), steps, drain, None)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "tile", "stages",
                                             "num_ctas", "interpret"))
def prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                      *, scale, sliding_window=None, tile=128, stages=2, num_ctas=None,
                      interpret=False):
    """Attention of the tokens of requests with more than one new token (arguments as
    `reference.ragged_paged_attention`). Rows of other tokens are left unspecified.
    interpret: True, or `plgpu.InterpretGPUParams`, runs the Mosaic GPU interpreter."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if not supports(q.dtype, head_dim, block_size, None, k_cache.dtype):
        raise ValueError(f"mosaic prefill: unsupported {q.dtype} (cache {k_cache.dtype}), "
                         f"head_dim {head_dim}, block_size {block_size}")
    padded = max(num_tokens, _ROWS)
    if padded > num_tokens:
        q = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    num_programs = seq_lens.shape[0] + num_tokens // _BLOCK_Q
    meta = pallas_attention.schedule(query_start_loc, seq_lens, num_seqs, _BLOCK_Q,
                                     num_programs, only="prefill")
    # Default: one item per CTA, so the hardware hands the next item to the first free
    # SM (items of unequal length balance better so than by a static split).
    num_ctas = min(num_ctas or num_q_heads * num_programs, num_q_heads * num_programs)
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kv = plgpu.SMEM((stages, tile, head_dim), q.dtype, transforms=swizzled)
    kv_loads = tile // min(tile, block_size)  # TMA copies per tile, one arrival each
    kernel = functools.partial(
        _kernel, scale=float(scale), sliding_window=sliding_window,
        group=num_q_heads // num_kv_heads, tile=tile, stages=stages,
        num_programs=num_programs, num_ctas=num_ctas)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=(  # 224 KiB of the 227 KiB a CTA may have, at head dim 128
            plgpu.SMEM((2, _ROWS, head_dim), q.dtype, transforms=swizzled),  # q_smem
            plgpu.SMEM((2, _ROWS, head_dim), q.dtype),                       # q_stage
            kv, kv,                                                          # k_smem, v_smem
            plgpu.SMEM((2, _ROWS, head_dim), q.dtype),                       # o_smem
            plgpu.Barrier(num_barriers=2),                                   # q_full
            plgpu.Barrier(num_arrivals=2),                                   # q_free
            plgpu.Barrier(num_arrivals=kv_loads, num_barriers=stages),       # k_full
            plgpu.Barrier(num_arrivals=kv_loads, num_barriers=stages),       # v_full
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),              # k_free
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),              # v_free
            plgpu.Barrier(num_arrivals=2),                                   # turn
            *([plgpu.SMEM((2, _ROWS, tile), q.dtype, transforms=swizzled)]   # p_smem
              if interpret else []),
        ),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None),
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
            or not supports(q.dtype, q.shape[2], k_cache.shape[1], soft_cap, k_cache.dtype)):
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
