"""The Mosaic GPU prefill kernel (Hopper) in the Mosaic GPU interpreter against the
reference, and on a Hopper GPU.

The interpreter runs the kernel's three warpgroups as threads, with its TMA copies,
barriers and wgmma, and fills outputs with NaN first, so a row no copy writes shows.
It has no `run_state` and no wgmma from registers, so there the P V product takes its
P through shared memory (the one place the interpreted kernel differs from the GPU's).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels import attention, mosaic_attention, reference
from tests.conftest import run_in_child
from tests.kernels.ragged_batch import HEADS, assert_matches, make_batch, random_requests

# The interpreter runs each warpgroup as a thread that executes XLA computations of its own,
# which block in callbacks until the other warpgroups reach a barrier. Under load, a warpgroup's
# computation could wait to start behind those blocked ones, and the kernel never ended: the mixed
# batches' test hung so in suite runs on 2 cores (once twice in a row in one run), never alone;
# forced onto one core (taskset) it hung every time: two warpgroups waiting at a barrier in their
# callbacks, two in XLA's execute. XLA:CPU's concurrency-optimized scheduler orders a computation
# for its independent thunks to run at once on XLA's thread pool, so a warpgroup's callbacks can
# hold pool threads its own other thunks wait for; with the plain scheduler
# (INTERPRETER_XLA_FLAGS) the interpreted tests pass on one core, also three children at once on
# two cores. They still run in a child process, started by the last test, where a hang would end
# the child at the timeout below with every thread's stack, and the child run once more.
INTERPRETER_XLA_FLAGS = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
pytestmark = pytest.mark.timeout(90, method="thread")
IN_CHILD = os.environ.get("JAXLLM_INTERPRETER_CHILD") == "1"


def interpreted(test):
    """A test of the interpreted kernel: marked `interpreter`, which the child selects (-k matches
    marker names), and skipped elsewhere."""
    skip = pytest.mark.skipif(not IN_CHILD, reason="run by test_the_interpreted_tests_in_a_fresh_process")
    return pytest.mark.interpreter(skip(test))


def mixed_requests(rng, max_ctx, max_chunk):
    """random_requests plus one chunk longer than a 128-token program, so blocks of
    a request end mid-tile with the next request's tokens behind them."""
    ctx_lens, q_lens = random_requests(rng, int(rng.integers(1, 4)), max_ctx, max_chunk)
    at = int(rng.integers(len(q_lens) + 1))
    ctx_lens.insert(at, int(rng.integers(0, max_ctx)))
    q_lens.insert(at, int(rng.integers(130, 200)))
    return ctx_lens, q_lens


