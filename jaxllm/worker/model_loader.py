"""The runner's weights: the model built on the mesh from its checkpoint (an HF folder, a GGUF
file, an orbax checkpoint, an EAGLE head's folder), from params in memory (models/params.py),
or random ("dummy"), quantized if asked, and kept as the step takes them: a flat list of
arrays (it dispatches faster than an nnx.State: 0.14 vs 0.7 ms for the 8B) with the NNX
graphdef and treedef that rebuild the model inside the step. New weights replace the old
ones in place, one param at a time, in the same shardings: the step's executables stay valid."""
import dataclasses
from collections.abc import Iterator, Mapping

import jax
from flax import nnx

from jaxllm.config import Config, ModelConfig
from jaxllm.models import params as memory_params
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.eagle import eagle_weights
from jaxllm.models.eagle_config import EagleArchConfig
from jaxllm.models.loader import (ParamPath, abstract_params, checkpoint_params, create_model, fp8_scale, hf_axes,
                                  iter_weights, param_shardings, place_source, quantize_fn, quantize_model)
from jaxllm.models.orbax_checkpoint import is_orbax_checkpoint, restore_model, restore_params
from jaxllm.sharding import StageMeshes
from jaxllm.worker import kv_heads


@dataclasses.dataclass
class ModelWeights:
    graphdef: nnx.GraphDef
    treedef: jax.tree_util.PyTreeDef
    params: list[jax.Array]
    paths: list[ParamPath]  # params[i]'s path in the model, e.g. ("layers", 0, "mlp", "down_proj", "kernel")

    def __post_init__(self):
        self.index = {path: i for i, path in enumerate(self.paths)}

    @classmethod
    def of(cls, model) -> "ModelWeights":
        graphdef, state = nnx.split(model)
        keyed, treedef = jax.tree_util.tree_flatten_with_path(state)
        paths = [tuple(getattr(k, "key", None) for k in key_path[:-1]) for key_path, _ in keyed]  # [-1]: .value
        return cls(graphdef, treedef, jax.block_until_ready([value for _, value in keyed]), paths)

    def model(self, params: list[jax.Array] | None = None):
        """The NNX model over `params` (default: these), e.g. inside a jitted function."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, self.params if params is None else params))

    def as_dict(self) -> dict:
        """The params as a nested dict (the engine's layout): the engine's own arrays."""
        return nnx.to_pure_dict(jax.tree.unflatten(self.treedef, self.params))

    def set(self, path: ParamPath, value: jax.Array) -> None:
        """Put `value` (in the old param's shape, dtype and sharding) in place of the param at
        `path`, and free the old one now."""
        i = self.index[path]
        old, self.params[i] = self.params[i], value
        if not old.is_deleted():
            old.delete()

    @property
    def deleted(self) -> bool:
        return any(p.is_deleted() for p in self.params)

    def delete(self) -> None:
        """Free the device memory now, not when a collector finds the arrays; the list keeps
        the (deleted) arrays, so `set` can fill it again."""
        for array in self.params:
            if not array.is_deleted():
                array.delete()


def load_weights(mc: ModelConfig, arch: ModelArchConfig, mesh: jax.sharding.Mesh | StageMeshes, repeat: int, seed: int = 0,
                 show_progress: bool = False, params: Mapping | None = None) -> ModelWeights:
    """The model's weights on `mesh`, from `params` in memory if given, else from the model's
    checkpoint (random from `seed` with load_format "dummy"). `arch` is what runs
    (worker/kv_heads.py: its KV heads repeated `repeat` times when tensor parallelism has more
    devices than KV heads)."""
    if params is not None:
        if mc.quantization is not None and mc.quantization.from_checkpoint:
            raise ValueError(f"params in memory are unquantized; the model's checkpoint is {mc.quantization.method}")
        _, abstract = abstract_params(arch, mc.dtype)
        layout = memory_params.check(params, abstract, mc.arch, mesh)
        values = dict(memory_params.place(params, layout, abstract, param_shardings(abstract, mesh), mc.arch, repeat))
        model = create_model(arch, dtype=mc.dtype, mesh=mesh, weights=None, values=values)
    elif mc.format == "orbax" and mc.load_format != "dummy":
        if isinstance(mesh, StageMeshes):
            raise ValueError("an orbax checkpoint restores onto one mesh: load its source (HF or GGUF) under "
                             "pipeline_parallel_size > 1")
        if repeat > 1:
            raise ValueError(f"an orbax checkpoint restores at tensor_parallel_size <= its KV heads "
                             f"({mc.arch.num_kv_heads}); load its source (HF or GGUF) for more devices")
        model = restore_model(mc.path, mc.arch, dtype=mc.dtype, mesh=mesh)  # straight into the shardings
    else:
        weights = None
        if mc.load_format != "dummy":
            weights = iter_weights(mc.path, mc.format, mc.quantization)
            if isinstance(mc.arch, EagleArchConfig):
                weights = eagle_weights(weights, mc.arch)
            weights = kv_heads.replicate_kv_weights(weights, mc.arch.num_kv_heads, repeat)
        model = create_model(arch, dtype=mc.dtype, mesh=mesh, weights=weights, seed=seed,
                             show_progress=show_progress, quantization=mc.quantization)
    quantize_model(model, mc.quantization, mesh)
    return ModelWeights.of(model)


@dataclasses.dataclass(frozen=True)
class ParamSpecs:
    """What new params must be: the unquantized model's abstract params and their shardings
    (made once: tracing the model's shapes takes a good part of a second)."""
    abstract: dict
    shardings: dict

    @classmethod
    def of(cls, arch: ModelArchConfig, dtype, mesh: jax.sharding.Mesh | StageMeshes) -> "ParamSpecs":
        _, abstract = abstract_params(arch, dtype)
        return cls(abstract, param_shardings(abstract, mesh))


def new_params(config: Config, arch: ModelArchConfig, mesh: jax.sharding.Mesh | StageMeshes, repeat: int,
               specs: ParamSpecs, source: Mapping | str) -> Iterator[tuple[ParamPath, jax.Array]]:
    """(path, array) of the model's unquantized params from `source`: params in memory (either
    layout), or a checkpoint's path (an HF folder, a .gguf file, or an orbax checkpoint's folder,
    read a layer at a time). The whole source is checked first: a bad one raises ValueError before
    any param comes. A checkpoint's params are cast to the engine's dtype, as at start-up."""
    mc = config.model
    if mc.quantization is not None and mc.quantization.from_checkpoint:
        raise ValueError(f"update_weights takes unquantized weights; this model runs its {mc.quantization.method} "
                         "checkpoint's quantized ones")
    abstract, shardings = specs.abstract, specs.shardings
    if isinstance(source, str) and is_orbax_checkpoint(source):
        if repeat > 1:  # the checkpoint holds the model's KV heads, the engine each one `repeat` times
            raise ValueError(f"an orbax checkpoint restores at tensor_parallel_size <= its KV heads "
                             f"({mc.arch.num_kv_heads}); update from its source (HF or GGUF) for more devices")
        yield from restore_params(source, {path: jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=shardings[path])
                                           for path, var in abstract.items()}, by_layer=True)
        return
    if isinstance(source, str):
        fmt = "gguf" if source.endswith(".gguf") else "hf"
        weights = kv_heads.replicate_kv_weights(iter_weights(source, fmt), mc.arch.num_kv_heads, repeat)
        sources = list(checkpoint_params(arch, abstract, weights))  # every name and shape checked, nothing read
        for path, tensor in sources:
            var = abstract[path]
            yield path, place_source(tensor, var.shape, var.dtype, shardings[path], hf_axes(path, var))
        return
    layout = memory_params.check(source, abstract, mc.arch, mesh)
    yield from memory_params.place(source, layout, abstract, shardings, mc.arch, repeat)


def update(weights: ModelWeights, values: Iterator[tuple[ParamPath, jax.Array]]) -> None:
    """Put each new unquantized param in place of the old, quantizing it first where the weights
    hold an FP8 Linear (its kernel and scale, in their shardings): at most one param's new and
    old copies are alive together."""
    index = weights.index
    for path, value in values:
        scale_path, quantize = fp8_scale(path)
        if scale_path in index:
            kernel_sharding, scale_sharding = (weights.params[index[p]].sharding for p in (path, scale_path))
            kernel, scale = quantize_fn(quantize, kernel_sharding, scale_sharding)(value)
            value.delete()
            weights.set(path, kernel)
            weights.set(scale_path, scale)
        else:
            weights.set(path, value)

