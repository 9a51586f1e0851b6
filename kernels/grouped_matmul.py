"""The MoE layer's grouped GEMM as a Pallas kernel: rows [M, K] sorted by group (expert g's being
the group_sizes[g] rows after the groups before it), each times its group's weight [G, K, N].

jax.lax.ragged_dot computes the same, but XLA's GPU lowering of it (this jax) runs every row
through every group's weight and keeps its own: 5 TFLOP/s at Qwen3-30B-A3B's experts on an H100,
a hundredth of a dense dot's rate, and a [G, M, N]-sized buffer that ran DeepSeek-V2-Lite's
16384-token step out of memory. Here the work is only each row times its own group's weight.

The rows are cut in [BM] tiles; a tile may hold rows of several groups, and a group's rows span
several tiles. Each (tile, group) pair that shares rows is one work item: a program per work item
and [BN] output columns multiplies the tile's rows by the group's weight, K walked in BK chunks
with a float32 accumulator, and stores the rows that are the group's (a masked store: each row
belongs to one group, so no two programs write the same row). The rows after the last group are
one more group, whose programs store zeros: every row is written, so the output needs no zeroed
buffer of its own (XLA may hoist such a buffer's fill, making every MoE layer's output live at
once). There are at most cdiv(M, BM) + G work items; the grid has that many, and those past the
real ones return at once. A group with no rows costs nothing, so a decode step reads only the
chosen experts' weights.

mosaic_grouped_matmul computes the same (its rows after the last group not written) with JAX's
Hopper kernel (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu: Mosaic GPU, TMA loads a few K
chunks ahead, wgmma, one persistent program per SM). It takes 16-bit rows and weights only, and
every group, empty or not, may cost a tile of its weight: it is for prefill's many rows, where
every expert has some.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels.tiling import check_tile_sizes, check_tiles, divisor, pad_rows


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """One launch: [block_m, block_n] output tiles, K in block_k chunks (block_n and block_k are
    fitted down to divisors of N and K), num_warps and num_stages."""
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        check_tiles(self, ("block_m", "block_n", "block_k"))


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """A launch of the Mosaic GPU kernel: [block_m, block_n] output tiles, K in block_k chunks
    (both fitted down to divisors of N and K), `steps` chunks loaded ahead, output column tiles walked
    grid_block_n at a time (the order of the persistent loop)."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    steps: int = 4
    grid_block_n: int = 1

    def __post_init__(self):
        check_tile_sizes(self, ("block_m", "block_n", "block_k"))
        if self.steps < 1 or self.grid_block_n < 1:
            raise ValueError(f"MosaicTiles: steps and grid_block_n must be >= 1, got {self}")


INTERPRET_TILES = GroupedTiles(16, 16, 16, 4, 1)  # small tiles: the interpreter runs every program in turn


