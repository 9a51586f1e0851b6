"""Build a model whose params live on the mesh: from HF tensors, or random ("dummy").

The module is built abstractly (nnx.eval_shape: shapes, dtypes and logical axes, no
arrays), then every param is made or loaded straight into its NamedSharding, one
param at a time. A checkpoint tensor comes as a TensorSource, read piece by piece:
each addressable device gets its shard read from just its slice of the file, so host
memory stays near one param, not the model, and each host of a multi-host mesh reads
only its own devices' shards. A fused param (qkv_proj, gate_up_proj) is placed once all
its HF tensors have come, from a source that packs them lazily (QKVSource,
GateUpSource): a device's piece is read from just its rows of each part. A MoE model's
stacked experts are packed so from each expert's tensors (ExpertsSource); Granite 4.0-H's come
stacked already, gate and up in one tensor (StackedGateUpSource).
"""
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxllm.models.config import GEMMA_ARCHITECTURES, ModelArchConfig
from jaxllm.models.deepseek import DeepseekForCausalLM
from jaxllm.models.eagle import EAGLE_HEADS
from jaxllm.models.fp8 import BlockFp8Linear, Fp8Linear, quantize_experts, quantize_kernel
from jaxllm.models.gemma3 import Gemma3ForCausalLM
from jaxllm.models.granite_hybrid import GraniteHybridForCausalLM
from jaxllm.models.hf_checkpoint import iter_hf_weights
from jaxllm.models.int4 import Int4Linear
from jaxllm.models.llama import INIT_STD, Linear, LlamaForCausalLM
from jaxllm.models.mamba2 import Mamba2ForCausalLM
from jaxllm.models.moe import Experts, MoeForCausalLM
from jaxllm.models.quant_checkpoint import quantized_weights
from jaxllm.models.quant_config import FP8_BLOCK, INT4, MODEL_DTYPE_LINEARS, QuantConfig
from jaxllm.models.tensor_sources import (ExpertsSource, GateUpSource, Index, MambaHeadsSource, QKVSource,
                                          RowsSource, SharedSource, StackedGateUpSource, TensorSource)
from jaxllm.sharding import StageMeshes, named_sharding, param_mesh

logger = logging.getLogger(__name__)
# Calibrated KV cache scales (compressed-tensors', ModelOpt's, vLLM's FP8 checkpoints): per layer, not read
_KV_SCALES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale")

ParamPath = tuple  # a param's path in the module, e.g. ("layers", 0, "self_attn", "qkv_proj", "kernel")
# A fused param's module and the HF projections it is packed from, in order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_INTO = {part: fused for fused, parts in FUSED_PROJECTIONS.items() for part in parts}
# HF's names where an architecture's differ from Llama's, replaced in order: Mixtral's MoE block and
# its experts' projections (Qwen's: mlp, gate_proj, up_proj, down_proj); Mamba2's backbone.
_HF_RENAMES = {
    "mixtral": {".mlp.": ".block_sparse_moe.", ".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."},
    "mamba2": {"model.embed_tokens.": "backbone.embeddings.", "model.norm.": "backbone.norm_f.", "model.": "backbone."},
    "granitemoehybrid": {".block_sparse_moe.gate.": ".block_sparse_moe.router.layer."},
}
# Granite 4.0-H's MLPs as HF stacks them: one tensor per projection, gate's rows then up's in input_linear.
_GRANITE_LINEARS = {"gate_up_proj": "input_linear", "down_proj": "output_linear"}
# A Mamba mixer's params read from rows of one HF tensor (models/mamba2.py): the tensor's module.
MAMBA_PARTS = {"zxdt_proj": "in_proj", "bc_proj": "in_proj", "conv_x": "conv1d", "conv_bc": "conv1d"}


