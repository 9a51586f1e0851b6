"""A Mamba2 model's state-space layers, read from a HF config.json (transformers' Mamba2Config).

A Mamba2 layer holds no KV cache: each request carries two fixed-size states per layer, its
convolution's last conv_kernel - 1 inputs and its SSM state (models/mamba2.py), whatever its
length. Without model code: the front end resolves it.
"""
import dataclasses

# HF's Mamba2Config keys read here, their JSON types and Mamba2Config's defaults (None: required).
_MAMBA2_KEYS = {
    "vocab_size": (int, None), "hidden_size": (int, None), "num_hidden_layers": (int, None),
    "num_heads": (int, None), "head_dim": (int, None), "state_size": (int, None), "expand": (int, 2),
    "n_groups": (int, 8), "conv_kernel": (int, 4), "chunk_size": (int, 256), "use_bias": (bool, False),
    "use_conv_bias": (bool, True), "layer_norm_epsilon": (float, 1e-5), "residual_in_fp32": (bool, True),
    "tie_word_embeddings": (bool, False), "hidden_act": (str, "silu"), "time_step_limit": (list, [0.0, float("inf")]),
    "max_position_embeddings": (int, 2048),
}
_POSITIVE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size", "expand",
                  "n_groups", "chunk_size", "max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """The Mamba2 mixers of a model: in_proj to (z, xBC, dt), a causal depthwise conv over xBC,
    the selective state space of num_heads heads of head_dim channels and state_size states (B
    and C shared by the heads of each of n_groups groups), a gated RMSNorm and out_proj."""
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int  # the SSD scan's chunk of a prefill (kernels/ssd.py)
    use_bias: bool  # on in_proj and out_proj
    use_conv_bias: bool
    time_step_limit: tuple[float, float]  # dt is clipped to it after softplus
    residual_in_fp32: bool  # the residual stream between layers in fp32
    layers: tuple[int, ...]  # the model's Mamba layers

    def __post_init__(self):
        if self.num_heads % self.n_groups:
            raise ValueError(f"config key 'n_groups' ({self.n_groups}) must divide 'num_heads' ({self.num_heads})")
        if self.conv_kernel < 2:
            raise ValueError(f"config key 'conv_kernel' must be >= 2, got {self.conv_kernel}")
        low, high = self.time_step_limit
        if not 0 <= low <= high:
            raise ValueError(f"config key 'time_step_limit' must be [low, high] with 0 <= low <= high, "
                             f"got {list(self.time_step_limit)}")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, then B and C of every group."""
        return self.intermediate_size + 2 * self.group_dim

    @property
    def group_dim(self) -> int:
        """B's (or C's) channels: state_size per group."""
        return self.n_groups * self.state_size

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A request's states in one layer: its convolution's last conv_kernel - 1 inputs, oldest first,
        of x (in heads' order: they split over devices with the heads) and of B and C (every device
        convolves them all), and its SSM state."""
        k = self.conv_kernel - 1
        return (k, self.intermediate_size), (k, 2 * self.group_dim), (self.num_heads, self.head_dim, self.state_size)


def read_keys(d: dict, keys: dict, positive: tuple[str, ...], model: str) -> dict:
    """The values of `keys` (key -> (JSON type, default; None: required)) in a config.json dict `d`,
    defaults filled in; raises ValueError naming a missing, ill-typed or (a `positive` key) non-positive key."""
    values = {}
    for key, (kind, default) in keys.items():
        value = d.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"missing the required key {key!r} of a {model} model")
            value = default
        kinds = (int, float) if kind is float else kind
        if not isinstance(value, kinds) or (isinstance(value, bool) and kind is not bool):
            raise ValueError(f"config key {key!r} must be of type {kind.__name__}, got {value!r}")
        if key in positive and value < 1:
            raise ValueError(f"config key {key!r} must be >= 1, got {value!r}")
        values[key] = value
    return values


def time_step_limit(value) -> tuple[float, float]:
    """The config's time_step_limit as (low, high); transformers 5 writes an infinite limit as
    {"__float__": "Infinity"}."""
    limit = [float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v for v in value]
    if len(limit) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit):
        raise ValueError(f"config key 'time_step_limit' must be [low, high], got {limit!r}")
    return float(limit[0]), float(limit[1])


def mamba2_fields(d: dict) -> dict:
    """ModelArchConfig's fields of a Mamba2ForCausalLM config.json dict `d`; raises ValueError
    naming a missing or ill-typed key. A model without attention reports its SSM heads as its
    heads (what the tensor-parallel checks divide)."""
    values = read_keys(d, _MAMBA2_KEYS, _POSITIVE_KEYS, "Mamba2")
    if values["hidden_act"] != "silu":
        raise ValueError(f"config key 'hidden_act' must be 'silu' for a Mamba2 model, got {values['hidden_act']!r}")
    heads, head_dim, hidden = values["num_heads"], values["head_dim"], values["hidden_size"]
    if heads * head_dim != values["expand"] * hidden:
        raise ValueError(f"config keys 'num_heads' * 'head_dim' ({heads} * {head_dim}) must equal 'expand' * "
                         f"'hidden_size' ({values['expand']} * {hidden})")
    num_layers = values["num_hidden_layers"]
    mamba = MambaConfig(heads, head_dim, values["state_size"], values["n_groups"], values["conv_kernel"],
                        values["chunk_size"], values["use_bias"], values["use_conv_bias"],
                        time_step_limit(values["time_step_limit"]), values["residual_in_fp32"],
                        tuple(range(num_layers)))
    return dict(vocab_size=values["vocab_size"], hidden_size=hidden, intermediate_size=mamba.intermediate_size,
                num_layers=num_layers, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                rms_norm_eps=float(values["layer_norm_epsilon"]),
                max_position_embeddings=values["max_position_embeddings"],
                tie_word_embeddings=values["tie_word_embeddings"], mamba=mamba)
