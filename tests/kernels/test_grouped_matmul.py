"""The MoE layer's grouped GEMMs (kernels/grouped_matmul.py) against a float64 reference: in the
Pallas and Mosaic GPU interpreters on CPU, and (marked gpu) compiled at Qwen3-30B-A3B's expert shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.grouped_matmul import GroupedTiles, MosaicTiles, grouped_matmul, mosaic_grouped_matmul, work_items
from jaxllm.models import moe
from jaxllm.models.fp8 import quantize_experts
from jaxllm.models.moe import moe_one_device
from tests.models.test_moe import moe_inputs, reference_moe


def reference(rows, weight, sizes):
    """Each row times its group's weight in float64; rows after the last group zero."""
    rows, weight = np.asarray(rows, np.float64), np.asarray(weight, np.float64)
    out = np.zeros((rows.shape[0], weight.shape[2]))
    ends = np.cumsum(sizes)
    for g, (start, end) in enumerate(zip(ends - sizes, ends)):
        out[start:end] = rows[start:end] @ weight[g]
    return out


def test_work_items_are_the_tiles_and_groups_that_share_rows():
    # groups of 3, 0 and 5 rows in tiles of 4: rows 0-2 are group 0's, rows 3-7 group 2's
    tile, group, starts, ends = (np.asarray(a) for a in work_items(jnp.array([3, 0, 5]), 8, 4))
    assert tile.tolist() == [0, 0, 1, 0, 0] and group.tolist() == [0, 2, 2, -1, -1]
    assert starts.tolist() == [0, 3, 3, 8] and ends.tolist() == [3, 3, 8, 8]
    # 3, 0 and 4 rows: row 7 is after the last group, group 3 (the rows the kernel zeroes)
    tile, group, starts, ends = (np.asarray(a) for a in work_items(jnp.array([3, 0, 4]), 8, 4))
    assert tile.tolist() == [0, 0, 1, 1, 0] and group.tolist() == [0, 2, 2, 3, -1]
    assert starts.tolist() == [0, 3, 3, 7] and ends.tolist() == [3, 3, 7, 8]


@pytest.mark.parametrize("sizes", [
    [3, 0, 20, 14, 0],  # groups across tile edges, empty ones between
    [0, 0, 0, 37],      # one group, every tile
    [1, 1, 1, 1, 1],    # a decode step: a row each, all in one tile
    [2, 0, 9, 0, 0],    # fewer rows than the matrix: the rest stay zero
])
def test_each_row_meets_its_groups_weight(sizes):
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    rows = rng.standard_normal((37, 48), np.float32)
    weight = rng.standard_normal((len(sizes), 48, 40), np.float32)
    got = jax.jit(grouped_matmul)(rows, weight, jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(got, reference(rows, weight, np.array(sizes)), rtol=1e-5, atol=1e-4)


def test_bfloat16_and_e4m3_rows_sum_in_float32():
    rng = np.random.default_rng(1)
    sizes = np.array([5, 0, 11])
    rows = rng.standard_normal((16, 32), np.float32)
    weight = rng.standard_normal((3, 32, 16), np.float32)
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        x, w = jnp.asarray(rows, dtype), jnp.asarray(weight, dtype)
        got = grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), jnp.float32)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, reference(x.astype(jnp.float32), w.astype(jnp.float32), sizes),
                                   rtol=1e-5, atol=1e-4)


