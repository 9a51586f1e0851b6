"""Tiny random Llama checkpoints in the quantized formats' exact layouts, each written beside its
dequantized twin: the same model with every quantized weight replaced by its dequantization
in float64 (then float32, where it is exact) by the format's published definition.

    AWQ (AutoAWQ GEMM)  qweight [K, N/8] int32, 8 columns an int32, column AWQ_ORDER[i] in bits 4i..4i+3;
                        qzeros [K/G, N/8] likewise; scales [K/G, N] float16; w = (q - z) * s
    GPTQ (v1)           qweight [K/8, N] int32, rows 8r + j in bits 4j; qzeros [K/G, N/8] int32 holding
                        z - 1, columns in order; scales [K/G, N] float16; g_idx [K] int32, row k's group
    compressed-tensors  weight e4m3 [N, K]; weight_scale float32 [1] (tensor), [N, 1] (channel) or
    FP8                 [N/bn, K/bk] (block); input_scale [1] (static); w = weight * scale
    fp8 (DeepSeek)      the same with weight_scale_inv [N/bn, K/bk] for blocks, scalars per tensor
"""
import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
E4M3_MAX = 448.0


def config(num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, intermediate=128, layers=2, vocab=256) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def dense_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights in HF names and layout ([out, in] Linears)."""
    rng = np.random.default_rng(seed)
    h, m, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    linear_shapes = dict(zip(LINEARS, [(q, h), (kv, h), (kv, h), (h, q), (m, h), (m, h), (h, m)]))
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in linear_shapes.items()})
        shapes.update({f"model.layers.{i}.input_layernorm.weight": (h,),
                       f"model.layers.{i}.post_attention_layernorm.weight": (h,)})
    return {name: (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                   else 0.15 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}


def write(folder, cfg: dict, tensors: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    save_file({name: np.ascontiguousarray(a) for name, a in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


def write_pair(folder, fmt: str, quantization_config: dict, quantize, cfg: dict | None = None,
               dense: set[str] = frozenset(), seed: int = 0) -> tuple[str, str]:
    """(the quantized checkpoint's folder, its dequantized twin's): each Linear weight W [N, K] not
    named in `dense` goes through quantize(W, name, rng) -> (its tensors by leaf, W dequantized)."""
    cfg = cfg or config()
    rng = np.random.default_rng(seed + 1)
    tensors = dense_tensors(cfg, seed)
    quantized, twin = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not module.endswith(LINEARS) or module in dense:
            quantized[name] = twin[name] = w
            continue
        parts, dequantized = quantize(w, module, rng)
        quantized.update({f"{module}.{leaf}": array for leaf, array in parts.items()})
        twin[name] = dequantized.astype(np.float32)  # exact for 4 bits; FP8's products round once
    path = write(os.path.join(folder, fmt), {**cfg, "quantization_config": quantization_config}, quantized)
    return path, write(os.path.join(folder, fmt + "_twin"), cfg, twin)


# ---- 4-bit ----

def int4_groups(w: np.ndarray, g_idx: np.ndarray, group_size: int, sym: bool, rng=None):
    """W [N, K] in groups of input rows (g_idx: row k's group) -> (q [K, N] 0..15, zeros [K/G, N],
    scales [K/G, N] float16, W dequantized in float64). Zero points in 1..15 (GPTQ v1's stored z - 1
    is then 0..14)."""
    n, k = w.shape
    q, zeros = np.zeros((k, n), np.int64), np.zeros((k // group_size, n), np.int64)
    scales = np.zeros((k // group_size, n), np.float16)
    for g in range(k // group_size):
        rows = np.flatnonzero(g_idx == g)
        wg = w[:, rows].astype(np.float64)  # [N, G]
        if sym:
            scale, zero = (np.abs(wg).max(1) / 7).astype(np.float16), np.full(n, 8)
        else:
            low, high = np.minimum(wg.min(1), 0), np.maximum(wg.max(1), 0)
            scale = ((high - low) / 15).astype(np.float16)
            zero = np.clip(np.round(-low / scale.astype(np.float64)), 1, 15).astype(np.int64)
        q[rows] = np.clip(np.round(wg / scale.astype(np.float64)[:, None]) + zero[:, None], 0, 15).T
        zeros[g], scales[g] = zero, scale
    dequantized = (q - zeros[g_idx]) * scales[g_idx].astype(np.float64)  # [K, N]
    return q, zeros, scales, dequantized.T


def pack_awq(ints: np.ndarray) -> np.ndarray:
    """[R, C] 0..15 -> [R, C/8] int32, column 8c + AWQ_ORDER[i] of each 8 in bits 4i."""
    out = np.zeros((ints.shape[0], ints.shape[1] // 8), np.uint32)
    for i, column in enumerate(AWQ_ORDER):
        out |= ints[:, column::8].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def pack_gptq_rows(ints: np.ndarray) -> np.ndarray:
    """[R, C] 0..15 -> [R/8, C] int32, row 8r + j in bits 4j."""
    out = np.zeros((ints.shape[0] // 8, ints.shape[1]), np.uint32)
    for j in range(8):
        out |= ints[j::8].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def pack_gptq_columns(ints: np.ndarray) -> np.ndarray:
    """[R, C] 0..15 -> [R, C/8] int32, column 8c + j in bits 4j."""
    return pack_gptq_rows(ints.T).T.copy()


def awq(group_size: int):
    def quantize(w, module, rng):
        q, zeros, scales, dequantized = int4_groups(w, np.arange(w.shape[1]) // group_size, group_size, sym=False)
        return {"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales}, dequantized
    return quantize


def gptq_g_idx(k: int, group_size: int, act_order: bool, rng) -> np.ndarray:
    """Row k's group: in order, or with act-order by its place in a random order of the rows."""
    if not act_order:
        return np.arange(k, dtype=np.int32) // group_size
    g_idx = np.empty(k, np.int32)
    g_idx[rng.permutation(k)] = np.arange(k) // group_size
    return g_idx