def abstract_params(config: ModelArchConfig, dtype, quantization: QuantConfig | None = None,
                    mesh: jax.sharding.Mesh | StageMeshes | None = None
                    ) -> tuple[nnx.GraphDef, dict[ParamPath, nnx.Variable]]:
    """The model's graphdef and its params without arrays: path -> Variable (shape, dtype, and
    the logical axes as `out_sharding` metadata). mesh: where its per-device kernels run (under
    pipeline parallelism each layer on its stage's). With a quantized checkpoint's `quantization`,
    its quantized Linears are the quantized modules."""
    dtype = jnp.dtype(dtype)

    def build():
        model = _model(config, dtype, mesh)
        if quantization is not None and quantization.from_checkpoint:
            _quantized_linears(model, quantization, dtype, mesh)
        return model

    graphdef, state = nnx.split(nnx.eval_shape(build))
    return graphdef, dict(nnx.to_flat_state(state))


def _model(config: ModelArchConfig, dtype, mesh: jax.sharding.Mesh | None) -> nnx.Module:
    rngs = nnx.Rngs(0)
    if config.architecture in EAGLE_HEADS:
        return EAGLE_HEADS[config.architecture](config, dtype=dtype, rngs=rngs)
    if config.granite is not None:  # its experts run per device, on `mesh`
        return GraniteHybridForCausalLM(config, dtype=dtype, rngs=rngs, mesh=mesh)
    if config.moe is not None:  # its experts run per device, on `mesh`
        model_class = DeepseekForCausalLM if config.mla is not None else MoeForCausalLM
        return model_class(config, dtype=dtype, rngs=rngs, mesh=mesh)
    if config.mamba is not None:
        return Mamba2ForCausalLM(config, dtype=dtype, rngs=rngs)
    model_class = Gemma3ForCausalLM if config.architecture in GEMMA_ARCHITECTURES else LlamaForCausalLM
    return model_class(config, dtype=dtype, rngs=rngs)


def _linears(model) -> Iterator[tuple[ParamPath, nnx.Module, str, Linear]]:
    """(path, parent, attribute, Linear) of every Linear but the LM head, a MoE layer's routers
    (which stay in the model's dtype, as in vLLM: a quantized router would pick other experts) and
    latent attention's kv_b_proj (models/deepseek.py: its kernel is absorbed into the queries and
    the outputs, read whole)."""
    paths = [path for path, module in nnx.iter_modules(model) if isinstance(module, Linear)
             and path != ("lm_head",) and path[-1] not in MODEL_DTYPE_LINEARS]
    for path in paths:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        yield path, parent, path[-1], getattr(parent, path[-1])  # a Linear is always a named attribute


def _quantized_linears(model, quant: QuantConfig, dtype, mesh) -> None:
    """Each Linear the checkpoint quantizes becomes its scheme's module (models/fp8.py, models/int4.py),
    in place, with placeholder arrays (built under eval_shape: none is made); its per-device kernels run
    on `mesh`, or under pipeline parallelism on its layer's stage's."""
    for path, parent, attr, linear in _linears(model):
        on = param_mesh(mesh, path)
        modules = [name.removesuffix(".weight") for name in path_to_hf_names((*path, "kernel"), model.config)]
        quantized = {module: quant.quantizes(module) for module in modules}
        if len(set(quantized.values())) > 1:
            raise ValueError(f"quantization_config quantizes some of the Linears fused into {'.'.join(map(str, path))} "
                             f"and not others ({quantized}): they must agree")
        in_dim, out_shape = linear.kernel.shape[0], tuple(linear.kernel.shape[1:])
        if not quantized[modules[0]] or not quant.whole_blocks(out_shape[-1], in_dim):
            continue  # (partial blocks load dequantized: models/quant_checkpoint.py)
        axes = linear.kernel.get_metadata()["out_sharding"]
        if quant.scheme == INT4:
            module = Int4Linear(in_dim, out_shape, axes, group_size=quant.group_size, act_order=quant.act_order,
                                bias=linear.bias, dtype=dtype, mesh=on)
        elif quant.scheme == FP8_BLOCK:
            module = BlockFp8Linear(in_dim, out_shape, axes, block=quant.block, bias=linear.bias, mesh=on)
        else:
            module = Fp8Linear(jnp.zeros((*out_shape, in_dim), jnp.float8_e4m3fn), jnp.zeros(out_shape, jnp.float32),
                               (*axes[1:], axes[0]), linear.bias,
                               jnp.zeros((), jnp.float32) if quant.static_input_scale else None)
        setattr(parent, attr, module)


