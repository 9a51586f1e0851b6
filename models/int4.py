"""Int4Linear: a Linear whose weights stay 4-bit on the device (AWQ and GPTQ checkpoints,
unpacked at load by models/quant_checkpoint.py), multiplied by the W4A16 kernel (kernels/w4a16.py).

    weight_packed [K // 2, *out] uint8   two weights a byte, in halves of each group (pack_groups)
    weight_scale  [K // G, *out]         the model's dtype (bf16 on a GPU: the kernel's operands' type)
    weight_zero   [K // G, *out] uint8   the zero point, 0..16
    input_perm    [K] int32              GPTQ act-order only: the rows' order after sorting by group

    y = x[:, input_perm] @ w,   w[k, n] = (q[k, n] - weight_zero[k // G, n]) * weight_scale[k // G, n]

Each param has its Linear's logical axes (in, *out), so they shard as the kernel would: a
column-parallel Linear splits the columns, a row-parallel one the groups (whole groups per
device: QuantConfig.check_model). The kernel runs per device (jaxllm.sharding.per_device_linear).
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.kernels import w4a16
from jaxllm.sharding import per_device_linear


def pack_groups(q: np.ndarray, group_size: int) -> np.ndarray:
    """q [K, N] ints 0..15 -> [K // 2, N] uint8: byte row r of group g holds row g*G + r in its low
    nibble and row g*G + G/2 + r in its high nibble (the kernel unpacks each into a contiguous half).

        G = 4, rows [a, b, c, d] -> bytes [a | c << 4, b | d << 4]
    """
    k, n = q.shape
    halves = q.astype(np.uint8).reshape(k // group_size, 2, group_size // 2, n)
    return (halves[:, 0] | halves[:, 1] << 4).reshape(k // 2, n)


class Int4Linear(nnx.Module):
    """A Linear (models/llama.py) with 4-bit weights; see the module's docstring for its params.
    `hf_axes` (metadata): each param is its HF-facing tensor ([*out reversed, in-ish], as the
    loader packs fused parts) transposed by these axes."""

    def __init__(self, in_dim: int, out_shape: tuple[int, ...], axes: tuple, *, group_size: int, act_order: bool,
                 bias: nnx.Param | None, dtype, mesh: jax.sharding.Mesh | None):
        reverse = tuple(range(len(out_shape), -1, -1))
        groups = in_dim // group_size

        def param(shape, param_dtype):
            return nnx.Param(jnp.zeros(shape, param_dtype), out_sharding=axes, eager_sharding=False, hf_axes=reverse)

        self.weight_packed = param((in_dim // 2, *out_shape), jnp.uint8)
        self.weight_scale = param((groups, *out_shape), dtype)
        self.weight_zero = param((groups, *out_shape), jnp.uint8)
        self.input_perm = nnx.Param(jnp.zeros((in_dim,), jnp.int32), out_sharding=(None,), eager_sharding=False,
                                    hf_axes=(0,), fuse="same") if act_order else None
        self.bias = bias
        self.axes, self.mesh = axes, mesh

    def __call__(self, x):
        """x [T, in] -> [T, *out] in x's dtype."""
        if self.input_perm is not None:
            x = jnp.take(x, self.input_perm[...], axis=-1)

        def local(x, packed, scale, zero):  # one device's shards, out axes flattened for the kernel
            y = w4a16.matmul(x, packed.reshape(packed.shape[0], -1), scale.reshape(scale.shape[0], -1),
                             zero.reshape(zero.shape[0], -1))
            return y.reshape(x.shape[0], *packed.shape[1:])

        y = per_device_linear(local, self.mesh, self.axes)(
            x, self.weight_packed[...], self.weight_scale[...], self.weight_zero[...])
        return y if self.bias is None else y + self.bias[...]
