"""FP8 (e4m3) weights and activations: `quantization="fp8"`, vLLM's dynamic FP8, and the FP8
checkpoints' Linears (compressed-tensors and DeepSeek-style, models/quant_checkpoint.py).

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
about 0.04, against bf16's 0.002. A checkpoint's per-tensor or per-channel scales load into
the same Fp8Linear (a per-tensor scale is the scale of each of its channels), with its static
input scale if it has one; 128 x 128 block scales run as a BlockFp8Linear (kernels/fp8_block.py).

With JAXLLM_FP8_FUSED=1 (off until a GPU has measured it) the layers hand an Fp8Linear its input
already in e4m3 (QuantizedRows), quantized inside the kernel that makes it: the residual add and
RMSNorm before qkv_proj and gate_up_proj, SwiGLU before down_proj (kernels/fp8_fused.py), where
unfused the quantization runs as small kernels of its own around every GEMM.
"""
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from jaxllm.kernels import batch_invariant, fp8_block, fp8_fused
from jaxllm.kernels.fp8_fused import E4M3_MAX, row_scale
from jaxllm.sharding import logical_to_spec, per_device_linear

FUSED_ENV = "JAXLLM_FP8_FUSED"  # "1": the fused kernels; "0" (the default): quantize_rows in every Fp8Linear


