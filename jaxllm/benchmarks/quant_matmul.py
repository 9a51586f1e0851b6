"""`jaxllm bench quant-matmul`: the quantized checkpoints' matmul kernels (kernels/w4a16.py for AWQ
and GPTQ, kernels/fp8_block.py for 128 x 128 block FP8) against XLA's bf16 dot at the 8B's shapes,
from decode's few rows to a prefill's thousands (one table, last).

For each weight K x N and row count M: XLA's dot on the bf16 weight, then each kernel with the
tiles its `tiles` picks (or each of --w4-tiles / --fp8-tiles instead: a sweep), timed on the device
(median_loop_s, enough weights in rotation that they do not sit in L2), each first checked against
its plain-JAX reference (relative L2 error; over 1e-2 the bench exits 1). The FP8 time is the
kernel's alone: the activations' quantization per token and block is an XLA fusion before it.
On a CPU the kernels run in the Pallas interpreter (a check of the bench, no timing to trust).
"""
import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import positive_int, positive_ints, write_json
from jaxllm.benchmarks.device_timing import median_loop_s
from jaxllm.benchmarks.fp8 import shapes

HELP = "the W4A16 and block-FP8 matmul kernels against XLA's bf16 dot: time per row count, checked first"
ROTATION_BYTES = 128 << 20  # weights in rotation per shape: twice the H200's 60 MB L2
MAX_ERROR = 1e-2


def _tiles(kind: str):
    def parse(text: str):
        from jaxllm.kernels.fp8_block import Fp8BlockTiles
        from jaxllm.kernels.w4a16 import W4A16Tiles
        found = []
        for item in text.split(","):
            try:
                blocks, warps, stages, *mma = item.split(":")
                bm, bn = blocks.split("x")
                fields = (int(bm), int(bn), int(warps), int(stages))
                found.append(W4A16Tiles(*fields) if kind == "w4" else Fp8BlockTiles(*fields, *mma))
            except (ValueError, TypeError) as e:
                raise argparse.ArgumentTypeError(f"{item!r} is not BMxBN:WARPS:STAGES{':MMA' if kind == 'fp8' else ''}"
                                                 f" ({e})") from None
        return found
    return parse


