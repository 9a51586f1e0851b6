"""`jaxllm bench moe-matmul`: the MoE layer's grouped GEMM (models/moe.py's expert_mlp: the experts'
SwiGLU on rows sorted by expert, two grouped GEMMs) at an MoE model's expert shapes, from
decode's few tokens to a prefill's thousands (one table, last).

For each token count T, the T * k (token, expert) rows of a uniform random routing, through:
- ragged: jax.lax.ragged_dot as XLA lowers it (JAXLLM_MOE_KERNEL=ragged);
- pallas: the Pallas grouped GEMM (kernels/grouped_matmul.py, JAXLLM_MOE_KERNEL=pallas);
- mosaic: JAX's Mosaic GPU grouped GEMM (a Hopper GPU; mosaic_grouped_matmul) at every T, where
  JAXLLM_MOE_KERNEL=mosaic takes it from MOSAIC_MIN_ROWS rows;
- fp8, fp8-pallas: the experts in e4m3 as quantization="fp8" holds them, the rows scaled to e4m3
  per row, through either;
- dense: the same rows through one expert's SwiGLU with jnp.dot, the same FLOPs: the rate a
  grouped GEMM is held to at prefill;
- gather (up to --gather-max-rows rows): each row's expert weights gathered and applied one row at
  a time, which reads only the chosen experts: the small-batch path a decode step could take.
Each variant's output is checked against ragged's (relative L2 error over 1e-2, fp8's over 0.1: the
bench exits 1),
then timed on the device (median_loop_s, two weight sets in rotation). The table gives each one's
time, its TFLOP/s and, against the bytes of the experts the routing chose, its GB/s: at small T
the layer should read only those, so a rate far under the device's copy rate means it read the others.

--tiles BMxBNxBKxWARPSxSTAGES,... also times the Pallas kernel alone at each of those launches
(mBMxBNxBKxSTEPSxGRIDN: the Mosaic kernel's, MosaicTiles), on each projection of the layer
(gate-up: K = hidden, N = 2I; down: K = I, N = hidden), against a dense dot of the same rows (a
second table): the sweep behind the kernels' default tiles.
"""
import argparse
import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import positive_int, positive_ints, write_json
from jaxllm.benchmarks.device_timing import median_loop_s

HELP = "the MoE grouped GEMM (ragged_dot, the Pallas kernel, FP8, a gather path) against a dense dot of the same FLOPs"
MAX_ERROR = 1e-2
FP8_MAX_ERROR = 0.1  # e4m3's rounding of the weights and of the rows, about 4% each
VARIANTS = ("ragged", "pallas", "mosaic", "fp8", "fp8-pallas", "dense", "gather")


def add_cli_args(parser) -> None:
    parser.add_argument("--experts", type=positive_int, default=128, help="E (default: Qwen3-30B-A3B's 128)")
    parser.add_argument("--top-k", type=positive_int, default=8, help="k, the experts per token (default 8)")
    parser.add_argument("--hidden-size", type=positive_int, default=2048, help="default 2048")
    parser.add_argument("--intermediate-size", type=positive_int, default=768, help="each expert's (default 768)")
    parser.add_argument("--tokens", type=positive_ints, default="1,4,16,64,256,1024,4096,8192", help="the T values")
    parser.add_argument("--gather-max-rows", type=int, default=64, help="time the gather path up to this many rows")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"a comma-separated subset of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--tiles", type=_tile_list, default=[],
                        help="also time the kernels per projection at these launches, e.g. 64x128x64x4x4,128x128x64x8x3 "
                             "(Pallas: BMxBNxBKxWARPSxSTAGES), m128x128x64x4x1 (Mosaic: mBMxBNxBKxSTEPSxGRIDN)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed loops, the median taken")
    parser.add_argument("--output-json", help="write the rows to this file")


def _tile_list(text: str) -> list:
    from jaxllm.kernels.grouped_matmul import GroupedTiles, MosaicTiles

    def tiles(item: str):
        if item.startswith("m"):
            return MosaicTiles(*map(int, item[1:].split("x")))
        return GroupedTiles(*map(int, item.split("x")))
    try:
        return [tiles(item) for item in text.split(",") if item]
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"BMxBNxBKxWARPSxSTAGES or mBMxBNxBKxSTEPSxGRIDN items, comma-separated "
                                         f"({err})") from None


def _launch(tiles) -> str:
    """A launch's name in the tables: its --tiles item."""
    from jaxllm.kernels.grouped_matmul import MosaicTiles
    if isinstance(tiles, MosaicTiles):
        return f"m{tiles.block_m}x{tiles.block_n}x{tiles.block_k}x{tiles.steps}x{tiles.grid_block_n}"
    return f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}x{tiles.num_warps}x{tiles.num_stages}"