def param_shardings(params: dict[ParamPath, nnx.Variable], mesh: jax.sharding.Mesh | StageMeshes) -> dict:
    """Each param's NamedSharding by the rules: on `mesh`, or under pipeline parallelism on its stage's."""
    return {path: named_sharding(param_mesh(mesh, path), var.get_metadata()["out_sharding"])
            for path, var in params.items()}


def create_model(config: ModelArchConfig, *, dtype, mesh: jax.sharding.Mesh | StageMeshes,
                 weights: Iterable[tuple[str, TensorSource]] | None, seed: int = 0,
                 show_progress: bool = False, values: dict | None = None,
                 quantization: QuantConfig | None = None) -> LlamaForCausalLM:
    """The model with params placed on `mesh` by the logical-axis rules (on their stages' meshes
    under pipeline parallelism, where a layer's experts and quantized kernels run on its stage's).

    weights: (HF name, tensor source) pairs in HF layout (Linear weights [out, in]; a quantized
    checkpoint's as models/quant_checkpoint.py hands them on), streamed, a fused param's parts in
    any order; None gives random weights made on device (load_format="dummy"), unless `values`
    (path -> array, placed) gives them. quantization: a quantized checkpoint's, whose Linears the
    model holds quantized. show_progress: a bar over the params loaded, with the rate in GB/s.
    """
    graphdef, params = abstract_params(config, dtype, quantization, mesh)
    shardings = param_shardings(params, mesh)
    if values is None and weights is None:
        values = _dummy_params(params, shardings, seed)
    elif values is None:
        values = dict(load_params(config, params, shardings, weights, show_progress))
    state = nnx.from_flat_state([(path, var.replace(values[path])) for path, var in params.items()])
    return nnx.merge(graphdef, state)


def quantize_model(model: LlamaForCausalLM, quantization: QuantConfig | None,
                   mesh: jax.sharding.Mesh | StageMeshes) -> None:
    """With quantization="fp8" on an unquantized checkpoint, every Linear but the LM head and the MoE
    routers becomes an Fp8Linear (models/fp8.py), and a MoE layer's stacked experts go to e4m3 with a
    scale per expert and output channel (models/moe.py, Experts), in place, one param at a time: the
    bf16 and e4m3 copies of one weight at most are alive together. A quantized checkpoint's Linears
    load quantized; its FP8 experts load dequantized (models/quant_checkpoint.py) and go to e4m3 here."""
    if quantization is None:
        return
    for path, parent, attr, linear in [] if quantization.from_checkpoint else list(_linears(model)):
        axes = linear.kernel.get_metadata()["out_sharding"]
        fp8_axes = (*axes[1:], axes[0])  # [*out, in]
        on = param_mesh(mesh, path)  # under pipeline parallelism its layer's stage's
        quantize = quantize_fn(quantize_kernel, named_sharding(on, fp8_axes), named_sharding(on, axes[1:]))
        kernel, scale = quantize(linear.kernel[...])
        setattr(parent, attr, Fp8Linear(kernel, scale, fp8_axes, linear.bias))
        del linear  # its bf16 kernel goes with it
    for path, experts in list(nnx.iter_modules(model)):
        if isinstance(experts, Experts):
            on = param_mesh(mesh, path)
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)
                axes = param.get_metadata()["out_sharding"]
                scale_axes = (axes[0], *axes[2:])  # [E, *out]
                quantize = quantize_fn(quantize_experts, named_sharding(on, axes), named_sharding(on, scale_axes))
                weight, scale = quantize(param[...])
                param.set_value(weight)
                setattr(experts, f"{name}_scale", nnx.Param(scale, out_sharding=scale_axes, eager_sharding=False))


