"""SamplingParams: how one request is sampled and when it stops (vLLM's fields)."""
import dataclasses
import enum
import sys

from jaxllm.typecheck import check_field_types


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every step: everything generated so far
    DELTA = 1       # every step: only what is new
    FINAL_ONLY = 2  # once, when the request finishes (what LLM.generate uses)


@dataclasses.dataclass
class SamplingParams:
    # n > 1: n samples of the prompt, each its own request in the engine (seeded: seed + i).
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Log probabilities of each generated token: the sampled token's and the top `logprobs`
    # tokens' (0: the sampled token's only; None: none). They are of the model's raw
    # distribution, log_softmax of its logits before temperature, penalties and top-k/top-p/
    # min-p (vLLM's default logprobs_mode, raw_logprobs). At most the engine's max_logprobs.
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Checks every field's type and range, naming the field; normalizes stop and
        stop_token_ids to lists. The engine calls it again, as params are mutable."""
        check_field_types(self)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not -sys.float_info.max <= value <= sys.float_info.max:  # nan, inf, an int too large for a float
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            # vLLM's -1 (the whole vocabulary) would copy [vocab] floats per token to the host.
            raise ValueError(f"logprobs must be None or >= 0 (-1, the whole vocabulary, is not supported), "
                             f"got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not all(self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
