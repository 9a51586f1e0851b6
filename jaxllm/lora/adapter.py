"""A PEFT LoRA adapter folder: adapter_config.json and adapter_model.safetensors, checked against
the engine's limits and the model's shapes, and read into the arrays a device slot takes.

PEFT's layout: the config holds `r`, `lora_alpha`, `target_modules` and optionally `use_rslora`;
each adapted Linear W [out, in] of layer N has two tensors,

    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight  [r, in]
    base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight  [out, r]

and the adapted layer computes x @ W.T + scaling * (x @ A.T) @ B.T, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora). The engine stores kernels [in, out]: a slot takes A.T and
scaling * B.T, zero-padded to max_lora_rank. Only safetensors+numpy: no torch.
"""
import dataclasses
import json
import math
import os
import re

import numpy as np
from safetensors import safe_open

from jaxllm.lora.request import LoRARequest
from jaxllm.models.lora import LORA_MODULES, ModuleDims, lora_module_dims

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """What check_adapter found: an adapter the engine can run."""
    path: str
    rank: int
    scaling: float
    tensors: dict[tuple[int, str, str], str]  # (layer, module, "A" | "B") -> tensor name


@dataclasses.dataclass(frozen=True)
class AdapterWeights:
    """An adapter as a slot takes it: per target module, A [num_layers, in, max_rank] and
    B [num_layers, max_rank, out] float32 (B scaled; zeros for layers and ranks it lacks)."""
    modules: dict[str, tuple[np.ndarray, np.ndarray]]


def check_adapter(path: str, max_rank: int, dims: dict[str, ModuleDims], num_layers: int) -> AdapterSpec:
    """Read the adapter's config and its tensors' names and shapes (not their values). `dims`: the
    model's target modules (models/lora.py, of the checkpoint's architecture: KV heads not repeated).
    Raises ValueError naming the file and the field at fault."""
    config_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter: lora_path {path!r} is not a folder")
    for file in (config_file, weights_file):
        if not os.path.isfile(file):
            raise ValueError(f"LoRA adapter {path}: {os.path.basename(file)} is missing (a PEFT adapter's folder "
                             f"holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = _read_config(config_file)
    rank, scaling = _rank_and_scaling(config, config_file, max_rank)
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{config_file}: target_modules must be a list of module names, got {targets!r}")
    unsupported = sorted(set(targets) - set(LORA_MODULES))
    if unsupported:
        raise ValueError(f"{config_file}: target_modules {unsupported} are not supported (supported: "
                         f"{list(LORA_MODULES)})")
    tensors = _check_tensors(weights_file, rank, set(targets), dims, num_layers)
    return AdapterSpec(path, rank, scaling, tensors)


def _read_config(config_file: str) -> dict:
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: a JSON object is needed")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{config_file}: peft_type must be 'LORA', got {peft_type!r}")
    for field, ok, why in (("use_dora", not config.get("use_dora"), "DoRA adapters"),
                           ("bias", config.get("bias", "none") == "none", "adapters with biases"),
                           ("rank_pattern", not config.get("rank_pattern"), "per-module ranks"),
                           ("alpha_pattern", not config.get("alpha_pattern"), "per-module alphas"),
                           ("modules_to_save", not config.get("modules_to_save"), "adapters that replace modules")):
        if not ok:
            raise ValueError(f"{config_file}: {field}={config[field]!r}: {why} are not supported")
    return config


