"""The architecture of a decoder model, read from a HF config.json.

One frozen dataclass covers the Llama family, Mistral, Qwen2, Qwen3, Gemma 2 and
Gemma 3: they differ only in a few flags (qkv bias, q/k norm, sliding window, rope
scaling; Gemma's soft-caps, query scale and local rope base). The mixture-of-experts
models (Qwen2-MoE, Qwen3-MoE, Mixtral) are their attention with a MoeConfig for the MLPs;
DeepSeek-V2 and V3 are experts too, with multi-head latent attention (an MlaConfig); Mamba2 is
its state-space layers' MambaConfig (models/mamba_config.py); Granite 4.0-H has attention and Mamba2
layers, experts and Granite's scalings (a GraniteConfig, models/granite_config.py).
"""
import dataclasses

from jaxllm.models.granite_config import GraniteConfig, granite_hybrid_fields
from jaxllm.models.mamba_config import MambaConfig, mamba2_fields
from jaxllm.models.yarn import softmax_mscale

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Gemma 3's multimodal checkpoints: we read the text model in them (text_config).
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Mamba2ForCausalLM": "mamba2",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "mixtral", *MLA_ARCHITECTURES)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}
# The config.json keys read here and their JSON types (a float key takes an int). A null
# passes (HF configs write null for keys left unset), except for the required keys.
_HF_KEY_TYPES = {
    "vocab_size": int, "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
    "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int, "max_position_embeddings": int,
    "rms_norm_eps": float, "rope_theta": float, "rope_scaling": dict, "rope_parameters": dict,
    "tie_word_embeddings": bool, "attention_bias": bool, "mlp_bias": bool, "hidden_act": str,
    "architectures": list, "sliding_window": int, "use_sliding_window": bool, "max_window_layers": int,
    "layer_types": list, "hidden_activation": str, "query_pre_attn_scalar": float,
    "attn_logit_softcapping": float, "final_logit_softcapping": float, "rope_local_base_freq": float,
    "sliding_window_pattern": int, "text_config": dict,
    "num_experts": int, "num_local_experts": int, "num_experts_per_tok": int, "moe_intermediate_size": int,
    "shared_expert_intermediate_size": int, "decoder_sparse_step": int, "norm_topk_prob": bool,
    "mlp_only_layers": list, "qkv_bias": bool,
    "q_lora_rank": int, "kv_lora_rank": int, "qk_nope_head_dim": int, "qk_rope_head_dim": int, "v_head_dim": int,
    "rope_interleave": bool, "n_routed_experts": int, "n_shared_experts": int, "first_k_dense_replace": int,
    "moe_layer_freq": int, "topk_method": str, "scoring_func": str, "n_group": int, "topk_group": int,
    "routed_scaling_factor": float,
}
_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Sizes and counts: 0 or less would divide by zero or build an empty model.
_POSITIVE_HF_KEYS = (*_REQUIRED_HF_KEYS, "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts",
                     "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "decoder_sparse_step", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_group", "topk_group")