def fp8_scale(path: ParamPath) -> tuple[ParamPath, Callable]:
    """The path of the scale that quantization="fp8" gives the param at `path`, and the function
    that quantizes it: an Fp8Linear's kernel's weight_scale, or stacked experts' {name}_scale."""
    if path[-1] == "kernel":
        return (*path[:-1], "weight_scale"), quantize_kernel
    return (*path[:-1], f"{path[-1]}_scale"), quantize_experts


@functools.lru_cache(maxsize=None)
def quantize_fn(quantize: Callable, kernel_sharding, scale_sharding):
    return jax.jit(quantize, out_shardings=(kernel_sharding, scale_sharding))


def _dummy_params(params: dict, shardings: dict, seed: int) -> dict:
    """Normal(0, INIT_STD) weights, ones for norm scales, zeros for integer params (EAGLE-3's d2t),
    each made by a jitted function straight into its sharding, with its own key."""
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
        if jnp.issubdtype(dtype, jnp.integer):  # EAGLE-3's d2t: the draft's ids are the target's
            return jnp.zeros(shape, dtype)
        return jnp.ones(shape, dtype) if ones else INIT_STD * jax.random.normal(key, shape, dtype)
    return jax.jit(make, out_shardings=sharding)


def load_params(config: ModelArchConfig, params: dict, shardings: dict, weights: Iterable[tuple[str, TensorSource]],
                show_progress: bool = False) -> Iterator[tuple[ParamPath, jax.Array]]:
    """(path, the param placed in its sharding), each as soon as its tensors have come (see
    checkpoint_params for the checks)."""
    loaded_bytes, start = 0, time.perf_counter()
    bar = tqdm(total=len(params), desc="Loading weights", unit="tensor", disable=not show_progress)
    for path, source in checkpoint_params(config, params, weights):
        var = params[path]
        yield path, place_source(source, var.shape, var.dtype, shardings[path], hf_axes(path, var))
        loaded_bytes += var.size * var.dtype.itemsize
        bar.set_postfix_str(f"{loaded_bytes / 1e9 / (time.perf_counter() - start):.2f} GB/s", refresh=False)
        bar.update()
    bar.close()


def checkpoint_params(config: ModelArchConfig, params: dict, weights: Iterable[tuple[str, TensorSource]]
                      ) -> Iterator[tuple[ParamPath, TensorSource]]:
    """(path, the param's source in HF layout), each as soon as its tensors have come, reading
    nothing; raises ValueError for a tensor the model has not, of another shape, twice, or
    missing (at the end: list() it to check a checkpoint whole before using any of it)."""
    tensors = hf_tensors(config, params)
    arrived = {}  # param path -> {HF name: source}, until all the param's tensors have come
    done, kv_scales = set(), 0
    for name, source in weights:
        name = _text_model_name(name)
        if name is not None and name.endswith(_KV_SCALES) and ".self_attn." in name and name not in tensors:
            kv_scales += 1
            continue
        if (name is None or name.endswith("rotary_emb.inv_freq")
                or (config.tie_word_embeddings and name == "lm_head.weight") or _is_mtp_layer(name, config)):
            continue  # a multimodal model's vision tower; a buffer some checkpoints save; the head a
            # tied model does not use; or DeepSeek-V3's multi-token prediction layer
        if name not in tensors:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint: the {config.architecture} "
                             f"model has no param {'.'.join(map(str, hf_name_to_path(name)))}")
        for path, expected in tensors[name]:  # its param (a Mamba mixer's in_proj and conv1d: two)
            parts = arrived.setdefault(path, {})
            if name in parts or path in done:
                raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
            if tuple(source.shape) != expected:
                raise ValueError(f"tensor {name!r} has shape {tuple(source.shape)}, expected {expected}")
            parts[name] = source
            names = path_to_hf_names(path, config)
            if len(parts) < len(names):
                continue  # a fused param waits for its other parts
            del arrived[path]
            done.add(path)
            yield path, _packed(config, path, [(n, parts[n]) for n in names], _fuse(params[path]))
    if kv_scales:
        logger.warning("the checkpoint's %d calibrated attention scales (k_scale, v_scale, ...) are not read: an "
                       "8-bit KV cache (kv_cache_dtype='fp8') scales by 1", kv_scales)
    missing = [name for path in params if path not in done for name in path_to_hf_names(path, config)
               if name not in arrived.get(path, {})]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                         + (", ..." if len(missing) > 8 else ""))