def case(i):
    """Case i cycles through head dims, block sizes, GQA ratios, dtypes and windows."""
    num_q_heads, num_kv_heads = HEADS[i % len(HEADS)]
    return dict(head_dim=(64, 128)[i % 2], block_size=(16, 32, 64, 128)[i % 4],
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                dtype=(jnp.bfloat16, jnp.float16)[i // 4 % 2]), (None, 70)[i % 3 == 2]


@interpreted
@pytest.mark.parametrize("i", range(6))
def test_interpreted_mosaic_matches_reference_on_mixed_batches(i):
    shapes, window = case(i)
    rng = np.random.default_rng(800 + i)
    ctx_lens, q_lens = mixed_requests(rng, max_ctx=300, max_chunk=40)
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, extra_tokens=int(rng.integers(0, 9)),
                       extra_reqs=int(rng.integers(0, 3)), **shapes)
    assert batch.args[0].shape[0] > batch.args[4].shape[0]  # not a decode bucket
    scale = float(rng.uniform(0.05, 0.2))
    out = mosaic_attention.paged_attention(*batch.args, scale=scale, sliding_window=window,
                                           interpret=True)
    ref = reference.ragged_paged_attention(*batch.args, scale=scale, sliding_window=window)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_matches(out, ref, batch, shapes["dtype"])


@interpreted
@pytest.mark.parametrize("num_ctas", [None, 3])
def test_prefill_writes_exactly_the_rows_of_its_chunks(num_ctas):
    """Chunks of 1, 63, 65 and 130 tokens packed back to back: the row-exact stores
    write every chunk row and nothing else (the rest keeps the interpreter's NaN).
    num_ctas=3: each CTA serves several items, its K/V ring running across them."""
    rng = np.random.default_rng(900)
    batch = make_batch(rng, ctx_lens=[0, 20, 0, 5, 33, 0], q_lens=[1, 63, 1, 65, 130, 2],
                       num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                       dtype=jnp.bfloat16, extra_tokens=5)
    out = mosaic_attention.prefill_attention(*batch.args, scale=0.1, num_ctas=num_ctas,
                                             interpret=True)
    out = np.asarray(out, np.float32)
    qsl = np.asarray(batch.args[3])
    chunk = np.zeros(out.shape[0], bool)
    for i, n in enumerate(batch.q_lens):
        chunk[qsl[i]:qsl[i + 1]] = n > 1
    assert np.isfinite(out[chunk]).all()
    assert np.isnan(out[~chunk]).all()
    ref = np.asarray(reference.ragged_paged_attention(*batch.args, scale=0.1), np.float32)
    np.testing.assert_allclose(out[chunk], ref[chunk], atol=2e-2, rtol=2e-2)


@interpreted
def test_interpreted_kernel_has_no_shared_memory_races():
    """The interpreter's happens-before race detector over every shared-memory access
    of the three warpgroups, two CTAs each serving several items."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    rng = np.random.default_rng(902)
    batch = make_batch(rng, ctx_lens=[0, 20, 40], q_lens=[70, 1, 130], num_q_heads=2,
                       num_kv_heads=1, head_dim=64, block_size=32, dtype=jnp.bfloat16,
                       extra_tokens=3)
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = mosaic_attention.prefill_attention(*batch.args, scale=0.1, num_ctas=2, interpret=params)
    jax.block_until_ready(out)
    assert not get_races().races_found


@interpreted
def test_unserved_shapes_fall_back_to_pallas():
    assert mosaic_attention.supports(jnp.bfloat16, 128, 16, None)
    assert not mosaic_attention.supports(jnp.float32, 128, 16, None)
    assert not mosaic_attention.supports(jnp.bfloat16, 256, 16, None)
    assert not mosaic_attention.supports(jnp.bfloat16, 128, 48, None)
    assert not mosaic_attention.supports(jnp.bfloat16, 128, 16, 30.0)
    assert mosaic_attention.supports(jnp.bfloat16, 128, 16, None, jnp.bfloat16)
    assert not mosaic_attention.supports(jnp.bfloat16, 128, 16, None, jnp.float8_e4m3fn)
    rng = np.random.default_rng(901)
    batch = make_batch(rng, ctx_lens=[3, 0], q_lens=[9, 1], num_q_heads=2, num_kv_heads=1,
                       head_dim=32, block_size=16, extra_tokens=2)
    out = mosaic_attention.paged_attention(*batch.args, scale=0.2, interpret=True)
    assert_matches(out, reference.ragged_paged_attention(*batch.args, scale=0.2), batch,
                   jnp.float32)


def test_default_backend_off_gpu_is_the_reference():
    if jax.default_backend() != "gpu":
        assert attention.default_backend() == "reference"
    else:
        want = "mosaic" if mosaic_attention.is_hopper() else "pallas"
        assert attention.default_backend() == want


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic_attention.is_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("cache_dtype", [None, jnp.float8_e4m3fn])  # fp8: served by pallas_attention
@pytest.mark.parametrize("i", range(6))
def test_gpu_mosaic_matches_reference(cache_dtype, i):
    shapes, window = case(i)
    rng = np.random.default_rng(1000 + i)
    ctx_lens, q_lens = random_requests(rng, int(rng.integers(2, 40)), max_ctx=3000,
                                       max_chunk=600)
    batch = make_batch(rng, ctx_lens=ctx_lens, q_lens=q_lens, extra_tokens=7, extra_reqs=3,
                       cache_dtype=cache_dtype, **shapes)
    out = mosaic_attention.ragged_paged_attention(*batch.args, scale=0.1, sliding_window=window)
    with jax.default_matmul_precision("highest"):
        ref = reference.ragged_paged_attention(*batch.args, scale=0.1, sliding_window=window)
    assert_matches(out, ref, batch, shapes["dtype"])


@pytest.mark.parametrize("tile,stages,block_size,head_dim,window",
                         [(128, 2, 16, 128, None), (64, 4, 128, 64, 100)])
def test_gpu_kernel_lowers_on_any_machine(tile, stages, block_size, head_dim, window):
    """The GPU form (P from registers, accumulated in place) is lowered to Mosaic GPU
    here, through its layout inference, so a CPU run catches what the interpreter
    cannot see."""
    rng = np.random.default_rng(1100)
    batch = make_batch(rng, ctx_lens=[0, 5, 100], q_lens=[300, 1, 70], num_q_heads=8,
                       num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                       dtype=jnp.bfloat16, extra_tokens=30)
    fn = jax.jit(mosaic_attention.prefill_attention, static_argnames=(
        "scale", "sliding_window", "tile", "stages"))
    lowered = fn.trace(*batch.args, scale=0.1, sliding_window=window, tile=tile,
                       stages=stages).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.skipif(IN_CHILD, reason="the child's own tests run")
@pytest.mark.timeout(1260, method="signal")
def test_the_interpreted_tests_in_a_fresh_process():
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} {INTERPRETER_XLA_FLAGS}".strip()
    run_in_child(__file__, "interpreter", "10 passed", 600, {"JAXLLM_INTERPRETER_CHILD": "1", "XLA_FLAGS": xla_flags},
                 again_after="+++++ Timeout +++++")
