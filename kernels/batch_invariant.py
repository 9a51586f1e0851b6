"""Batch-invariant forms of the ops whose numbers would otherwise depend on the batch
(EngineArgs.batch_invariant): with them a request's logits are the same bits whatever else
shares its step and wherever it sits in it.

XLA picks a matmul's algorithm, and a row reduction's tiling, from the whole operand's shape,
so a row's sum runs in another order in a bucket of 16 tokens than in one of 256 (measured on
CPU: RMSNorm and the attention einsums move a request's hidden states by ~1e-6; on GPU the
GEMMs' split and tile choices do the same). Here each output element is reduced in one fixed
order whatever the batch:

- matmul(x, w): a Pallas kernel over [BM, BN] output tiles, K walked in BK chunks with a
  float32 accumulator and never split; BK depends only on the weight's shape, the tiles
  (`tiles`) on the number of rows (they do not change the order of summation).
- rms_normalize(x, eps): a Pallas kernel over row blocks ([BR, D] on CPU, one row on a GPU).
- log_softmax(x): in blocks of BR rows.
- attention: the reference in blocks of BR tokens (CPU), or the Pallas kernel in one launch shape
  for every bucket, with no split-K (GPU).

Both kernels have a custom VJP through plain jnp, so the forward a trainer differentiates can
use them. The model's Linear and RMSNorm take these forms while `enabled()` (the runner traces
its executables inside `tracing()`).

Under tensor parallelism (`tracing(mesh=...)` with several devices on "model") a Pallas call is
one custom call XLA cannot split, and a cross-device sum would run in the order of the
collective's algorithm, which on a GPU (NCCL) may follow the message's size, i.e. the bucket. So
each device runs the kernels on its own shards (jaxllm.sharding.per_device_linear), partial
sums are gathered and added in device order (jaxllm.sharding.sum_in_device_order), never
all-reduced, and a reduction over the vocabulary (log_softmax, the sampler's softmax) runs
whole on each device (`on_every_device`) after its logits are gathered.
"""
import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec

from jaxllm.kernels import reference
from jaxllm.kernels.tiling import divisor, pad_rows

_ENABLED = contextvars.ContextVar("batch_invariant", default=False)
_MESH = contextvars.ContextVar("batch_invariant_mesh", default=None)
ROW_BLOCK = 16  # BR: rows per RMSNorm block and tokens per attention block


def enabled() -> bool:
    return _ENABLED.get()


def tensor_parallel_mesh():
    """The mesh `tracing` was given, while the batch-invariant ops are on and its "model" axis
    spans several devices (else None: the ops run as on one device)."""
    mesh = _MESH.get()
    return mesh if enabled() and mesh is not None and mesh.shape["model"] > 1 else None


@contextlib.contextmanager
def tracing(on: bool = True, mesh=None):
    """Trace the model with the batch-invariant ops (or, with on=False, without); mesh: the
    ("data", "model") mesh its params are sharded over, whose devices then run the ops per device."""
    tokens = _ENABLED.set(on), _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(tokens[1])
        _ENABLED.reset(tokens[0])


def on_every_device(fn):
    """fn(*arrays) run whole on every device of the tensor-parallel mesh (its inputs gathered first,
    an all-gather, exact): XLA cannot split its reductions across devices. Without one, fn."""
    mesh = tensor_parallel_mesh()
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False)


def with_plain_gradient(fn, plain):
    """fn(*args) in the forward, the gradient of plain(*args) (the same function in plain JAX, which
    XLA partitions itself) in the backward."""
    @jax.custom_vjp
    def call(*args):
        return fn(*args)

    def forward(*args):
        return fn(*args), args

    def backward(args, g):
        return jax.vjp(plain, *args)[1](g)

    call.defvjp(forward, backward)
    return call


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