_JSON_TYPE_NAMES = {int: "an int", float: "a number", bool: "a bool", str: "a string", dict: "an object",
                    list: "a list"}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A model's mixture-of-experts MLPs (models/moe.py): each token's MLP is the weighted sum of
    `top_k` of `num_experts` SwiGLU experts, picked by a router (softmax, then top-k)."""
    num_experts: int
    top_k: int  # experts per token (HF's num_experts_per_tok)
    intermediate_size: int  # each expert's (Qwen's moe_intermediate_size; Mixtral's intermediate_size)
    renormalize: bool  # the top-k weights divided by their sum (Qwen's norm_topk_prob; Mixtral always)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts; the others' a dense MLP
    # Qwen2-MoE: a dense expert of this size that every token takes, scaled by sigmoid(shared_expert_gate(x)); 0: none
    shared_expert_intermediate_size: int = 0
    # The engine's choice, not the checkpoint's (EngineArgs.enable_expert_parallel): whole experts on each
    # device of the "model" axis, tokens sent to them by all-to-all; else each expert's intermediate split.
    expert_parallel: bool = False
    # DeepSeek's routing (models/moe.py, route); the defaults are Qwen's and Mixtral's.
    scoring: str = "softmax"  # the experts' scores: "softmax" over them, or each one's "sigmoid" (V3)
    score_bias: bool = False  # V3's e_score_correction_bias, added to the scores to choose the experts only
    num_groups: int = 1  # the experts in equal groups; a token chooses only in its topk_groups best groups
    topk_groups: int = 1
    group_score: str = "max"  # a group's score: its best expert's ("max", V2) or its best two's sum ("top2", V3)
    routed_scaling_factor: float = 1.0  # the factor on the routed experts' weights

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"config key 'num_experts_per_tok' ({self.top_k}) must be in [1, num_experts "
                             f"({self.num_experts})]")
        group_size, least = self.num_experts // self.num_groups, 2 if self.group_score == "top2" else 1
        if self.num_experts % self.num_groups or group_size < least:
            raise ValueError(f"config key 'n_group' ({self.num_groups}) must divide the {self.num_experts} experts "
                             f"into groups of at least {least}")
        if not 1 <= self.topk_groups <= self.num_groups or self.top_k > self.topk_groups * group_size:
            raise ValueError(f"config key 'topk_group' ({self.topk_groups}) must be in [1, n_group "
                             f"({self.num_groups})], its groups holding num_experts_per_tok ({self.top_k}) experts")


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2 and V3; models/deepseek.py): a token's keys and values
    are one latent of kv_lora_rank values, shared by every head and expanded by kv_b_proj, beside one
    key part with rope that every head shares too. The KV cache holds just those (latent_dim a token)."""
    kv_lora_rank: int
    qk_nope_head_dim: int  # a head's query and key dimensions without rope
    qk_rope_head_dim: int  # ... and with it
    v_head_dim: int
    q_lora_rank: int | None = None  # the queries through a low-rank bottleneck of this size; None: one projection
    rope_interleave: bool = True  # rope on pairs (x0, x1), (x2, x3), ... (DeepSeek's layout); else on halves

    @property
    def latent_dim(self) -> int:
        """What the KV cache holds for a token and a layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelArchConfig:
    # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3" | "qwen2_moe" | "qwen3_moe" | "mixtral"
    # | "deepseek_v2" | "deepseek_v3" | "mamba2" | "granitemoehybrid"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3"|"yarn", ...}; None: plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None  # layers that slide; None: all (when sliding_window)
    # Gemma 2/3 only (None elsewhere):
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power; None: head_dim's
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    rope_local_theta: float | None = None  # Gemma 3: plain RoPE of this base on sliding layers
    moe: MoeConfig | None = None  # the mixture-of-experts models' MLPs; None: dense MLPs
    mla: MlaConfig | None = None  # DeepSeek's latent attention (num_kv_heads = num_heads, head_dim its rope part's)
    mamba: MambaConfig | None = None  # the Mamba2 layers (models/mamba2.py); None: attention only
    granite: GraniteConfig | None = None  # Granite 4.0-H's scalings (models/granite_hybrid.py)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {ROPE_TYPES}")
        missing = [k for k in _ROPE_KEYS[rope_type] if k not in scaling]
        if missing:
            raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")

    def __hash__(self):  # rope_scaling is a dict; hash its items so the config can be a static arg
        fields = dataclasses.astuple(self)
        return hash(tuple(tuple(sorted(f.items())) if isinstance(f, dict) else f for f in fields))

    @property
    def o_proj_bias(self) -> bool:
        """Llama/Qwen3's attention_bias also covers o_proj; Qwen2's bias is on q/k/v only."""
        return self.attention_bias and self.architecture not in ("qwen2", "qwen2_moe")

    @property
    def attn_scale(self) -> float:
        """The factor on q.k scores (latent attention's: its query dimensions' and YaRN's mscale, as DeepSeek)."""
        if self.mla is not None:
            return (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) ** -0.5 * softmax_mscale(self.rope_scaling)
        if self.granite is not None:
            return self.granite.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> tuple[float, dict | None]:
        """(theta, rope_scaling) of layer `layer`: Gemma 3's sliding layers use plain RoPE
        of base rope_local_theta; every other layer rope_theta with rope_scaling."""
        if self.rope_local_theta is not None and self.layer_sliding_window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or layer in self.sliding_layers:
            return self.sliding_window
        return None

    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelArchConfig":
        """Map a HF config.json dict; raises ValueError on an unsupported architecture, a
        missing required key or a value of the wrong type, naming the key."""
        _check_hf_values(d)
        archs = d.get("architectures") or []
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ValueError(f"unsupported model architecture {archs or d.get('model_type')!r}; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        arch = SUPPORTED_ARCHITECTURES[known[0]]
        if arch == "mamba2":
            return cls(architecture=arch, **mamba2_fields(d))
        if arch == "granitemoehybrid":
            fields = granite_hybrid_fields(d)
            moe = fields.pop("moe")
            rope_theta, rope_scaling, _ = _rope_from_hf(d, arch)
            return cls(architecture=arch, rope_theta=rope_theta, rope_scaling=rope_scaling,
                       moe=None if moe is None else MoeConfig(**moe), **fields)
        if isinstance(d.get("text_config"), dict):  # a multimodal Gemma 3: its text model
            d = {**d["text_config"], "architectures": archs}
            _check_hf_values(d)
        missing = [key for key in _REQUIRED_HF_KEYS if d.get(key) is None]
        if missing:
            raise ValueError(f"missing the required key(s) {missing}")
        _check_mlp(d, arch)
        num_heads = d["num_attention_heads"]
        num_kv_heads = d.get("num_key_value_heads") or num_heads  # unset: multi-head attention
        if num_heads % num_kv_heads:
            raise ValueError(f"config key 'num_attention_heads' ({num_heads}) must be a multiple of "
                             f"'num_key_value_heads' ({num_kv_heads})")
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        num_layers = d["num_hidden_layers"]
        mla = _mla_from_hf(d, arch)
        if mla is not None:  # every head its own keys and values, expanded from the latent; the rope on part of them
            num_kv_heads, head_dim = num_heads, mla.qk_rope_head_dim
        rope_theta, rope_scaling, rope_local_theta = _rope_from_hf(d, arch)
        sliding_window, sliding_layers = _sliding_from_hf(d, arch, num_layers)
        gemma = arch in GEMMA_ARCHITECTURES
        # HF's defaults for keys a Gemma config leaves out: Gemma 2 soft-caps at 50 and 30,
        # Gemma 3 not at all; both scale q by 256**-0.5.
        attn_cap, final_cap = (50.0, 30.0) if arch == "gemma2" else (None, None)
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", gemma),  # HF's Gemma configs tie by default
            # Qwen2(-MoE): q/k/v biases (transformers 5 names Qwen2-MoE's qkv_bias, default on)
            attention_bias=arch == "qwen2" or (d.get("qkv_bias", True) if arch == "qwen2_moe"
                                               else d.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256) if gemma else None,
            attn_logit_softcap=d.get("attn_logit_softcapping", attn_cap) if gemma else None,
            final_logit_softcap=d.get("final_logit_softcapping", final_cap) if gemma else None,
            rope_local_theta=rope_local_theta,
            moe=_moe_from_hf(d, arch, num_layers),
            mla=mla,
        )


def _moe_from_hf(d: dict, arch: str, num_layers: int) -> MoeConfig | None:
    """The experts of a MoE architecture's config (None for a dense one). Qwen's layer i is sparse
    unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0 (HF's rule); Mixtral's all are."""
    if arch not in MOE_ARCHITECTURES:
        return None
    if arch in MLA_ARCHITECTURES:
        return _deepseek_moe_from_hf(d, arch, num_layers)
    # Qwen's key is num_experts; Mixtral's (and transformers 5's, for Qwen3-MoE) num_local_experts.
    num_experts = d.get("num_experts") or d.get("num_local_experts")
    size_key = "intermediate_size" if arch == "mixtral" else "moe_intermediate_size"
    required = {"num_experts": num_experts, "num_experts_per_tok": d.get("num_experts_per_tok"),
                size_key: d.get(size_key)}
    if arch == "qwen2_moe":
        required["shared_expert_intermediate_size"] = d.get("shared_expert_intermediate_size")
    missing = [key for key, value in required.items() if value is None]
    if missing:
        raise ValueError(f"missing the required key(s) {missing} of a {arch} model")
    if arch == "mixtral":
        return MoeConfig(num_experts, d["num_experts_per_tok"], d["intermediate_size"], renormalize=True,
                         sparse_layers=tuple(range(num_layers)))
    mlp_only = d.get("mlp_only_layers") or []
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in mlp_only):
        raise ValueError(f"config key 'mlp_only_layers' must hold layer indices in [0, {num_layers}), got {mlp_only!r}")
    step = d.get("decoder_sparse_step") or 1
    sparse = tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
    return MoeConfig(num_experts, d["num_experts_per_tok"], d["moe_intermediate_size"],
                     renormalize=bool(d.get("norm_topk_prob", False)), sparse_layers=sparse,
                     shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0)