def _grouped_at(x, weight, sizes, tiles):
    """The grouped GEMM of tiles' kernel at that launch."""
    from jaxllm.kernels.grouped_matmul import MosaicTiles, grouped_matmul, mosaic_grouped_matmul
    if isinstance(tiles, MosaicTiles):
        return mosaic_grouped_matmul(x, weight, sizes, tiles)
    return grouped_matmul(x, weight, sizes, tiles=tiles)


def _routing(rng, t: int, e: int, k: int):
    """A uniform random routing of t tokens to k distinct experts each: (row experts [t * k] sorted,
    group sizes [e], the number of experts hit)."""
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].reshape(-1)
    return (jnp.asarray(np.sort(ids, kind="stable"), jnp.int32), jnp.asarray(np.bincount(ids, minlength=e), jnp.int32),
            len(np.unique(ids)))


def _tile_sweep(ns, rng) -> tuple[list[dict], list[str]]:
    """Each projection's grouped GEMM at each of ns.tiles, beside a dense dot of the same rows: prints
    the table; (its rows, the launches whose output differs from the default launch's)."""
    from jaxllm.kernels.grouped_matmul import grouped_matmul
    e, k, hidden, inter = ns.experts, ns.top_k, ns.hidden_size, ns.intermediate_size
    rows_out, failed = [], []
    for name, kk, n in (("gate-up", hidden, 2 * inter), ("down", inter, hidden)):
        weight_sets = [jnp.asarray(rng.standard_normal((e, kk, n), np.float32) * 0.02, jnp.bfloat16) for _ in range(2)]
        for t in ns.tokens:
            _, sizes, _ = _routing(rng, t, e, k)
            x = jnp.asarray(rng.standard_normal((t * k, kk), np.float32), jnp.bfloat16)
            want = np.asarray(jax.jit(grouped_matmul)(x, weight_sets[0], sizes), np.float32)
            flops = 2 * t * k * kk * n
            dense_s = median_loop_s(lambda x, w: jnp.dot(x, w[0]), [(x, w) for w in weight_sets], reps=ns.repeats)
            for tiles in ns.tiles:
                fn = lambda x, w, tiles=tiles: _grouped_at(x, w, sizes, tiles)
                try:
                    got = np.asarray(jax.jit(fn)(x, weight_sets[0]), np.float32)
                except Exception as err:  # a launch this device cannot run (shared memory): said, not fatal
                    print(f"{name} T={t} {_launch(tiles)}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                    continue
                error = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
                if error > MAX_ERROR:
                    failed.append(f"{name} T={t} {_launch(tiles)}: relative error {error:.2e}")
                s = median_loop_s(fn, [(x, w) for w in weight_sets], reps=ns.repeats)
                launch = _launch(tiles)
                rows_out.append({"projection": name, "tokens": t, "tiles": launch, "us": 1e6 * s,
                                 "TFLOPs": flops / s / 1e12, "vs_dense": dense_s / s})
                print(*rows_out[-1].values(), flush=True)
    print(f"\n{'projection':>10} {'T':>6} {'tiles':>16} {'us':>9} {'TFLOP/s':>8} {'vs dense':>8}")
    for r in rows_out:
        print(f"{r['projection']:>10} {r['tokens']:>6} {r['tiles']:>16} {r['us']:>9.1f} {r['TFLOPs']:>8.1f} "
              f"{r['vs_dense']:>8.2f}")
    return rows_out, failed


def _gather_mlp(rows, experts, gate_up, down):
    """Each row through its own expert, the weights gathered per row: rows [M, hidden], experts [M]."""
    g, hidden, _, inter = gate_up.shape
    gu = jnp.einsum("mh,mhn->mn", rows, gate_up[experts].reshape(-1, hidden, 2 * inter)).reshape(-1, 2, inter)
    return jnp.einsum("mi,mih->mh", jax.nn.silu(gu[:, 0]) * gu[:, 1], down[experts])


def _mosaic_mlp(rows, sizes, gate_up, down):
    """expert_mlp's two GEMMs through the Mosaic kernel whatever the number of rows."""
    from jaxllm.kernels.grouped_matmul import mosaic_grouped_matmul
    g, hidden, _, inter = gate_up.shape
    gu = mosaic_grouped_matmul(rows, gate_up.reshape(g, hidden, 2 * inter), sizes).reshape(-1, 2, inter)
    return mosaic_grouped_matmul(jax.nn.silu(gu[:, 0]) * gu[:, 1], down, sizes)


def _dense_mlp(rows, gate_up, down):
    gu = jnp.dot(rows, gate_up.reshape(gate_up.shape[0], -1)).reshape(rows.shape[0], 2, -1)
    return jnp.dot(jax.nn.silu(gu[:, 0]) * gu[:, 1], down)


@contextlib.contextmanager
def _moe_kernel(kind: str):
    """JAXLLM_MOE_KERNEL=kind (read when a jitted function traces) while inside."""
    before = os.environ.get("JAXLLM_MOE_KERNEL")
    os.environ["JAXLLM_MOE_KERNEL"] = kind
    try:
        yield
    finally:
        if before is None:
            del os.environ["JAXLLM_MOE_KERNEL"]
        else:
            os.environ["JAXLLM_MOE_KERNEL"] = before


def main(ns) -> int:
    from jaxllm.models.fp8 import quantize_experts
    from jaxllm.models.moe import expert_mlp
    chosen = [name for name in ns.variants.split(",") if name]  # none: the --tiles sweep alone
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise ValueError(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    device = jax.devices()[0].device_kind
    print(device, jax.__version__)
    e, k, hidden, inter = ns.experts, ns.top_k, ns.hidden_size, ns.intermediate_size
    rng = np.random.default_rng(0)

    def weights(shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, jnp.bfloat16)

    sets = [(weights((e, hidden, 2, inter)), weights((e, inter, hidden))) for _ in range(2)]
    fp8_sets = [tuple(quantize_experts(w) for w in weight_set) for weight_set in sets]
    expert_bytes = (hidden * 2 * inter + inter * hidden) * 2
    rows_out, failed = [], []
    for t in ns.tokens if chosen else ():
        experts, sizes, active = _routing(rng, t, e, k)
        x = jnp.asarray(rng.standard_normal((t * k, hidden), np.float32), jnp.bfloat16)
        def grouped(x, gu, d):
            return expert_mlp(x, experts, sizes, gu, d)

        variants = {"ragged": grouped, "pallas": grouped, "fp8": grouped, "fp8-pallas": grouped,
                    "mosaic": lambda x, gu, d: _mosaic_mlp(x, sizes, gu, d),
                    "dense": lambda x, gu, d: _dense_mlp(x, gu[0], d[0])}
        if t * k <= ns.gather_max_rows:
            variants["gather"] = lambda x, gu, d: _gather_mlp(x, experts, gu, d)
        with _moe_kernel("ragged"):
            want = np.asarray(jax.jit(grouped)(x, *sets[0]), np.float32)
        for name, variant in ((n, f) for n, f in variants.items() if n in chosen):
            fn = lambda *a, f=variant: f(*a)  # a function of its own, traced anew under its kernel's variable
            error, weight_sets = None, fp8_sets if name.startswith("fp8") else sets
            with _moe_kernel("pallas" if name.endswith("pallas") else "ragged"):
                if name != "dense":
                    try:
                        got = np.asarray(jax.jit(fn)(x, *weight_sets[0]), np.float32)
                    except Exception as err:  # a lowering this device or jax version lacks: said, not fatal
                        print(f"T={t} {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                        continue
                    error = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
                    if error > (FP8_MAX_ERROR if name.startswith("fp8") else MAX_ERROR):
                        failed.append(f"T={t} {name}: relative error {error:.2e}")
                s = median_loop_s(fn, [(x, *w) for w in weight_sets], reps=ns.repeats)
            flops = 2 * t * k * (hidden * 2 * inter + inter * hidden)
            read = active * expert_bytes // (2 if name.startswith("fp8") else 1)
            rows_out.append({"tokens": t, "rows": t * k, "experts_hit": active, "variant": name, "us": 1e6 * s,
                             "TFLOPs": flops / s / 1e12, "active_GBps": read / s / 1e9,
                             "error": error})
            print(*rows_out[-1].values(), flush=True)  # as it comes, in case the call is cut short
    print(f"\nE={e} k={k} hidden={hidden} I={inter} ({expert_bytes / 2**20:.1f} MiB per expert, bf16)")
    print(f"{'T':>6} {'rows':>6} {'hit':>4} {'variant':>10} {'us':>9} {'TFLOP/s':>8} {'active GB/s':>11} {'vs dense':>8}")
    dense = {r["tokens"]: r["us"] for r in rows_out if r["variant"] == "dense"}
    ratio = lambda r: f"{dense[r['tokens']] / r['us']:>8.2f}" if r["tokens"] in dense else f"{'-':>8}"
    for r in rows_out:
        print(f"{r['tokens']:>6} {r['rows']:>6} {r['experts_hit']:>4} {r['variant']:>10} {r['us']:>9.1f} "
              f"{r['TFLOPs']:>8.1f} {r['active_GBps']:>11.0f} {ratio(r)}")
    tile_rows, tile_failed = _tile_sweep(ns, rng) if ns.tiles else ([], [])
    write_json(ns.output_json, {"device": device, "experts": e, "top_k": k, "hidden_size": hidden,
                                "intermediate_size": inter, "rows": rows_out, "tiles": tile_rows})
    for line in failed + tile_failed:
        print("wrong:", line)
    return 1 if failed or tile_failed else 0
