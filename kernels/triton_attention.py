"""Unified ragged paged attention written directly in Triton and called through
jax-triton (`triton_call`). Same signature and cache layout as
`reference.ragged_paged_attention`, and the same algorithm, grid and block shapes as
`pallas_attention` (read its header): one program per (q block of one request,
KV head, KV split), the `group` q heads of a KV head stacked as rows of one tile, K/V
tiles gathered through the block table, online softmax in exp2, split-K partials
merged by `pallas_attention.combine_splits`.

Triton and jax-triton are imported on first call, so this module imports on
machines without them (CPU CI).
"""
import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels.pallas_attention import combine_splits, launch_programs, plan


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_kernel(meta_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, prev_ptr, o_ptr, lse_ptr,
                         scale: tl.constexpr, soft_cap: tl.constexpr, window: tl.constexpr,
                         num_tokens: tl.constexpr, num_q_heads: tl.constexpr,
                         num_kv_heads: tl.constexpr, head_dim: tl.constexpr,
                         block_size: tl.constexpr, table_stride: tl.constexpr,
                         group: tl.constexpr, group_pad: tl.constexpr, block_q: tl.constexpr,
                         tile: tl.constexpr, num_splits: tl.constexpr,
                         precision: tl.constexpr):
        # prev_ptr: the earlier launch's output, aliased to o_ptr (or unused).
        prog, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        req = tl.load(meta_ptr + prog * 4)
        q_start = tl.load(meta_ptr + prog * 4 + 1)
        q_end = tl.load(meta_ptr + prog * 4 + 2)
        offset = tl.load(meta_ptr + prog * 4 + 3)

        rows = tl.arange(0, block_q * group_pad)
        g = rows % group_pad
        token = q_start + rows // group_pad
        row_ok = (token < q_end) & (g < group)
        head = kv_head * group + g
        pos = token + offset
        dims = tl.arange(0, head_dim)
        q_off = (token.to(tl.int64) * num_q_heads + head) * head_dim
        q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)

        kv_end = q_end + offset
        kv_start = 0
        if window > 0:
            kv_start = tl.maximum(q_start + offset - window + 1, 0)
        first = kv_start // tile
        last = tl.cdiv(kv_end, tile)
        per_split = tl.cdiv(last - first, num_splits)
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, last)
        # Tiles before `mid` are visible to every row: they skip the masks.
        if window > 0:
            mid = lo
        else:
            mid = tl.minimum(tl.maximum((q_start + offset + 1) // tile, lo), hi)

        m = tl.full([block_q * group_pad], -1e30, tl.float32)
        l = tl.zeros([block_q * group_pad], tl.float32)
        acc = tl.zeros([block_q * group_pad, head_dim], tl.float32)
        for masked in tl.static_range(2):  # unmasked tiles [lo, mid), then [mid, hi)
            if masked:
                start, stop = mid, hi
            else:
                start, stop = lo, mid
            for t in range(start, stop):
                kpos = t * tile + tl.arange(0, tile)
                kv_ok = kpos < kv_end
                page_ptr = tables_ptr + req * table_stride + kpos // block_size
                if masked:
                    page = tl.load(page_ptr, mask=kv_ok, other=0)
                else:
                    page = tl.load(page_ptr)
                slot = page.to(tl.int64) * block_size + kpos % block_size
                kv_off = ((slot * num_kv_heads + kv_head) * head_dim)[:, None] + dims[None, :]
                if masked:
                    k = tl.load(k_ptr + kv_off, mask=kv_ok[:, None], other=0.0)
                    v = tl.load(v_ptr + kv_off, mask=kv_ok[:, None], other=0.0)
                else:
                    k = tl.load(k_ptr + kv_off)
                    v = tl.load(v_ptr + kv_off)
                k = k.to(q.dtype)  # an 8-bit cache is widened after the load
                v = v.to(q.dtype)
                s = tl.dot(q, tl.trans(k), input_precision=precision) * scale
                if soft_cap > 0:
                    # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both infinities.
                    s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
                s = s * 1.4426950408889634  # log2(e): the softmax runs in exp2
                mask = kpos[None, :] <= pos[:, None]
                if window > 0:
                    mask = mask & (kpos[None, :] > pos[:, None] - window)
                if masked:
                    s = tl.where(mask, s, -1e30)
                m_new = tl.maximum(m, tl.max(s, axis=1))
                p = tl.exp2(s - m_new[:, None])
                if masked:
                    p = tl.where(mask, p, 0.0)
                alpha = tl.exp2(m - m_new)
                l = l * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=precision)
                m = m_new

        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        if num_splits == 1:
            tl.store(o_ptr + q_off[:, None] + dims[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=row_ok[:, None])
        else:
            part = split.to(tl.int64) * num_tokens * num_q_heads
            tl.store(o_ptr + part * head_dim + q_off[:, None] + dims[None, :], out,
                     mask=row_ok[:, None])
            lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), -1e30)
            tl.store(lse_ptr + part + token.to(tl.int64) * num_q_heads + head, lse, mask=row_ok)

    return attention_kernel


def _launch(launch, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
            out, *, scale, sliding_window, soft_cap):
    """One triton_call for `launch` (see pallas_attention._launch)."""
    import jax_triton

    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group, group_pad, block_q, num_programs, meta = launch_programs(
        launch, num_tokens, num_q_heads, num_kv_heads, query_start_loc, seq_lens, num_seqs)
    splits = launch.num_splits
    assert not (out is not None and splits > 1), "only a first launch may split"
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                     jax.ShapeDtypeStruct((1,), jnp.float32)]  # no lse
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), jnp.float32)]
    prev = out if out is not None else jnp.zeros((1,), q.dtype)
    o, lse = jax_triton.triton_call(
        meta, q, k_cache, v_cache, block_tables.astype(jnp.int32), prev,
        kernel=_kernel(), out_shape=out_shape,
        grid=(num_programs, num_kv_heads, splits),
        input_output_aliases={5: 0} if out is not None else {},
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        scale=float(scale), soft_cap=float(soft_cap or 0.0), window=int(sliding_window or 0),
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, table_stride=block_tables.shape[1],
        group=group, group_pad=group_pad, block_q=block_q, tile=launch.tile,
        num_splits=splits, precision="ieee" if q.dtype == jnp.float32 else "tf32")
    return o if splits == 1 else combine_splits(o, lse, q.dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "block_m", "tile", "num_splits", "num_warps",
    "num_stages"))
def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                    *, scale, sliding_window=None, soft_cap=None, block_m=None, tile=None,
                    num_splits=None, num_warps=None, num_stages=None):
    """`ragged_paged_attention` with the launch shape exposed (None: `plan` decides).
    Shapes as in pallas_attention.paged_attention."""
    num_tokens, num_q_heads, head_dim = q.shape
    launches = plan(num_tokens, seq_lens.shape[0], num_q_heads, k_cache.shape[2], head_dim,
                    q.dtype.itemsize, block_m=block_m, tile=tile, num_splits=num_splits,
                    num_warps=num_warps, num_stages=num_stages)
    out = None
    for launch in launches:
        out = _launch(launch, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                      num_seqs, out, scale=scale, sliding_window=sliding_window,
                      soft_cap=soft_cap)
    return out


def ragged_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                           num_seqs, *, scale, sliding_window=None, soft_cap=None):
    """The jax-triton backend (see reference.ragged_paged_attention). GPU only."""
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                           num_seqs, scale=scale, sliding_window=sliding_window,
                           soft_cap=soft_cap)
