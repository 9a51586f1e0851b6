"""The FP8 Linears' neighbours fused into their activations' quantization (models/fp8.py,
JAXLLM_FP8_FUSED=1): each kernel hands on e4m3 rows and one float32 scale per row (max |row| / 448,
an all-zero row's the smallest float32), which the e4m3 GEMM takes as they are.

- add_rms_norm_quantize: (residual + x), then RMSNorm, then per-row e4m3: the new residual, the
  e4m3 rows, the scales. Before qkv_proj and gate_up_proj.
- swiglu_quantize: silu(gate) * up, then per-row e4m3. Before down_proj; with `scale` given (a
  tensor-parallel device's slice of every row, scaled by the whole row's max), the quantization
  alone, and swiglu_amax for the slice's own max.

Unfused, XLA runs each as several small kernels (the norm's reduction, the max's, the elementwise
ops between); at batch 1 each is a launch of a few microseconds (docs/benchmarks.md). Grid: one
program per row. A program walks its row in chunks of `block` columns (a power of two, as Triton's
tensors must be; masked past the row's end), once for each reduction and once to write: the row is
read two or three times, from L1/L2 after the first. Untuned: at batch 1 one program (one SM) walks
the whole row, the 8B's SwiGLU row of 14,336 in four chunks; should a GPU show that slower than
XLA's kernels spread over the SMs, split the row over programs (its max then a second launch).

Both compute in float32 from the loaded rows to the e4m3 values, rounding to the model's dtype only
the residual they store (XLA, by its excess precision, skips some roundings between fused ops too;
Triton's 16-bit math is partial). The plain-JAX references beside them compute the same; the kernels differ
from them only in the order of the float32 sums. In float32 they are the unfused layers' numbers
(models/llama.py RMSNorm and MLP, then models/fp8.py quantize_rows) bit for bit.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
TINY = float(jnp.finfo(jnp.float32).tiny)  # an all-zero row's scale (no 0 / 0)
MAX_BLOCK = 4096  # columns a program holds at once: a float32 row of the 8B's hidden size (16 KiB)


def _block(columns: int) -> int:
    return min(pl.next_power_of_2(columns), MAX_BLOCK)


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


# ---- references ----

def row_scale(amax):
    """amax [...] float32, a row's max |x| -> its e4m3 scale."""
    return jnp.maximum(amax / E4M3_MAX, TINY)


def quantize_with(x32, scale):
    """x32 [T, D] float32 and scale [T] -> e4m3 [T, D]."""
    return (x32 / scale[:, None]).astype(jnp.float8_e4m3fn)


def rms_norm(x, weight, eps: float):
    """x [T, D] -> weight * (x / rms(x)) [T, D] float32 (models/llama.py RMSNorm, not rounded to x's dtype)."""
    x32 = x.astype(jnp.float32)
    return weight.astype(jnp.float32) * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))


def swiglu(gate_up):
    """gate_up [T, 2, I] -> silu(gate) * up [T, I] float32 (models/llama.py MLP, not rounded to its dtype)."""
    g32 = gate_up.astype(jnp.float32)
    return jax.nn.silu(g32[:, 0]) * g32[:, 1]


def reference_add_rms_norm_quantize(x, residual, weight, eps: float):
    """x [T, D], residual [T, D] or None, weight [D] -> (residual + x [T, D], e4m3 [T, D] of its
    RMSNorm, float32 scale [T])."""
    if residual is not None:
        x = residual + x
    # The sum as stored, in x's dtype: XLA may otherwise normalise the float32 sum it rounds (excess precision).
    info = jnp.finfo(x.dtype)
    y32 = rms_norm(jax.lax.reduce_precision(x.astype(jnp.float32), info.nexp, info.nmant), weight, eps)
    scale = row_scale(jnp.max(jnp.abs(y32), axis=-1))
    return x, quantize_with(y32, scale), scale


