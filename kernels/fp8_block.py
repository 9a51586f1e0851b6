"""Block-scaled FP8 matmul: e4m3 weights with one float32 scale per [bn, bk] block (DeepSeek's and
Qwen's 128 x 128), e4m3 activations with one scale per token and bk columns (models/fp8.py).

    y [M, N] = sum over K blocks b of (x8[:, b] . w8[:, b]^T) * x_scale[:, b] * w_scale[n // bn, b]

    x8 [M, K] e4m3, x_scale [M, K // bk] float32, w8 [N, K] e4m3 (the checkpoint's layout, the
    in axis contiguous), w_scale [N // bn, K // bk] float32

Each block's product is exact in float32 (e4m3 products are), so the kernel and the reference
differ only in the order of float32 sums. Why a kernel and not XLA: the scales change inside the
K reduction, so one dot_general cannot carry them; the exact XLA form (a batched dot per K block,
then a scaled sum) writes a float32 [K // bk, M, N] intermediate, 32x the output at K = 4096.

`pallas_matmul`: grid (M / block_m, N / block_n), block_n dividing bn so that a program's columns
share one row of w_scale; each program walks K one block of bk at a time, one dot per block
(on e4m3 operands, or widened to bf16 in registers: `Fp8BlockTiles.mma`), scales the float32
partial product and accumulates it.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.tiling import check_tiles, divisor, pad_rows

_MMA_DTYPES = {"e4m3": None, "bfloat16": jnp.bfloat16}  # None: the e4m3 operands as they are


@dataclasses.dataclass(frozen=True)
class Fp8BlockTiles:
    """One launch: [block_m, block_n] output tiles (block_n divides the scale block's bn),
    num_warps, num_stages, and the dot's operand type: "bfloat16" widens the e4m3 tiles in
    registers (exact; bf16 tensor cores, Ampere on), "e4m3" hands them to FP8 tensor cores
    (Hopper; 1.5-2.4x faster on the H200 at the 8B's shapes, docs/kernels.md)."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    mma: str = "bfloat16"

    def __post_init__(self):
        check_tiles(self, ("block_m", "block_n"))
        if self.mma not in _MMA_DTYPES:
            raise ValueError(f"Fp8BlockTiles.mma must be one of {tuple(_MMA_DTYPES)}, got {self.mma!r}")


def tiles(m: int, scale_block_n: int) -> Fp8BlockTiles:
    """The tiles of an [m, K] x [K, N] product whose weight scales cover scale_block_n rows, on FP8
    tensor cores. Untuned sizes: decode (m <= 16) takes narrow column stripes so the weight streams
    over many programs."""
    if m <= 16:
        return Fp8BlockTiles(16, divisor(scale_block_n, (64, 32, 16)), mma="e4m3")
    return Fp8BlockTiles(64 if m <= 64 else 128, divisor(scale_block_n, (128, 64, 32, 16)),
                         num_warps=4 if m <= 64 else 8, mma="e4m3")


def dequantize(w8, w_scale):
    """w8 [N, K] e4m3 and w_scale [N // bn, K // bk] -> [N, K] float32."""
    bn, bk = w8.shape[0] // w_scale.shape[0], w8.shape[1] // w_scale.shape[1]
    scale = jnp.repeat(jnp.repeat(w_scale, bn, axis=0), bk, axis=1)
    return w8.astype(jnp.float32) * scale


def reference_matmul(x8, x_scale, w8, w_scale, out_dtype=jnp.float32):
    """Both operands dequantized, one dot: [M, K], [N, K] -> [M, N] in out_dtype."""
    x = dequantize(x8, x_scale)  # a row's groups of bk columns are [1, bk] blocks
    y = jax.lax.dot_general(x, dequantize(w8, w_scale), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def _kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, block_k: int, num_k: int, mma_dtype):
    # x_ref [block_m, K] e4m3; xs_ref [block_m, K // bk]; w_ref [block_n, K] e4m3; ws_ref [1, K // bk]
    def body(b, acc):
        x = x_ref[:, pl.ds(b * block_k, block_k)]
        w = w_ref[:, pl.ds(b * block_k, block_k)]
        if mma_dtype is not None:
            x, w = x.astype(mma_dtype), w.astype(mma_dtype)
        part = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + part * (xs_ref[:, pl.ds(b, 1)] * ws_ref[:, pl.ds(b, 1)])

    acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def pallas_matmul(x8, x_scale, w8, w_scale, t: Fp8BlockTiles, out_dtype=jnp.float32, *, interpret: bool = False):
    """[M, K] x [N, K] -> [M, N] in out_dtype, launched with the tiles t."""
    m, k = x8.shape
    n = w8.shape[0]
    bn, num_k = n // w_scale.shape[0], w_scale.shape[1]
    if bn % t.block_n:
        raise ValueError(f"Fp8BlockTiles.block_n={t.block_n} must divide the scale block's {bn} rows")
    xp, xsp = pad_rows(x8, t.block_m), pad_rows(x_scale, t.block_m)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=k // num_k, num_k=num_k, mma_dtype=_MMA_DTYPES[t.mma]),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), out_dtype),
        grid=(xp.shape[0] // t.block_m, n // t.block_n),
        in_specs=[pl.BlockSpec((t.block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((t.block_m, num_k), lambda i, j: (i, 0)),
                  pl.BlockSpec((t.block_n, k), lambda i, j: (j, 0)),
                  pl.BlockSpec((1, num_k), lambda i, j: (j * t.block_n // bn, 0))],
        out_specs=pl.BlockSpec((t.block_m, t.block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
    )(xp, xsp, w8, w_scale)
    return out[:m]


def matmul(x8, x_scale, w8, w_scale, out_dtype=jnp.float32):
    """[M, K] x [N, K] -> [M, N]: the Pallas kernel on a GPU, the reference elsewhere."""
    if jax.default_backend() != "gpu":
        return reference_matmul(x8, x_scale, w8, w_scale, out_dtype)
    return pallas_matmul(x8, x_scale, w8, w_scale, tiles(x8.shape[0], w8.shape[0] // w_scale.shape[0]), out_dtype)