def test_tiles_are_checked():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        GroupedTiles(block_n=24)
    with pytest.raises(ValueError, match="MosaicTiles.block_n must be a power of two"):
        MosaicTiles(block_n=24)
    with pytest.raises(ValueError, match="MosaicTiles: steps and grid_block_n must be >= 1"):
        MosaicTiles(steps=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_moe_layer_through_the_kernel_is_its_reference(monkeypatch, fp8):
    """JAXLLM_MOE_KERNEL picks the grouped GEMM a model traces with: the kernel gives the layer of
    the float64 reference (ragged_dot's, within e4m3's error with FP8 experts)."""
    x, weights, ids, gate_up, down = moe_inputs("random")
    if fp8:
        gate_up, down = quantize_experts(gate_up), quantize_experts(down)
    outputs = {}
    for kind in ("ragged", "pallas"):
        monkeypatch.setenv("JAXLLM_MOE_KERNEL", kind)
        layer = jax.jit(lambda *a: moe_one_device(*a))  # traced anew: the variable is read when tracing
        outputs[kind] = np.asarray(layer(x, weights, ids, gate_up, down))
        jaxpr = str(jax.make_jaxpr(lambda *a: moe_one_device(*a))(x, weights, ids, gate_up, down))
        assert ("pallas_call" in jaxpr, "ragged_dot" in jaxpr) == (kind == "pallas", kind == "ragged")
    np.testing.assert_allclose(outputs["pallas"], outputs["ragged"], rtol=1e-5, atol=1e-5)
    if not fp8:
        np.testing.assert_allclose(outputs["pallas"], reference_moe(x, weights, ids, gate_up, down), rtol=1e-5,
                                   atol=1e-5)
    monkeypatch.setenv("JAXLLM_MOE_KERNEL", "triton")
    with pytest.raises(ValueError, match="JAXLLM_MOE_KERNEL must be"):
        jax.jit(lambda *a: moe_one_device(*a))(x, weights, ids, gate_up, down)


@pytest.mark.parametrize("sizes", [
    [30, 0, 70, 50, 20],  # groups across 64-row tiles, an empty one, 30 rows after the last group
    [0, 0, 200, 0],       # one group over every tile
])
def test_mosaic_rows_meet_their_groups_weight(interpreted_mosaic, sizes):
    rng = np.random.default_rng(sum(sizes) + len(sizes))
    rows = jnp.asarray(rng.standard_normal((200, 128)), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((len(sizes), 128, 192)) * 0.1, jnp.bfloat16)
    got = mosaic_grouped_matmul(rows, weight, jnp.asarray(sizes, jnp.int32), MosaicTiles(64, 64, 64, 2))
    assert got.shape == (200, 192) and got.dtype == jnp.bfloat16
    real = sum(sizes)  # the rows after the last group are not written
    want = reference(rows.astype(jnp.float32), weight.astype(jnp.float32), np.array(sizes))[:real]
    np.testing.assert_allclose(np.asarray(got, np.float32)[:real], want, rtol=1e-2, atol=2e-2)  # bf16's rounding


def test_mosaic_takes_the_16_bit_gemms_of_steps_with_many_rows(monkeypatch, interpreted_mosaic):
    """JAXLLM_MOE_KERNEL=mosaic: a layer of MOSAIC_MIN_ROWS rows or more runs its two bf16 GEMMs
    through the Mosaic kernel, fewer rows and FP8 experts through the Pallas one; the same layer."""
    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (24, 64), jnp.bfloat16)
    gate_up = (jax.random.normal(keys[1], (4, 64, 2, 32)) / 4).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[2], (4, 32, 64)) / 4).astype(jnp.bfloat16)
    weights, ids = moe.route(jax.random.normal(keys[3], (24, 4)), 2, renormalize=True)
    calls = []
    monkeypatch.setattr(moe, "mosaic_grouped_matmul", lambda *a: calls.append(a[0].shape) or mosaic_grouped_matmul(*a))
    monkeypatch.setattr(moe, "MOSAIC_MIN_ROWS", 48)  # the layer's 24 tokens x 2 experts
    monkeypatch.setenv("JAXLLM_MOE_KERNEL", "mosaic")
    got = moe_one_device(x, weights, ids, gate_up, down)
    assert calls == [(48, 64), (48, 32)]
    want = reference_moe(x, weights, ids, gate_up, down)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=5e-2, atol=5e-2)
    moe_one_device(*(quantize_experts(w) if i > 2 else w for i, w in enumerate((x, weights, ids, gate_up, down))))
    monkeypatch.setattr(moe, "MOSAIC_MIN_ROWS", 49)
    moe_one_device(x, weights, ids, gate_up, down)
    assert len(calls) == 2  # neither the FP8 layer nor the one of too few rows


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 16, 200])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_compiled_kernel_at_qwen3_30b_a3bs_experts(num_tokens, dtype):
    """128 experts of [2048, 1536] (gate and up), 8 a token, uniform routing."""
    rng = np.random.default_rng(num_tokens)
    ids = np.argsort(rng.random((num_tokens, 128)), axis=1)[:, :8].reshape(-1)
    sizes = np.bincount(ids, minlength=128)
    rows = (rng.standard_normal((ids.size, 2048)) * 0.5).astype(np.float32)
    weight = (rng.standard_normal((128, 2048, 1536)) * 0.02).astype(np.float32)
    x, w = jnp.asarray(rows, dtype), jnp.asarray(weight, dtype)
    got = np.asarray(jax.jit(grouped_matmul, static_argnums=3)(x, w, jnp.asarray(sizes, jnp.int32), jnp.float32))
    want = reference(np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), sizes)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("num_tokens", [1, 200, 1024])
@pytest.mark.parametrize("kk, n", [(2048, 1536), (768, 2048)])  # Qwen3-30B-A3B's gate-up and down
def test_the_compiled_mosaic_kernel_at_qwen3_30b_a3bs_experts(num_tokens, kk, n):
    rng = np.random.default_rng(num_tokens)
    ids = np.argsort(rng.random((num_tokens, 128)), axis=1)[:, :8].reshape(-1)
    sizes = np.bincount(ids, minlength=128)
    x = jnp.asarray(rng.standard_normal((ids.size, kk)) * 0.5, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, kk, n)) * 0.02, jnp.bfloat16)
    got = np.asarray(jax.jit(mosaic_grouped_matmul)(x, w, jnp.asarray(sizes, jnp.int32)), np.float32)
    want = reference(np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), sizes)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # the output's bf16 rounding
