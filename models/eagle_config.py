"""An EAGLE head's architecture (speculative_config method "eagle" or "eagle3"), read from its
config.json and checked against the target's; the heads themselves are models/eagle.py's.
Without model code: the front end resolves it."""
import dataclasses

from jaxllm.models.config import ModelArchConfig

EAGLE_ARCHITECTURES = ("eagle", "eagle3")
EAGLE_TARGETS = ("llama", "mistral", "qwen2", "qwen3")  # the targets whose forward gives the heads' inputs


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's EAGLE-3 default: a low, a middle and a high layer of the target."""
    return 2, num_layers // 2, num_layers - 3


@dataclasses.dataclass(frozen=True)
class EagleArchConfig(ModelArchConfig):
    """An EAGLE head: its decoder layer's Llama fields (architecture "eagle" or "eagle3"), and
    what it reads of the target and holds of its own."""
    target_hidden_size: int = 0         # the target's hidden states' width
    draft_vocab_size: int = 0           # EAGLE-3: its LM head's tokens (vocab_size for EAGLE-1)
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3: the target layers whose input it reads, ascending
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(f), not f
    fc_bias: bool = False               # the checkpoint's fc has a bias (EAGLE-1's original heads)
    has_d2t: bool = False               # EAGLE-3: the draft-to-target id offsets (absent: the same ids)
    own_embedding: bool = False         # an embedding of its own (one of another width than the target's)

    __hash__ = ModelArchConfig.__hash__

    @classmethod
    def of_head(cls, d: dict, method: str, target: ModelArchConfig, tensor_names: set[str] | None
                ) -> "EagleArchConfig":
        """The head of a config.json dict `d` for `target`; tensor_names: its checkpoint's (None: random
        weights). Raises ValueError naming what does not fit."""
        if d.get("add_para_norm"):  # HASS's EAGLE variant
            raise ValueError("config key 'add_para_norm' (norms on the embedding and the hidden state) is not built")
        eagle_config = d.get("eagle_config")
        if isinstance(eagle_config, dict) and eagle_config.get("use_aux_hidden_state") is False:
            raise ValueError("config key 'eagle_config.use_aux_hidden_state' false (a head without fc) is not built")
        # Its layer is Llama's; its LM head (EAGLE-3's) is never tied.
        head = dataclasses.replace(cls.from_hf_config({**d, "architectures": ["LlamaForCausalLM"]}),
                                   tie_word_embeddings=False)
        names = {n.removeprefix("model.") for n in tensor_names} if tensor_names is not None else None
        fc_bias = names is not None and "fc.bias" in names  # EAGLE-1's original heads have one
        if head.vocab_size != target.vocab_size:
            raise ValueError(f"the head's vocabulary has {head.vocab_size} tokens and the target's "
                             f"{target.vocab_size}: a head shares the target's tokenizer")
        if method == "eagle":
            if head.hidden_size != target.hidden_size:
                raise ValueError(f"the head's hidden_size ({head.hidden_size}) must be the target's "
                                 f"({target.hidden_size}): EAGLE reads the target's hidden states and embedding")
            return dataclasses.replace(head, architecture=method, target_hidden_size=target.hidden_size,
                                       draft_vocab_size=head.vocab_size, fc_bias=fc_bias)
        if head.num_layers != 1:
            raise ValueError(f"config key 'num_hidden_layers' must be 1 for an EAGLE-3 head, got {head.num_layers}")
        target_hidden = _int_key(d, "target_hidden_size", head.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"config key 'target_hidden_size' ({target_hidden}) must be the target's hidden size "
                             f"({target.hidden_size})")
        draft_vocab = _int_key(d, "draft_vocab_size", head.vocab_size)
        if not 1 <= draft_vocab <= head.vocab_size:
            raise ValueError(f"config key 'draft_vocab_size' must be in [1, {head.vocab_size}], got {draft_vocab}")
        layers = _aux_layers(d.get("eagle_aux_hidden_state_layer_ids"), target.num_layers)
        norm_before_residual = d.get("norm_before_residual") or False
        if not isinstance(norm_before_residual, bool):
            raise ValueError(f"config key 'norm_before_residual' must be a bool, got {norm_before_residual!r}")
        own_embedding = head.hidden_size != target.hidden_size
        if names is not None and own_embedding and "embed_tokens.weight" not in names:
            raise ValueError(f"the head's hidden_size ({head.hidden_size}) is not the target's "
                             f"({target.hidden_size}) and its checkpoint has no embed_tokens.weight")
        has_d2t = names is not None and "d2t" in names
        if names is not None and draft_vocab < head.vocab_size and not has_d2t:
            raise ValueError(f"the head's draft vocabulary ({draft_vocab} tokens) is smaller than the target's "
                             f"({head.vocab_size}) and its checkpoint has no d2t to map one to the other")
        return dataclasses.replace(
            head, architecture=method, target_hidden_size=target_hidden, draft_vocab_size=draft_vocab,
            aux_layer_ids=layers, norm_before_residual=norm_before_residual, fc_bias=fc_bias, has_d2t=has_d2t,
            own_embedding=own_embedding)


def _int_key(d: dict, key: str, default: int) -> int:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config key {key!r} must be an int, got {value!r}")
    return value


def _aux_layers(value, num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's target layers: config key eagle_aux_hidden_state_layer_ids, else vLLM's default;
    three distinct layers of the target, taken in ascending order (as vLLM's forward collects them)."""
    source = "config key 'eagle_aux_hidden_state_layer_ids'"
    if value is None:
        value, source = default_aux_layers(num_layers), "vLLM's default layers (2, num_layers // 2, num_layers - 3)"
    ok = (isinstance(value, (list, tuple)) and len(value) == 3
          and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in value)
          and len(set(value)) == 3)
    if not ok:
        raise ValueError(f"{source} must be three distinct layers of the target's {num_layers}, "
                         f"in [0, {num_layers}), got {list(value) if isinstance(value, tuple) else value!r}")
    return tuple(sorted(value))
