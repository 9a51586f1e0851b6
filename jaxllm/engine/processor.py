"""Processor: turns a user's prompt into validated token ids, at the boundary."""
import dataclasses

from jaxllm.config import Config
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

PromptType = str | dict


def check_text(text: str, field: str) -> None:
    """A ValueError naming the field if UTF-8 cannot encode the text: a lone surrogate
    such as "\\ud800" (or an undecodable byte of sys.argv) fails inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid text: {e.reason} (position {e.start}: {text[e.start]!r})") from None


@dataclasses.dataclass
class ProcessedRequest:
    """What the Processor makes of one request's prompt and params, ready for the core."""
    prompt: str | None                    # the prompt's text, as given (None for token ids)
    prompt_token_ids: list[int]           # after truncate_prompt_tokens
    bad_words_token_ids: list[list[int]]  # SamplingParams.bad_words, tokenized


class Processor:
    def __init__(self, config: Config, tokenizer):
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.arch.vocab_size
        self.max_logprobs = config.model.max_logprobs
        self.hf_config, self.hidden_size = config.model.hf_config, config.model.arch.hidden_size
        self.pools = config.model.pooler_config is not None
        self.has_experts = config.model.arch.moe is not None
        self.tokenizer = tokenizer

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedRequest:
        """Raises ValueError (TypeError for a wrong type) naming the problem."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: the caller may have changed the params since they were made
        self._check_params(params)
        text, token_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        self._check_prompt(token_ids)
        return ProcessedRequest(text, token_ids, self._bad_words_token_ids(params.bad_words or []))

    def process_pooling(self, prompt: PromptType, params: PoolingParams) -> ProcessedRequest:
        """As process, for a pooling request (an engine started with runner="pooling")."""
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        if not self.pools:
            raise ValueError("pooling_params: this engine generates only; embeddings and scores need an engine "
                             "started with runner='pooling' (vLLM's --runner pooling)")
        params.validate()
        self._check_dimensions(params.dimensions)
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        return ProcessedRequest(text, token_ids, [])

    def _check_dimensions(self, dimensions: int | None) -> None:
        """Matryoshka truncation where vLLM allows it: the model's config.json sets is_matryoshka, or lists
        matryoshka_dimensions (then only those)."""
        if dimensions is None:
            return
        listed = self.hf_config.get("matryoshka_dimensions")
        if not listed and not self.hf_config.get("is_matryoshka"):
            raise ValueError("dimensions is for a Matryoshka model, and this model's config.json sets neither "
                             f"is_matryoshka nor matryoshka_dimensions: leave it unset (all {self.hidden_size} values)")
        if listed and dimensions not in listed:
            raise ValueError(f"dimensions must be one of the model's matryoshka_dimensions {listed}, got {dimensions}")
        if dimensions > self.hidden_size:
            raise ValueError(f"dimensions must be <= the model's hidden size ({self.hidden_size}), got {dimensions}")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, longer than max_model_len ({self.max_model_len})")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids hold ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the limits of this engine and its model."""
        if params.return_routed_experts and not self.has_experts:
            raise ValueError("return_routed_experts: the model has no mixture-of-experts layers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs ({self.max_logprobs}, an engine arg), got {value}")
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            outside = [t for t in getattr(params, name) or () if t >= self.vocab_size]
            if outside:
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): "
                                 f"{outside[:5]}")
        so = params.structured_outputs
        if so is not None and so.reasoning_end_token_id is not None and so.reasoning_end_token_id >= self.vocab_size:
            raise ValueError(f"structured_outputs.reasoning_end_token_id must be in the vocabulary [0, "
                             f"{self.vocab_size}), got {so.reasoning_end_token_id}")
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be <= max_model_len ({self.max_model_len}) or -1, "
                             f"got {params.truncate_prompt_tokens}")
        if self.tokenizer is None:
            for name, why in (("stop", "to find stop strings in the text"), ("bad_words", "to tokenize them"),
                              ("structured_outputs", "to map the constraint onto token ids")):
                if getattr(params, name):
                    raise ValueError(f"{name} needs a tokenizer ({why}), and this engine was started with "
                                     "skip_tokenizer_init")

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """vLLM's rule: each word, stripped of leading whitespace, is tokenized alone (as at the
        start of a text) and after a space (as inside one); the spaced form is kept only when it
        is a different word token of the same length (a tokenizer that splits the space into a
        token of its own gives nothing new). Duplicates are dropped."""
        sequences: list[list[int]] = []
        for i, word in enumerate(bad_words):
            check_text(word, f"bad_words[{i}]")
            word = word.lstrip()
            alone = self.tokenizer.encode(word, add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word, add_special_tokens=False)
            if not alone:
                raise ValueError(f"bad_words[{i}] ({word!r}) tokenizes to no tokens")
            for ids in [alone] + ([spaced] if len(spaced) == len(alone) and spaced[0] != alone[0] else []):
                if ids not in sequences:
                    sequences.append(ids)
        outside = [t for ids in sequences for t in ids if t >= self.vocab_size]
        if outside:
            raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}")
        return sequences

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(type(t) is int for t in ids):  # bool is no id
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        check_text(prompt, "prompt")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer, and this engine was started with "
                             "skip_tokenizer_init: pass {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer.encode(prompt)