def reference_swiglu_quantize(gate_up, scale=None):
    """gate_up [T, 2, I] -> (e4m3 [T, I] of silu(gate) * up, float32 scale [T]); scale: given, or
    each row's own."""
    h32 = swiglu(gate_up)
    if scale is None:
        scale = row_scale(jnp.max(jnp.abs(h32), axis=-1))
    return quantize_with(h32, scale), scale


def reference_swiglu_amax(gate_up):
    """gate_up [T, 2, I] -> max |silu(gate) * up| per row [T] float32."""
    return jnp.max(jnp.abs(swiglu(gate_up)), axis=-1)


# ---- kernels ----

def _chunks(columns: int, block: int):
    """(number of chunks, chunk c's column indices [block] and mask)."""
    def at(c):
        cols = c * block + jnp.arange(block)
        return cols, cols < columns
    return pl.cdiv(columns, block), at


def _fold(num: int, body, init):
    """body(c, acc) over chunks 0 .. num - 1 (a loop only where there are several)."""
    return body(0, init) if num == 1 else jax.lax.fori_loop(0, num, body, init)


def _amax(values, num: int, block: int):
    """max |values(c)| over a row's chunks c; values(c) -> (columns, mask, float32 [block], 0 past the end)."""
    return jnp.max(_fold(num, lambda c, acc: jnp.maximum(acc, jnp.abs(values(c)[2])), jnp.zeros(block, jnp.float32)))


def _store_quantized(q_ref, values, num: int, scale):
    """values(c) / scale in e4m3 into the row q_ref [D], chunk by chunk."""
    @pl.loop(0, num)
    def _(c):
        cols, mask, v32 = values(c)
        plgpu.store(q_ref.at[cols], (v32 / scale).astype(q_ref.dtype), mask=mask)


def _by_rows(kernel, inputs, in_specs, outputs, out_specs, block: int, name: str, interpret: bool):
    """kernel over a grid of one program a row (inputs[0]'s)."""
    return pl.pallas_call(
        kernel, out_shape=outputs, grid=(inputs[0].shape[0],), in_specs=in_specs, out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=_num_warps(block)),
        interpret=interpret, name=name,
    )(*inputs)