def _deepseek_moe_from_hf(d: dict, arch: str, num_layers: int) -> MoeConfig:
    """DeepSeek's experts, on every layer from first_k_dense_replace on (HF's rule), beside
    n_shared_experts * moe_intermediate_size of shared experts. V2 routes by softmax, its greedy
    topk_method over every expert or group_limited_greedy over its topk_group best groups (by their best
    expert); V3 by sigmoid, choosing with e_score_correction_bias in its topk_group best groups (by their
    best two), the weights renormalized where norm_topk_prob says. Both scale by routed_scaling_factor."""
    required = {key: d.get(key) for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")}
    v3 = arch == "deepseek_v3"
    method = d.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    grouped = v3 or method == "group_limited_greedy"
    if grouped:
        required.update(n_group=d.get("n_group"), topk_group=d.get("topk_group"))
    missing = [key for key, value in required.items() if value is None]
    if missing:
        raise ValueError(f"missing the required key(s) {missing} of a {arch} model")
    methods, scoring = (("noaux_tc",), "sigmoid") if v3 else (("greedy", "group_limited_greedy"), "softmax")
    if method not in methods:
        raise ValueError(f"config key 'topk_method' must be one of {methods} for {arch}, got {method!r}")
    if d.get("scoring_func", scoring) != scoring:
        raise ValueError(f"config key 'scoring_func' must be {scoring!r} for {arch}, got {d['scoring_func']!r}")
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config key 'moe_layer_freq' must be 1 (every layer from first_k_dense_replace on "
                         f"is sparse), got {d['moe_layer_freq']!r}")
    if not v3 and d.get("norm_topk_prob"):
        # transformers ignores it for V2, DeepSeek's own code renormalizes and drops routed_scaling_factor
        raise ValueError("config key 'norm_topk_prob' must be false for deepseek_v2 (its meaning there is not settled)")
    first_dense = d.get("first_k_dense_replace") or 0
    if not 0 <= first_dense <= num_layers:
        raise ValueError(f"config key 'first_k_dense_replace' must be in [0, {num_layers}], got {first_dense!r}")
    num_shared = d.get("n_shared_experts") or 0
    if num_shared < 0:
        raise ValueError(f"config key 'n_shared_experts' must be >= 0, got {num_shared}")
    return MoeConfig(d["n_routed_experts"], d["num_experts_per_tok"], d["moe_intermediate_size"],
                     renormalize=v3 and bool(d.get("norm_topk_prob")),
                     sparse_layers=tuple(range(first_dense, num_layers)),
                     shared_expert_intermediate_size=num_shared * d["moe_intermediate_size"], scoring=scoring,
                     score_bias=v3, num_groups=d["n_group"] if grouped else 1,
                     topk_groups=d["topk_group"] if grouped else 1, group_score="top2" if v3 else "max",
                     routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0))


