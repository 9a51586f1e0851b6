"""Granite 4.0-H (HF transformers' GraniteMoeHybridForCausalLM), read from its config.json.

Each layer mixes its tokens with attention or with a Mamba2 mixer (`layer_types`: "attention" /
"full_attention" or "mamba" / "linear_attention"), then runs a dense SwiGLU MLP every token takes
(the shared MLP, shared_intermediate_size) beside top-k of num_local_experts experts (none when 0).
Granite's multipliers: the embeddings times embedding_multiplier, each block's output times
residual_multiplier before its residual add, attention scores times attention_multiplier (the
softmax scale), the logits divided by logits_scaling. Attention has no positions ("nope", Granite
4.0-H's) or RoPE (position_embedding_type "rope"). Without model code: the front end resolves it.
"""
import dataclasses

from jaxllm.models.mamba_config import MambaConfig, read_keys, time_step_limit

# The config.json keys read here, their JSON types and GraniteMoeHybridConfig's defaults (None: required).
_KEYS = {
    "vocab_size": (int, None), "hidden_size": (int, None), "intermediate_size": (int, None),
    "num_hidden_layers": (int, None), "num_attention_heads": (int, None), "num_key_value_heads": (int, 0),
    "max_position_embeddings": (int, 2048), "rms_norm_eps": (float, 1e-6), "tie_word_embeddings": (bool, False),
    "attention_bias": (bool, False), "hidden_act": (str, "silu"), "embedding_multiplier": (float, 1.0),
    "residual_multiplier": (float, 1.0), "attention_multiplier": (float, 1.0), "logits_scaling": (float, 1.0),
    "num_local_experts": (int, 8), "num_experts_per_tok": (int, 2), "shared_intermediate_size": (int, 1024),
    "position_embedding_type": (str, "nope"), "layer_types": (list, []), "mamba_n_heads": (int, 128),
    "mamba_n_groups": (int, 1), "mamba_d_state": (int, 256), "mamba_d_head": (int, 0), "mamba_d_conv": (int, 4),
    "mamba_expand": (int, 2), "mamba_chunk_size": (int, 256), "mamba_conv_bias": (bool, True),
    "mamba_proj_bias": (bool, False), "time_step_limit": (list, [0.0, float("inf")]),
}
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "shared_intermediate_size", "mamba_n_heads", "mamba_n_groups",
             "mamba_d_state", "mamba_expand", "mamba_chunk_size")
_MAMBA_TYPES, _ATTENTION_TYPES = ("mamba", "linear_attention"), ("attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class GraniteConfig:
    """Granite's scalings (the module's docstring) and its attention's positions."""
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float  # the softmax scale of attention scores
    logits_scaling: float  # the logits are divided by it
    rope: bool  # attention with RoPE; else without positions


def granite_hybrid_fields(d: dict) -> dict:
    """ModelArchConfig's fields of a GraniteMoeHybridForCausalLM config.json dict `d` (its rope aside),
    the experts as MoeConfig's arguments under "moe" (None without experts); raises ValueError naming
    a missing or ill-typed key."""
    v = read_keys(d, _KEYS, _POSITIVE, "Granite 4.0-H")
    num_layers, hidden = v["num_hidden_layers"], v["hidden_size"]
    if v["hidden_act"] != "silu":
        raise ValueError(f"config key 'hidden_act' must be 'silu' for a Granite 4.0-H model, got {v['hidden_act']!r}")
    if v["position_embedding_type"] not in ("nope", "rope"):
        raise ValueError(f"config key 'position_embedding_type' must be 'nope' or 'rope', "
                         f"got {v['position_embedding_type']!r}")
    types = v["layer_types"] or ["mamba"] * num_layers  # HF's default: every layer Mamba
    if len(types) != num_layers or any(t not in _MAMBA_TYPES + _ATTENTION_TYPES for t in types):
        raise ValueError(f"config key 'layer_types' must name {num_layers} layers, each one of "
                         f"{_MAMBA_TYPES + _ATTENTION_TYPES}, got {types!r}")
    mamba_layers = tuple(i for i, t in enumerate(types) if t in _MAMBA_TYPES)
    heads, inner = v["mamba_n_heads"], v["mamba_expand"] * hidden
    head_dim = v["mamba_d_head"] or inner // heads  # HF's "auto"
    if heads * head_dim != inner:
        raise ValueError(f"config keys 'mamba_n_heads' * 'mamba_d_head' ({heads} * {head_dim}) must equal "
                         f"'mamba_expand' * 'hidden_size' ({inner})")
    mamba = MambaConfig(heads, head_dim, v["mamba_d_state"], v["mamba_n_groups"], v["mamba_d_conv"],
                        v["mamba_chunk_size"], v["mamba_proj_bias"], v["mamba_conv_bias"],
                        time_step_limit(v["time_step_limit"]), residual_in_fp32=False, layers=mamba_layers)
    num_heads = v["num_attention_heads"]
    if v["num_local_experts"] < 0:
        raise ValueError(f"config key 'num_local_experts' must be >= 0, got {v['num_local_experts']}")
    # The experts' size is intermediate_size; the dense MLP every layer runs is the shared one.
    moe = None if not v["num_local_experts"] else dict(
        num_experts=v["num_local_experts"], top_k=v["num_experts_per_tok"], intermediate_size=v["intermediate_size"],
        renormalize=True, sparse_layers=tuple(range(num_layers)))
    granite = GraniteConfig(float(v["embedding_multiplier"]), float(v["residual_multiplier"]),
                            float(v["attention_multiplier"]), float(v["logits_scaling"]),
                            v["position_embedding_type"] == "rope")
    return dict(vocab_size=v["vocab_size"], hidden_size=hidden, intermediate_size=v["shared_intermediate_size"],
                num_layers=num_layers, num_heads=num_heads, num_kv_heads=v["num_key_value_heads"] or num_heads,
                head_dim=d.get("head_dim") or hidden // num_heads, rms_norm_eps=float(v["rms_norm_eps"]),
                max_position_embeddings=v["max_position_embeddings"], tie_word_embeddings=v["tie_word_embeddings"],
                attention_bias=v["attention_bias"], mamba=mamba if mamba_layers else None, granite=granite, moe=moe)