def place_source(source: TensorSource, shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding,
                 axes: tuple[int, ...]) -> jax.Array:
    """The param [shape] in `sharding`, each addressable device's shard read from its slice
    of `source`, the param's HF-layout tensor: the param is it transposed by `axes` (hf_axes)."""
    pieces = {}  # devices that share an index (a replicated axis) share one read
    source_axes = np.argsort(axes)  # the param's axis of each source axis

    def read(index: Index) -> np.ndarray:
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        if key not in pieces:
            piece = np.asarray(source[tuple(index[a] for a in source_axes)])
            pieces[key] = np.require(piece.transpose(axes), dtype=dtype, requirements="C")  # 0-d stays 0-d
        return pieces[key]

    # Blocking keeps at most one param's host pieces alive.
    return jax.block_until_ready(jax.make_array_from_callback(shape, sharding, read, dtype=dtype))


def _is_mtp_layer(name: str, config: ModelArchConfig) -> bool:
    """DeepSeek-V3 checkpoints hold their multi-token prediction module as the layers after the last
    (model.layers.61 of 61), which transformers does not load either."""
    parts = name.split(".")
    return (config.architecture == "deepseek_v3" and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= config.num_layers)


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


def hf_axes(path: ParamPath, var) -> tuple[int, ...]:
    """A param is its HF-layout tensor transposed by these axes: a Linear's kernel [in, *out] is HF's
    weight [*out reversed, in] reversed; a quantized param's are in its metadata (models/fp8.py,
    models/int4.py); any other param is as HF has it."""
    axes = _metadata(var).get("hf_axes")
    if axes is not None:
        return axes
    ndim = len(var.shape)
    return tuple(range(ndim - 1, -1, -1)) if path[-1] == "kernel" else tuple(range(ndim))


def _metadata(var) -> dict:
    return var.get_metadata() if isinstance(var, nnx.Variable) else {}


def _fuse(var) -> str:
    """How a fused Linear's param is made of its parts' tensors: "rows" (each part's output rows,
    as QKVSource and GateUpSource pack them), or one tensor all parts share: "same" (they must
    be equal: act-order's input permutation) or "max" (the largest: a static input scale)."""
    return _metadata(var).get("fuse", "rows")


def hf_tensors(config: ModelArchConfig, params: dict) -> dict[str, list[tuple[ParamPath, tuple[int, ...]]]]:
    """Every HF tensor the params are read from: name -> [(its param's path, its shape in HF layout,
    e.g. a kernel's reversed)], one param but for a Mamba mixer's in_proj and conv1d (two each).
    params: path -> the model's abstract param."""
    tensors = {}
    for path, var in params.items():
        hf_shape = tuple(var.shape[i] for i in np.argsort(hf_axes(path, var)))
        for name, shape in zip(path_to_hf_names(path, config), _part_shapes(config, path, hf_shape, _fuse(var))):
            tensors.setdefault(name, []).append((path, shape))
    return tensors


