"""W4A16 matmul: activations in 16 bits (or float32) times 4-bit integer weights with a scale
and a zero point per group of G input rows (AWQ and GPTQ checkpoints, models/int4.py).

    y [M, N] = x [M, K] @ w [K, N],   w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]

The weights stay 4-bit on the device, in the layout models/int4.py prepares at load:

    w_packed [K // 2, N] uint8   two weights a byte, along K, in halves of each group: byte row r
                                 of group g holds row g*G + r in its low nibble and row
                                 g*G + G/2 + r in its high nibble
    scales   [K // G, N]          float (the model's dtype)
    zeros    [K // G, N] uint8    0..16 (GPTQ's stored zero + 1)

G is 32, 64 or 128 (models/quant_config.py): half a group must make a dot at least 16 deep.
Halves, not neighbours: a byte tile unpacks into two [G/2, BN] halves, each the weights of a
contiguous half of the group's x columns, so the kernel never interleaves registers.

`pallas_matmul`: grid (M / block_m, N / block_n); each program walks K one group at a time,
unpacks its [G/2, block_n] bytes in registers, dequantizes them into x's dtype (bf16 on the
GPU: tensor-core math) and accumulates two dots in float32. `reference_matmul` dequantizes
the whole weight and calls one dot: the oracle, and what runs off the GPU.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.tiling import check_tiles, divisor, pad_rows

@dataclasses.dataclass(frozen=True)
class W4A16Tiles:
    """One launch: [block_m, block_n] output tiles, num_warps and num_stages (the software
    pipeline's depth over the groups). Not yet measured on a GPU: `tiles` gives untuned values."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_tiles(self, ("block_m", "block_n"))


def tiles(m: int, n: int) -> W4A16Tiles:
    """The tiles of an [m, K] x [K, n] product. Untuned: decode (m <= 16) takes narrow column
    stripes so the weight streams over many programs; larger m wider, taller tiles."""
    if m <= 16:
        return W4A16Tiles(16, divisor(n, (64, 32, 16)))
    if m <= 64:
        return W4A16Tiles(32 if m <= 32 else 64, divisor(n, (128, 64, 32, 16)))
    return W4A16Tiles(128, divisor(n, (128, 64, 32, 16)), num_warps=8)


def dequantize(w_packed, scales, zeros):
    """[K // 2, N] uint8, [K // G, N], [K // G, N] uint8 -> w [K, N] float32."""
    num_groups, n = scales.shape
    half = w_packed.shape[0] // num_groups
    packed = w_packed.astype(jnp.int32).reshape(num_groups, 1, half, n)
    q = jnp.concatenate([packed & 0xF, packed >> 4], axis=1)  # [groups, 2 halves, G/2, N]
    w = (q - zeros.astype(jnp.int32)[:, None, None]).astype(jnp.float32) * scales.astype(jnp.float32)[:, None, None]
    return w.reshape(-1, n)


def reference_matmul(x, w_packed, scales, zeros):
    """x [M, K] @ the dequantized weight -> [M, N] in x's dtype (float32 accumulation)."""
    w = dequantize(w_packed, scales, zeros).astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(x_ref, w_ref, s_ref, z_ref, o_ref, *, half: int, num_groups: int):
    # x_ref [block_m, K]; w_ref [K // 2, block_n] uint8; s_ref, z_ref [K // G, block_n]; o_ref [block_m, block_n]
    def body(g, acc):
        packed = w_ref[pl.ds(g * half, half), :].astype(jnp.int32)  # [G/2, block_n]
        scale = s_ref[pl.ds(g, 1), :].astype(jnp.float32)  # [1, block_n]
        zero = z_ref[pl.ds(g, 1), :].astype(jnp.int32)
        x_lo = x_ref[:, pl.ds(g * 2 * half, half)]
        x_hi = x_ref[:, pl.ds(g * 2 * half + half, half)]
        w_lo = ((packed & 0xF) - zero).astype(jnp.float32) * scale
        w_hi = ((packed >> 4) - zero).astype(jnp.float32) * scale
        acc += jnp.dot(x_lo, w_lo.astype(x_lo.dtype), preferred_element_type=jnp.float32)
        return acc + jnp.dot(x_hi, w_hi.astype(x_hi.dtype), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, num_groups, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def pallas_matmul(x, w_packed, scales, zeros, t: W4A16Tiles, *, interpret: bool = False):
    """x [M, K] @ w -> [M, N] in x's dtype, launched with the tiles t (N a multiple of block_n)."""
    m, k = x.shape
    num_groups, n = scales.shape
    if n % t.block_n:
        raise ValueError(f"W4A16Tiles.block_n={t.block_n} must divide the weight's {n} columns")
    xp = pad_rows(x, t.block_m)
    out = pl.pallas_call(
        functools.partial(_kernel, half=k // num_groups // 2, num_groups=num_groups),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), x.dtype),
        grid=(xp.shape[0] // t.block_m, n // t.block_n),
        in_specs=[pl.BlockSpec((t.block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k // 2, t.block_n), lambda i, j: (0, j)),
                  pl.BlockSpec((num_groups, t.block_n), lambda i, j: (0, j)),
                  pl.BlockSpec((num_groups, t.block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((t.block_m, t.block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
    )(xp, w_packed, scales, zeros)
    return out[:m]


def matmul(x, w_packed, scales, zeros):
    """x [M, K] @ w -> [M, N] in x's dtype: the Pallas kernel on a GPU, the reference elsewhere
    (the interpreter would run every program of every layer one by one on a CPU)."""
    if jax.default_backend() != "gpu":
        return reference_matmul(x, w_packed, scales, zeros)
    return pallas_matmul(x, w_packed, scales, zeros, tiles(x.shape[0], scales.shape[1]))
