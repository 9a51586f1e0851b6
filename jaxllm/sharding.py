"""Where every weight and cache lives: a ("data", "model") mesh and one table of
logical-axis rules; under pipeline parallelism, one such mesh per stage (StageMeshes).

Model params carry logical axis names as NNX metadata (`out_sharding`, e.g.
("embed", "qkv")); the rules below map each name to a mesh axis. Tensor
parallelism is the "model" axis: column-parallel qkv/gate_up shard their output
axis, row-parallel o/down their input axis, embedding and head their vocab axis,
and XLA inserts the collectives. Changing the parallelism changes the mesh (and
at most this table), never the model.
"""
import dataclasses
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "model"),     # embedding rows, head columns
    ("embed", None),        # the residual stream: replicated
    # qkv_proj out: num_kv_heads groups of (q heads, k, v) * head_dim. The KV heads divide
    # over the devices (worker/kv_heads.py repeats them if too few): each device gets whole groups.
    ("qkv", "model"),
    ("q_heads", "model"),   # o_proj in: num_heads * head_dim, the q heads of qkv's groups, in order
    ("kv_heads", "model"),  # the KV cache's heads
    ("mlp", "model"),       # intermediate: gate_up out ([2, intermediate]), down in
    ("expert", "model"),    # a MoE layer's stacked experts under expert parallelism (models/moe.py)
    ("ssm_heads", "model"), # a Mamba layer's heads, or its channels in whole heads (models/mamba2.py)
    ("norm", None),         # RMSNorm scales
)
_RULES = dict(LOGICAL_AXIS_RULES)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, device_ids: tuple[int, ...] | None = None
              ) -> Mesh:
    """A [data, model] mesh over the first dp * tp devices (of `device_ids`, in their order, if
    given: a caller's mesh). Axes are Auto, so XLA propagates shardings through the model from
    the weights' placements."""
    n = tensor_parallel_size * data_parallel_size
    devices = jax.devices()
    if device_ids is not None:
        by_id = {d.id: d for d in devices}
        devices = [by_id[i] for i in device_ids]
    if n < 1 or n > len(devices):
        raise ValueError(f"tensor_parallel_size * data_parallel_size = {n} must be in "
                         f"[1, {len(devices)}] (the number of {jax.default_backend()} devices)")
    grid = np.array(devices[:n]).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


@dataclasses.dataclass(frozen=True)
class StageMeshes:
    """Pipeline parallelism's meshes: stage s is a [data, model] mesh of its own tensor_parallel_size
    devices (devices s * tp .. (s + 1) * tp - 1, disjoint from the other stages'), and holds the
    decoder layers layer_stage maps to it; the embedding lives on the first stage, the final norm and
    the LM head on the last (models/loader.py places each param with of_param)."""
    meshes: tuple[Mesh, ...]
    layer_stage: tuple[int, ...]  # per decoder layer, its stage

    def of_param(self, path: tuple) -> Mesh:
        """The mesh of a param at `path` in the model (("layers", 3, "mlp", ...), ("embed_tokens", ...))."""
        if path[0] == "layers":
            return self.meshes[self.layer_stage[path[1]]]
        return self.meshes[0] if path[0] == "embed_tokens" else self.meshes[-1]


def param_mesh(mesh: "Mesh | StageMeshes | None", path: tuple) -> Mesh | None:
    """The mesh of the param or module at `path` (("layers", 3, ...): a decoder layer's), where its
    per-device kernels run: under pipeline parallelism its stage's (StageMeshes.of_param)."""
    return mesh.of_param(path) if isinstance(mesh, StageMeshes) else mesh


PP_LAYER_PARTITION_ENV = "JAXLLM_PP_LAYER_PARTITION"


