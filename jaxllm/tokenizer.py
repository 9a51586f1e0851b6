"""The tokenizer of a model, whatever its format: a transformers fast tokenizer."""
import json
import os

from jaxllm.config import ModelConfig


def get_tokenizer(mc: ModelConfig):
    if mc.skip_tokenizer_init or mc.format == "bundled":
        return None  # bundled configs ship no vocabulary: token-id prompts only
    if mc.format == "gguf":
        from jaxllm.models.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(mc.path)
    if mc.format == "hf":
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(mc.path)
        except (OSError, ValueError) as e:
            raise ValueError(f"model folder {mc.path!r} has no usable tokenizer ({e}); "
                             "pass skip_tokenizer_init=True to feed token ids") from e
    raise ValueError(f"model {mc.path!r} has no tokenizer: pass skip_tokenizer_init=True and token-id prompts")


def generation_eos_ids(mc: ModelConfig, tokenizer) -> tuple[int, ...]:
    """EOS ids that end generation: generation_config.json's, else the config's, else the tokenizer's."""
    ids = None
    if mc.format == "hf" and os.path.isfile(os.path.join(mc.path, "generation_config.json")):
        with open(os.path.join(mc.path, "generation_config.json")) as f:
            ids = json.load(f).get("eos_token_id")
    if ids is None:
        ids = mc.hf_config.get("eos_token_id")
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (ids,)
