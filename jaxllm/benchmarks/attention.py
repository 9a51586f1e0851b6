"""`jaxllm bench attention`: the ragged paged attention kernels on one GPU, in one run: checks
the Pallas, jax-triton and Mosaic kernels against the reference, then times the ones that
passed next to baselines measured in the same run, and prints a short table last.

  decode   batch 1..256 x context 512..32k (--decode-batches, --decode-contexts): TB/s of KV
           read, beside a device-to-device copy (PyTorch, before and after, where it is
           installed) and JAX's own deprecated Pallas `ops.gpu.paged_attention`.
  prefill  8192-token steps of 512 / 2k / 8k-token chunks, with and without 4k of cached
           context: TFLOP/s beside cuDNN causal attention of the same chunks, and the Mosaic
           prefill kernel alone under a few launch variants.
  mixed    four 512-token prefill chunks + 200 decodes in one call, under each q-block launch.
  --tune   Pallas decode launch shapes around `plan`'s choice.

Shapes: the Llama-3.1-8B heads (32 q / 8 KV heads, dim 128), bf16, block 16.
Timing (device_timing.median_loop_s): the median of 7 runs, each a jitted loop of calls long
enough (20 ms) to hide host dispatch, after a warm-up; inputs rotate over block tables
pointing at a cache much larger than L2 (60 MB), filled with random data.
The check: each kernel's relative L2 error against the reference at highest matmul precision
on bf16 decode and mixed batches; a kernel that raises or errs by 1.5e-2 or more is not timed,
and the bench exits 1. --interpret runs the Pallas and Mosaic kernels in the interpreter, a
check of the bench itself on a CPU at a tiny --decode-* shape (the timings then mean nothing).
"""
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import names_from, positive_ints, report_failures, write_json
from jaxllm.benchmarks.device_timing import median_loop_s, torch_copy_tbps

HELP = "the attention kernels: checked against the reference, timed beside cuDNN, JAX's kernel and the copy rate"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SCALE = 1 / math.sqrt(HEAD_DIM)
KERNELS = ("pallas", "triton", "mosaic")
SECTIONS = ("mixed", "prefill", "decode")
ROTATE_BYTES = 512 << 20  # inputs touched over the rotations: several times the 60 MB L2
MAX_ROTATIONS = 64
PREFILL_TOKENS = 8192  # new tokens per prefill step
# The largest batch the prefill and mixed sections draw from the cache at once: 16 chunks of
# 512 after 4k of context, or the mixed batch's 200 decodes of up to 4k.
SECTION_TOKENS = 1 << 19


def add_cli_args(parser) -> None:
    parser.add_argument("--sections", type=names_from(SECTIONS), default=list(SECTIONS),
                        help="comma-separated: mixed, prefill, decode")
    parser.add_argument("--kernels", type=names_from(KERNELS), default=list(KERNELS),
                        help="comma-separated: which of ours to check and time (pallas, triton, mosaic)")
    parser.add_argument("--decode-batches", type=positive_ints, default="1,8,32,64,256")
    parser.add_argument("--decode-contexts", type=positive_ints, default="512,2048,8192,32768",
                        help="tokens of context per request (multiples of the block size, 16)")
    parser.add_argument("--tune", action="store_true", help="also sweep Pallas decode launch shapes")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--interpret", action="store_true",
                        help="Pallas and Mosaic in the interpreter: a CPU check of the bench at a tiny shape")
    parser.add_argument("--output-json", "--json", dest="output_json", help="write the results to this file")