def layer_partition(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Each pipeline stage's number of decoder layers: $JAXLLM_PP_LAYER_PARTITION's "n0,n1,..." if set,
    else vLLM's split: equal parts, the remainder one layer each to the stages before the last (which also
    holds the final norm and the LM head). 10 over 4 -> (2, 3, 3, 2)."""
    text = os.environ.get(PP_LAYER_PARTITION_ENV)
    if text is not None:
        try:
            partition = tuple(int(n) for n in text.split(","))
        except ValueError:
            partition = ()
        if len(partition) != num_stages or min(partition) < 1 or sum(partition) != num_layers:
            raise ValueError(f"${PP_LAYER_PARTITION_ENV} must be {num_stages} counts >= 1 (one per pipeline stage) "
                             f"adding up to the model's {num_layers} layers, got {text!r}")
        return partition
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers")
    partition = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        partition[-i] += 1
    return tuple(partition)


def make_stage_meshes(tensor_parallel_size: int, layer_partition: tuple[int, ...]) -> StageMeshes | None:
    """One [1, tp] mesh per stage over consecutive devices; layer_partition: each stage's number of
    decoder layers, in order (None for one stage or none: no pipeline)."""
    tp, num_stages = tensor_parallel_size, len(layer_partition)
    if num_stages <= 1:
        return None
    devices = jax.devices()
    if tp * num_stages > len(devices):
        raise ValueError(f"pipeline_parallel_size * tensor_parallel_size = {tp * num_stages} exceeds the "
                         f"{len(devices)} {jax.default_backend()} devices")
    meshes = tuple(make_mesh(tp, device_ids=tuple(d.id for d in devices[s * tp:(s + 1) * tp]))
                   for s in range(num_stages))
    layer_stage = tuple(s for s, n in enumerate(layer_partition) for _ in range(n))
    return StageMeshes(meshes, layer_stage)


def logical_to_spec(logical_axes: tuple[str | None, ...]) -> PartitionSpec:
    """PartitionSpec of an array whose dimensions have these logical names."""
    for a in logical_axes:
        if a is not None and a not in _RULES:
            raise ValueError(f"logical axis {a!r} has no rule; known: {sorted(_RULES)}")
    return PartitionSpec(*(None if a is None else _RULES[a] for a in logical_axes))


def named_sharding(mesh: Mesh, logical_axes: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes))


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """[num_blocks, block_size, num_kv_heads, head_dim] caches shard over KV heads."""
    return split_over_model(mesh, 4, 2)


def split_over_model(mesh: Mesh, ndim: int, axis: int) -> NamedSharding:
    """An array of `ndim` axes whose `axis` splits over the mesh's "model" axis (tensor parallelism)."""
    return NamedSharding(mesh, PartitionSpec(*("model" if a == axis else None for a in range(ndim))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def per_device_linear(fn, mesh: Mesh | None, kernel_axes: tuple[str | None, ...], in_last: bool = False,
                      sum_in_order: bool = False):
    """fn(x [T, in], *weights) -> y [T, *out], run on each device's shards of x and the weights,
    for a kernel XLA cannot partition (a Pallas call would be gathered whole onto every device).
    kernel_axes: a Linear kernel's logical axes (in, *out); each weight's leading axis is the in
    axis (or a packing of it) and the rest the out axes, or with in_last its out axes (or blocks
    of them) then the in axis. A row-parallel Linear (in sharded) sums
    its devices' partial products (psum, or with sum_in_order gathered and added in device order:
    sum_in_device_order); a column-parallel one gives each device its columns."""
    if mesh is None or mesh.shape["model"] == 1:
        return fn
    in_spec, *out_spec = logical_to_spec(kernel_axes)
    weight = PartitionSpec(*out_spec, in_spec) if in_last else PartitionSpec(in_spec, *out_spec)

    def local(x, *weights):
        y = fn(x, *weights)
        if in_spec is None:
            return y
        if sum_in_order:
            return sum_in_device_order(y, in_spec)
        return jax.lax.psum(y, in_spec)

    def call(x, *weights):
        return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(None, in_spec), *[weight] * len(weights)),
                             out_specs=PartitionSpec(None, *out_spec), check_vma=False)(x, *weights)
    return call


def sum_in_device_order(partial, axis_name: str = "model"):
    """Inside a shard_map: the sum over `axis_name` of each device's `partial`, the same bits on every
    device and for every shape: the partials are all-gathered (a copy, exact) and added in device order
    in partial's dtype (float32 for a matmul's). An all-reduce (psum) would add them in the order of
    the collective's algorithm, which NCCL may pick by the message's size."""
    partials = jax.lax.all_gather(partial, axis_name)  # [devices, *partial.shape]
    total = partials[0]
    for i in range(1, partials.shape[0]):
        total = total + partials[i]
    return total
