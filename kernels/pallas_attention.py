"""Unified ragged paged attention in Pallas (Triton lowering): prefill chunks and
decode tokens of many requests in one jitted call. Same signature and cache layout
as `reference.ragged_paged_attention`.

Grid (num_programs, num_kv_heads, num_splits), or (num_kv_heads, num_programs, num_splits)
for a head-major launch (the decode one), whose programs of one request's KV heads run
side by side:
  axis 0  one "q block": up to `block_q` consecutive new tokens of one request.
          `schedule` maps programs to (request, first token) outside the kernel; the
          count is static (an upper bound), and programs past the real blocks run no
          loop iterations.
  axis 1  one KV head. Its `group` q heads share every K/V tile the program loads,
          so K/V is read once per KV head, whatever the GQA ratio.
  axis 2  split-K (flash-decoding): the program's KV range is cut in `num_splits`
          tile-aligned pieces; each writes a normalized partial output and its
          log-sum-exp, and `combine_splits` merges them. Used when a decode bucket
          has too few requests to fill the GPU; 1 otherwise.
Block shapes: the q tile is [block_m, head_dim] with block_m = block_q * group_pad
rows (row r is token r // group_pad, head r % group_pad; group_pad is the GQA ratio
rounded up to a power of two, padding rows masked). Each loop step gathers a K and
a V tile of [tile, head_dim] through the block table (a tile may span several cache
blocks or part of one, so tile and block_size are independent); tiles wholly below
the causal diagonal skip the masks. `plan` picks the shapes: 16-row q blocks for
one-token requests, 128-row blocks (64 for dim 256) for prefill chunks, in a second
launch that writes its rows into the first one's output.
All indexing is integer-array gathers and masked scatters, which the interpreter
(`interpret=True`, CPU tests) and the Triton lowering both accept.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


_MASKED = -1e30
_LOG2E = math.log2(math.e)
_PROGRAMS_PER_SM = 4  # programs wanted in flight per SM when choosing split-K
_CPU_SMS = 132  # in the interpreter (CPU tests), as an H200: the same launches as on the GPU
_MAX_SPLITS = 64


@functools.lru_cache(maxsize=1)
def _target_programs() -> int:
    """Programs in flight that fill the device: a few per SM (an H200 has 132), read from it."""
    device = jax.devices()[0]
    sms = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return _PROGRAMS_PER_SM * (sms or _CPU_SMS)


def _cdiv(a, b):
    return (a + b - 1) // b


def _next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def schedule(query_start_loc, seq_lens, num_seqs, block_q, num_programs, only=None):
    """Maps each program to a block of at most `block_q` new tokens of one request.

    only: None for every request, "decode" for those with one new token, "prefill"
    for those with more. Returns [num_programs, 4] int32 rows (request, first token,
    end token, position offset), where token t of the block sits at position
    t + offset. Programs past the real blocks get an empty block (0, 0, 0, 0).
    """
    num_reqs = seq_lens.shape[0]
    real = jnp.arange(num_reqs) < jnp.reshape(num_seqs, ())
    q_lens = jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)
    if only == "decode":
        q_lens = jnp.where(q_lens == 1, q_lens, 0)
    elif only == "prefill":
        q_lens = jnp.where(q_lens > 1, q_lens, 0)
    blocks = _cdiv(q_lens, block_q)
    ends = jnp.cumsum(blocks)
    prog = jnp.arange(num_programs, dtype=jnp.int32)
    # compare_all: one fused comparison, where the default search is a loop of launches.
    req = jnp.searchsorted(ends, prog, side="right", method="compare_all")
    req = jnp.minimum(req, num_reqs - 1).astype(jnp.int32)
    valid = prog < ends[-1]
    q_start = query_start_loc[req] + (prog - (ends[req] - blocks[req])) * block_q
    q_end = jnp.minimum(q_start + block_q, query_start_loc[req] + q_lens[req])
    offset = seq_lens[req] - query_start_loc[req + 1]
    zero = jnp.zeros_like(prog)
    meta = [req, jnp.where(valid, q_start, zero), jnp.where(valid, q_end, zero),
            jnp.where(valid, offset, zero)]
    return jnp.stack(meta, axis=1).astype(jnp.int32)


def combine_splits(o_parts, lse_parts, dtype):
    """Merges split-K partials. o_parts [num_splits, T, H, D] f32, each normalized
    over its own KV piece; lse_parts [num_splits, T, H] log2-sum-exp2 of each piece."""
    lse_max = lse_parts.max(axis=0)
    w = jnp.exp2(lse_parts - lse_max[None])
    out = (w[..., None] * o_parts).sum(axis=0) / w.sum(axis=0)[..., None]
    return out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: which requests it serves and its static shape."""
    only: str | None  # None (all requests), "decode" or "prefill": see `schedule`
    block_m: int      # q rows a program: block_m // group_pad tokens x group_pad heads
    tile: int         # KV tokens a loop step
    num_splits: int   # split-K pieces
    num_warps: int
    num_stages: int
    head_major: bool = False  # grid (kv_heads, programs, splits): a request's KV heads run together
    prefetch: bool = False    # each loop step loads the next tile's page ids, for the next step