def quantize_kernel(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """kernel [in, *out] -> (e4m3 [*out, in], float32 scale [*out]), per output channel."""
    w = jnp.moveaxis(kernel.astype(jnp.float32), 0, -1)  # [*out, in]
    scale = row_scale(jnp.max(jnp.abs(w), axis=-1))
    return (w / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def quantize_experts(weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stacked experts [E, in, *out] -> (e4m3 [E, in, *out], float32 scale [E, *out]), per expert and
    output channel, the layout kept (the grouped GEMM reads it as the model's dtype's)."""
    w = weight.astype(jnp.float32)
    scale = row_scale(jnp.max(jnp.abs(w), axis=1))
    return (w / jnp.expand_dims(scale, 1)).astype(jnp.float8_e4m3fn), scale


def quantize_rows(x: jax.Array, group_size: int | None = None, over: str | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """x [T, in] -> (e4m3 [T, in], float32 scale [T]), per token (an all-zero row: scale tiny);
    with group_size, per token and group of that many columns: scale [T, in // group_size]. over: a
    mesh axis whose devices each hold a slice of every row (inside shard_map): the scale is the whole
    row's, as on one device."""
    x32 = x.astype(jnp.float32)
    if group_size is not None:
        x32 = x32.reshape(x.shape[0], -1, group_size)
    scale = row_scale(jnp.max(jnp.abs(x32), axis=-1))
    if over is not None:
        scale = jax.lax.pmax(scale, over)
    return (x32 / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(x.shape), scale


def fused_enabled() -> bool:
    """Whether JAXLLM_FP8_FUSED picks the fused kernels ("1") over quantize_rows in each Fp8Linear ("0", unset)."""
    choice = os.environ.get(FUSED_ENV, "0")
    if choice not in ("0", "1"):
        raise ValueError(f"{FUSED_ENV} must be '0' or '1', got {choice!r}")
    return choice == "1"


@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """An Fp8Linear's input already in e4m3, from a fused kernel: values [T, in] float8_e4m3fn, scale
    [T] float32 (as quantize_rows gives them), dtype: the activations' (the product's)."""
    values: jax.Array
    scale: jax.Array
    dtype: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def takes_rows(linear) -> bool:
    """Whether `linear` takes QuantizedRows: an Fp8Linear that scales each token by its own max,
    with JAXLLM_FP8_FUSED=1 (the batch-invariant ops refuse quantization; checked all the same)."""
    return (isinstance(linear, Fp8Linear) and linear.input_scale is None and fused_enabled()
            and not batch_invariant.enabled())


def _tensor_parallel_mesh(x) -> jax.sharding.AbstractMesh | None:
    """The mesh x is traced on where its "model" axis spans several devices and is not manual (inside
    a shard_map): tensor parallelism, whose devices each run the kernels; else None."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is None or "model" not in mesh.axis_names:
        return None
    i = mesh.axis_names.index("model")
    return None if mesh.axis_sizes[i] == 1 or mesh.axis_types[i] == AxisType.Manual else mesh


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def add_norm_quantize(x, residual, weight, eps: float) -> tuple[jax.Array, QuantizedRows]:
    """residual + x [T, D] (x alone where residual is None) and its RMSNorm (weight [D]) in e4m3 rows,
    one kernel: (residual + x, QuantizedRows). The residual stream is replicated over "model": under
    tensor parallelism each device runs the kernel on the whole rows."""
    def run(x, residual, weight):
        return fp8_fused.add_rms_norm_quantize(x, residual, weight, eps, interpret=_interpret())

    mesh = _tensor_parallel_mesh(x)
    if mesh is not None:
        run = jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    x, x8, scale = run(x, residual, weight)
    return x, QuantizedRows(x8, scale, x.dtype)


def swiglu_quantize(gate_up) -> QuantizedRows:
    """silu(gate) * up of gate_up [T, 2, I] in e4m3 rows, one kernel. Under tensor parallelism I is
    split over "model" (a row-parallel down_proj's input): each device's kernel finds its slice's max,
    then quantizes it by the whole row's (quantize_rows's `over`), two launches."""
    mesh = _tensor_parallel_mesh(gate_up)
    if mesh is None:
        return QuantizedRows(*fp8_fused.swiglu_quantize(gate_up, interpret=_interpret()), gate_up.dtype)
    axis = logical_to_spec(("mlp",))[0]

    def local(gate_up):  # [T, 2, I / devices]
        scale = jax.lax.pmax(row_scale(fp8_fused.swiglu_amax(gate_up, interpret=_interpret())), axis)
        return fp8_fused.swiglu_quantize(gate_up, scale, interpret=_interpret())

    x8, scale = jax.shard_map(local, mesh=mesh, in_specs=P(None, None, axis), out_specs=(P(None, axis), P()),
                              check_vma=False)(gate_up)
    return QuantizedRows(x8, scale, gate_up.dtype)


def _in_last_axes(ndim: int) -> tuple[int, ...]:
    """A [*out, in] param from its HF-facing tensor [*out reversed, in] (the loader's packing of
    fused parts): gate_up's [2, I, H] from [I, 2, H]."""
    return (*range(ndim - 2, -1, -1), ndim - 1)


class Fp8Linear(nnx.Module):
    """A Linear (models/llama.py) with e4m3 weights: kernel [*out, in] float8_e4m3fn, weight_scale
    [*out] float32, the bias as it was. Logical axes: the Linear's, the in axis moved last.
    input_scale: a checkpoint's calibrated activation scale (a float32 scalar, the largest of a
    fused Linear's parts'), or None: each token scaled by its own max |x| / 448."""

    def __init__(self, kernel: jax.Array, scale: jax.Array, kernel_axes: tuple, bias: nnx.Param | None,
                 input_scale: jax.Array | None = None):
        self.kernel = nnx.Param(kernel, out_sharding=kernel_axes, eager_sharding=False,  # placed already
                                hf_axes=_in_last_axes(kernel.ndim))
        self.weight_scale = nnx.Param(scale, out_sharding=kernel_axes[:-1], eager_sharding=False,
                                      hf_axes=tuple(range(scale.ndim - 1, -1, -1)))
        self.input_scale = None if input_scale is None else nnx.Param(
            input_scale, out_sharding=(), eager_sharding=False, hf_axes=(), fuse="max")
        self.bias = bias

    def __call__(self, x):
        """x [T, in], or QuantizedRows (takes_rows) -> [T, *out] in x's dtype."""
        if isinstance(x, QuantizedRows):
            x8, x_scale = x.values, x.scale
        elif self.input_scale is None:
            x8, x_scale = quantize_rows(x)
        else:  # static: values past the calibrated range saturate, as vLLM's
            x_scale = self.input_scale[...]
            x8 = jnp.clip(x.astype(jnp.float32) / x_scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
            x_scale = jnp.broadcast_to(x_scale, x.shape[:1])
        kernel = self.kernel[...]
        y = jax.lax.dot_general(x8, kernel, (((1,), (kernel.ndim - 1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        y = y * x_scale.reshape(-1, *([1] * (y.ndim - 1))) * self.weight_scale[...]
        y = y.astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]


class BlockFp8Linear(nnx.Module):
    """A Linear with block-scaled e4m3 weights (kernels/fp8_block.py): kernel [*out, in]
    float8_e4m3fn and weight_scale [*out // bn, in // bk] float32 (gate_up: [2, I // bn, H // bk]),
    the bias as it was. Activations are scaled per token and bk columns as they come. The
    kernel runs per device (whole blocks per device: QuantConfig.check_model)."""

    def __init__(self, in_dim: int, out_shape: tuple[int, ...], axes: tuple, *, block: tuple[int, int],
                 bias: nnx.Param | None, mesh: jax.sharding.Mesh | None):
        bn, bk = block
        kernel_axes = (*axes[1:], axes[0])
        hf_axes = _in_last_axes(len(out_shape) + 1)
        scale_shape = (*out_shape[:-1], out_shape[-1] // bn, in_dim // bk)
        self.kernel = nnx.Param(jnp.zeros((*out_shape, in_dim), jnp.float8_e4m3fn), out_sharding=kernel_axes,
                                eager_sharding=False, hf_axes=hf_axes)
        self.weight_scale = nnx.Param(jnp.zeros(scale_shape, jnp.float32), out_sharding=kernel_axes,
                                      eager_sharding=False, hf_axes=hf_axes)
        self.bias = bias
        self.axes, self.block_k, self.mesh = axes, bk, mesh

    def __call__(self, x):
        """x [T, in] -> [T, *out] in x's dtype."""
        def local(x, kernel, scale):  # one device's shards, out axes flattened for the kernel
            x8, x_scale = quantize_rows(x, self.block_k)
            y = fp8_block.matmul(x8, x_scale, kernel.reshape(-1, kernel.shape[-1]), scale.reshape(-1, scale.shape[-1]))
            return y.reshape(x.shape[0], *kernel.shape[:-1]).astype(x.dtype)

        y = per_device_linear(local, self.mesh, self.axes, in_last=True)(x, self.kernel[...], self.weight_scale[...])
        return y if self.bias is None else y + self.bias[...]
