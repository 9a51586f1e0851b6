"""Build a model whose params live on the mesh: from HF tensors, or random ("dummy").

The module is built abstractly (nnx.eval_shape: shapes, dtypes and logical axes, no
arrays), then every param is made or loaded straight into its NamedSharding, one
tensor at a time. A checkpoint tensor comes as a TensorSource, read piece by piece:
each addressable device gets its shard read from just its slice of the file, so host
memory stays near one tensor, not the model, and each host of a multi-host mesh reads
only its own devices' shards.
"""
import functools
import json
import os
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm import tqdm

from jaxllm.models.config import GEMMA_ARCHITECTURES, ModelArchConfig
from jaxllm.models.gemma3 import Gemma3ForCausalLM
from jaxllm.models.llama import INIT_STD, LlamaForCausalLM
from jaxllm.sharding import named_sharding

Path = tuple  # a param's path in the module, e.g. ("layers", 0, "self_attn", "q_proj", "kernel")
Index = tuple[slice, ...]  # one slice per axis: the piece of a tensor one device holds


class TensorSource(Protocol):
    """A checkpoint tensor, in HF layout, that reads only the pieces asked for:
    `source[index]` is the numpy array of that piece. A numpy array is one."""
    shape: tuple[int, ...]

    def __getitem__(self, index: Index) -> np.ndarray: ...


def create_model(config: ModelArchConfig, *, dtype, mesh: jax.sharding.Mesh,
                 weights: Iterable[tuple[str, TensorSource]] | None, seed: int = 0,
                 show_progress: bool = False) -> LlamaForCausalLM | Gemma3ForCausalLM:
    """The model with params placed on `mesh` by the logical-axis rules.

    weights: (HF name, tensor source) pairs in HF layout (Linear weights [out, in]),
    streamed; None gives random weights made on device (load_format="dummy").
    show_progress: a bar over the tensors loaded, with the rate in GB/s.
    """
    dtype = jnp.dtype(dtype)
    model_class = Gemma3ForCausalLM if config.architecture in GEMMA_ARCHITECTURES else LlamaForCausalLM
    abstract = nnx.eval_shape(lambda: model_class(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = dict(nnx.to_flat_state(state))
    shardings = {path: named_sharding(mesh, var.get_metadata()["out_sharding"]) for path, var in params.items()}
    if weights is None:
        values = _dummy_params(params, shardings, seed)
    else:
        values = _load_params(config, params, shardings, weights, show_progress)
    state = nnx.from_flat_state([(path, var.replace(values[path])) for path, var in params.items()])
    return nnx.merge(graphdef, state)


def _dummy_params(params: dict, shardings: dict, seed: int) -> dict:
    """Normal(0, INIT_STD) weights, ones for norm scales, each made by a jitted function
    straight into its sharding, with its own key."""
    base_key = jax.random.key(seed)
    values = {}
    for i, (path, var) in enumerate(params.items()):
        is_norm = var.get_metadata()["out_sharding"] == ("norm",)
        make = _random_fn(var.shape, var.dtype, shardings[path], is_norm)
        values[path] = make(jax.random.fold_in(base_key, i))
    return values


@functools.lru_cache(maxsize=None)
def _random_fn(shape, dtype, sharding, ones):
    def make(key):
        return jnp.ones(shape, dtype) if ones else INIT_STD * jax.random.normal(key, shape, dtype)
    return jax.jit(make, out_shardings=sharding)


def _load_params(config: ModelArchConfig, params: dict, shardings: dict,
                 weights: Iterable[tuple[str, TensorSource]], show_progress: bool) -> dict:
    values = {}
    loaded_bytes, start = 0, time.perf_counter()
    bar = tqdm(total=len(params), desc="Loading weights", unit="tensor", disable=not show_progress)
    for name, source in weights:
        name = _text_model_name(name)
        if (name is None or name.endswith("rotary_emb.inv_freq")
                or (config.tie_word_embeddings and name == "lm_head.weight")):
            continue  # a multimodal model's vision tower; a buffer some checkpoints save; or
            # the head a tied model does not use
        path, transpose = hf_name_to_path(name)
        if path not in params:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint: the {config.architecture} "
                             f"model has no param {'.'.join(map(str, path))}")
        if path in values:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
        var = params[path]
        expected = var.shape[::-1] if transpose else var.shape  # in HF layout
        if tuple(source.shape) != expected:
            raise ValueError(f"tensor {name!r} has shape {tuple(source.shape)}, expected {expected}")
        values[path] = _place(source, var.shape, var.dtype, shardings[path], transpose)
        loaded_bytes += var.size * var.dtype.itemsize
        bar.set_postfix_str(f"{loaded_bytes / 1e9 / (time.perf_counter() - start):.2f} GB/s", refresh=False)
        bar.update()
    bar.close()
    missing = [path_to_hf_name(p) for p in params if p not in values]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                         + (", ..." if len(missing) > 8 else ""))
    return values


def _place(source: TensorSource, shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding,
           transpose: bool) -> jax.Array:
    """The param [shape] in `sharding`, each addressable device's shard read from its slice
    of `source` (HF layout: `shape` reversed when `transpose`)."""
    pieces = {}  # devices that share an index (a replicated axis) share one read

    def read(index: Index) -> np.ndarray:
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        if key not in pieces:
            piece = np.asarray(source[index[::-1] if transpose else index])
            pieces[key] = np.ascontiguousarray(piece.T if transpose else piece, dtype=dtype)
        return pieces[key]

    # Blocking keeps at most one param's host pieces alive.
    return jax.block_until_ready(jax.make_array_from_callback(shape, sharding, read))


# A multimodal Gemma 3 checkpoint's text model, as transformers 4 and 5 name it.
_TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                        "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name in a text-only model; None for a vision tensor."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, text_prefix in _TEXT_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return text_prefix + name.removeprefix(prefix)
    return name


def hf_name_to_path(name: str) -> tuple[Path, bool]:
    """HF tensor name -> (our param path, whether to transpose [out, in] -> [in, out])."""
    parts = [int(p) if p.isdigit() else p for p in name.removeprefix("model.").split(".")]
    *module, leaf = parts
    if module and module[-1] == "embed_tokens":
        return (*module, "embedding"), False
    if module and leaf == "weight" and (str(module[-1]).endswith("_proj") or module[-1] == "lm_head"):
        return (*module, "kernel"), True
    return tuple(parts), False


def path_to_hf_name(path: Path) -> str:
    name = ".".join(str(p) for p in path)
    for ours in (".kernel", ".embedding"):
        if name.endswith(ours):
            name = name.removesuffix(ours) + ".weight"
    return name if name.startswith("lm_head") else "model." + name


def iter_hf_weights(path: str) -> Iterator[tuple[str, TensorSource]]:
    """(name, tensor source) for every tensor of the HF folder's safetensors files, listed
    by model.safetensors.index.json when present; a source reads only the slices asked
    for. (config.json is jaxllm.config's to read.)"""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]  # beside it may sit e.g. Mistral's consolidated.safetensors
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {path!r}")

    def tensors():
        for file in files:
            with safe_open(os.path.join(path, file), framework="np") as f:
                for name in f.keys():
                    yield name, SafetensorsTensor(f.get_slice(name))

    return tensors()


class SafetensorsTensor:
    """A safetensors tensor read slice by slice from the file's mapping (the slice keeps
    the file open after its safe_open closes)."""

    def __init__(self, tensor_slice):
        self._slice = tensor_slice
        self.shape = tuple(tensor_slice.get_shape())

    def __getitem__(self, index: Index) -> np.ndarray:
        return self._slice[index]
