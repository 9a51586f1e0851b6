"""Processor: turns a user's prompt into validated token ids, at the boundary."""
from jaxllm.config import Config
from jaxllm.sampling_params import SamplingParams

PromptType = str | dict


def check_text(text: str, field: str) -> None:
    """A ValueError naming the field if UTF-8 cannot encode the text: a lone surrogate
    such as "\\ud800" (or an undecodable byte of sys.argv) fails inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid text: {e.reason} (position {e.start}: {text[e.start]!r})") from None


class Processor:
    def __init__(self, config: Config, tokenizer):
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.arch.vocab_size
        self.max_logprobs = config.model.max_logprobs
        self.tokenizer = tokenizer

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids); raises ValueError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: the caller may have changed the params since they were made
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs ({self.max_logprobs}, an engine arg), "
                             f"got {params.logprobs}")
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, longer than max_model_len ({self.max_model_len})")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids hold ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine was started with skip_tokenizer_init")
        return text, token_ids

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
