"""Ragged paged attention on one GPU, in one run: checks the Pallas and jax-triton
kernels against the reference, then times them next to the baselines measured in
the same run, and prints a short table last.

  decode   batch 1..256 x context 512..32k, 32 q / 8 KV heads, dim 128, bf16, block 16:
           TB/s of KV read, beside a device-to-device copy (PyTorch) and JAX's own
           deprecated Pallas `ops.gpu.paged_attention`.
  prefill  8192-token steps of 512 / 2k / 8k-token chunks, with and without 4k of
           cached context: TFLOP/s beside cuDNN causal attention of the same chunks.
  mixed    four 512-token prefill chunks + 200 decodes in one call.

Usage (device command, after scripts/gpu_wheels.sh's install line):
  python3 scripts/bench_attention.py [--tune] [--json FILE]
Timing: the median of 7 runs, each a jitted loop of calls long enough (20 ms) to
hide host dispatch, after a warm-up, synchronized with block_until_ready; inputs
rotate over block tables pointing at a cache much larger than L2 (60 MB), filled
with random data.
"""
import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

# Leave PyTorch room for the copy measured again at the end.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (1, 8, 32, 64, 256)
DECODE_CONTEXTS = (512, 2048, 8192, 32768)
MAX_BLOCKS_PER_SEQ = max(DECODE_CONTEXTS) // BLOCK_SIZE
ROTATE_BYTES = 512 << 20  # inputs touched over the rotations: several times the 60 MB L2
MAX_ROTATIONS = 64


