"""The tokenizer of a model, whatever its format (a transformers fast tokenizer), and what
the model's files say about generation: its EOS ids and its recommended sampling params."""
import json
import logging
import os

from jaxllm.config import ModelConfig

logger = logging.getLogger(__name__)

# generation_config.json's keys -> SamplingParams fields, vLLM's list (get_diff_sampling_param).
_HF_SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_p": "top_p",
                     "top_k": "top_k", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def get_tokenizer(mc: ModelConfig):
    """The tokenizer of EngineArgs.tokenizer if set, else the model's own; None under
    skip_tokenizer_init and for a bundled config (which ships no vocabulary)."""
    if mc.skip_tokenizer_init or (mc.format == "bundled" and mc.tokenizer is None):
        return None
    path = mc.tokenizer or mc.path
    if path.endswith(".gguf"):
        from jaxllm.models.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        what = "tokenizer" if mc.tokenizer else "model"
        raise ValueError(f"{what} folder {path!r} has no usable tokenizer ({e}); "
                         "pass skip_tokenizer_init=True to feed token ids") from e


def generation_config(mc: ModelConfig) -> dict:
    """An HF or orbax folder's generation_config.json ({} when it has none, and for other formats)."""
    path = os.path.join(mc.path, "generation_config.json")
    if mc.format not in ("hf", "orbax") or not os.path.isfile(path):
        return {}
    try:
        with open(path, "rb") as f:
            config = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


# llama.cpp's end-of-turn tokens of chat formats, for a GGUF that names no eot id (llama-vocab.cpp).
_GGUF_END_OF_TURN_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


def generation_eos_ids(mc: ModelConfig, tokenizer) -> tuple[int, ...]:
    """The token ids that end generation: the one place that decides them, for every format.

    HF folder: generation_config.json's eos_token_id (Gemma 3 lists <eos> and
    <end_of_turn>), else config.json's, else the tokenizer's. GGUF: as llama.cpp, the
    file's EOS, end-of-turn and end-of-message ids; without an end-of-turn id, the token
    spelled as a chat format's end of turn, when the vocabulary has one."""
    if mc.format == "gguf":
        ids = _gguf_end_of_generation_ids(mc.path)
    else:
        ids = generation_config(mc).get("eos_token_id")
        if ids is None:
            ids = mc.hf_config.get("eos_token_id")
        if ids is None and tokenizer is not None:
            ids = tokenizer.eos_token_id
        ids = () if ids is None else tuple(ids) if isinstance(ids, list) else (ids,)
    # An id the model cannot produce ends nothing, and would index past the sampler's vocabulary rows.
    outside = [i for i in ids if not (type(i) is int and 0 <= i < mc.arch.vocab_size)]
    if outside:
        logger.warning("%s: end-of-generation ids outside the vocabulary [0, %d) are ignored: %s",
                       mc.path, mc.arch.vocab_size, outside)
    return tuple(i for i in ids if i not in outside)


def _gguf_end_of_generation_ids(path: str) -> tuple[int, ...]:
    from jaxllm.models.gguf import read_gguf_metadata
    meta = read_gguf_metadata(path)
    ids = [meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    if ids[1] is None:
        tokens = meta.get("tokenizer.ggml.tokens") or []
        ids[1] = next((i for i, t in enumerate(tokens) if t in _GGUF_END_OF_TURN_TEXTS), None)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def default_sampling_fields(mc: ModelConfig) -> dict:
    """The SamplingParams fields the model's authors set (vLLM's get_diff_sampling_param):
    generation_config.json's repetition_penalty, temperature, top_p, top_k, min_p and
    max_new_tokens (as max_tokens), or a GGUF file's general.sampling.* keys; {} for none. As in vLLM,
    do_sample is not read: a temperature of 0 is what makes a request greedy."""
    if mc.format in ("hf", "orbax"):  # jaxllm convert copies the source's generation_config.json
        config = generation_config(mc)
        return {field: config[key] for key, field in _HF_SAMPLING_KEYS.items() if config.get(key) is not None}
    if mc.format == "gguf":
        from gguf import Keys
        from jaxllm.models.gguf import read_gguf_metadata
        keys = {Keys.General.SAMPLING_TEMP: "temperature", Keys.General.SAMPLING_TOP_P: "top_p",
                Keys.General.SAMPLING_TOP_K: "top_k", Keys.General.SAMPLING_MIN_P: "min_p"}
        meta = read_gguf_metadata(mc.path)
        # GGUF stores float32: 0.95 reads back as 0.949999988, so round to float32's precision.
        return {field: round(meta[key], 6) if isinstance(meta[key], float) else meta[key]
                for key, field in keys.items() if key in meta}
    return {}