def random_cache(key, num_blocks: int, shape_tail: tuple, dtype=jnp.bfloat16, chunk: int = 1 << 16):
    """[num_blocks, *shape_tail] of normal random data, made chunk by chunk."""
    @functools.partial(jax.jit, static_argnums=1)
    def make(k, n):
        return jax.random.normal(k, (n, *shape_tail), jnp.float32).astype(dtype)
    keys = jax.random.split(key, -(-num_blocks // chunk))
    parts = [make(k, min(chunk, num_blocks - i * chunk)) for i, k in enumerate(keys)]
    return jnp.concatenate(parts)


def block_tables(rng, num_reqs: int, pages_per_req: int, num_blocks: int, width: int):
    """[num_reqs, width] int32: distinct random cache blocks for every request."""
    pages = rng.choice(num_blocks, size=num_reqs * pages_per_req, replace=False)
    table = np.zeros((num_reqs, width), np.int32)
    table[:, :pages_per_req] = pages.reshape(num_reqs, pages_per_req)
    return jnp.asarray(table)


def batch_args(rng, k_cache, v_cache, ctx_lens, q_lens, num_tokens: int, max_num_reqs: int, width: int):
    """Arguments of ragged_paged_attention for requests with the given cached context and new
    tokens, padded to the token and request buckets, each request on random cache blocks."""
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


class Kernels:
    """Our kernels under test: those asked for, less those that failed the check."""

    def __init__(self, names: list[str], interpret: bool):
        from jaxllm.kernels import mosaic_attention, pallas_attention, triton_attention
        modules = {"pallas": pallas_attention, "triton": triton_attention, "mosaic": mosaic_attention}
        self.modules = {name: modules[name] for name in names}
        self.interpret = interpret
        # The interpreter's timings mean nothing (and no L2 to defeat): two rotations keep its loops short.
        self.max_rotations = 2 if interpret else MAX_ROTATIONS
        self.broken: set[str] = set()

    def call(self, name: str, *args, **launch):
        """One kernel on one batch; jax-triton has no interpreter."""
        interpret = {"interpret": True} if self.interpret and name != "triton" else {}
        return self.modules[name].paged_attention(*args, **launch, **interpret)

    def fns(self, **launch) -> dict:
        """name -> fn(*batch) of each kernel that passed, with these launch knobs. Mosaic (its
        prefill kernel + Pallas decode) has no knobs of its own: it runs only without them."""
        return {name: functools.partial(self.call, name, scale=SCALE, **({} if name == "mosaic" else launch))
                for name in self.modules
                if name not in self.broken and not (name == "mosaic" and any(launch.values()))}


def check(rng, k_cache, v_cache, kernels: Kernels, max_context: int) -> dict:
    """Relative L2 error of each kernel against the reference (at highest matmul precision, as
    in the tests: XLA's f32 default on GPU is TF32) on bf16 batches, contexts clipped to
    `max_context`; a kernel that raises, or errs by 1.5e-2 or more, goes into kernels.broken."""
    from jaxllm.kernels import reference
    cases = {
        "decode b8": ([900, 3000, 17, 1, 2048, 4095, 64, 333], [1] * 8, 9, 9),
        "mixed": ([0, 700, 1500, 40, 2000, 0], [300, 129, 1, 1, 77, 1], 512, 8),
        "decode b64": (list(rng.integers(1, 5000, 64)), [1] * 64, 64, 64),
    }
    errors = {}
    for name, (ctx, qn, num_tokens, max_reqs) in cases.items():
        ctx = np.minimum(ctx, np.maximum(max_context - np.asarray(qn), 0))
        args = batch_args(rng, k_cache, v_cache, ctx, qn, num_tokens, max_reqs, 512)
        n = int(sum(qn))
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(reference.ragged_paged_attention(*args, scale=0.088)[:n], np.float32)
        for kname in kernels.modules:
            for splits in ((None,) if kname == "mosaic" else (None, 4)):
                try:
                    knobs = {} if splits is None else {"num_splits": splits}
                    out = np.asarray(kernels.call(kname, *args, scale=0.088, **knobs)[:n], np.float32)
                except Exception as e:  # noqa: BLE001 - report, time the others
                    print(f"check {kname} {name} FAILED: {e!r}"[:3000], flush=True)
                    kernels.broken.add(kname)
                    continue
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                errors[f"{kname} {name} splits={splits}"] = err
                ok = err < 1.5e-2 and np.isfinite(out).all()
                if not ok:
                    kernels.broken.add(kname)
                print(f"check {kname:6s} {name:10s} splits={splits}: rel err {err:.2e}"
                      f"{'' if ok else '  <-- FAIL'}", flush=True)
    return errors


def jax_paged_attention_fn():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated: it is the baseline
        from jax.experimental.pallas.ops.gpu import paged_attention
    return paged_attention.paged_attention


def decode_sets(rng, k_cache, v_cache, batch: int, ctx: int, width: int, max_rotations: int) -> tuple[list, int]:
    """Rotating decode batches of `batch` requests at context `ctx`, and the KV bytes each reads."""
    kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.dtype.itemsize
    rotations = max(1, min(max_rotations, ROTATE_BYTES // kv_bytes))
    return [batch_args(rng, k_cache, v_cache, [ctx - 1] * batch, [1] * batch, batch, batch, width)
            for _ in range(rotations)], kv_bytes


def bench_decode(rng, k_cache, v_cache, jk_pages, jv_pages, kernels: Kernels, batches, contexts) -> list[dict]:
    rows = []
    jax_fn = jax_paged_attention_fn()
    fns = kernels.fns()
    fns.pop("mosaic", None)  # a decode bucket runs the Pallas kernel
    num_blocks = k_cache.shape[0]
    for batch in batches:
        for ctx in contexts:
            sets, kv_bytes = decode_sets(rng, k_cache, v_cache, batch, ctx, max(contexts) // BLOCK_SIZE,
                                         kernels.max_rotations)
            row = {"batch": batch, "ctx": ctx, "kv_MB": kv_bytes / 1e6}
            for name, fn in fns.items():
                t = median_loop_s(fn, sets)
                row[name] = {"us": t * 1e6, "TBps": kv_bytes / t / 1e12}
            pages = ctx // BLOCK_SIZE
            jsets = [(s[0], jk_pages, jv_pages, block_tables(rng, batch, pages, num_blocks, pages),
                      jnp.full((batch,), ctx, jnp.int32)) for s in sets]
            try:
                t = median_loop_s(jax_fn, jsets)
                row["jax"] = {"us": t * 1e6, "TBps": kv_bytes / t / 1e12}
            except Exception as e:  # noqa: BLE001 - report and go on
                row["jax"] = {"error": repr(e)[:200]}
            print("decode", json.dumps(row), flush=True)
            rows.append(row)
    return rows


def causal_flops(ctx: int, chunk: int, num_reqs: int) -> float:
    """FLOPs of QK^T and PV over the unmasked pairs, for num_reqs chunks."""
    pairs = chunk * ctx + chunk * (chunk + 1) / 2
    return 4 * NUM_Q_HEADS * HEAD_DIM * pairs * num_reqs


def mosaic_variants() -> list[tuple]:
    """Mosaic GPU prefill launches timed alone: (tile, stages, CTAs; None: one per work item,
    the device's SM count: one per SM, persistent)."""
    num_sms = getattr(jax.devices()[0], "core_count", None)
    return [(128, 2, None), *([(128, 2, num_sms)] if num_sms else []), (64, 4, None)]


def variant_name(tile: int, stages: int, ctas) -> str:
    return f"mosaic t{tile} s{stages} c{ctas}"


def bench_prefill(rng, k_cache, v_cache, kernels: Kernels) -> list[dict]:
    from jaxllm.kernels import mosaic_attention
    rows = []
    fns = kernels.fns()
    for chunk in (512, 2048, 8192):
        num_reqs = PREFILL_TOKENS // chunk
        shape = (num_reqs, chunk, NUM_Q_HEADS, HEAD_DIM)
        q = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
        k = jax.random.normal(jax.random.key(2), shape[:2] + (NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
        v = jax.random.normal(jax.random.key(3), k.shape, jnp.bfloat16)
        cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"))
        try:
            cudnn_tflops = causal_flops(0, chunk, num_reqs) / median_loop_s(cudnn, [(q, k, v)]) / 1e12
        except Exception as e:  # noqa: BLE001 - no cuDNN here: the kernels' figures still stand
            print("cudnn failed:", repr(e)[:300], flush=True)
            cudnn_tflops = float("nan")
        for ctx in (0, 4096):
            width = -(-(ctx + chunk) // BLOCK_SIZE)
            sets = [batch_args(rng, k_cache, v_cache, [ctx] * num_reqs, [chunk] * num_reqs,
                               PREFILL_TOKENS, num_reqs, width) for _ in range(2)]
            flops = causal_flops(ctx, chunk, num_reqs)
            row = {"chunk": chunk, "ctx": ctx, "reqs": num_reqs, "cudnn_TFLOPs": cudnn_tflops}
            for name, fn in fns.items():
                t = median_loop_s(fn, sets)
                row[name] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
            if "mosaic" in fns:
                for tile, stages, ctas in mosaic_variants():
                    fn = functools.partial(mosaic_attention.prefill_attention, scale=SCALE, tile=tile,
                                           stages=stages, num_ctas=ctas, interpret=kernels.interpret)
                    try:
                        t = median_loop_s(fn, sets)
                        row[variant_name(tile, stages, ctas)] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
                    except Exception as e:  # noqa: BLE001
                        print(f"{variant_name(tile, stages, ctas)} failed: {e!r}"[:2000], flush=True)
            print("prefill", json.dumps(row), flush=True)
            rows.append(row)
    return rows


def bench_mixed(rng, k_cache, v_cache, kernels: Kernels) -> list[dict]:
    ctx = [0, 1000, 2000, 3000] + list(rng.integers(256, 4096, 200))
    qn = [512] * 4 + [1] * 200
    sets = [batch_args(rng, k_cache, v_cache, ctx, qn, 2304, 256, 512) for _ in range(4)]
    kv_bytes = sum(c + n for c, n in zip(ctx, qn)) * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    rows = []
    # None: `plan`'s two launches; a block_m: one launch of that shape for all.
    for block_m in (None, 16, 128):
        for name, fn in kernels.fns(block_m=block_m).items():
            t = median_loop_s(fn, sets)
            row = {"kernel": name, "block_m": block_m, "us": t * 1e6, "TBps": kv_bytes / t / 1e12}
            print("mixed", json.dumps(row), flush=True)
            rows.append(row)
    return rows


def tune(rng, k_cache, v_cache, kernels: Kernels, width: int) -> list[dict]:
    """Pallas decode launch shapes at batch 32 x 2k context (the one decode cell under target)
    and batch 8 x 8k, around `plan`'s choice (tile 64, 3 stages, 2 and 8 splits)."""
    results = []
    for batch, ctx, shapes in [
            (32, 2048, [(64, 3, 1), (64, 3, 2), (64, 2, 2), (64, 2, 4), (32, 3, 2), (32, 3, 4),
                        (32, 4, 4), (128, 2, 2)]),
            (8, 8192, [(64, 3, 8), (32, 3, 16), (32, 4, 8)])]:
        sets, kv_bytes = decode_sets(rng, k_cache, v_cache, batch, ctx, width, kernels.max_rotations)
        for tile, stages, splits in shapes:
            config = dict(tile=tile, num_stages=stages, num_splits=splits, num_warps=4)
            t = median_loop_s(kernels.fns(**config)["pallas"], sets)
            row = {"decode": [batch, ctx], **config, "TBps": kv_bytes / t / 1e12}
            print("tune", json.dumps(row), flush=True)
            results.append(row)
    return results


def _rate(row: dict, name: str, key: str) -> float:
    return row.get(name, {}).get(key, float("nan"))


def table(results: dict) -> str:
    copy = results["copy_TBps"]
    decode = results.get("decode", [])
    contexts = sorted({r["ctx"] for r in decode})
    lines = [f"copy (PyTorch D2D, read+write): {copy[0]:.2f} TB/s before, {copy[1]:.2f} after",
             "decode: TB/s of KV read, pallas / triton / jax paged_attention",
             "batch " + "".join(f"{c:>20d}" for c in contexts)]
    for batch in sorted({r["batch"] for r in decode}):
        cells = [f"{_rate(r, 'pallas', 'TBps'):.2f}/{_rate(r, 'triton', 'TBps'):.2f}/{_rate(r, 'jax', 'TBps'):.2f}"
                 for r in decode if r["batch"] == batch]
        lines.append(f"{batch:5d} " + "".join(f"{c:>20s}" for c in cells))
    variants = [variant_name(*v) for v in results["mosaic_variants"]]
    lines.append("prefill: TFLOP/s, pallas / triton / mosaic (backend) / cuDNN causal on the "
                 "same chunks without context | mosaic prefill kernel alone: " + ", ".join(variants))
    for r in results.get("prefill", []):
        lines.append(f"  chunk {r['chunk']:5d} x{r['reqs']:2d}, ctx {r['ctx']:5d}: "
                     + " / ".join(f"{_rate(r, k, 'TFLOPs'):6.1f}" for k in KERNELS)
                     + f" / {r['cudnn_TFLOPs']:6.1f} | "
                     + ", ".join(f"{_rate(r, k, 'TFLOPs'):6.1f}" for k in variants))
    lines.append("mixed (4 x 512-token chunks + 200 decodes): us, TB/s of KV read; block_m=None "
                 "is the default two launches, a number one launch of that q block")
    for r in results.get("mixed", []):
        lines.append(f"  {r['kernel']:6s} block_m={str(r['block_m']):4s}: {r['us']:8.1f} us {r['TBps']:5.2f} TB/s")
    return "\n".join(lines)


def cache_blocks(ns) -> int:
    """Cache blocks enough for every batch the run draws at once (distinct blocks per batch)."""
    tokens = 64 * max(ns.decode_contexts)  # the check's 64 decodes
    if "decode" in ns.sections:
        tokens = max(tokens, max(ns.decode_batches) * max(ns.decode_contexts))
    if ns.tune:  # 32 x 2k and 8 x 8k
        tokens = max(tokens, 1 << 16)
    if {"prefill", "mixed"} & set(ns.sections):
        tokens = max(tokens, SECTION_TOKENS)
    return tokens // BLOCK_SIZE


def main(ns) -> int:
    if any(c % BLOCK_SIZE for c in ns.decode_contexts):
        raise ValueError(f"--decode-contexts must be multiples of the block size ({BLOCK_SIZE})")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")  # PyTorch's copy runs again at the end
    copy_before = torch_copy_tbps()  # before JAX takes its share of the GPU's memory
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    rng = np.random.default_rng(0)
    num_blocks = cache_blocks(ns)
    tail = (BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = random_cache(jax.random.key(10), num_blocks, tail)
    v_cache = random_cache(jax.random.key(11), num_blocks, tail)
    kernels = Kernels(ns.kernels, ns.interpret)
    results = {"device": jax.devices()[0].device_kind, "mosaic_variants": mosaic_variants()}
    if not ns.skip_check:
        results["check"] = check(rng, k_cache, v_cache, kernels, max(ns.decode_contexts))
    if ns.tune and "pallas" in kernels.fns():
        results["tune"] = tune(rng, k_cache, v_cache, kernels, max(8192, *ns.decode_contexts) // BLOCK_SIZE)
    if "mixed" in ns.sections:
        results["mixed"] = bench_mixed(rng, k_cache, v_cache, kernels)
    if "prefill" in ns.sections:
        results["prefill"] = bench_prefill(rng, k_cache, v_cache, kernels)
    if "decode" in ns.sections:
        # JAX's kernel wants [kv_heads, pages, page_size, dim]: its own random cache.
        jk = random_cache(jax.random.key(12), NUM_KV_HEADS, (num_blocks, BLOCK_SIZE, HEAD_DIM), chunk=1)
        jv = random_cache(jax.random.key(13), NUM_KV_HEADS, (num_blocks, BLOCK_SIZE, HEAD_DIM), chunk=1)
        results["decode"] = bench_decode(rng, k_cache, v_cache, jk, jv, kernels, ns.decode_batches,
                                         ns.decode_contexts)
        del jk, jv
    del k_cache, v_cache
    results["copy_TBps"] = [copy_before, torch_copy_tbps()]
    results["failed_check"] = sorted(kernels.broken)
    write_json(ns.output_json, results)
    print(table(results))
    return report_failures([f"{name} failed the correctness check, so it was not timed"
                            for name in sorted(kernels.broken)])
