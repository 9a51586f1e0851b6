"""Decode attention over a bf16 and an e4m3 KV cache (kv_cache_dtype="fp8"), in one GPU run:
the Pallas kernel's default launch on both and jax-triton's, the Pallas decode launch without
its head-major order and page-id prefetch (and with each alone), then the 8-bit cache under
a sweep of KV tile, pipeline stages and warps; each checked against the
reference on the same cache, and timed as scripts/bench_attention.py times (median of 7
jitted loops). Llama-3.1-8B heads (32 q, 8 KV, dim 128), block 16. Prints TB/s of KV read
(the cache's own bytes) and the table last.

Usage (device command, after scripts/gpu_setup.sh): python3 scripts/bench_kv_dtype.py
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import bench_attention as ba  # noqa: E402  (measures the copy rate on import)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import pallas_attention, reference, triton_attention  # noqa: E402

SHAPES = ((256, 1024), (64, 4096), (4, 2048))  # (batch, context)
# The decode launch's order and prefetch against the plain launch, on both caches; then the 8-bit
# cache under a sweep of KV tile, pipeline stages and warps.
PLAIN = dict(head_major=False, prefetch=False)
SWEEP = [dict(tile=t, num_stages=st, num_warps=w) for t, st, w in
         ((64, 3, 4), (128, 2, 4), (128, 4, 4), (128, 3, 8), (256, 2, 4), (256, 3, 8))]


def main():
    rng = np.random.default_rng(0)
    num_blocks = 256 * 4096 // ba.BLOCK_SIZE + 64
    tail = (ba.BLOCK_SIZE, ba.NUM_KV_HEADS, ba.HEAD_DIM)
    k16 = ba.random_cache(jax.random.key(1), num_blocks, tail)
    v16 = ba.random_cache(jax.random.key(2), num_blocks, tail)
    caches = {"bf16": (k16, v16),
              "e4m3": (k16.astype(jnp.float8_e4m3fn), v16.astype(jnp.float8_e4m3fn))}
    scale = 1 / math.sqrt(ba.HEAD_DIM)
    rows = []
    for batch, ctx in SHAPES:
        sets = {name: [ba.batch_args(rng, k, v, [ctx - 1] * batch, [1] * batch, batch, batch, ctx // ba.BLOCK_SIZE + 1)
                       for _ in range(3)] for name, (k, v) in caches.items()}
        variants = [("pallas", "bf16", {}), ("pallas", "e4m3", {}), ("triton", "bf16", {}), ("triton", "e4m3", {})]
        variants += [("pallas", dtype, PLAIN) for dtype in caches]
        variants += [("pallas", dtype, dict(PLAIN, **flag)) for dtype in caches for flag in
                     (dict(head_major=True), dict(prefetch=True))]
        variants += [("pallas", "e4m3", knobs) for knobs in SWEEP]
        for backend, dtype, knobs in variants:
            module = pallas_attention if backend == "pallas" else triton_attention
            fn = lambda *a, m=module, kn=knobs: m.paged_attention(*a, scale=scale, **kn)  # noqa: E731
            args = sets[dtype][0]
            try:
                out = np.asarray(fn(*args), np.float32)
                with jax.default_matmul_precision("highest"):
                    ref = np.asarray(reference.ragged_paged_attention(*args, scale=scale), np.float32)
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                seconds = ba.median_time_s(fn, sets[dtype], expect_s=1e-3)
            except Exception as e:  # noqa: BLE001 - report, time the others
                print(f"{backend} {dtype} {knobs} FAILED: {e!r}"[:600], flush=True)
                continue
            kv_bytes = 2 * batch * ctx * ba.NUM_KV_HEADS * ba.HEAD_DIM * caches[dtype][0].dtype.itemsize
            row = (batch, ctx, backend, dtype, str(knobs or "default"), seconds * 1e6, kv_bytes / seconds / 1e12, err)
            rows.append(row)
            print("%4d %5d %-6s %-4s %-48s %8.1f us %5.2f TB/s err %.1e" % row, flush=True)
    print(f"\ncopy rate (PyTorch, before JAX): {ba.COPY_BEFORE:.2f} TB/s")
    print(f"{'batch':>5} {'ctx':>5} {'kernel':6} {'KV':4} {'launch':48} {'us':>8} {'TB/s':>5} {'rel err':>8}")
    for row in rows:
        print("%5d %5d %-6s %-4s %-48s %8.1f %5.2f %8.1e" % row)


if __name__ == "__main__":
    main()