def _part_shapes(config: ModelArchConfig, path: ParamPath, hf_shape: tuple[int, ...],
                 fuse: str) -> list[tuple[int, ...]]:
    """The HF-layout shapes of the tensors a param of this HF-layout shape is read from."""
    if fuse != "rows":
        return [hf_shape] * len(path_to_hf_names(path, config))
    if _mamba_part(config, path):  # the whole tensor its rows are read from: [rows, *rest]
        m = config.mamba
        rows = (2 * m.intermediate_size + 2 * m.group_dim + m.num_heads if MAMBA_PARTS[path[-2]] == "in_proj"
                else m.conv_dim)
        return [(rows, *hf_shape[2:])] if path[-2] == "zxdt_proj" else [(rows, *hf_shape[1:])]
    granite = granite_linear(config, path)
    if granite:  # input_linear: [..., I, 2, H] from one [..., 2I, H]
        return [(*hf_shape[:-3], 2 * hf_shape[-3], hf_shape[-1])] if granite == "input_linear" else [hf_shape]
    if path[-2:-1] == ("experts",):  # [E, *an expert's]: gate_up's [E, I, 2, H] from each expert's gate and up [I, H]
        expert = hf_shape[1:]
        return ([(expert[0], *expert[2:])] * 2 if path[-1] == "gate_up_proj" else [expert]) * hf_shape[0]
    if path[-2:-1] == ("qkv_proj",):  # [num_kv_heads * (g + 2) * unit, ...], unit: head_dim (or blocks of it)
        unit = hf_shape[0] // (config.num_heads + 2 * config.num_kv_heads)
        q_rows, kv_rows = config.num_heads * unit, config.num_kv_heads * unit
        return [(rows, *hf_shape[1:]) for rows in (q_rows, kv_rows, kv_rows)]
    if path[-2:-1] == ("gate_up_proj",):  # [intermediate, 2, hidden]
        return [(hf_shape[0], *hf_shape[2:])] * 2
    return [hf_shape]


def _packed(config: ModelArchConfig, path: ParamPath, parts: list[tuple[str, TensorSource]],
            fuse: str) -> TensorSource:
    """The param's source in HF layout, from its HF tensors (name, source) in path_to_hf_names' order."""
    sources = [source for _, source in parts]
    if fuse != "rows" and len(parts) > 1:
        return SharedSource(parts, fuse)
    if _mamba_part(config, path):
        m = config.mamba
        if path[-2] == "zxdt_proj":
            return MambaHeadsSource(sources[0], m.num_heads, m.head_dim, 2 * m.group_dim)
        return RowsSource(sources[0], *mamba_rows(m, path[-2]))
    granite = granite_linear(config, path)
    if granite:
        return StackedGateUpSource(sources[0]) if granite == "input_linear" else sources[0]
    if path[-2:-1] == ("experts",):
        if path[-1] == "gate_up_proj":  # expert e's gate and up are parts 2e and 2e + 1
            return ExpertsSource([GateUpSource(gate, up) for gate, up in zip(sources[::2], sources[1::2])])
        return ExpertsSource(sources)
    if path[-2:-1] == ("qkv_proj",):
        return QKVSource(*sources, num_kv_heads=config.num_kv_heads)
    if path[-2:-1] == ("gate_up_proj",):
        return GateUpSource(*sources)
    return sources[0]


def hf_name_to_path(name: str) -> ParamPath:
    """HF tensor name -> the path of the param it is, or is packed into (q_proj -> qkv_proj)."""
    *module, leaf = [int(p) if p.isdigit() else p for p in name.removeprefix("model.").split(".")]
    if module and module[-1] == "embed_tokens":
        return (*module, "embedding")
    if module and module[-1] in _FUSED_INTO:
        module[-1] = _FUSED_INTO[module[-1]]
    if module and leaf == "weight" and (str(module[-1]).endswith("_proj") or module[-1] in (
            "lm_head", "fc", "gate", "shared_expert_gate", "kv_a_proj_with_mqa")):
        return (*module, "kernel")
    return (*module, leaf)


