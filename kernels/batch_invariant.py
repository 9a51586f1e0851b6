"""Batch-invariant forms of the ops whose numbers would otherwise depend on the batch
(EngineArgs.batch_invariant): with them a request's logits are the same bits whatever else
shares its step and wherever it sits in it.

XLA picks a matmul's algorithm, and a row reduction's tiling, from the whole operand's shape,
so a row's sum runs in another order in a bucket of 16 tokens than in one of 256 (measured on
CPU: RMSNorm and the attention einsums move a request's hidden states by ~1e-6; on GPU the
GEMMs' split and tile choices do the same). Here the work is cut into tiles of one fixed shape
for every batch, and each output element is reduced in one fixed order:

- matmul(x, w): a Pallas kernel over [BM, BN] output tiles, K walked in BK chunks with a
  float32 accumulator; BN and BK depend only on the weight's shape, BM on the platform.
- rms_normalize(x, eps): a Pallas kernel over [BR, D] row blocks.
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


def _block_m() -> int:
    # Hopper's wgmma takes 64 rows: one instruction shape for every bucket.
    return 16 if _interpret() else 64


def _divisor(n: int, choices=(64, 32, 16, 8)) -> int:
    """The largest of `choices` that divides n. BN of 64: at decode's few rows the grid is
    N / BN programs, and fewer than the SMs leave bandwidth unused."""
    return next((c for c in choices if n % c == 0), 1)


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
    bm, bn, bk = _block_m(), _divisor(n), _divisor(k, (64, 32, 16, 8))
    xp = _pad_rows(x, bm)
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, block_k=bk, num_k=k // bk),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), out_dtype),
        grid=(xp.shape[0] // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
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
    """x [..., D] float32 -> x / rms(x) over the last axis, in [BR, D] row blocks."""
    shape = x.shape
    rows = _pad_rows(x.reshape(-1, shape[-1]), ROW_BLOCK)
    out = pl.pallas_call(
        functools.partial(_rms_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(rows.shape, jnp.float32),
        grid=(rows.shape[0] // ROW_BLOCK,),
        in_specs=[pl.BlockSpec((ROW_BLOCK, shape[-1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((ROW_BLOCK, shape[-1]), lambda i: (i, 0)),
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
