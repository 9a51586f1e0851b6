"""SamplingParams: how one request is sampled and when it stops (vLLM's fields)."""
import dataclasses
import enum
from typing import Any

from jaxllm.typecheck import check_field_types

_FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every step: everything generated so far
    DELTA = 1       # every step: only what is new
    FINAL_ONLY = 2  # once, when the request finishes (what LLM.generate uses)


@dataclasses.dataclass
class StructuredOutputsParams:
    """Constrains a request's output (vLLM's StructuredOutputsParams): set exactly one of
    `json` (a JSON schema, as a dict or its text), `regex`, `choice` (one of these strings),
    `grammar` (a Lark grammar, llguidance's dialect) or `json_object` (any JSON object).
    llguidance checks the constraint when the params are made: a bad one raises ValueError
    with the library's message."""
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (compact output)
    disable_additional_properties: bool = False  # JSON: objects hold only their schema's properties
    whitespace_pattern: str | None = None  # JSON: a regex for the whitespace allowed between tokens
    # A reasoning model's end of thinking (its </think> token id): the constraint applies to the
    # tokens after the first one the output generates, and masks nothing before (vLLM's rule with
    # a reasoning parser). None: the constraint applies from the first token.
    reasoning_end_token_id: int | None = None

    def __post_init__(self):
        check_field_types(self)
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar and "
                             f"json_object, got {kinds or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must hold at least one string")
        if self.reasoning_end_token_id is not None and self.reasoning_end_token_id < 0:
            raise ValueError(f"structured_outputs.reasoning_end_token_id must be a token id (>= 0), got "
                             f"{self.reasoning_end_token_id}")
        from jaxllm.structured_output import check_structured_outputs
        check_structured_outputs(self)


@dataclasses.dataclass
class SamplingParams:
    # n > 1: n samples of the prompt, each its own request in the engine (seeded: seed + i).
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # Penalties, as vLLM (and OpenAI): presence and frequency over the output's tokens (subtracted
    # once per token present / per occurrence); repetition over the prompt's and the output's
    # (positive logits divided by it, negative ones multiplied: HF's and vLLM's definition).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until the output holds this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (each as tokenized with and without a leading space)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (and then no stop strings)
    # Keep only the prompt's last k tokens (-1: the last max_model_len); None keeps all.
    truncate_prompt_tokens: int | None = None
    # Log probabilities of each generated token: the sampled token's and the top `logprobs`
    # tokens' (0: the sampled token's only; None: none). They are of the model's raw
    # distribution, log_softmax of its logits before temperature, penalties and top-k/top-p/
    # min-p (vLLM's default logprobs_mode, raw_logprobs). At most the engine's max_logprobs.
    logprobs: int | None = None
    # Log probabilities of each prompt token after the first (the first gets None): the prompt
    # token's and the top `prompt_logprobs` tokens', of the raw distribution as `logprobs`.
    prompt_logprobs: int | None = None
    # A mixture-of-experts model's routing of each generated token (CompletionOutput.routed_experts): the
    # expert ids each MoE layer's router chose in the forward that sampled the token.
    return_routed_experts: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None  # for users' logits processors (vLLM's extra_args)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Checks every field's type and range, naming the field; normalizes stop and
        stop_token_ids to lists. The engine calls it again, as params are mutable."""
        check_field_types(self)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_int64()
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        numbers = {name: getattr(self, name) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                                          "frequency_penalty", "repetition_penalty")}
        numbers.update((f"logit_bias[{t}]", bias) for t, bias in (self.logit_bias or {}).items())
        for name, value in numbers.items():
            # The sampler reads them as float32: nan, inf, and what float32 cannot hold are out.
            if not -_FLOAT32_MAX <= value <= _FLOAT32_MAX:
                raise ValueError(f"{name} must be a finite number within float32's range (±3.4e38), got "
                                 f"{_short_repr(value) if isinstance(value, int) else value}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                # vLLM's -1 (the whole vocabulary) would copy [vocab] floats per token to the host.
                raise ValueError(f"{name} must be None or >= 0 (-1, the whole vocabulary, is not supported), "
                                 f"got {value}")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1):
            raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 (max_model_len), or None, "
                             f"got {self.truncate_prompt_tokens}")
        for name in ("logit_bias", "allowed_token_ids"):
            ids = list(getattr(self, name) or ())
            if any(t < 0 for t in ids):
                raise ValueError(f"{name} holds negative token ids: {[t for t in ids if t < 0][:5]}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must hold at least one token id (None allows all)")
        if self.bad_words is not None and not all(w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not all(self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: without text there is nothing to match them in")

    def _check_int64(self) -> None:
        """Every int the engine carries fits in 64 bits: a larger one (from JSON, say) would fail
        in the messages to the engine core, far from the field that holds it."""
        ints = {name: getattr(self, name) for name in ("n", "top_k", "seed", "max_tokens", "min_tokens",
                                                       "truncate_prompt_tokens", "logprobs", "prompt_logprobs")}
        for name in ("stop_token_ids", "allowed_token_ids"):
            ints.update((f"{name}[{i}]", t) for i, t in enumerate(getattr(self, name) or ()))
        ints.update((f"logit_bias key {i}", t) for i, t in enumerate(self.logit_bias or ()))
        for name, value in ints.items():
            if value is not None and not -2**63 <= value < 2**63:
                raise ValueError(f"{name} must fit in 64 bits, got {_short_repr(value)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _short_repr(value: int) -> str:
    """Python refuses to print an int of more than 4300 digits; its size says enough."""
    return repr(value) if abs(value) < 10**30 else f"an int of {value.bit_length()} bits"
