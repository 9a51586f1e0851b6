"""FP8 (e4m3) weights and activations: `quantization="fp8"`, vLLM's dynamic FP8.

Each Linear but the LM head becomes an Fp8Linear once its bf16 weights are on the
mesh: the kernel in e4m3 with one float32 scale per output channel (max |w| / 448),
stored [*out, in], the in axis contiguous, as cuBLASLt's FP8 GEMM reads it (stored
[in, out], XLA copies it into that layout every call). Activations are quantized per
token, each row by its own max |x| / 448, on the fly. The product runs as one
`dot_general` of two e4m3 operands with a float32 result, the one form XLA hands to
cuBLASLt's FP8 GEMM on Hopper, then both scales. The runner compiles an FP8 model with XLA's
Triton GEMMs off, so that it does (worker/model_runner.py).

    y [T, *out] = (x8 [T, in] . w8 [*out, in]) * x_scale [T] * w_scale [*out]

On an H200 that GEMM is 1.2-1.7x bf16's at the 8B's shapes from M = 16 (the smallest
token bucket) to prefill (docs/benchmarks.md); the relative error of one product is
about 0.04, against bf16's 0.002.
"""
import jax
import jax.numpy as jnp
from flax import nnx

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_kernel(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """kernel [in, *out] -> (e4m3 [*out, in], float32 scale [*out]), per output channel."""
    w = jnp.moveaxis(kernel.astype(jnp.float32), 0, -1)  # [*out, in]
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=-1) / E4M3_MAX, jnp.finfo(jnp.float32).tiny)
    return (w / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def quantize_rows(x: jax.Array, group_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, in] -> (e4m3 [T, in], float32 scale [T]), per token (an all-zero row: scale tiny);
    with group_size, per token and group of that many columns: scale [T, in // group_size]."""
    x32 = x.astype(jnp.float32)
    if group_size is not None:
        x32 = x32.reshape(x.shape[0], -1, group_size)
    scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1) / E4M3_MAX, jnp.finfo(jnp.float32).tiny)
    return (x32 / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(x.shape), scale


class Fp8Linear(nnx.Module):
    """A Linear (models/llama.py) with e4m3 weights: kernel [*out, in] float8_e4m3fn, scale
    [*out] float32, the bias as it was. Logical axes: the Linear's, the in axis moved last."""

    def __init__(self, kernel: jax.Array, scale: jax.Array, kernel_axes: tuple, bias: nnx.Param | None):
        self.kernel = nnx.Param(kernel, out_sharding=kernel_axes, eager_sharding=False)  # placed already
        self.scale = nnx.Param(scale, out_sharding=kernel_axes[:-1], eager_sharding=False)
        self.bias = bias

    def __call__(self, x):
        """x [T, in] -> [T, *out] in x's dtype."""
        x8, x_scale = quantize_rows(x)
        kernel = self.kernel[...]
        y = jax.lax.dot_general(x8, kernel, (((1,), (kernel.ndim - 1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        y = y * x_scale.reshape(-1, *([1] * (y.ndim - 1))) * self.scale[...]
        y = y.astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]