def _mla_from_hf(d: dict, arch: str) -> MlaConfig | None:
    if arch not in MLA_ARCHITECTURES:
        return None
    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [key for key in keys if d.get(key) is None]
    if missing:
        raise ValueError(f"missing the required key(s) {missing} of a {arch} model")
    if d["qk_rope_head_dim"] % 2:
        raise ValueError(f"config key 'qk_rope_head_dim' must be even (rope turns pairs), got {d['qk_rope_head_dim']}")
    # V2's rope is always on interleaved pairs; V3's unless rope_interleave says otherwise (HF's default: on)
    interleave = arch == "deepseek_v2" or d.get("rope_interleave", True) is not False
    return MlaConfig(*(d[key] for key in keys), q_lora_rank=d.get("q_lora_rank"), rope_interleave=interleave)


def _check_mlp(d: dict, arch: str) -> None:
    """Llama-family models take a bias-free SiLU MLP; Gemma a bias-free tanh-GELU one."""
    if arch in GEMMA_ARCHITECTURES:
        act, allowed = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh", "gelu_pytorch_tanh"
    else:
        act, allowed = d.get("hidden_act", "silu"), "silu"
    if act != allowed or d.get("mlp_bias", False):
        raise ValueError(f"unsupported MLP: hidden_act={act!r}, mlp_bias={d.get('mlp_bias')!r} "
                         f"(the {arch} model takes only a bias-free {allowed!r} MLP)")