def _rank_and_scaling(config: dict, config_file: str, max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)  # PEFT's default alpha
    if type(rank) is not int or rank < 1:
        raise ValueError(f"{config_file}: r must be an int >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{config_file}: r={rank} exceeds max_lora_rank ({max_rank}, an engine arg)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_file}: lora_alpha must be a number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _check_tensors(weights_file: str, rank: int, targets: set[str], dims: dict[str, ModuleDims],
                   num_layers: int) -> dict[tuple[int, str, str], str]:
    tensors = {}
    try:
        with safe_open(weights_file, framework="np") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise ValueError(f"{weights_file}: not a readable safetensors file: {e}") from None
    for name, shape in shapes.items():
        match = _TENSOR.fullmatch(name)
        if match is None:
            raise ValueError(f"{weights_file}: tensor {name!r} is not a LoRA weight of a decoder layer's "
                             f"{'/'.join(LORA_MODULES)}")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in targets:
            raise ValueError(f"{weights_file}: tensor {name!r} is of a module not in target_modules "
                             f"{sorted(targets)}")
        if layer >= num_layers:
            raise ValueError(f"{weights_file}: tensor {name!r} is of layer {layer}; the model has {num_layers}")
        d = dims[module]
        expected = (rank, d.in_dim) if side == "A" else (d.out_dim, rank)
        if shape != expected:
            raise ValueError(f"{weights_file}: tensor {name!r} has shape {list(shape)}, expected {list(expected)} "
                             f"(r={rank} and the model's {module})")
        tensors[(layer, module, side)] = name
    for layer, module, side in tensors:
        other = "B" if side == "A" else "A"
        if (layer, module, other) not in tensors:
            raise ValueError(f"{weights_file}: layer {layer}'s {module} has lora_{side} and no lora_{other}")
    if not tensors:
        raise ValueError(f"{weights_file}: holds no LoRA weights")
    return tensors


def read_adapter(spec: AdapterSpec, max_rank: int, dims: dict[str, ModuleDims], num_layers: int,
                 kv_head_repeat: int = 1, head_dim: int = 0) -> AdapterWeights:
    """The checked adapter's weights as a slot takes them. dims: the modules' widths in the model that
    runs; with tensor parallelism over more devices than KV heads (worker/kv_heads.py) k_proj's and
    v_proj's out holds each KV head `kv_head_repeat` times, and B's columns are repeated to match."""
    modules = {}
    with safe_open(os.path.join(spec.path, WEIGHTS_FILE), framework="np") as f:
        for (layer, module, side), name in spec.tensors.items():
            if module not in modules:
                d = dims[module]
                modules[module] = (np.zeros((num_layers, d.in_dim, max_rank), np.float32),
                                   np.zeros((num_layers, max_rank, d.out_dim), np.float32))
            a, b = modules[module]
            weight = f.get_slice(name)[:].astype(np.float32)  # a slice reads bf16 too (as ml_dtypes')
            if side == "A":  # [r, in] -> [in, r]
                a[layer, :, :spec.rank] = weight.T
                continue
            b_t = weight.T * spec.scaling  # [out, r] -> [r, out]
            if module in ("k_proj", "v_proj") and kv_head_repeat > 1:
                # [r, kv_heads * head_dim] -> [r, kv_heads * repeat * head_dim]: head j's columns repeat times
                b_t = np.repeat(b_t.reshape(spec.rank, -1, 1, head_dim), kv_head_repeat, axis=2).reshape(spec.rank, -1)
            b[layer, :spec.rank] = b_t
    return AdapterWeights(modules)


class AdapterChecks:
    """The front end's check of a request's LoRARequest before it reaches the engine core: the engine
    runs adapters, and the adapter's files fit its limits and the model (once per id and path)."""

    def __init__(self, lora_config, arch):
        """lora_config: the engine's LoRAConfig (None: started without enable_lora); arch: the checkpoint's."""
        self.lora_config, self.arch = lora_config, arch
        self._checked: set[tuple[int, str]] = set()

    def check(self, lora_request) -> None:
        """Raises TypeError or ValueError (naming the adapter's file and field) for a bad one; None passes."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_config is None:
            raise ValueError("lora_request: this engine was started without enable_lora")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._checked:
            check_adapter(lora_request.lora_path, self.lora_config.max_lora_rank, lora_module_dims(self.arch),
                          self.arch.num_layers)
            self._checked.add(key)
