"""`jaxllm bench fp8`: which FP8 matmul forms XLA makes fast on this GPU, against bf16, at the
8B's decode and prefill shapes (one table, last).

Forms, each y [M, N] = x [M, K] @ W [K, N] with W quantized per output channel (e4m3):
  bf16        x_bf16 @ w_bf16: the baseline
  w8a16       x_bf16 @ convert(w_f8) * scale: weight-only, the convert left to XLA to fuse
              into the GEMM's operand load (half the weight bytes when it does)
  w8a8        both operands e4m3 (x per-tensor, dynamic): dot_general(x_f8, w_f8) in f32,
              then both scales: the scaled-FP8 pattern XLA hands to cuBLASLt
  w8a8_dq     the same as dequantize-then-dot (convert * scale on each operand, then dot),
              the other pattern XLA's GEMM rewriter matches
  w8a8_t      w8a8 with the weight stored transposed, [N, K] (K contiguous: cuBLASLt's FP8
              GEMM takes its operands so, "TN"), x scaled per token: models/fp8.py's form
  w8a8_t_lt   w8a8_t compiled without XLA's Triton GEMMs (xla_gpu_enable_triton_gemm off),
              as the runner compiles an FP8 model: the GEMM goes to cuBLASLt
--forms picks forms, --batches the M values, --shapes the K x N (default: the 8B's fused qkv,
fused gate-up and down projections).
Each timing: a fori_loop of --iters matmuls over the same weight (larger than L2), one call,
median of --repeats. Each form is checked first: its relative error against float32 is in the
table. The table gives ms per matmul, the weight's bytes over that time, that error, the speed-up
over bf16 in the same run, the seconds one matmul took to compile (XLA's GEMM autotuning) and
what XLA compiled the dot to. A form this XLA cannot compile is reported and left out.
"""
import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import names_from, positive_int, positive_ints, write_json

HELP = "FP8 matmul forms against bf16 at the 8B's shapes: time, error, compile time, XLA's kernel"
E4M3_MAX = 448.0


def shapes(text: str) -> list[tuple[int, int]]:
    """"4096x6144,14336x4096" -> [(4096, 6144), (14336, 4096)]: K x N of each weight."""
    found = []
    for shape in text.split(","):
        dims = shape.split("x")
        if len(dims) != 2:
            raise argparse.ArgumentTypeError(f"{shape!r} is not K x N, e.g. 4096x6144")
        found.append((positive_int(dims[0]), positive_int(dims[1])))
    return found


def quantize_weight(w):
    scale = jnp.max(jnp.abs(w), axis=0) / E4M3_MAX  # [N], per output channel
    return (w / scale).astype(jnp.float8_e4m3fn), scale.astype(jnp.float32)