def _check_hf_values(d) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"must hold a JSON object, got {type(d).__name__}")
    for key, kind in _HF_KEY_TYPES.items():
        value = d.get(key)
        kinds = (int, float) if kind is float else kind
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and kind is not bool):
            raise ValueError(f"config key {key!r} must be {_JSON_TYPE_NAMES[kind]}, got {value!r}")
    for key in _POSITIVE_HF_KEYS:
        if d.get(key) is not None and d[key] < 1:
            raise ValueError(f"config key {key!r} must be >= 1, got {d[key]!r}")


def _rope_from_hf(d: dict, arch: str) -> tuple[float, dict | None, float | None]:
    """(theta, scaling, local theta) from either the legacy `rope_theta` + `rope_scaling`
    keys or transformers 5's `rope_parameters` dict. Gemma 3 has two ropes: theta and
    scaling for its full-attention layers, a plain one of base `local theta` (legacy key
    rope_local_base_freq, default 10000) for its sliding layers; None for other models."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if arch != "gemma3":
        return (*_one_rope(d, params), None)
    if "full_attention" in params:  # transformers 5: a rope per layer type
        local_theta, local_scaling = _one_rope(d, params.get("sliding_attention") or {})
        if local_scaling is not None:
            raise ValueError(f"unsupported rope on Gemma 3's sliding layers: {params['sliding_attention']!r}")
        return (*_one_rope(d, params["full_attention"]), local_theta)
    return (*_one_rope(d, params), float(d.get("rope_local_base_freq") or 10000.0))


def _one_rope(d: dict, params: dict) -> tuple[float, dict | None]:
    """(theta, scaling) of one rope_parameters / rope_scaling dict; theta from it or d."""
    params = dict(params)
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _sliding_from_hf(d: dict, arch: str, num_layers: int):
    """(sliding_window, sliding_layers). Mistral slides every layer when `sliding_window`
    is set; Qwen only with `use_sliding_window`, and only layers >= max_window_layers;
    Gemma the layers of its pattern. `layer_types`' "sliding_attention" layers win over all."""
    window = d.get("sliding_window")
    qwen = arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if qwen and not d.get("use_sliding_window", False):
        window = None
    if arch == "llama" or arch in MLA_ARCHITECTURES or window is None:
        return None, None
    if d.get("layer_types"):
        return window, tuple(i for i, t in enumerate(d["layer_types"]) if t == "sliding_attention")
    if arch in GEMMA_ARCHITECTURES:  # HF's default: Gemma 2 alternates; Gemma 3 is full every 6th layer
        pattern = 2 if arch == "gemma2" else d.get("sliding_window_pattern") or 6
        return window, tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if qwen:
        return window, tuple(range(d.get("max_window_layers", 0), num_layers))
    return window, None