def work_items(group_sizes, num_rows: int, block_m: int):
    """The (tile, group) pairs that share rows, in order of group, the rows after the last group
    being group G: (tile [W] int32, group [W] int32, -1 past the real ones, group starts [G + 1],
    group ends [G + 1]) for W = cdiv(num_rows, block_m) + G."""
    group_sizes = jnp.append(group_sizes, num_rows - jnp.sum(group_sizes)).astype(jnp.int32)
    num_groups = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // block_m
    count = jnp.where(group_sizes > 0, (ends - 1) // block_m - first + 1, 0)
    # group sizes [3, 0, 4] with 4-row tiles: rows 0-2, 3-6, 7 -> items (tile 0, g 0), (0, 2), (1, 2), (1, 3)
    cumulative = jnp.cumsum(count)
    item = jnp.arange(pl.cdiv(num_rows, block_m) + num_groups - 1, dtype=jnp.int32)
    # searchsorted(cumulative, item, side="right") as one comparison (jnp.searchsorted lowers to a
    # loop, a launch per step on a GPU): W x G compares, W at most a few thousand
    group = jnp.minimum(jnp.sum(cumulative[None, :] <= item[:, None], axis=1), num_groups - 1).astype(jnp.int32)
    tile = first[group] + item - (cumulative[group] - count[group])
    valid = item < cumulative[-1]
    return (jnp.where(valid, tile, 0).astype(jnp.int32), jnp.where(valid, group, -1),
            starts.astype(jnp.int32), ends.astype(jnp.int32))


def _kernel(tile_ref, group_ref, start_ref, end_ref, x_ref, w_ref, o_ref, *,
            block_m: int, block_n: int, block_k: int, num_k: int, num_groups: int):
    item, j = pl.program_id(0), pl.program_id(1)
    group = group_ref[item]
    row0 = tile_ref[item] * block_m
    columns = pl.ds(j * block_n, block_n)
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
    mine = (rows >= start_ref[jnp.maximum(group, 0)]) & (rows < end_ref[jnp.maximum(group, 0)])

    @pl.when((group >= 0) & (group < num_groups))
    def _():
        def body(k, acc):
            x = x_ref[pl.ds(row0, block_m), pl.ds(k * block_k, block_k)]
            w = w_ref[group, pl.ds(k * block_k, block_k), columns]
            return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(o_ref.at[pl.ds(row0, block_m), columns], acc.astype(o_ref.dtype), mask=mine)

    @pl.when(group == num_groups)  # the rows after the last group
    def _():
        plgpu.store(o_ref.at[pl.ds(row0, block_m), columns], jnp.zeros((block_m, block_n), o_ref.dtype), mask=mine)


def grouped_matmul(rows, weight, group_sizes, out_dtype=None, tiles: GroupedTiles | None = None,
                   interpret: bool | None = None):
    """rows [M, K] grouped as group_sizes [G] int32 says, each times its group's weight [G, K, N]
    -> [M, N] out_dtype (default rows'), summed in float32; rows after the last group are zero.
    interpret: run in the Pallas interpreter (default: off a GPU)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    t = tiles or (INTERPRET_TILES if interpret else GroupedTiles())
    m, k = rows.shape
    num_groups, _, n = weight.shape
    smaller = (8, 4, 2, 1) if interpret else ()  # a GPU's dots take 16 or more
    bn = divisor(n, tuple(c for c in (256, 128, 64, 32, 16) if c <= t.block_n) + smaller)
    bk = divisor(k, tuple(c for c in (128, 64, 32, 16) if c <= t.block_k) + smaller)
    if n % bn or k % bk or min(bn, bk) < 16 and not interpret:
        raise ValueError(f"grouped_matmul: on a GPU N ({n}) and K ({k}) must be multiples of 16")
    x = pad_rows(rows, t.block_m)
    tile, group, starts, ends = work_items(group_sizes, x.shape[0], t.block_m)
    out_dtype = out_dtype or rows.dtype
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=t.block_m, block_n=bn, block_k=bk, num_k=k // bk, num_groups=num_groups),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), out_dtype),
        grid=(tile.shape[0], n // bn),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
    )(tile, group, starts, ends, x, weight)
    return out[:m]


def mosaic_grouped_matmul(rows, weight, group_sizes, tiles: MosaicTiles | None = None):
    """grouped_matmul through JAX's Mosaic GPU kernel (a Hopper GPU): rows [M, K] and weight [G, K, N]
    of one 16-bit dtype -> [M, N] in it, summed in float32; rows after the last group not defined."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    t = tiles or MosaicTiles()
    (m, k), (_, _, n) = rows.shape, weight.shape
    if rows.dtype != weight.dtype or rows.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"mosaic_grouped_matmul: rows and weight of one 16-bit dtype, got {rows.dtype} and "
                         f"{weight.dtype}")
    bn = divisor(n, tuple(c for c in (256, 128, 64, 32, 16) if c <= t.block_n))
    bk = divisor(k, tuple(c for c in (128, 64, 32, 16) if c <= t.block_k))
    if n % bn or k % bk:
        raise ValueError(f"mosaic_grouped_matmul: N ({n}) and K ({k}) must be multiples of 16")
    return ragged_dot_mgpu.ragged_dot(rows, weight, group_sizes=group_sizes.astype(jnp.int32), block_m=t.block_m,
                                      block_n=bn, block_k=bk, max_concurrent_steps=t.steps,
                                      grid_block_n=t.grid_block_n)