def quantize_act(x):
    scale = jnp.max(jnp.abs(x)).astype(jnp.float32) / E4M3_MAX
    return (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale


def quantize_act_per_token(x):
    scale = jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32) / E4M3_MAX  # [M, 1]
    scale = jnp.maximum(scale, 1e-12)
    return (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale


def bf16(x, w, w8, w_scale):
    return x @ w


def w8a16(x, w, w8, w_scale):
    y = jnp.dot(x, w8.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return (y * w_scale).astype(jnp.bfloat16)


def w8a8(x, w, w8, w_scale):
    x8, x_scale = quantize_act(x)
    y = jax.lax.dot_general(x8, w8, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * (x_scale * w_scale)).astype(jnp.bfloat16)


def w8a8_dq(x, w, w8, w_scale):
    x8, x_scale = quantize_act(x)
    xd = x8.astype(jnp.bfloat16) * x_scale.astype(jnp.bfloat16)
    wd = w8.astype(jnp.bfloat16) * w_scale.astype(jnp.bfloat16)
    return jnp.dot(xd, wd, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def w8a8_t(x, w, w8t, w_scale):
    x8, x_scale = quantize_act_per_token(x)
    y = jax.lax.dot_general(x8, w8t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * x_scale * w_scale).astype(jnp.bfloat16)


FORMS = {"bf16": bf16, "w8a16": w8a16, "w8a8": w8a8, "w8a8_dq": w8a8_dq, "w8a8_t": w8a8_t, "w8a8_t_lt": w8a8_t}
OPTIONS = {"w8a8_t_lt": {"xla_gpu_enable_triton_gemm": False}}  # XLA's compiler options, per form


def add_cli_args(parser) -> None:
    parser.add_argument("--forms", type=names_from(tuple(FORMS)), default=list(FORMS),
                        help="comma-separated, of " + ", ".join(FORMS))
    parser.add_argument("--batches", type=positive_ints, default="1,16,64,256,2048", help="the M values")
    parser.add_argument("--shapes", type=shapes, default="4096x6144,4096x28672,14336x4096",
                        help="K x N of each weight, comma-separated")
    parser.add_argument("--iters", type=positive_int, default=20, help="matmuls per timed loop")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed loops, the median taken")
    parser.add_argument("--output-json", help="write the rows to this file")


def looped(form, iters: int):
    def run(x, w, w8, w_scale):
        def body(i, y):  # a fresh input each time, so nothing is hoisted out of the loop
            return form(x + i.astype(x.dtype) * 1e-3, w, w8, w_scale)
        return jax.lax.fori_loop(0, iters, body, jnp.zeros((x.shape[0], w.shape[1]), jnp.bfloat16))
    return jax.jit(run)


def what_xla_made(compiled_text: str) -> str:
    targets = set(re.findall(r'custom_call_target="([^"]+)"', compiled_text))
    kinds = set(re.findall(r'"kind":"(__triton_gemm|__cudnn\$fusion|__custom_fusion)"', compiled_text))
    names = sorted(t for t in targets if "gemm" in t.lower() or "matmul" in t.lower()) + sorted(kinds)
    if re.search(r"= [^ ]+ (transpose|copy)\(|kind=kLoop.*transpose", compiled_text):
        names.append("+transpose")  # a copy of an operand into another layout, every call
    return ",".join(names) or "other"


def time_form(name: str, args, ref, iters: int, repeats: int) -> dict:
    """One form at one shape: checked against the float32 `ref`, then timed."""
    form, options = FORMS[name], OPTIONS.get(name, {})
    start = time.perf_counter()
    once = jax.jit(form).lower(*args).compile(compiler_options=options)
    compile_s = time.perf_counter() - start
    y = np.asarray(once(*args), np.float32)
    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    fn = looped(form, iters).lower(*args).compile(compiler_options=options)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) / iters)
    return {"ms": 1e3 * float(np.median(times)), "rel_err": err, "compile_s": compile_s,
            "xla_dot": what_xla_made(once.as_text())}


def main(ns) -> int:
    print(jax.devices()[0].device_kind, jax.__version__)
    rng = np.random.default_rng(0)
    rows = []
    for k, n in ns.shapes:
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        w8, w_scale = jax.jit(quantize_weight)(w)
        w8t = jnp.asarray(w8.T)  # the transposed copy w8a8_t reads
        for m in ns.batches:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
            base_ms = None
            for name in ns.forms:
                weight8 = w8t if name.startswith("w8a8_t") else w8  # the form's weight layout
                try:
                    timed = time_form(name, (x, w, weight8, w_scale), ref, ns.iters, ns.repeats)
                except Exception as e:  # a form this XLA cannot compile: say so, go on
                    print(f"{name} K={k} N={n} M={m}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                base_ms = timed["ms"] if name == "bf16" else base_ms
                weight_bytes = k * n * (2 if name == "bf16" else 1)
                rows.append({"shape": f"{k}x{n}", "m": m, "form": name, **timed,
                             "TBps": weight_bytes / timed["ms"] / 1e9,
                             "vs_bf16": base_ms / timed["ms"] if base_ms else float("nan")})
                print(*rows[-1].values(), flush=True)  # as it comes, in case the call is cut short
    write_json(ns.output_json, {"device": jax.devices()[0].device_kind, "rows": rows})
    print(f"\n{'K x N':>11} {'M':>5} {'form':>9} {'ms':>8} {'TB/s':>6} {'rel err':>8} {'vs bf16':>7} "
          f"{'compile s':>9}  XLA's dot")
    for r in rows:
        print(f"{r['shape']:>11} {r['m']:>5} {r['form']:>9} {r['ms']:>8.4f} {r['TBps']:>6.2f} {r['rel_err']:>8.4f} "
              f"{r['vs_bf16']:>7.2f} {r['compile_s']:>9.1f}  {r['xla_dot']}")
    return 0
