"""A model's params handed over in memory (a JAX program's own: `LLM(params=...)`,
`update_weights`), checked whole, then placed on the mesh one param at a time, device to
device where they are already on devices (no copy through the host).

Two layouts are taken:
- the engine's own: the nested dict `LLM.get_params()` gives, e.g.
  {"embed_tokens": {"embedding": [vocab, hidden]}, "layers": {0: {"self_attn": {"qkv_proj":
  {"kernel": [hidden, qkv]}}, ...}}, ...}, Linear kernels [in, *out], qkv_proj and gate_up_proj
  fused (models/llama.py; docs/jax.md lists every param with its shape and logical axes);
- HF's: a flat mapping of HF parameter names to arrays ("model.layers.0.self_attn.q_proj.weight":
  [out, in]), as a checkpoint holds them, which is packed here as the loader packs a checkpoint
  (models/loader.py), in jnp on the mesh.

A wrong name, shape or dtype, or an array on a device outside the mesh, raises ValueError
naming the param (and both shapes) before any param is placed.
"""
import functools
import math
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.models.config import ModelArchConfig
from jaxllm.models.loader import (MAMBA_PARTS, ParamPath, checkpoint_params, granite_linear, hf_axes, hf_tensors,
                                  mamba_rows, path_to_hf_names)
from jaxllm.sharding import StageMeshes

ENGINE, HF = "engine", "hf"


def layout_of(params: Mapping) -> str:
    """HF when `params` is a flat mapping of dotted names to arrays, else the engine's."""
    if not isinstance(params, Mapping) or not params:
        raise ValueError(f"params must be a non-empty dict (the engine's layout, or HF names to arrays), "
                         f"got {type(params).__name__}")
    flat = all(isinstance(k, str) and "." in k and not isinstance(v, Mapping) for k, v in params.items())
    return HF if flat else ENGINE


