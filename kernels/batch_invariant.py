"""Batch-invariant forms of the ops whose numbers would otherwise depend on the batch
(EngineArgs.batch_invariant): with them a request's logits are the same bits whatever else
shares its step and wherever it sits in it.

XLA picks a matmul's algorithm, and a row reduction's tiling, from the whole operand's shape,
so a row's sum runs in another order in a bucket of 16 tokens than in one of 256 (measured on
CPU: RMSNorm and the attention einsums move a request's hidden states by ~1e-6; on GPU the
GEMMs' split and tile choices do the same). Here each output element is reduced in one fixed
order whatever the batch:

- matmul(x, w): a Pallas kernel over [BM, BN] output tiles, K walked in BK chunks with a
  float32 accumulator and never split; BK depends only on the weight's shape, the tiles on
  the number of rows (they do not change the order of summation).
- rms_normalize(x, eps): a Pallas kernel over row blocks ([BR, D] on CPU, one row on a GPU).
- log_softmax(x): in blocks of BR rows.
- attention: the reference in blocks of BR tokens (CPU), or the Pallas kernel in one launch shape
  for every bucket, with no split-K (GPU).

Both kernels have a custom VJP through plain jnp, so the forward a trainer differentiates can
use them. The model's Linear and RMSNorm take these forms while `enabled()` (the runner traces
its executables inside `tracing()`).
"""
import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels import reference

_ENABLED = contextvars.ContextVar("batch_invariant", default=False)
ROW_BLOCK = 16  # BR: rows per RMSNorm block and tokens per attention block


def enabled() -> bool:
    return _ENABLED.get()


@contextlib.contextmanager
def tracing(on: bool = True):
    """Trace the model with the batch-invariant ops (or, with on=False, without)."""
    token = _ENABLED.set(on)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _divisor(n: int, choices=(64, 32, 16, 8)) -> int:
    """The largest of `choices` that divides n."""
    return next((c for c in choices if n % c == 0), 1)


BLOCK_K = 64  # with no split of K, the one thing that fixes each element's order of summation