def plan(num_tokens, max_num_reqs, num_q_heads, num_kv_heads, head_dim, itemsize,
         cache_itemsize=None, **override):
    """The launches for static input shapes. A decode-only bucket (no more tokens
    than request slots) takes one launch of 16-row q blocks, split-K when the
    requests are too few to fill the GPU. A bucket with prefill chunks takes two:
    the one-token requests as above, then the longer ones with large q blocks, so
    that K/V tiles are shared by many rows. `override` (non-None Launch fields)
    forces a single launch of that shape over every request (head_major and prefetch
    apply to both launches). The decode launch runs head-major with its page ids
    prefetched (3-10% at batch 64-256 on the H200). cache_itemsize: the KV cache's
    (None: itemsize); over an 8-bit cache the decode launch takes KV tiles of up to 128
    tokens (`jaxllm bench kv-dtype` has both sweeps). The jax-triton backend shares the
    shapes only: it passes no cache_itemsize and ignores head_major and prefetch."""
    group_pad = _next_pow2(num_q_heads // num_kv_heads)
    # K/V tiles of 16 KiB and q tiles of 32 KiB keep 3 pipeline stages in shared memory.
    tile = max(16, min(64, 16384 // (head_dim * itemsize)))
    prefill_m = max(group_pad, min(128, 32768 // (head_dim * itemsize)))
    num_splits = min(_MAX_SPLITS, max(1, _target_programs() // (max_num_reqs * num_kv_heads)))
    num_splits = 1 << (num_splits.bit_length() - 1)  # a power of two, rounded down
    decode = Launch(None, max(16, group_pad), tile, num_splits, 4, 3, head_major=True, prefetch=True)
    if cache_itemsize == 1:
        decode = dataclasses.replace(decode, tile=max(16, min(128, 16384 // head_dim)))
    prefill = Launch("prefill", prefill_m, tile, 1, 8, 3)
    override = {k: v for k, v in override.items() if v is not None}
    flags = {k: override.pop(k) for k in ("head_major", "prefetch") if k in override}
    decode, prefill = (dataclasses.replace(x, **flags) for x in (decode, prefill))
    if set(override) - {"num_splits"}:
        base = decode if num_tokens <= max_num_reqs else dataclasses.replace(prefill, only=None)
        base = dataclasses.replace(base, **override)
        if "num_warps" not in override:
            base = dataclasses.replace(base, num_warps=8 if base.block_m >= 128 else 4)
        return [base]
    decode = dataclasses.replace(decode, **override)
    if num_tokens <= max_num_reqs:
        return [decode]
    # Beside prefill chunks, merging splits would read num_splits x num_tokens rows.
    return [dataclasses.replace(decode, only="decode", num_splits=override.get("num_splits", 1)),
            prefill]


def _attention_kernel(meta_ref, q_ref, k_ref, v_ref, tables_ref, *out_refs, scale,
                      sliding_window, soft_cap, group, group_pad, block_q, tile,
                      block_size, num_splits, aliased, precision, head_major, prefetch):
    num_tokens, _, head_dim = q_ref.shape
    prog, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if head_major:
        prog, kv_head = kv_head, prog
    req, q_start, q_end, offset = (meta_ref[prog, i] for i in range(4))
    out_refs = out_refs[1:] if aliased else out_refs  # skip the aliased input

    rows = jnp.arange(block_q * group_pad)
    g = rows % group_pad
    token = q_start + rows // group_pad
    row_ok = (token < q_end) & (g < group)
    pos = (token + offset)[:, None]  # [block_m, 1]
    # Masked rows point past the end, so the interpreter's scatter drops them.
    token_1d = jnp.where(row_ok, token, num_tokens)
    head_1d = kv_head * group + g
    token, head = token_1d[:, None], head_1d[:, None]
    dims = jnp.arange(head_dim)[None, :]
    q = plgpu.load(q_ref.at[token, head, dims], mask=row_ok[:, None], other=0)
    # An 8-bit cache is widened after the load, to q's dtype, or to float16 beside a bfloat16 q:
    # e4m3/e5m2 -> float16 is one conversion on Hopper, to bfloat16 several (1.35x decode on the
    # H200). q is scaled first, which keeps it far inside float16's range.
    prescaled = k_ref.dtype.itemsize == 1 and q.dtype == jnp.bfloat16
    if prescaled:
        q = (q.astype(jnp.float32) * scale).astype(jnp.float16)

    kv_end = q_end + offset  # one past the last position this block attends to
    kv_start = 0
    if sliding_window is not None:
        kv_start = jnp.maximum(q_start + offset - sliding_window + 1, 0)
    first, last = kv_start // tile, _cdiv(kv_end, tile)
    per_split = _cdiv(last - first, num_splits)
    lo = first + split * per_split
    hi = jnp.minimum(lo + per_split, last)
    # Tiles before `mid` are visible to every row: they skip the masks.
    mid = lo if sliding_window is not None else (q_start + offset + 1) // tile

    def pages_of(t, masked=True):
        """The cache block of each of tile t's positions, [tile, 1] (0 past the context)."""
        kpos = t * tile + jnp.arange(tile)
        kv_ok, other = ((kpos < kv_end)[:, None], 0) if masked else (None, None)
        return plgpu.load(tables_ref.at[req, (kpos // block_size)[:, None]], mask=kv_ok, other=other)

    def body(t, carry, masked):
        m, l, acc, *page = carry
        # With prefetch, tile t's page ids came from the step before, and this step loads the
        # next tile's: the K/V gathers below never wait on a load of their own step.
        page, next_page = (page[0], pages_of(t + 1)) if prefetch else (pages_of(t, masked), None)
        kpos = t * tile + jnp.arange(tile)
        # Masked tiles may run past the context: their loads are masked too. A float fill: the
        # lowering casts an int one to the cache's dtype, which fails for 8 bits.
        kv_ok, kv_other = ((kpos < kv_end)[:, None], 0.0) if masked else (None, None)
        slot = page * block_size + (kpos % block_size)[:, None]  # [tile, 1]
        # Widened to q's dtype after the load (see above): an 8-bit cache reads half the bytes.
        k = plgpu.load(k_ref.at[slot, kv_head, dims], mask=kv_ok, other=kv_other).astype(q.dtype)
        v = plgpu.load(v_ref.at[slot, kv_head, dims], mask=kv_ok, other=kv_other).astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True, precision=precision)  # [block_m, tile] f32
        if not prescaled:
            s = s * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = s * _LOG2E
        if masked:
            mask = kpos[None, :] <= pos
            if sliding_window is not None:
                mask &= kpos[None, :] > pos - sliding_window
            s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return (m_new, l, acc, next_page) if prefetch else (m_new, l, acc)

    block_m = rows.shape[0]
    carry = (jnp.full((block_m,), _MASKED, jnp.float32), jnp.zeros((block_m,), jnp.float32),
             jnp.zeros((block_m, head_dim), jnp.float32))
    if prefetch:
        carry = (*carry, pages_of(lo))
    mid = jnp.clip(mid, lo, hi)
    carry = jax.lax.fori_loop(lo, mid, functools.partial(body, masked=False), carry)
    m, l, acc, *_ = jax.lax.fori_loop(mid, hi, functools.partial(body, masked=True), carry)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[token, head, dims], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        o_ref, lse_ref = out_refs
        lse = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), _MASKED)
        plgpu.store(o_ref.at[split, token, head, dims], out, mask=row_ok[:, None])
        plgpu.store(lse_ref.at[split, token_1d, head_1d], lse, mask=row_ok)


def launch_programs(launch, num_tokens, num_q_heads, num_kv_heads, query_start_loc, seq_lens,
                    num_seqs):
    """What every backend derives from a Launch: q heads per KV head and its power-of-two
    pad, tokens per q block, the number of programs, and their schedule."""
    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    block_q = max(1, launch.block_m // group_pad)
    num_programs = seq_lens.shape[0]
    if launch.only != "decode":
        num_programs += num_tokens // block_q
    meta = schedule(query_start_loc, seq_lens, num_seqs, block_q, num_programs, launch.only)
    return group, group_pad, block_q, num_programs, meta


def _launch(launch, q, k_slots, v_slots, query_start_loc, seq_lens, block_tables, num_seqs,
            out, *, block_size, interpret, **options):
    """One pallas_call for `launch`. When `out` ([num_tokens, q_heads, dim]) is given,
    the call writes its rows into it, in place, and keeps the others."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_slots.shape[1]
    group, group_pad, block_q, num_programs, meta = launch_programs(
        launch, num_tokens, num_q_heads, num_kv_heads, query_start_loc, seq_lens, num_seqs)
    splits = launch.num_splits
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
                     jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), jnp.float32)]
    aliased = out is not None  # an earlier launch wrote the other requests' rows
    assert not (aliased and splits > 1), "only a first launch may split"
    kernel = functools.partial(
        _attention_kernel, group=group, group_pad=group_pad, block_q=block_q,
        tile=launch.tile, block_size=block_size, num_splits=splits, aliased=aliased,
        head_major=launch.head_major, prefetch=launch.prefetch,
        precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None, **options)
    grid = (num_kv_heads, num_programs, splits) if launch.head_major else (num_programs, num_kv_heads, splits)
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        input_output_aliases={5: 0} if aliased else {},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps,
                                             num_stages=launch.num_stages),
        name="ragged_paged_attention",
    )(meta, q, k_slots, v_slots, block_tables, *([out] if aliased else []))
    if splits == 1:
        return outs[0]
    return combine_splits(outs[0], outs[1], q.dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "block_m", "tile", "num_splits", "num_warps",
    "num_stages", "head_major", "prefetch", "interpret"))
def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                    *, scale, sliding_window=None, soft_cap=None, block_m=None, tile=None,
                    num_splits=None, num_warps=None, num_stages=None, head_major=None,
                    prefetch=None, interpret=False):
    """`ragged_paged_attention` with the launch shape exposed (None: `plan` decides).

    q [num_tokens, num_q_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; query_start_loc [max_num_reqs + 1]; seq_lens
    [max_num_reqs]; block_tables [max_num_reqs, max_blocks_per_seq]; num_seqs [1].
    Returns [num_tokens, num_q_heads, head_dim] in q's dtype; rows of padding tokens
    are left unspecified.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    launches = plan(num_tokens, seq_lens.shape[0], num_q_heads, k_cache.shape[2], head_dim,
                    q.dtype.itemsize, k_cache.dtype.itemsize, block_m=block_m, tile=tile,
                    num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                    head_major=head_major, prefetch=prefetch)
    return _run(launches, None, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                num_seqs, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                interpret=interpret)


def _run(launches, out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
         *, scale, sliding_window, soft_cap, interpret):
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    # A flat [slot, kv_head, head_dim] view: a slot is block * block_size + offset.
    k_slots = k_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    v_slots = v_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    for launch in launches:
        out = _launch(launch, q, k_slots, v_slots, query_start_loc, seq_lens, block_tables,
                      num_seqs, out, block_size=block_size, interpret=interpret,
                      scale=float(scale), sliding_window=sliding_window,
                      soft_cap=None if soft_cap is None else float(soft_cap))
    return out


def decode_into(out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                *, scale, sliding_window=None, soft_cap=None, interpret=False):
    """Attention of the requests with one new token, written into `out` ([num_tokens,
    q_heads, dim], from another kernel that served the others) in place."""
    num_tokens, num_q_heads, head_dim = q.shape
    [launch, *_] = plan(num_tokens, seq_lens.shape[0], num_q_heads, k_cache.shape[2],
                        head_dim, q.dtype.itemsize, k_cache.dtype.itemsize)
    launch = dataclasses.replace(launch, only="decode", num_splits=1)
    return _run([launch], out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                num_seqs, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                interpret=interpret)


def ragged_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                           num_seqs, *, scale, sliding_window=None, soft_cap=None):
    """The Pallas backend (see reference.ragged_paged_attention). Off GPU it runs in
    the Pallas interpreter: correct, but slow."""
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                           num_seqs, scale=scale, sliding_window=sliding_window,
                           soft_cap=soft_cap, interpret=jax.default_backend() != "gpu")