def _add_rms_kernel(*refs, eps: float, block: int, with_residual: bool):
    # x_ref, r_ref [D] the row (model dtype); w_ref [D]; out: res_ref [D], q_ref [D] e4m3, s_ref [] float32
    if with_residual:
        x_ref, r_ref, w_ref, res_ref, q_ref, s_ref = refs
    else:
        (x_ref, w_ref, q_ref, s_ref), r_ref = refs, None
    d = x_ref.shape[0]
    num, at = _chunks(d, block)

    def row(cols, mask):  # residual + x in the model's dtype, added in float32 (as XLA adds 16-bit floats)
        x = plgpu.load(x_ref.at[cols], mask=mask, other=0)
        if r_ref is None:
            return x
        return (plgpu.load(r_ref.at[cols], mask=mask, other=0).astype(jnp.float32) + x.astype(jnp.float32)
                ).astype(x.dtype)

    def squares(c, acc):
        cols, mask = at(c)
        x = row(cols, mask)
        if r_ref is not None:
            plgpu.store(res_ref.at[cols], x, mask=mask)
        x32 = x.astype(jnp.float32)
        return acc + x32 * x32

    total = jnp.sum(_fold(num, squares, jnp.zeros(block, jnp.float32)))
    rstd = jax.lax.rsqrt(total / d + eps)

    def normed(c):
        cols, mask = at(c)
        x = row(cols, mask)
        w = plgpu.load(w_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
        return cols, mask, w * (x.astype(jnp.float32) * rstd)

    scale = row_scale(_amax(normed, num, block))
    s_ref[...] = scale
    _store_quantized(q_ref, normed, num, scale)


def add_rms_norm_quantize(x, residual, weight, eps: float, *, interpret: bool = False):
    """x [T, D], residual [T, D] or None, weight [D] -> (residual + x [T, D] (x itself without a
    residual), e4m3 [T, D] of its RMSNorm, float32 scale [T]), one program a row."""
    t, d = x.shape
    block = _block(d)
    row = pl.BlockSpec((None, d), lambda i: (i, 0))
    inputs = (x, weight) if residual is None else (x, residual, weight)
    in_specs = [row] * (len(inputs) - 1) + [pl.BlockSpec((d,), lambda i: (0,))]
    outputs = [jax.ShapeDtypeStruct((t, d), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((t,), jnp.float32)]
    out_specs = [row, pl.BlockSpec((None,), lambda i: (i,))]
    if residual is not None:
        outputs, out_specs = [jax.ShapeDtypeStruct(x.shape, x.dtype), *outputs], [row, *out_specs]
    out = _by_rows(functools.partial(_add_rms_kernel, eps=eps, block=block, with_residual=residual is not None),
                   inputs, in_specs, outputs, out_specs, block, "add_rms_norm_quantize", interpret)
    return (x, *out) if residual is None else tuple(out)


def _swiglu_kernel(gate_ref, up_ref, *refs, block: int, phase: str):
    # gate_ref, up_ref [I] the row's (model dtype); phase "amax": out a_ref [] float32;
    # "quantize": out q_ref [I] e4m3, s_ref [] float32; "given": in s_in_ref [], out q_ref [I] e4m3
    num, at = _chunks(gate_ref.shape[0], block)

    def h32(c):
        cols, mask = at(c)
        gate = plgpu.load(gate_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
        up = plgpu.load(up_ref.at[cols], mask=mask, other=0).astype(jnp.float32)
        return cols, mask, jax.nn.silu(gate) * up  # 0 past the row's end

    if phase == "given":
        s_in_ref, q_ref = refs
        scale = s_in_ref[...]
    else:
        amax = _amax(h32, num, block)
        if phase == "amax":
            refs[0][...] = amax
            return
        q_ref, s_ref = refs
        scale = row_scale(amax)
        s_ref[...] = scale
    _store_quantized(q_ref, h32, num, scale)


def _swiglu_call(gate_up, phase: str, scale=None, *, interpret: bool):
    t, _, i = gate_up.shape
    block = _block(i)
    scalar = pl.BlockSpec((None,), lambda r: (r,))
    rows = pl.BlockSpec((None, i), lambda r: (r, 0))
    out_scale = jax.ShapeDtypeStruct((t,), jnp.float32)
    outputs = {"amax": ([out_scale], [scalar]),
               "quantize": ([jax.ShapeDtypeStruct((t, i), jnp.float8_e4m3fn), out_scale], [rows, scalar]),
               "given": ([jax.ShapeDtypeStruct((t, i), jnp.float8_e4m3fn)], [rows])}[phase]
    inputs = (gate_up, gate_up) if scale is None else (gate_up, gate_up, scale)  # read as gate and as up
    in_specs = [pl.BlockSpec((None, None, i), lambda r: (r, 0, 0)), pl.BlockSpec((None, None, i), lambda r: (r, 1, 0)),
                scalar][:len(inputs)]
    return _by_rows(functools.partial(_swiglu_kernel, block=block, phase=phase), inputs, in_specs, *outputs, block,
                    f"swiglu_{phase}", interpret)


def swiglu_quantize(gate_up, scale=None, *, interpret: bool = False):
    """gate_up [T, 2, I] -> (e4m3 [T, I] of silu(gate) * up, float32 scale [T]); scale [T]: given
    (the row's max over the devices that share it, swiglu_amax's), or each row's own."""
    if scale is None:
        return tuple(_swiglu_call(gate_up, "quantize", interpret=interpret))
    return _swiglu_call(gate_up, "given", scale, interpret=interpret)[0], scale


def swiglu_amax(gate_up, *, interpret: bool = False):
    """gate_up [T, 2, I] -> max |silu(gate) * up| per row [T] float32."""
    return _swiglu_call(gate_up, "amax", interpret=interpret)[0]