def _tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) for an [m, K] @ [K, n] matmul. Only BK and the absence of
    a split fix an element's order of summation: on the H200 the bits are the same for BM 64 or
    128 and BN 32 to 256 (measured with bf16 on the 8B shape's four GEMMs), so the tiles may
    follow m. A few rows stream the weight in 64-wide stripes (N / 64 programs keep the SMs
    reading); many rows take wide tiles to reuse what they load."""
    if _interpret():
        return 16, _divisor(n), 4, 3
    if m <= 128:
        return 64, _divisor(n), 4, 4
    if m <= 512:
        return 128, _divisor(n, (128, 64, 32, 16, 8)), 8, 3
    return 128, _divisor(n, (256, 128, 64, 32, 16, 8)), 8, 3


def _pad_rows(x, multiple: int):
    pad = (-x.shape[0]) % multiple
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x


# ---- matmul ----

def _matmul_kernel(x_ref, w_ref, o_ref, *, block_k: int, num_k: int):
    def body(k, acc):
        x = x_ref[:, pl.ds(k * block_k, block_k)]
        w = w_ref[pl.ds(k * block_k, block_k), :]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _matmul_fwd_impl(x, w, out_dtype):
    m, k = x.shape
    n = w.shape[1]
    bm, bn, num_warps, num_stages = _tiles(m, n)
    bk = _divisor(k, (BLOCK_K, 32, 16, 8))
    xp = _pad_rows(x, bm)
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, block_k=bk, num_k=k // bk),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), out_dtype),
        grid=(xp.shape[0] // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=_interpret(),
    )(xp, w)
    return out[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x, w, out_dtype=None):
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x's), each element summed over K in
    the same order whatever M is."""
    return _matmul_fwd_impl(x, w, out_dtype or x.dtype)


def _matmul_fwd(x, w, out_dtype):
    return matmul(x, w, out_dtype), (x, w)


def _matmul_bwd(out_dtype, residuals, g):
    x, w = residuals
    g = g.astype(jnp.float32)
    return ((g @ w.astype(jnp.float32).T).astype(x.dtype), (x.astype(jnp.float32).T @ g).astype(w.dtype))


matmul.defvjp(_matmul_fwd, _matmul_bwd)


# ---- RMSNorm ----

def _rms_kernel(x_ref, o_ref, *, eps: float):
    x = x_ref[...]
    o_ref[...] = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _rms_reference(x, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rms_normalize(x, eps: float):
    """x [..., D] float32 -> x / rms(x) over the last axis, in row blocks (BR rows on CPU, one on a GPU)."""
    shape = x.shape
    # On a GPU one row per program: a [16, 4096] float32 block spills registers (61 us per call
    # at batch 1 on the H200, 1.8 us for one row a program).
    block = ROW_BLOCK if _interpret() else 1
    rows = _pad_rows(x.reshape(-1, shape[-1]), block)
    out = pl.pallas_call(
        functools.partial(_rms_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(rows.shape, jnp.float32),
        grid=(rows.shape[0] // block,),
        in_specs=[pl.BlockSpec((block, shape[-1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((block, shape[-1]), lambda i: (i, 0)),
        interpret=_interpret(),
    )(rows)
    return out[:x.size // shape[-1]].reshape(shape)


def _rms_fwd(x, eps):
    return rms_normalize(x, eps), x


def _rms_bwd(eps, x, g):
    return (jax.vjp(lambda a: _rms_reference(a, eps), x)[1](g)[0],)


rms_normalize.defvjp(_rms_fwd, _rms_bwd)


def log_softmax(x):
    """jax.nn.log_softmax over the last axis of x [N, V], in blocks of ROW_BLOCK rows."""
    n = x.shape[0]
    blocks = _pad_rows(x, ROW_BLOCK).reshape(-1, ROW_BLOCK, x.shape[-1])
    return jax.lax.map(lambda b: jax.nn.log_softmax(b, axis=-1), blocks).reshape(-1, x.shape[-1])[:n]


# ---- attention ----

def pallas_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs, *, scale,
                     sliding_window=None, soft_cap=None):
    """The Pallas kernel in one launch shape for every bucket and every token, prefill or decode
    (its plan would pick the shape, and split-K, from the bucket): 16-row q blocks, 16 KiB K/V
    tiles, no split."""
    from jaxllm.kernels import pallas_attention as kernel
    head_dim, group = q.shape[-1], q.shape[1] // k_cache.shape[2]
    tile = max(16, min(64, 16384 // (head_dim * k_cache.dtype.itemsize)))
    return kernel.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                                  scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                  block_m=max(16, 1 << max(0, (group - 1).bit_length())), tile=tile, num_splits=1,
                                  num_warps=4, num_stages=3, head_major=True, prefetch=True,
                                  interpret=_interpret())


def reference_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs, *, scale,
                        sliding_window=None, soft_cap=None, every_block=False):
    """reference.ragged_paged_attention over blocks of ROW_BLOCK tokens, one at a time (the
    signature of every backend): each block's einsums have one shape whatever the batch."""
    num_tokens = q.shape[0]
    req, pos, valid = reference.token_positions(query_start_loc, seq_lens, num_seqs, num_tokens)

    def block(args):
        qb, tables, pb, vb = args
        return reference.attend(qb, k_cache, v_cache, tables, pb, vb, scale=scale, sliding_window=sliding_window,
                                soft_cap=soft_cap, every_block=every_block)

    blocks = [_pad_rows(a, ROW_BLOCK) for a in (q, block_tables[req], pos, valid)]
    blocks = [a.reshape(-1, ROW_BLOCK, *a.shape[1:]) for a in blocks]
    out = jax.lax.map(block, tuple(blocks))
    return out.reshape(-1, *q.shape[1:])[:num_tokens]