def flatten(params: Mapping, prefix: ParamPath = ()) -> dict[ParamPath, object]:
    """The engine layout's nested dict as {path: array}; a layer's key may be an int or its digits."""
    flat = {}
    for key, value in params.items():
        key = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(value, Mapping):
            flat.update(flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def _name(path: ParamPath) -> str:
    return ".".join(map(str, path))


def check(params: Mapping, abstract: dict, arch: ModelArchConfig, mesh: jax.sharding.Mesh | StageMeshes) -> str:
    """Raise ValueError naming the first bad param; returns the layout. `abstract`: the model's
    params (loader.abstract_params) as the engine runs them (KV heads repeated for tensor
    parallelism: arch, the checkpoint's architecture, gives the HF shapes)."""
    layout = layout_of(params)
    if layout == ENGINE:
        given = flatten(params)
        expected = {path: (tuple(var.shape), var.dtype) for path, var in abstract.items()}
        names = {path: _name(path) for path in set(given) | set(expected)}
    else:
        given = dict(params)
        dtypes = {path: var.dtype for path, var in abstract.items()}
        expected = {name: (shape, dtypes[path]) for name, [(path, shape), *_] in
                    hf_tensors(arch, _hf_abstract(abstract, arch)).items()}
        if arch.tie_word_embeddings:
            given.pop("lm_head.weight", None)
        names = {name: name for name in set(given) | set(expected)}
    missing = sorted(names[p] for p in expected if p not in given)
    extra = sorted(names[p] for p in given if p not in expected)
    if missing or extra:
        raise ValueError(f"params do not fit the {arch.architecture} model ({layout} layout): "
                         f"missing {missing[:8]}, unexpected {extra[:8]}")
    mesh_devices = {d for m in (mesh.meshes if isinstance(mesh, StageMeshes) else (mesh,)) for d in m.devices.flat}
    for key, value in given.items():
        shape, dtype = expected[key]
        if tuple(np.shape(value)) != shape:
            raise ValueError(f"param {names[key]} has shape {tuple(np.shape(value))}, expected {shape}")
        if jnp.dtype(getattr(value, "dtype", None) or np.asarray(value).dtype) != jnp.dtype(dtype):
            raise ValueError(f"param {names[key]} has dtype {value.dtype}, expected {jnp.dtype(dtype).name} "
                             "(the engine's dtype: cast it, or set dtype)")
        if isinstance(value, jax.Array) and not set(value.sharding.device_set) <= mesh_devices:
            raise ValueError(f"param {names[key]} lives on devices outside the engine's mesh "
                             f"({sorted(d.id for d in value.sharding.device_set - mesh_devices)}): "
                             "put it on the mesh's devices (jax.device_put) or pass a host array")
    return layout


def _hf_abstract(abstract: dict, arch: ModelArchConfig) -> dict:
    """The abstract params as the checkpoint's architecture has them (KV heads not repeated), with
    their metadata (loader.hf_axes reads it)."""
    return {path: var.replace(jax.ShapeDtypeStruct(_hf_engine_shape(path, var.shape, arch), var.dtype))
            for path, var in abstract.items()}


def _hf_engine_shape(path: ParamPath, shape, arch: ModelArchConfig) -> tuple:
    """A param's engine-layout shape for the checkpoint's KV heads (the engine may repeat them)."""
    if path[-2] != "qkv_proj":
        return tuple(shape)
    rows = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    return (shape[0], rows) if path[-1] == "kernel" else (rows,)


def place(params: Mapping, layout: str, abstract: dict, shardings: dict, arch: ModelArchConfig,
          repeat: int) -> Iterator[tuple[ParamPath, jax.Array]]:
    """(path, the param on the mesh in its sharding, a copy of its own) for every param, one at a
    time. `repeat`: the engine's copies of each KV head (worker/kv_heads.py)."""
    if layout == ENGINE:
        for path, value in flatten(params).items():
            yield path, jax.device_put(value, shardings[path], may_alias=False)
        return
    hf_abstract = _hf_abstract(abstract, arch)
    for path, _ in checkpoint_params(arch, hf_abstract, ((name, params[name]) for name in params
                                                         if name != "lm_head.weight" or not arch.tie_word_embeddings)):
        packing, axes = _packing(path, arch), hf_axes(path, abstract[path])
        parts = [jax.device_put(params[name], _part_sharding(packing, axes, shardings[path], np.shape(params[name])))
                 for name in path_to_hf_names(path, arch)]
        pack = _packer(packing, axes, arch.num_kv_heads, arch.head_dim, repeat, abstract[path].dtype, shardings[path])
        yield path, pack(*parts)


def _part_sharding(packing: str | tuple | None, axes: tuple[int, ...], sharding: NamedSharding,
                   shape: tuple[int, ...]) -> NamedSharding:
    """Where one HF part of a param goes before _packer packs it: the param's own split, read back
    through the transposition and the packing onto the part's axes, so that each device holds about
    its share of the part, not the whole of it (a part replicated on every device would hold a
    whole tensor on each, tensor parallelism's memory gone for a moment). An axis the split does
    not divide evenly stays whole."""
    spec = (*sharding.spec, *(None,) * (len(axes) - len(sharding.spec)))
    packed = [None] * len(axes)  # the packed HF-layout tensor's split: the param is it transposed by axes
    for param_axis, packed_axis in enumerate(axes):
        packed[packed_axis] = spec[param_axis]
    if packing == "stacked_gate_up":  # [..., I, 2, H] from [..., 2I, H]: a split of I splits the 2I rows
        packed = packed[:-2] + packed[-1:]
    elif packing == "gate_up_proj":  # gate and up stacked on axis 1
        packed = packed[:1] + packed[2:]
    elif packing == "experts.down_proj":  # the experts stacked on axis 0
        packed = packed[1:]
    elif packing == "experts.gate_up_proj":  # the experts on axis 0, each one's gate and up on axis 2
        packed = packed[1:2] + packed[3:]
    elif isinstance(packing, tuple) and packing[0] == "zxdt_proj":  # [heads, a head's z, x and dt rows, ...]
        packed = packed[:1] + packed[2:]  # cut from [rows, ...]: a split of the heads splits the rows
    def devices(split) -> int:  # a split over one mesh axis, or over several
        return math.prod(sharding.mesh.shape[a] for a in (split if isinstance(split, tuple) else (split,)))
    part = [split if split is not None and size % devices(split) == 0 else None for split, size in zip(packed, shape)]
    return NamedSharding(sharding.mesh, PartitionSpec(*part))


def _packing(path: ParamPath, arch: ModelArchConfig) -> str | tuple | None:
    """How a param is packed from its HF tensors: "qkv_proj", "gate_up_proj", a MoE layer's stacked
    "experts.gate_up_proj" or "experts.down_proj", Granite 4.0-H's "stacked_gate_up" (gate's rows then
    up's in one input_linear, StackedGateUpSource's), a Mamba mixer's ("zxdt_proj", heads, head_dim, B and
    C's rows) or ("rows", start, stop) of its HF tensor (models/tensor_sources.py MambaHeadsSource,
    RowsSource), or None (it is one tensor)."""
    granite = granite_linear(arch, path)
    if granite:  # its output_linear is the param's tensor as it is
        return "stacked_gate_up" if granite == "input_linear" else None
    if path[-2] == "experts":
        return f"experts.{path[-1]}"
    if arch.mamba is not None and path[-2] in MAMBA_PARTS:
        m = arch.mamba
        return ("zxdt_proj", m.num_heads, m.head_dim, 2 * m.group_dim) if path[-2] == "zxdt_proj" else (
            "rows", *mamba_rows(m, path[-2]))
    return path[-2] if path[-2] in ("qkv_proj", "gate_up_proj") else None


@functools.lru_cache(maxsize=None)
def _packer(fused: str | tuple | None, axes: tuple[int, ...], num_kv_heads: int, head_dim: int, repeat: int, dtype,
            sharding):
    """The jitted HF-to-engine packing of one param kind (models/tensor_sources.py: QKVSource's,
    GateUpSource's, ExpertsSource's and a Mamba mixer's, in jnp: _packing), then its transposition by
    `axes` (loader.hf_axes), straight into its sharding; one per kind and shape, so an update compiles
    nothing new."""
    def pack(*parts):
        if fused == "experts.gate_up_proj":  # expert e's gate and up: parts 2e and 2e + 1
            x = jnp.stack([jnp.stack(pair, axis=1) for pair in zip(parts[::2], parts[1::2])])
        elif fused == "experts.down_proj":
            x = jnp.stack(parts)
        elif fused == "qkv_proj":
            q, k, v = parts
            k, v = (_repeat_heads(x, head_dim, repeat) for x in (k, v))
            groups = num_kv_heads * repeat
            pieces = [x.reshape(groups, x.shape[0] // groups, *x.shape[1:]) for x in (q, k, v)]
            x = jnp.concatenate(pieces, axis=1).reshape(-1, *q.shape[1:])
        elif fused == "gate_up_proj":
            x = jnp.stack(parts, axis=1)
        elif fused == "stacked_gate_up":  # [..., 2I, H] -> [..., I, 2, H]
            (w,) = parts
            x = jnp.stack(jnp.split(w, 2, axis=-2), axis=-2)
        elif isinstance(fused, tuple) and fused[0] == "rows":
            x = parts[0][fused[1]:fused[2]]
        elif isinstance(fused, tuple):  # per head its z rows, its x rows, its dt row
            (w,), (_, heads, dim, bc_rows) = parts, fused
            inner = heads * dim
            z, x = (w[s:s + inner].reshape(heads, dim, *w.shape[1:]) for s in (0, inner))
            x = jnp.concatenate([z, x, w[2 * inner + bc_rows:][:, None]], axis=1)
        else:
            (x,) = parts
        return jnp.transpose(x, axes).astype(dtype)
    return jax.jit(pack, out_shardings=sharding)


def _repeat_heads(x, head_dim: int, repeat: int):
    """[kv_heads * head_dim, ...] -> [kv_heads * repeat * head_dim, ...], each head's rows repeated."""
    if repeat == 1:
        return x
    heads = x.reshape(-1, head_dim, *x.shape[1:])
    return jnp.repeat(heads, repeat, axis=0).reshape(-1, *x.shape[1:])