def gptq(group_size: int, act_order: bool, sym: bool, shared_g_idx: dict | None = None):
    """GPTQ v1 tensors. Fused parts (q, k, v; gate, up) share a g_idx, as GPTQ's act-order gives
    them (one input, one Hessian); shared_g_idx keeps one per input."""
    shared = {} if shared_g_idx is None else shared_g_idx

    def quantize(w, module, rng):
        layer, _, proj = module.rpartition(".")
        fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
        g_idx = shared.setdefault((layer, fused.get(proj, proj)), gptq_g_idx(w.shape[1], group_size, act_order, rng))
        q, zeros, scales, dequantized = int4_groups(w, g_idx, group_size, sym)
        return {"qweight": pack_gptq_rows(q), "qzeros": pack_gptq_columns((zeros - 1) & 0xF), "scales": scales,
                "g_idx": g_idx}, dequantized
    return quantize


# ---- FP8 ----

def fp8_weight(w: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [N, K] and a float32 scale broadcast over it -> (e4m3 weight, W dequantized in float64)."""
    w8 = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    return w8, w8.astype(np.float64) * scale.astype(np.float64)


def fp8_channel(per_tensor: bool, static_input_scale: float | None = None, scale_name: str = "weight_scale",
                scalar: bool = False):
    """Per-tensor (shape [1], or [] with scalar) or per-channel ([N, 1]) scales."""
    def quantize(w, module, rng):
        amax = np.abs(w).max(keepdims=True) if per_tensor else np.abs(w).max(1, keepdims=True)
        scale = (amax / E4M3_MAX).astype(np.float32)
        w8, dequantized = fp8_weight(w, scale)
        stored = scale.reshape(() if scalar else (1,)) if per_tensor else scale
        parts = {"weight": w8, scale_name: stored}
        if static_input_scale is not None:
            parts["input_scale"] = np.full(() if scalar else (1,), static_input_scale, np.float32)
        return parts, dequantized
    return quantize


def fp8_block(block: tuple[int, int], scale_name: str):
    """A scale per block of bn rows and bk columns, the last ones partial where the weight is not whole
    blocks (DeepSeek-V3's scales of kv_a_proj_with_mqa: 576 rows in blocks of 128)."""
    bn, bk = block

    def quantize(w, module, rng):
        n, k = w.shape
        padded = np.pad(np.abs(w), ((0, -n % bn), (0, -k % bk)))
        blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).max((1, 3))
        scale = (blocks / E4M3_MAX).astype(np.float32)
        w8, dequantized = fp8_weight(w, np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k])
        return {"weight": w8, scale_name: scale}, dequantized
    return quantize


def compressed_tensors_config(strategy: str, activations: dict, block=None, ignore=("lm_head",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": list(ignore), "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None,
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": strategy, "block_structure": block, "group_size": None},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, **activations}}}}


PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 256, 40)]
# compressed-tensors FP8 checkpoints, committed with transformers' logits (scripts/make_quant_fixtures.py):
# name -> (quantization_config, quantizer, Linears left unquantized)
CT_FIXTURES = {
    "ct_fp8_channel": (compressed_tensors_config("channel", {"strategy": "token", "dynamic": True}),
                       fp8_channel(per_tensor=False), frozenset()),
    # layer 1's MLP left in float32 by a regex of the ignore list
    "ct_fp8_tensor_static": (compressed_tensors_config("tensor", {"strategy": "tensor", "dynamic": False},
                                                       ignore=("lm_head", r"re:.*layers\.1\.mlp\..*")),
                             fp8_channel(per_tensor=True, static_input_scale=8 / E4M3_MAX),
                             frozenset(f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))),
    "ct_fp8_block": (compressed_tensors_config("block", {"strategy": "group", "dynamic": True, "group_size": 16},
                                               block=[16, 16]), fp8_block((16, 16), "weight_scale"), frozenset()),
}