def path_to_hf_names(path: ParamPath, config: ModelArchConfig) -> list[str]:
    """The HF tensors a param of `config`'s model is read from: its one, or a fused param's parts in
    packing order (a MoE layer's stacked experts: expert by expert, each one's parts)."""
    *module, leaf = path
    granite = granite_linear(config, path)
    if granite:  # block_sparse_moe.experts.gate_up_proj -> block_sparse_moe.input_linear.weight, and so
        return [_hf_name((*module[:-1], granite, "kernel"))]  # shared_mlp.gate_up_proj.kernel
    if _mamba_part(config, path):  # mixer.zxdt_proj.kernel -> mixer.in_proj.weight, and so on
        return [_renamed(_hf_name((*module[:-1], MAMBA_PARTS[module[-1]], leaf)), config.architecture)]
    if module and module[-1] == "experts":
        parts = FUSED_PROJECTIONS.get(leaf, (leaf,))
        names = [_hf_name((*module, e, part, "kernel")) for e in range(config.moe.num_experts) for part in parts]
    elif module and module[-1] in FUSED_PROJECTIONS:
        names = [_hf_name((*module[:-1], part, leaf)) for part in FUSED_PROJECTIONS[module[-1]]]
    else:
        names = [_hf_name(path)]
    return [_renamed(name, config.architecture) for name in names]


def granite_linear(config: ModelArchConfig, path: ParamPath) -> str | None:
    """Granite 4.0-H's HF tensor of a param read whole from one (input_linear or output_linear): a MoE
    layer's stacked experts' gate_up_proj or down_proj, or its shared MLP's kernel of them; None otherwise."""
    if config.architecture != "granitemoehybrid":
        return None
    if path[-2:-1] == ("experts",):
        return _GRANITE_LINEARS.get(path[-1])
    if path[-1] == "kernel" and path[-3:-2] == ("shared_mlp",):
        return _GRANITE_LINEARS.get(path[-2])
    return None


def mamba_rows(mamba, part: str) -> tuple[int, int]:
    """The rows of its HF tensor a Mamba mixer's bc_proj, conv_x or conv_bc is read from."""
    inner = mamba.intermediate_size
    return {"bc_proj": (2 * inner, 2 * inner + 2 * mamba.group_dim), "conv_x": (0, inner),
            "conv_bc": (inner, mamba.conv_dim)}[part]


def _mamba_part(config: ModelArchConfig, path: ParamPath) -> bool:
    """A Mamba mixer's param read from rows of HF's in_proj or conv1d (MAMBA_PARTS)."""
    return config.mamba is not None and len(path) >= 2 and path[-2] in MAMBA_PARTS


def _renamed(name: str, architecture: str) -> str:
    for ours, theirs in _HF_RENAMES.get(architecture, {}).items():
        name = name.replace(ours, theirs)
    return name


def _hf_name(path: ParamPath) -> str:
    name = ".".join(str(p) for p in path)
    for ours in (".kernel", ".embedding"):
        if name.endswith(ours):
            name = name.removesuffix(ours) + ".weight"
    return name if name.startswith("lm_head") else "model." + name


def iter_weights(path: str, checkpoint_format: str,
                 quantization: QuantConfig | None = None) -> Iterator[tuple[str, TensorSource]]:
    """(HF name, tensor source) pairs from a checkpoint: a .gguf file ("gguf") or an HF folder, a
    quantized one's tensors as its quantized Linears take them (models/quant_checkpoint.py)."""
    if checkpoint_format == "gguf":
        from jaxllm.models.gguf import iter_gguf_weights
        return iter_gguf_weights(path)
    if quantization is not None and quantization.from_checkpoint:
        return quantized_weights(iter_hf_weights(path), quantization)
    return iter_hf_weights(path)