def torch_copy_tbps(num_bytes=4 << 30):
    """Device-to-device copy through PyTorch, bytes read + written per second."""
    try:
        import torch
        src = torch.randn(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
    except (ImportError, RuntimeError) as e:  # no PyTorch, no CUDA, or out of memory
        print("copy not measured:", repr(e)[:200], flush=True)
        return float("nan")
    times = []
    for i in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / statistics.median(times) / 1e12


COPY_BEFORE = torch_copy_tbps()  # before JAX takes its share of the GPU's memory

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import (mosaic_attention, pallas_attention, reference,  # noqa: E402
                            triton_attention)


def median_time_s(fn, arg_sets, expect_s, reps=7, min_loop_s=0.02):
    """Median seconds per call of fn, timed on the device: one jitted fori_loop calls
    fn over the rotating argument sets many times, so host dispatch (about 50 us a
    call) stays out of the figure. Arguments shared by every set (the caches) are
    passed once; the others are stacked and indexed by the loop counter, which also
    keeps XLA from hoisting the call out of the loop."""
    arg_sets = list(arg_sets) * (2 if len(arg_sets) == 1 else 1)
    num_sets = len(arg_sets)
    shared = [all(a[i] is arg_sets[0][i] for a in arg_sets) for i in range(len(arg_sets[0]))]
    args = [x if sh else jnp.stack([a[i] for a in arg_sets])
            for i, (x, sh) in enumerate(zip(arg_sets[0], shared))]

    @functools.partial(jax.jit, static_argnums=0)
    def loop(num_calls, *args):
        def body(j, acc):
            out = fn(*[x if sh else x[j % num_sets] for x, sh in zip(args, shared)])
            return acc + out.reshape(-1)[0].astype(jnp.float32)
        return jax.lax.fori_loop(0, num_calls, body, jnp.float32(0))

    # The loop length comes from the caller's rough guess, so the loop compiles once.
    num_calls = num_sets * max(1, math.ceil(min_loop_s / expect_s / num_sets))
    jax.block_until_ready(loop(num_calls, *args))  # compile + warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(loop(num_calls, *args))
        times.append((time.perf_counter() - start) / num_calls)
    return statistics.median(times)


def random_cache(key, num_blocks, shape_tail, dtype=jnp.bfloat16, chunk=1 << 16):
    """[num_blocks, *shape_tail] of normal random data, made chunk by chunk."""
    @functools.partial(jax.jit, static_argnums=1)
    def make(k, n):
        return jax.random.normal(k, (n, *shape_tail), jnp.float32).astype(dtype)
    keys = jax.random.split(key, -(-num_blocks // chunk))
    parts = [make(k, min(chunk, num_blocks - i * chunk)) for i, k in enumerate(keys)]
    return jnp.concatenate(parts)


def block_tables(rng, num_reqs, pages_per_req, num_blocks, width):
    """[num_reqs, width] int32: distinct random cache blocks for every request."""
    pages = rng.choice(num_blocks, size=num_reqs * pages_per_req, replace=False)
    table = np.zeros((num_reqs, width), np.int32)
    table[:, :pages_per_req] = pages.reshape(num_reqs, pages_per_req)
    return jnp.asarray(table)


def batch_args(rng, k_cache, v_cache, ctx_lens, q_lens, num_tokens, max_num_reqs, width):
    """Arguments of ragged_paged_attention for requests with the given cached
    context and new tokens, padded to the token and request buckets."""
    num_blocks = k_cache.shape[0]
    seq_lens = np.zeros(max_num_reqs, np.int32)
    seq_lens[:len(ctx_lens)] = np.add(ctx_lens, q_lens)
    qsl = np.zeros(max_num_reqs + 1, np.int32)
    qsl[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1:] = qsl[len(q_lens)]
    pages = -(-seq_lens // BLOCK_SIZE)
    flat = rng.choice(num_blocks, size=int(pages.sum()), replace=False)
    table = np.zeros((max_num_reqs, width), np.int32)
    for i, start in enumerate(np.cumsum(pages) - pages):
        table[i, :pages[i]] = flat[start:start + pages[i]]
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))),
                          (num_tokens, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    return (q, k_cache, v_cache, jnp.asarray(qsl), jnp.asarray(seq_lens), jnp.asarray(table),
            jnp.asarray([len(ctx_lens)], jnp.int32))


MODULES = {"pallas": pallas_attention, "triton": triton_attention, "mosaic": mosaic_attention}
# Mosaic GPU prefill variants timed alone: (tile, stages, CTAs; None: one per work
# item, 132: one per SM of an H200, persistent).
MOSAIC_VARIANTS = ((128, 2, None), (128, 2, 132), (64, 4, None))
BROKEN = set()  # kernels that failed check() (an error or a wrong result): not timed; the script exits 1


def kernels(**launch):
    scale = 1 / math.sqrt(HEAD_DIM)
    # mosaic: Mosaic GPU prefill + Pallas decode, no launch knobs of its own.
    fns = {name: functools.partial(module.paged_attention, scale=scale, **launch)
           for name, module in MODULES.items() if name not in BROKEN | {"mosaic"}}
    if "mosaic" in MODULES and "mosaic" not in BROKEN and not any(launch.values()):
        fns["mosaic"] = functools.partial(mosaic_attention.paged_attention, scale=scale)
    return fns


def check(rng, k_cache, v_cache):
    """Relative L2 error of each kernel against the reference (at highest matmul
    precision, as in the tests: XLA's f32 default on GPU is TF32) on bf16 batches; a
    kernel that raises, or errs by 1.5e-2 or more, goes into BROKEN."""
    cases = {
        "decode b8": ([900, 3000, 17, 1, 2048, 4095, 64, 333], [1] * 8, 9, 9),
        "mixed": ([0, 700, 1500, 40, 2000, 0], [300, 129, 1, 1, 77, 1], 512, 8),
        "decode b64": (list(rng.integers(1, 5000, 64)), [1] * 64, 64, 64),
    }
    errors = {}
    for name, (ctx, qn, num_tokens, max_reqs) in cases.items():
        args = batch_args(rng, k_cache, v_cache, ctx, qn, num_tokens, max_reqs, 512)
        n = int(sum(qn))
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(reference.ragged_paged_attention(*args, scale=0.088)[:n], np.float32)
        for kname, module in MODULES.items():
            for splits in ((None,) if kname == "mosaic" else (None, 4)):
                try:
                    knobs = {} if splits is None else {"num_splits": splits}
                    out = module.paged_attention(*args, scale=0.088, **knobs)
                    out = np.asarray(out[:n], np.float32)
                except Exception as e:  # noqa: BLE001 - report, time the others
                    print(f"check {kname} {name} FAILED: {e!r}"[:3000], flush=True)
                    BROKEN.add(kname)
                    continue
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                errors[f"{kname} {name} splits={splits}"] = err
                ok = err < 1.5e-2 and np.isfinite(out).all()
                if not ok:
                    BROKEN.add(kname)
                print(f"check {kname:6s} {name:10s} splits={splits}: rel err {err:.2e}"
                      f"{'' if ok else '  <-- FAIL'}", flush=True)
    return errors


def jax_paged_attention_fn():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import paged_attention
    return paged_attention.paged_attention


def bench_decode(rng, k_cache, v_cache, jk_pages, jv_pages, launch):
    rows = []
    jax_fn = jax_paged_attention_fn()
    fns = kernels(**launch)
    fns.pop("mosaic", None)  # a decode bucket runs the Pallas kernel
    num_blocks = k_cache.shape[0]
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2
            rotations = max(1, min(MAX_ROTATIONS, ROTATE_BYTES // kv_bytes))
            sets = [batch_args(rng, k_cache, v_cache, [ctx - 1] * batch, [1] * batch, batch,
                               batch, MAX_BLOCKS_PER_SEQ) for _ in range(rotations)]
            row = {"batch": batch, "ctx": ctx, "kv_MB": kv_bytes / 1e6}
            for name, fn in fns.items():
                t = median_time_s(fn, sets, kv_bytes / 3e12 + 5e-6)
                row[name] = {"us": t * 1e6, "TBps": kv_bytes / t / 1e12}
            pages = ctx // BLOCK_SIZE
            jsets = [(s[0], jk_pages, jv_pages,
                      block_tables(rng, batch, pages, num_blocks, pages),
                      jnp.full((batch,), ctx, jnp.int32)) for s in sets]
            try:
                t = median_time_s(jax_fn, jsets, kv_bytes / 2e12 + 5e-6)
                row["jax"] = {"us": t * 1e6, "TBps": kv_bytes / t / 1e12}
            except Exception as e:  # noqa: BLE001 - report and go on
                row["jax"] = {"error": repr(e)[:200]}
            print("decode", json.dumps(row), flush=True)
            rows.append(row)
    return rows


def causal_flops(ctx, chunk, num_reqs):
    """FLOPs of QK^T and PV over the unmasked pairs, for num_reqs chunks."""
    pairs = chunk * ctx + chunk * (chunk + 1) / 2
    return 4 * NUM_Q_HEADS * HEAD_DIM * pairs * num_reqs


def bench_prefill(rng, k_cache, v_cache, launch):
    rows = []
    fns = kernels(**launch)
    for chunk in (512, 2048, 8192):
        num_reqs = 8192 // chunk
        shape = (num_reqs, chunk, NUM_Q_HEADS, HEAD_DIM)
        q = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
        k = jax.random.normal(jax.random.key(2), shape[:2] + (NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
        v = jax.random.normal(jax.random.key(3), k.shape, jnp.bfloat16)
        cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                          implementation="cudnn"))
        try:
            t = median_time_s(cudnn, [(q, k, v)], causal_flops(0, chunk, num_reqs) / 3e14)
            cudnn_tflops = causal_flops(0, chunk, num_reqs) / t / 1e12
        except Exception as e:  # noqa: BLE001
            print("cudnn failed:", repr(e)[:300], flush=True)
            cudnn_tflops = float("nan")
        for ctx in (0, 4096):
            width = -(-(ctx + chunk) // BLOCK_SIZE)
            sets = [batch_args(rng, k_cache, v_cache, [ctx] * num_reqs, [chunk] * num_reqs,
                               8192, num_reqs, width) for _ in range(2)]
            flops = causal_flops(ctx, chunk, num_reqs)
            row = {"chunk": chunk, "ctx": ctx, "reqs": num_reqs, "cudnn_TFLOPs": cudnn_tflops}
            for name, fn in fns.items():
                t = median_time_s(fn, sets, flops / 2e14)
                row[name] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
            if "mosaic" not in BROKEN:
                for tile, stages, ctas in MOSAIC_VARIANTS:
                    fn = functools.partial(mosaic_attention.prefill_attention,
                                           scale=1 / math.sqrt(HEAD_DIM), tile=tile, stages=stages,
                                           num_ctas=ctas)
                    name = f"mosaic t{tile} s{stages} c{ctas}"
                    try:
                        t = median_time_s(fn, sets, flops / 4e14)
                        row[name] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
                    except Exception as e:  # noqa: BLE001
                        print(f"{name} failed: {e!r}"[:2000], flush=True)
            print("prefill", json.dumps(row), flush=True)
            rows.append(row)
    return rows


def bench_mixed(rng, k_cache, v_cache):
    ctx = [0, 1000, 2000, 3000] + list(rng.integers(256, 4096, 200))
    qn = [512] * 4 + [1] * 200
    sets = [batch_args(rng, k_cache, v_cache, ctx, qn, 2304, 256, 512) for _ in range(4)]
    kv_bytes = sum(c + n for c, n in zip(ctx, qn)) * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    rows = []
    # None: `plan`'s two launches; a block_m: one launch of that shape for all.
    for block_m in (None, 16, 128):
        for name, fn in kernels(block_m=block_m).items():
            t = median_time_s(fn, sets, 1e-3)
            row = {"kernel": name, "block_m": block_m, "us": t * 1e6, "TBps": kv_bytes / t / 1e12}
            print("mixed", json.dumps(row), flush=True)
            rows.append(row)
    return rows


def tune(rng, k_cache, v_cache):
    """Pallas decode launch shapes at batch 32 x 2k context (the one decode cell under
    target) and batch 8 x 8k, around `plan`'s choice (tile 64, 3 stages, 2 and 8 splits)."""
    results = []
    for batch, ctx, shapes in [
            (32, 2048, [(64, 3, 1), (64, 3, 2), (64, 2, 2), (64, 2, 4), (32, 3, 2), (32, 3, 4),
                        (32, 4, 4), (128, 2, 2)]),
            (8, 8192, [(64, 3, 8), (32, 3, 16), (32, 4, 8)])]:
        kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 4
        rotations = max(1, min(MAX_ROTATIONS, ROTATE_BYTES // kv_bytes))
        sets = [batch_args(rng, k_cache, v_cache, [ctx - 1] * batch, [1] * batch, batch, batch,
                           MAX_BLOCKS_PER_SEQ) for _ in range(rotations)]
        for tile, stages, splits in shapes:
            config = dict(tile=tile, num_stages=stages, num_splits=splits, num_warps=4)
            t = median_time_s(kernels(**config)["pallas"], sets, kv_bytes / 3e12)
            row = {"decode": [batch, ctx], **config, "TBps": kv_bytes / t / 1e12}
            print("tune", json.dumps(row), flush=True)
            results.append(row)
    return results


def _rate(row, name, key):
    return row.get(name, {}).get(key, float("nan"))


def table(results):
    copy = results["copy_TBps"]
    lines = [f"copy (PyTorch D2D, read+write): {copy[0]:.2f} TB/s before, {copy[1]:.2f} after",
             "decode: TB/s of KV read, pallas / triton / jax paged_attention",
             "batch " + "".join(f"{c:>20d}" for c in DECODE_CONTEXTS)]
    for batch in DECODE_BATCHES:
        cells = [f"{_rate(r, 'pallas', 'TBps'):.2f}/{_rate(r, 'triton', 'TBps'):.2f}/"
                 f"{_rate(r, 'jax', 'TBps'):.2f}"
                 for r in results.get("decode", []) if r["batch"] == batch]
        lines.append(f"{batch:5d} " + "".join(f"{c:>20s}" for c in cells))
    variants = [f"mosaic t{t} s{s} c{c}" for t, s, c in MOSAIC_VARIANTS]
    lines.append("prefill: TFLOP/s, pallas / triton / mosaic (backend) / cuDNN causal on the "
                 "same chunks without context | mosaic prefill kernel alone: " + ", ".join(variants))
    for r in results.get("prefill", []):
        lines.append(f"  chunk {r['chunk']:5d} x{r['reqs']:2d}, ctx {r['ctx']:5d}: "
                     + " / ".join(f"{_rate(r, k, 'TFLOPs'):6.1f}" for k in MODULES)
                     + f" / {r['cudnn_TFLOPs']:6.1f} | "
                     + ", ".join(f"{_rate(r, k, 'TFLOPs'):6.1f}" for k in variants))
    lines.append("mixed (4 x 512-token chunks + 200 decodes): us, TB/s of KV read; block_m=None "
                 "is the default two launches, a number one launch of that q block")
    for r in results.get("mixed", []):
        lines.append(f"  {r['kernel']:6s} block_m={str(r['block_m']):4s}: {r['us']:8.1f} us "
                     f"{r['TBps']:5.2f} TB/s")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="also sweep launch shapes")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--sections", default="mixed,prefill,decode",
                        help="comma-separated: mixed, prefill, decode")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."),
                                                       "bench_attention.json"))
    args = parser.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    rng = np.random.default_rng(0)
    num_blocks = max(DECODE_BATCHES) * max(DECODE_CONTEXTS) // BLOCK_SIZE
    tail = (BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = random_cache(jax.random.key(10), num_blocks, tail)
    v_cache = random_cache(jax.random.key(11), num_blocks, tail)
    results = {"device": jax.devices()[0].device_kind}
    if not args.skip_check:
        results["check"] = check(rng, k_cache, v_cache)
    if args.tune and "pallas" not in BROKEN:
        results["tune"] = tune(rng, k_cache, v_cache)
    sections = args.sections.split(",")
    if "mixed" in sections:
        results["mixed"] = bench_mixed(rng, k_cache, v_cache)
    if "prefill" in sections:
        results["prefill"] = bench_prefill(rng, k_cache, v_cache, {})
    if "decode" in sections:
        # JAX's kernel wants [kv_heads, pages, page_size, dim]: its own random cache.
        jk = random_cache(jax.random.key(12), NUM_KV_HEADS, (num_blocks, BLOCK_SIZE, HEAD_DIM),
                          chunk=1)
        jv = random_cache(jax.random.key(13), NUM_KV_HEADS, (num_blocks, BLOCK_SIZE, HEAD_DIM),
                          chunk=1)
        results["decode"] = bench_decode(rng, k_cache, v_cache, jk, jv, {})
        del jk, jv
    del k_cache, v_cache
    results["copy_TBps"] = [COPY_BEFORE, torch_copy_tbps()]
    results["failed_check"] = sorted(BROKEN)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    if BROKEN:
        sys.exit(f"FAILED the correctness check, not timed: {', '.join(sorted(BROKEN))}")


if __name__ == "__main__":
    main()
