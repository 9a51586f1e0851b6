"""Which FP8 matmul forms XLA makes fast on this GPU, against bf16, at the 8B's decode and
prefill shapes. Run on the device: `python3 scripts/bench_fp8.py` (one table, last).

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
FP8_FORMS picks forms (comma-separated), FP8_BATCHES the M values.
Each timing: a fori_loop of ITERS matmuls over the same weight (larger than L2), one call,
median of REPEATS. The table gives ms per matmul, the weight's bytes over that time, the
relative error against float32, the seconds one matmul took to compile (XLA's GEMM autotuning)
and what XLA compiled the dot to.
"""
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

ITERS, REPEATS = 20, 5
SHAPES = ((4096, 6144), (4096, 28672), (14336, 4096))  # K, N: fused qkv, fused gate-up, down
BATCHES = tuple(int(b) for b in os.environ.get("FP8_BATCHES", "1,16,64,256,2048").split(","))
E4M3_MAX = 448.0


def quantize_weight(w):
    scale = jnp.max(jnp.abs(w), axis=0) / E4M3_MAX  # [N], per output channel
    return (w / scale).astype(jnp.float8_e4m3fn), scale.astype(jnp.float32)


def quantize_act(x):
    scale = jnp.max(jnp.abs(x)).astype(jnp.float32) / E4M3_MAX
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


def quantize_act_per_token(x):
    scale = jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32) / E4M3_MAX  # [M, 1]
    scale = jnp.maximum(scale, 1e-12)
    return (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale


def w8a8_t(x, w, w8t, w_scale):
    x8, x_scale = quantize_act_per_token(x)
    y = jax.lax.dot_general(x8, w8t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * x_scale * w_scale).astype(jnp.bfloat16)


FORMS = {"bf16": bf16, "w8a16": w8a16, "w8a8": w8a8, "w8a8_dq": w8a8_dq, "w8a8_t": w8a8_t, "w8a8_t_lt": w8a8_t}
OPTIONS = {"w8a8_t_lt": {"xla_gpu_enable_triton_gemm": False}}  # XLA's compiler options, per form
FORMS = {name: FORMS[name] for name in os.environ.get("FP8_FORMS", ",".join(FORMS)).split(",")}


def looped(form):
    def run(x, w, w8, w_scale):
        def body(i, y):  # a fresh input each time, so nothing is hoisted out of the loop
            return form(x + i.astype(x.dtype) * 1e-3, w, w8, w_scale)
        return jax.lax.fori_loop(0, ITERS, body, jnp.zeros((x.shape[0], w.shape[1]), jnp.bfloat16))
    return jax.jit(run)


def what_xla_made(compiled_text: str) -> str:
    targets = set(re.findall(r'custom_call_target="([^"]+)"', compiled_text))
    kinds = set(re.findall(r'"kind":"(__triton_gemm|__cudnn\$fusion|__custom_fusion)"', compiled_text))
    names = sorted(t for t in targets if "gemm" in t.lower() or "matmul" in t.lower()) + sorted(kinds)
    if re.search(r"= [^ ]+ (transpose|copy)\(|kind=kLoop.*transpose", compiled_text):
        names.append("+transpose")  # a copy of an operand into another layout, every call
    return ",".join(names) or "other"


def main():
    print(jax.devices()[0].device_kind, jax.__version__)
    rng = np.random.default_rng(0)
    rows = []
    for k, n in SHAPES:
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        w8, w_scale = jax.jit(quantize_weight)(w)
        w8t = jnp.asarray(w8.T)  # the transposed copy w8a8_t reads
        for m in BATCHES:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
            base_ms = None
            for name, form in FORMS.items():
                weight8 = w8t if name.startswith("w8a8_t") else w8  # the form's weight layout
                args, options = (x, w, weight8, w_scale), OPTIONS.get(name, {})
                try:
                    start = time.perf_counter()
                    once = jax.jit(form).lower(*args).compile(compiler_options=options)
                    compile_s = time.perf_counter() - start
                    y = np.asarray(once(*args), np.float32)
                    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    fn = looped(form).lower(*args).compile(compiler_options=options)
                    made = what_xla_made(once.as_text())
                    jax.block_until_ready(fn(*args))
                    times = []
                    for _ in range(REPEATS):
                        start = time.perf_counter()
                        jax.block_until_ready(fn(*args))
                        times.append((time.perf_counter() - start) / ITERS)
                    ms = 1e3 * float(np.median(times))
                except Exception as e:  # a form this XLA cannot compile: say so, go on
                    print(f"{name} K={k} N={n} M={m}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                base_ms = ms if name == "bf16" else base_ms
                weight_bytes = k * n * (2 if name == "bf16" else 1)
                rows.append((f"{k}x{n}", m, name, ms, weight_bytes / ms / 1e9, err,
                             base_ms / ms if base_ms else float("nan"), compile_s, made))
                print(*rows[-1], flush=True)  # as it comes, in case the call is cut short
    print(f"\n{'K x N':>11} {'M':>5} {'form':>9} {'ms':>8} {'TB/s':>6} {'rel err':>8} {'vs bf16':>7} "
          f"{'compile s':>9}  XLA's dot")
    for shape, m, name, ms, tbs, err, speedup, compile_s, made in rows:
        print(f"{shape:>11} {m:>5} {name:>9} {ms:>8.4f} {tbs:>6.2f} {err:>8.4f} {speedup:>7.2f} {compile_s:>9.1f}  {made}")


if __name__ == "__main__":
    main()
