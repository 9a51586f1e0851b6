"""`jaxllm bench kv-dtype`: decode attention over a bf16 and an e4m3 KV cache
(kv_cache_dtype="fp8"), in one GPU run: the Pallas kernel's default launch on both and
jax-triton's, the Pallas decode launch without its head-major order and page-id prefetch (and
with each alone), then the 8-bit cache under a sweep of KV tile, pipeline stages and warps.

Each variant is checked against the reference on the same cache (its relative error is in the
table) and timed as `bench attention` times (device_timing.median_loop_s: the median of 7
jitted loops over 3 rotating batches). Llama-3.1-8B heads (32 q, 8 KV, dim 128), block 16,
batch x context 256 x 1024, 64 x 4096 and 4 x 2048. Prints TB/s of KV read (the cache's own
bytes) beside the PyTorch copy rate measured before JAX starts (where PyTorch is installed),
and the table last. A variant that fails is reported and left out.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.attention import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, SCALE, batch_args, random_cache
from jaxllm.benchmarks.common import write_json
from jaxllm.benchmarks.device_timing import median_loop_s, torch_copy_tbps

HELP = "decode attention over bf16 and e4m3 KV caches, under the Pallas decode launch's variants"
SHAPES = ((256, 1024), (64, 4096), (4, 2048))  # (batch, context)
# The decode launch's order and prefetch against the plain launch, on both caches; then the 8-bit
# cache under a sweep of KV tile, pipeline stages and warps.
PLAIN = dict(head_major=False, prefetch=False)
SWEEP = [dict(tile=t, num_stages=st, num_warps=w) for t, st, w in
         ((64, 3, 4), (128, 2, 4), (128, 4, 4), (128, 3, 8), (256, 2, 4), (256, 3, 8))]


def add_cli_args(parser) -> None:
    parser.add_argument("--output-json", help="write the rows to this file")


def variants(cache_dtypes) -> list[tuple[str, str, dict]]:
    """(kernel, cache dtype, launch knobs) of every variant timed at each shape."""
    found = [("pallas", "bf16", {}), ("pallas", "e4m3", {}), ("triton", "bf16", {}), ("triton", "e4m3", {})]
    found += [("pallas", dtype, PLAIN) for dtype in cache_dtypes]
    found += [("pallas", dtype, dict(PLAIN, **flag)) for dtype in cache_dtypes
              for flag in (dict(head_major=True), dict(prefetch=True))]
    return found + [("pallas", "e4m3", knobs) for knobs in SWEEP]


def main(ns) -> int:
    from jaxllm.kernels import pallas_attention, reference, triton_attention

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")  # as bench attention: room for PyTorch
    copy_tbps = torch_copy_tbps()  # before JAX takes its share of the GPU's memory
    rng = np.random.default_rng(0)
    num_blocks = 256 * 4096 // BLOCK_SIZE + 64
    tail = (BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k16 = random_cache(jax.random.key(1), num_blocks, tail)
    v16 = random_cache(jax.random.key(2), num_blocks, tail)
    caches = {"bf16": (k16, v16), "e4m3": (k16.astype(jnp.float8_e4m3fn), v16.astype(jnp.float8_e4m3fn))}
    modules = {"pallas": pallas_attention, "triton": triton_attention}
    rows = []
    for batch, ctx in SHAPES:
        sets = {name: [batch_args(rng, k, v, [ctx - 1] * batch, [1] * batch, batch, batch, ctx // BLOCK_SIZE + 1)
                       for _ in range(3)] for name, (k, v) in caches.items()}
        for backend, dtype, knobs in variants(caches):
            fn = lambda *a, m=modules[backend], kn=knobs: m.paged_attention(*a, scale=SCALE, **kn)  # noqa: E731
            args = sets[dtype][0]
            try:
                out = np.asarray(fn(*args), np.float32)
                with jax.default_matmul_precision("highest"):
                    ref = np.asarray(reference.ragged_paged_attention(*args, scale=SCALE), np.float32)
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                seconds = median_loop_s(fn, sets[dtype])
            except Exception as e:  # noqa: BLE001 - report, time the others
                print(f"{backend} {dtype} {knobs} FAILED: {e!r}"[:600], flush=True)
                continue
            kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * caches[dtype][0].dtype.itemsize
            row = (batch, ctx, backend, dtype, str(knobs or "default"), seconds * 1e6,
                   kv_bytes / seconds / 1e12, err)
            rows.append(row)
            print("%4d %5d %-6s %-4s %-48s %8.1f us %5.2f TB/s err %.1e" % row, flush=True)
    write_json(ns.output_json, {"device": jax.devices()[0].device_kind, "copy_TBps": copy_tbps, "rows": [
        dict(zip(("batch", "ctx", "kernel", "kv", "launch", "us", "TBps", "rel_err"), row)) for row in rows]})
    print(f"\ncopy rate (PyTorch, before JAX): {copy_tbps:.2f} TB/s")
    print(f"{'batch':>5} {'ctx':>5} {'kernel':6} {'KV':4} {'launch':48} {'us':>8} {'TB/s':>5} {'rel err':>8}")
    for row in rows:
        print("%5d %5d %-6s %-4s %-48s %8.1f %5.2f %8.1e" % row)
    return 0