def add_cli_args(parser) -> None:
    parser.add_argument("--shapes", type=shapes, default="4096x4096,14336x4096,4096x6144,4096x28672",
                        help="K x N of each weight, comma-separated (default: the 8B's o, down, qkv and gate-up)")
    parser.add_argument("--rows", type=positive_ints, default="16,64,256,1024,8192", help="the M values")
    parser.add_argument("--group-size", type=positive_int, default=128, help="W4A16: input rows per scale and zero")
    parser.add_argument("--block", type=positive_int, default=128, help="FP8: the scale block's rows and columns")
    parser.add_argument("--w4-tiles", type=_tiles("w4"), help="time these W4A16 launches instead of the picked "
                        "one (BMxBN:WARPS:STAGES, comma-separated)")
    parser.add_argument("--fp8-tiles", type=_tiles("fp8"), help="time these FP8 launches instead of the picked "
                        "ones (BMxBN:WARPS:STAGES:MMA, MMA bfloat16 or e4m3)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed loops, the median taken")
    parser.add_argument("--output-json", help="write the rows to this file")


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def main(ns) -> int:
    from jaxllm.kernels import fp8_block, w4a16
    from jaxllm.models.fp8 import quantize_rows
    interpret = jax.default_backend() != "gpu"
    print(jax.devices()[0].device_kind, jax.__version__)
    rng = np.random.default_rng(0)
    rows, failed = [], []
    for k, n in ns.shapes:
        count = min(max(2, -(-ROTATION_BYTES // (k * n // 2))), 16)  # 16 int4 weights of 4096 x 4096 fill it
        group, block = ns.group_size, ns.block
        int4 = [(jnp.asarray(rng.integers(0, 256, (k // 2, n)), jnp.uint8),
                 jnp.asarray(rng.uniform(0.001, 0.002, (k // group, n)), jnp.bfloat16),
                 jnp.asarray(rng.integers(0, 16, (k // group, n)), jnp.uint8)) for _ in range(count)]
        fp8 = [(jnp.asarray(rng.standard_normal((n, k)), jnp.float8_e4m3fn),
                jnp.asarray(rng.uniform(0.001, 0.002, (n // block, k // block)), jnp.float32))
               for _ in range(max(2, count // 2))]
        bf16 = [jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16) for _ in range(max(2, count // 4))]
        x = jnp.asarray(rng.standard_normal((max(ns.rows), k)), jnp.bfloat16)
        for m in ns.rows:
            xla_ms = 1e3 * median_loop_s(jnp.dot, [(x[:m], w) for w in bf16], reps=ns.repeats)
            x8, x_scale = jax.jit(quantize_rows, static_argnums=1)(x[:m], block)
            launches = [("w4a16", t) for t in ns.w4_tiles or [w4a16.tiles(m, n)]]
            picked = fp8_block.tiles(m, block)
            launches += [("fp8_block", t) for t in ns.fp8_tiles or [picked, dataclasses.replace(picked, mma="bfloat16")]]
            for kind, t in launches:
                if kind == "w4a16":
                    fn = functools.partial(w4a16.pallas_matmul, t=t, interpret=interpret)
                    args, weight_bytes = [(x[:m], *w) for w in int4], k * n // 2
                    want = w4a16.reference_matmul(x[:m].astype(jnp.float32), *int4[0])
                else:
                    fn = functools.partial(fp8_block.pallas_matmul, t=t, out_dtype=jnp.bfloat16, interpret=interpret)
                    args, weight_bytes = [(x8, x_scale, *w) for w in fp8], k * n
                    want = fp8_block.reference_matmul(x8, x_scale, *fp8[0])
                try:
                    error = _relative_error(jax.jit(fn)(*args[0]), want)
                except Exception as e:  # a launch the compiler refuses: reported, the others still run
                    error, message = float("inf"), f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                else:
                    message = None
                tiles = f"{t.block_m}x{t.block_n}:{t.num_warps}:{t.num_stages}" + (f":{t.mma}" if kind != "w4a16" else "")
                row = {"shape": f"{k}x{n}", "m": m, "kernel": kind, "tiles": tiles, "rel_err": error, "xla_ms": xla_ms}
                if error > MAX_ERROR:
                    failed.append(f"{kind} {k}x{n} M={m} tiles {tiles}: " + (message or f"relative error {error:.2e}"))
                else:
                    ms = 1e3 * median_loop_s(fn, args, reps=ns.repeats)
                    row.update(ms=ms, vs_xla=ms / xla_ms, TBps=weight_bytes / ms / 1e9, TFLOPs=2 * m * k * n / ms / 1e9)
                rows.append(row)
                print(*row.values(), flush=True)  # as it comes, in case the call is cut short
    write_json(ns.output_json, {"device": jax.devices()[0].device_kind, "rows": rows, "failed": failed})
    print(f"\n{'K x N':>11} {'M':>5} {'kernel':>9} {'tiles':>22} {'ms':>8} {'bf16 ms':>8} {'vs bf16':>7} "
          f"{'W TB/s':>6} {'TFLOP/s':>7} {'rel err':>8}")
    for r in rows:
        timed = "ms" in r
        print(f"{r['shape']:>11} {r['m']:>5} {r['kernel']:>9} {r['tiles']:>22} "
              + (f"{r['ms']:>8.4f} {r['xla_ms']:>8.4f} {r['vs_xla']:>7.2f} {r['TBps']:>6.2f} {r['TFLOPs']:>7.0f}"
                 if timed else f"{'-':>8} {r['xla_ms']:>8.4f} {'-':>7} {'-':>6} {'-':>7}") + f" {r['rel_err']:>8.1e}")
    for line in failed:
        print("FAILED:", line)
    return 1 if failed else 0