BLOCK_K = 64  # K is walked in BK chunks, never split: each element's sum runs in one order


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
    """One launch of the matmul: [block_m, block_n] output tiles, num_warps and num_stages
    (the software pipeline's depth). The tiles do not change an element's order of summation
    as long as each runs on wgmma (64 rows or more): on the H200, float32 results are the same
    bits for block_m 64 to 256, block_n 16 to 256, 4 or 8 warps and 3 to 6 stages (and for Mosaic
    GPU's wgmma matmul) at the 8B shape's GEMMs; only a split of K changes them (XLA's dot splits K
    at 256 rows or fewer). Tiles of 16 rows (mma.sync) agreed on random data but moved a logprob by
    one ulp in the engine's check of a request alone and among 255 others, so `tiles` keeps 64."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 8 or value & (value - 1):
                raise ValueError(f"MatmulTiles.{name} must be a power of two >= 8, got {value}")
        if self.num_warps not in (2, 4, 8) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"MatmulTiles: num_warps in 2, 4, 8 and num_stages in 1..8, got {self}")


def tiles(m: int, n: int) -> MatmulTiles:
    """The tiles of an [m, K] @ [K, n] matmul, measured best on the H200 at the 8B's shapes (jaxllm
    bench invariant-matmul): up to 64 rows the weight streams once, in narrow stripes so that
    N = 4096 still gives 128 programs; wider tiles as the rows grow and the matmul turns compute-bound.
    Never fewer than 64 rows a tile (MatmulTiles says why)."""
    if _interpret():
        return MatmulTiles(16, divisor(n), 4, 3)
    if m <= 64:
        return MatmulTiles(64, divisor(n, (32, 16, 8) if n <= 4096 else (64, 32, 16, 8)), 4, 6)
    if m <= 256 and n <= 8192:
        return MatmulTiles(64, divisor(n, (128, 64, 32, 16, 8)), 4, 6)
    return MatmulTiles(128, divisor(n, (256, 128, 64, 32, 16, 8)), 8, 3)


# ---- matmul ----

def _matmul_kernel(x_ref, w_ref, o_ref, *, t: MatmulTiles, block_k: int, num_k: int):
    # Whole refs: the program's [block_m, block_n] tile at (i, j). Where the rows are fewer than a tile
    # (a bucket of 16 or 32 tokens against 64-row tiles) the missing rows load as zeros and store
    # nowhere: no padded copy of x, and no read of its padding by every program.
    i, j = pl.program_id(0), pl.program_id(1)
    rows, columns = pl.ds(i * t.block_m, t.block_m), pl.ds(j * t.block_n, t.block_n)
    num_rows = x_ref.shape[0]
    real = None
    if num_rows % t.block_m:
        real = i * t.block_m + jax.lax.broadcasted_iota(jnp.int32, (t.block_m, 1), 0) < num_rows

    def body(k, acc):
        x = plgpu.load(x_ref.at[rows, pl.ds(k * block_k, block_k)], mask=real, other=None if real is None else 0)
        w = w_ref[pl.ds(k * block_k, block_k), columns]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros((t.block_m, t.block_n), jnp.float32))
    plgpu.store(o_ref.at[rows, columns], acc.astype(o_ref.dtype), mask=real)


def pallas_matmul(x, w, t: MatmulTiles, out_dtype):
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype, launched with the tiles t (matmul picks them)."""
    m, k = x.shape
    n = w.shape[1]
    bk = divisor(k, (BLOCK_K, 32, 16, 8))
    return pl.pallas_call(
        functools.partial(_matmul_kernel, t=t, block_k=bk, num_k=k // bk),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(m, t.block_m), n // t.block_n),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=_interpret(),
    )(x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x, w, out_dtype=None):
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x's), each element summed over K in
    the same order whatever M is."""
    return pallas_matmul(x, w, tiles(x.shape[0], w.shape[1]), out_dtype or x.dtype)


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
    rows = pad_rows(x.reshape(-1, shape[-1]), block)
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


def _log_softmax_blocks(x):
    n = x.shape[0]
    blocks = pad_rows(x, ROW_BLOCK).reshape(-1, ROW_BLOCK, x.shape[-1])
    return jax.lax.map(lambda b: jax.nn.log_softmax(b, axis=-1), blocks).reshape(-1, x.shape[-1])[:n]


def log_softmax(x):
    """jax.nn.log_softmax over the last axis of x [N, V], in blocks of ROW_BLOCK rows; under tensor
    parallelism whole on every device (logits split over the vocabulary are gathered first)."""
    if tensor_parallel_mesh() is None:
        return _log_softmax_blocks(x)
    return with_plain_gradient(on_every_device(_log_softmax_blocks), lambda a: jax.nn.log_softmax(a, axis=-1))(x)


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

    blocks = [pad_rows(a, ROW_BLOCK) for a in (q, block_tables[req], pos, valid)]
    blocks = [a.reshape(-1, ROW_BLOCK, *a.shape[1:]) for a in blocks]
    out = jax.lax.map(block, tuple(blocks))
    return out.reshape(-1, *q.shape[1:])[:num_tokens]


def with_reference_gradient(attention):
    """`attention` (pallas_attention) in the forward and reference_attention's gradient (every block
    walked) in the backward: a forward a trainer differentiates whose numbers are bitwise the engine's
    kernel's, as the matmul and the RMSNorm above are."""
    def call(*args, **options):
        plain = functools.partial(reference_attention, every_block=True, **options)
        return with_plain_gradient(functools.partial(attention, **options), plain)(*args)
    return call
