"""`jaxllm bench invariant-matmul`: the batch-invariant matmul (kernels/batch_invariant.py)
against XLA's dot at the 8B's shapes, from decode's few rows to a prefill's thousands, and
whether a row's bits stay the same whatever the number of rows (one table, last).

For each weight K x N and row count M: XLA's dot and the invariant matmul with the tiles it
picks (`tiles`), or with each of --tiles instead (a sweep), timed on the device
(median_loop_s, four weights in rotation so that they do not sit in L2); each one's float32
result for its first 16 rows compared bit for bit with the picked tiles' at the largest M. Exits 1 if
an invariant launch's bits differ: those tiles would make a request's numbers depend on its
batch.
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import positive_int, positive_ints, write_json
from jaxllm.benchmarks.device_timing import median_loop_s
from jaxllm.benchmarks.fp8 import shapes

HELP = "the batch-invariant matmul against XLA's dot: time per row count, and the bits across row counts"
NUM_WEIGHTS = 4  # in rotation: the 8B's smallest weight is 32 MiB, four pass the H200's L2
CHECKED_ROWS = 16


def tile_list(text: str):
    """"16x32:4:6,64x64:4:6" -> [MatmulTiles(16, 32, 4, 6), MatmulTiles(64, 64, 4, 6)]."""
    from jaxllm.kernels.batch_invariant import MatmulTiles
    found = []
    for item in text.split(","):
        try:
            blocks, warps, stages = item.split(":")
            bm, bn = blocks.split("x")
            found.append(MatmulTiles(int(bm), int(bn), int(warps), int(stages)))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{item!r} is not BMxBN:WARPS:STAGES, e.g. 16x32:4:6 ({e})") from None
    return found


def add_cli_args(parser) -> None:
    parser.add_argument("--shapes", type=shapes, default="4096x4096,14336x4096,4096x6144,4096x28672",
                        help="K x N of each weight, comma-separated (default: the 8B's o, down, qkv and gate-up)")
    parser.add_argument("--rows", type=positive_ints, default="16,64,128,256,1024,8192", help="the M values")
    parser.add_argument("--tiles", type=tile_list, help="time these launches too (BMxBN:WARPS:STAGES, comma-"
                        "separated) at every M, beside the picked one")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed loops, the median taken")
    parser.add_argument("--output-json", help="write the rows to this file")


def main(ns) -> int:
    from jaxllm.kernels import batch_invariant
    print(jax.devices()[0].device_kind, jax.__version__)
    rng = np.random.default_rng(0)
    rows, failed = [], []
    for k, n in ns.shapes:
        weights = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
                   for _ in range(NUM_WEIGHTS)]
        x = jnp.asarray(rng.standard_normal((max(ns.rows), k), np.float32), jnp.bfloat16)

        def first_rows(fn, m):
            return np.asarray(jax.jit(fn)(x[:m], weights[0]))[:CHECKED_ROWS].view(np.uint32)

        largest = max(ns.rows)
        want = first_rows(functools.partial(batch_invariant.matmul, out_dtype=jnp.float32), largest)
        for m in ns.rows:
            xla_s = median_loop_s(jnp.dot, [(x[:m], w) for w in weights], reps=ns.repeats)
            launches = [("picked", batch_invariant.tiles(m, n))] + [("sweep", t) for t in ns.tiles or ()]
            for kind, t in launches:
                fn = functools.partial(batch_invariant.pallas_matmul, t=t)
                ms = 1e3 * median_loop_s(functools.partial(fn, out_dtype=jnp.bfloat16),
                                         [(x[:m], w) for w in weights], reps=ns.repeats)
                got = first_rows(functools.partial(fn, out_dtype=jnp.float32), m)
                same = bool(np.array_equal(got, want[:len(got)]))
                rows.append({"shape": f"{k}x{n}", "m": m, "launch": kind, "tiles": f"{t.block_m}x{t.block_n}:"
                             f"{t.num_warps}:{t.num_stages}", "ms": ms, "xla_ms": 1e3 * xla_s,
                             "vs_xla": ms / (1e3 * xla_s), "TBps": k * n * 2 / ms / 1e9,
                             "TFLOPs": 2 * m * k * n / ms / 1e9, "same_bits": same})
                print(*rows[-1].values(), flush=True)  # as it comes, in case the call is cut short
                if not same:
                    failed.append(f"{k}x{n} M={m} tiles {rows[-1]['tiles']}")
    write_json(ns.output_json, {"device": jax.devices()[0].device_kind, "rows": rows})
    print(f"\n{'K x N':>11} {'M':>5} {'launch':>6} {'tiles':>12} {'ms':>8} {'XLA ms':>8} {'vs XLA':>6} "
          f"{'TB/s':>5} {'TFLOP/s':>7}  bits as at M={max(ns.rows)}")
    for r in rows:
        print(f"{r['shape']:>11} {r['m']:>5} {r['launch']:>6} {r['tiles']:>12} {r['ms']:>8.4f} {r['xla_ms']:>8.4f} "
              f"{r['vs_xla']:>6.2f} {r['TBps']:>5.2f} {r['TFLOPs']:>7.0f}  {'same' if r['same_bits'] else 'DIFFERENT'}")
    for line in failed:
        print("bits differ:", line)
    return 1 if failed else 0
